"""How much int8 and int4 shards change the default model's predictions.

Teacher-forced over a text the tests ship (tests/data/agreement.txt): one prefill gives
the logits at every position, for the float32 model and for each quantized one. Prints
each one's perplexity of the text, its top-1 agreement with float32 at every position,
and the mean KL divergence from float32's next-token distribution.

    python benchmarks/quant_accuracy.py [--text tests/data/agreement.txt] [--threads 2]

Writes benchmarks/results/quant_accuracy.json. (The prefill's products dequantize the
weights and multiply in float32; a decode step's round the activations to 16 bits, see
zmqllm/engine/csrc/quant_avx2.h.)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import math
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.report import write_json
from zmqllm.config.paths import default_model_dir
from zmqllm.engine.generator import Generator
from zmqllm.models.prepare import prepare_default_model
from zmqllm.models.tokenizer import Tokenizer

QUANTS = ("none", "int8", "int4")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", default="tests/data/agreement.txt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/quant_accuracy.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model_dir = prepare_default_model(default_model_dir())
    ids = Tokenizer.from_dir(model_dir).encode(Path(a.text).read_text())
    target = torch.tensor(ids[1:])
    logits = {q: Generator(model_dir, quant=q).all_logits(ids)[:-1] for q in QUANTS}
    ref = logits["none"]
    ref_logp = F.log_softmax(ref, -1)
    rows: dict[str, dict[str, Any]] = {}
    for q, lg in logits.items():
        logp = F.log_softmax(lg, -1)
        nll = F.nll_loss(logp, target).item()
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item()
        rows[q] = {
            "perplexity": math.exp(nll),
            "top1_agreement": (lg.argmax(-1) == ref.argmax(-1)).float().mean().item(),
            "mean_kl_from_float32": kl,
        }
    print(f"\n{model_dir.name}, {len(ids)} tokens of {a.text}, teacher-forced")
    print(f"{'':10} {'perplexity':>10} {'top-1 = float32':>16} {'KL from float32':>16}")
    for q, r in rows.items():
        name = "float32" if q == "none" else q
        print(
            f"{name:10} {r['perplexity']:10.3f} {r['top1_agreement']:16.4f} "
            f"{r['mean_kl_from_float32']:16.5f}"
        )
    meta = {"model": model_dir.name, "text": a.text, "tokens": len(ids), "threads": a.threads}
    write_json(Path(a.out), {"meta": meta, "results": rows})


if __name__ == "__main__":
    main()
