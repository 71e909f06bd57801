"""The matrix units end to end: one worker with and without them, through HTTP, one run.

A local cluster (broker, one worker of every layer, gateway) of a quantized model, its
worker started with ``--matrix-units`` and then ``--no-matrix-units`` (and with
``--int8-activations`` too, given ``--int8``) in alternating rounds. At each concurrency
level that many streamed chat requests start at once (``ignore_eos``, as throughput.py
sends them): wall tokens/s, the decode rate while every stream is past its prompt
(tokens stamped between the last first token and the first stream's end, over that
window), inter-token latency and TTFT; then the prefill rate of one ~512-token prompt on
the idle cluster (prompt tokens / TTFT). Prints them side by side with the ratios to
off, names the CPU and the units the worker found.

    python benchmarks/matrix_units.py [--model DIR] [--quant int4] [--levels 1 16 64]
        [--new-tokens 32] [--rounds 2] [--int8]

Writes benchmarks/results/matrix_units.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import tempfile
from typing import Any

from benchmarks.http_client import RequestInput, run_all
from benchmarks.report import cpu_name, write_json
from benchmarks.stats import median
from benchmarks.throughput import burst
from testbed.cluster import Cluster
from zmqllm.config.paths import default_model_dir
from zmqllm.engine import native
from zmqllm.models.prepare import prepare_default_model
from zmqllm.models.tokenizer import Tokenizer

CONFIGS = {
    "on": ("--matrix-units",),
    "off": ("--no-matrix-units",),
    # the opt-in 8-bit activations (VNNI), where the build has them: --int8
    "int8": ("--matrix-units", "--int8-activations"),
}
LONG_WORDS = 512


def decode_rate(stamps: list[list[float]]) -> float:
    """Tokens/s while every stream is past its prompt: the window from the last stream's
    first token to the first stream's last one (0 when they do not overlap)."""
    begin = max(s[1] for s in stamps if len(s) > 1)
    end = min(s[-1] for s in stamps if len(s) > 1)
    if end <= begin:
        return 0.0
    count = sum(1 for s in stamps for t in s[1:] if begin < t <= end)
    return count / (end - begin)


def long_prompt(tok: Tokenizer) -> tuple[str, int]:
    """A user message of about LONG_WORDS tokens, and its length as the chat template
    encodes it."""
    words = " ".join(f"item{i % 97} is listed under section {i % 13}." for i in range(90))
    ids = tok.encode_chat([{"role": "user", "content": words}])
    while len(ids) > LONG_WORDS:
        words = words[: int(len(words) * LONG_WORDS / len(ids)) - 1]
        ids = tok.encode_chat([{"role": "user", "content": words}])
    return words, len(ids)


def prefill(c: Cluster, text: str, tokens: int) -> dict[str, float]:
    url = f"{c.url}/v1/chat/completions"
    msg = [{"role": "user", "content": text}]
    one = RequestInput(url, messages=msg, max_tokens=1, temperature=0)
    out = run_all([one])[0]
    return {"prompt_tokens": tokens, "ttft_s": out.ttft, "prompt_tok_per_s": tokens / out.ttft}


def run_config(
    model: Path, quant: str, flags: tuple[str, ...], a: argparse.Namespace, text: str, n: int
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        c = Cluster(Path(tmp), model, heartbeat=1.0, threads=a.threads, quant=quant,
                    worker_flags=flags)  # fmt: skip
        try:
            c.start_all(("",))
            burst(c, 2, 4)  # warm-up
            out: dict[str, Any] = {"prefill": prefill(c, text, n)}
            for level in a.levels:
                b = burst(c, level, a.new_tokens)
                out[str(level)] = {
                    "tokens_per_s": b["tokens_per_s"],
                    "decode_tokens_per_s": decode_rate(b["stamps"]),
                    "itl_ms_p50": b["itl_ms_p50"],
                    "ttft_ms_p50": b["ttft_ms_p50"],
                }
                print(f"    {level} streams: {out[str(level)]}", flush=True)
            return out
        finally:
            c.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a model directory (default: the default model)")
    ap.add_argument("--quant", default="int4", choices=["int4", "int8"])
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--int8", action="store_true", help="also with --int8-activations")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/matrix_units.json"))
    a = ap.parse_args()
    model = a.model or prepare_default_model(default_model_dir())
    text, n = long_prompt(Tokenizer.from_dir(model))
    units = native.use_matrix_units(True, a.int8) or "none on this CPU or build"
    configs = {k: v for k, v in CONFIGS.items() if k != "int8" or a.int8}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in configs}
    for r in range(a.rounds):
        order = list(configs.items())
        for name, flags in order[::-1] if r % 2 else order:
            print(f"round {r + 1}, matrix units {name}", flush=True)
            runs[name].append(run_config(model, a.quant, flags, a, text, n))
    print(f"\n{cpu_name()}; matrix units: {units}; {model.name} {a.quant}, one worker")
    print("median of rounds (range); ratios on/off (and int8/off) of the medians")
    rows = [("prefill", "prompt_tok_per_s", f"prefill {n} tokens, prompt tok/s")]
    for level in a.levels:
        rows.append((str(level), "decode_tokens_per_s", f"{level} streams, decode tok/s"))
        rows.append((str(level), "tokens_per_s", f"{level} streams, wall tok/s"))
    table = []
    for key, field, label in rows:
        vals = {k: [run[key][field] for run in runs[k]] for k in configs}
        med = {k: median(v) for k, v in vals.items()}
        ratios = {k: med[k] / med["off"] if med["off"] else float("nan") for k in vals}
        shown = "  ".join(f"{k} {med[k]:8.2f} ({min(v):.2f}-{max(v):.2f})" for k, v in vals.items())
        print(f"  {label:36} {shown}  on {ratios['on']:5.2f}x", end="")
        print(f"  int8 {ratios['int8']:5.2f}x" if "int8" in ratios else "")
        table.append({"what": label, **vals, "ratio": ratios["on"], "ratios": ratios})
    meta = {"cpu": cpu_name(), "units": units, "model": model.name, "quant": a.quant,
            "new_tokens": a.new_tokens, "rounds": a.rounds}  # fmt: skip
    write_json(a.out, {"meta": meta, "table": table, "runs": runs})


if __name__ == "__main__":
    main()
