"""Engine latency: zmqllm's single-process engine against HF transformers `generate`.

Same weights (the converted default model), same dtype, same torch threads, in
one run, in alternating rounds: HF, zmqllm's engine (the compiled single-stream
path) and the engine on PyTorch's ops alone (its portable fallback). Measures
prefill time for a 256-token prompt and decode ms/token over 128 tokens, and
the memory floor: weight bytes read per token / the read bandwidth of a sum
over a filled 512 MiB tensor with the same threads, measured every round.

    python benchmarks/engine_latency.py [--threads 2] [--repeats 5] [--out FILE]

Prints a table and writes JSON (default benchmarks/results/engine_latency.json).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import repo_root  # noqa: F401  (this checkout first on sys.path)
import torch
from report import write_json

from zmqllm.config import default_model_dir
from zmqllm.engine.generator import Generator
from zmqllm.models import prepare_default_model
from zmqllm.tokenizer import Tokenizer

FLOOR_BYTES = 512 << 20

TEXT = (
    "ZeroMQ is a high-performance asynchronous messaging library aimed at use in distributed "
    "or concurrent applications. It provides a message queue, but unlike message-oriented "
    "middleware, a ZeroMQ system can run without a dedicated message broker. "
)


def seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def floor_seconds_per_byte(buf: torch.Tensor) -> float:
    """The memory floor's rate: seconds per byte of a sum over a filled buffer larger
    than every cache, with the threads torch was given."""
    buf.sum()
    return min(seconds(buf.sum) for _ in range(3)) / (buf.numel() * buf.element_size())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="alternating rounds")
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

    gen_pt = Generator(model_dir, dtype=a.dtype, compiled=False)

    def pt_run(k: int) -> list[int]:
        return list(gen_pt.generate(ids, k))

    runs: dict[str, Callable[[int], list[int]]] = {
        "hf_generate": hf_run,
        "zmqllm_engine": zmq_run,
        "zmqllm_pytorch_ops": pt_run,
    }
    want = hf_run(n)
    same = {name: run(n) == want for name, run in runs.items() if name != "hf_generate"}

    # Bytes read per decode token: every weight once (the embedding is only
    # gathered, one row, unless tied to the lm_head, which reads it whole).
    itemsize = torch.empty((), dtype=dtype).element_size()
    shard = gen.shards[0]
    weight_bytes = sum(p.numel() for p in shard.layers.parameters()) * itemsize
    weight_bytes += shard.lm_head.numel() * itemsize if shard.lm_head is not None else 0
    buf = torch.ones(FLOOR_BYTES // 4, dtype=torch.float32)

    # Alternating rounds (the order flipped each round): this machine's speed drifts.
    decode: dict[str, list[float]] = {name: [] for name in [*runs, "floor"]}
    prefill: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(a.repeats):
        order = list(runs.items())
        for name, run in order if r % 2 == 0 else order[::-1]:
            run(2)  # warm-up
            t1 = seconds(lambda run=run: run(1))
            tn = seconds(lambda run=run: run(n))
            prefill[name].append(t1 * 1e3)
            decode[name].append((tn - t1) / (n - 1) * 1e3)
        decode["floor"].append(floor_seconds_per_byte(buf) * weight_bytes * 1e3)
        print(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in decode.items()))

    def spread(xs: list[float]) -> dict[str, float]:
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    results = {
        name: {"prefill_ms": spread(prefill[name]), "decode_ms_per_token": spread(decode[name])}
        for name in runs
    }
    ratio = [z / h for z, h in zip(decode["zmqllm_engine"], decode["hf_generate"], strict=True)]
    over = [z / f for z, f in zip(decode["zmqllm_engine"], decode["floor"], strict=True)]
    floor = statistics.median(decode["floor"])
    summary = {
        "ratio_decode_zmqllm_over_hf": spread(ratio),
        "weight_bytes_per_token": weight_bytes,
        "floor_ms_per_token": spread(decode["floor"]),
        "read_bandwidth_gb_s": weight_bytes / floor / 1e6,
        "zmqllm_decode_over_floor": spread(over),
        "greedy_tokens_identical_to_hf": same,
    }

    print(
        f"\nengine latency — {model_dir.name}, {a.dtype}, {a.threads} threads, "
        f"prompt {len(ids)} tokens, {n} new tokens, {a.repeats} alternating rounds"
    )
    print(f"{'':20} {'prefill ms':>11} {'decode ms/tok (range)':>24} {'tok/s':>7}")
    for name in [*runs, "floor"]:
        d = spread(decode[name])
        pre = f"{statistics.median(prefill[name]):11.1f}" if name in prefill else " " * 11
        print(
            f"{name:20} {pre} {d['median']:9.2f} ({d['min']:5.2f}-{d['max']:6.2f}) "
            f"{1e3 / d['median']:7.1f}"
        )
    rs, os_ = summary["ratio_decode_zmqllm_over_hf"], summary["zmqllm_decode_over_floor"]
    print(
        f"zmqllm / HF per round: {rs['median']:.2f} ({rs['min']:.2f}-{rs['max']:.2f}); "
        f"zmqllm / floor: {os_['median']:.2f} ({os_['min']:.2f}-{os_['max']:.2f})"
    )
    print(
        f"floor: {weight_bytes / 1e6:.0f} MB/token at {summary['read_bandwidth_gb_s']:.1f} GB/s "
        f"(sum over a filled 512 MiB tensor); greedy tokens identical to HF: {same}"
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
