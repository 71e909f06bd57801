"""Engine latency: zmqllm's single-process engine against HF transformers `generate`.

Same weights (the converted default model), same dtype, same torch threads, in
one run. Measures prefill time for a 256-token prompt and decode ms/token over
128 tokens, and how close decode is to the memory-bandwidth bound (bytes of
weights read per token / measured read bandwidth).

    python benchmarks/engine_latency.py [--threads 2] [--repeats 3] [--out FILE]

Prints a table and writes JSON (default benchmarks/results/engine_latency.json).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from report import write_json

from zmqllm.config import default_model_dir
from zmqllm.engine.generator import Generator
from zmqllm.models import prepare_default_model
from zmqllm.tokenizer import Tokenizer

TEXT = (
    "ZeroMQ is a high-performance asynchronous messaging library aimed at use in distributed "
    "or concurrent applications. It provides a message queue, but unlike message-oriented "
    "middleware, a ZeroMQ system can run without a dedicated message broker. "
)


def median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: allocator, thread pool, first-call paths
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes/s for a streaming read of a buffer larger than any cache."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    t = median_time(lambda: buf.sum(), repeats)
    return nbytes / t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default="benchmarks/results/engine_latency.json")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    model_dir = Path(a.model) if a.model else prepare_default_model(default_model_dir())
    tok = Tokenizer.from_dir(model_dir)
    ids = (tok.encode(TEXT) * (a.prompt_tokens // 10 + 1))[: a.prompt_tokens]
    n = a.new_tokens
    dtype = getattr(torch, a.dtype)

    from transformers import MistralForCausalLM

    hf = MistralForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    x = torch.tensor([ids])

    def hf_run(k: int) -> list[int]:
        with torch.inference_mode():
            out = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=k,
                do_sample=False,
                eos_token_id=None,
            )
        return out[0, len(ids) :].tolist()

    gen = Generator(model_dir, dtype=a.dtype)

    def zmq_run(k: int) -> list[int]:
        return list(gen.generate(ids, k))

    results: dict[str, dict[str, float]] = {}
    same = hf_run(n) == zmq_run(n)
    for name, run in (("hf_generate", hf_run), ("zmqllm_engine", zmq_run)):
        t1 = median_time(lambda run=run: run(1), a.repeats)
        tn = median_time(lambda run=run: run(n), a.repeats)
        decode = (tn - t1) / (n - 1)
        results[name] = {
            "prefill_ms": t1 * 1e3,
            "decode_ms_per_token": decode * 1e3,
            "decode_tokens_per_s": 1.0 / decode,
        }

    # Bytes read per decode token: every weight once (the embedding is only
    # gathered, one row, unless tied to the lm_head, which reads it whole).
    itemsize = torch.empty((), dtype=dtype).element_size()
    shard = gen.shards[0]
    weight_bytes = sum(p.numel() for p in shard.layers.parameters()) * itemsize
    weight_bytes += shard.lm_head.numel() * itemsize if shard.lm_head is not None else 0
    bw = read_bandwidth(1 << 30, a.repeats)
    bound_ms = weight_bytes / bw * 1e3
    zm, hfr = results["zmqllm_engine"], results["hf_generate"]
    summary = {
        "ratio_decode_zmqllm_over_hf": zm["decode_ms_per_token"] / hfr["decode_ms_per_token"],
        "ratio_prefill_zmqllm_over_hf": zm["prefill_ms"] / hfr["prefill_ms"],
        "weight_bytes_per_token": weight_bytes,
        "read_bandwidth_gb_s": bw / 1e9,
        "bandwidth_bound_ms_per_token": bound_ms,
        "zmqllm_decode_over_bound": zm["decode_ms_per_token"] / bound_ms,
        "greedy_tokens_identical": same,
    }

    print(
        f"\nengine latency — {model_dir.name}, {a.dtype}, {a.threads} threads, "
        f"prompt {len(ids)} tokens, {n} new tokens, median of {a.repeats}"
    )
    print(f"{'':16} {'prefill ms':>11} {'decode ms/tok':>14} {'tok/s':>8}")
    for name, r in results.items():
        print(
            f"{name:16} {r['prefill_ms']:11.1f} {r['decode_ms_per_token']:14.2f} "
            f"{r['decode_tokens_per_s']:8.1f}"
        )
    print(
        f"{'zmqllm / HF':16} {summary['ratio_prefill_zmqllm_over_hf']:11.2f} "
        f"{summary['ratio_decode_zmqllm_over_hf']:14.2f}"
    )
    print(
        f"bandwidth bound: {weight_bytes / 1e6:.0f} MB/token at {bw / 1e9:.1f} GB/s = "
        f"{bound_ms:.1f} ms/token; zmqllm decode is {summary['zmqllm_decode_over_bound']:.2f}x "
        f"the bound; greedy tokens identical: {same}"
    )
    meta = {
        "model": str(model_dir),
        "dtype": a.dtype,
        "threads": a.threads,
        "prompt_tokens": len(ids),
        "new_tokens": n,
        "repeats": a.repeats,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }
    write_json(Path(a.out), {"meta": meta, "results": results, "summary": summary})


if __name__ == "__main__":
    main()
