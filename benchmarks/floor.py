"""The floor under a serving figure: what this machine's memory and matrix units allow.

A decode step of ``n`` streams reads every weight once, whatever ``n`` is, and each
stream's keys and values; it does 2 flops per weight per stream, plus its attention.
Its least time is the larger of (bytes read / read bandwidth) and (flops / the best
matrix rate measured here), so the decode floor is ``n`` tokens over that time. A
prompt's tokens share their weight reads, so the prefill floor is the matrix rate over
the flops of one prompt token. Both are bounds no runtime reaches: a runtime's figure
over its floor says how much of the machine it uses.

The machine is measured, never assumed: the read bandwidth of a sum over a filled 512 MiB
buffer, and the rate of PyTorch's float32 and bfloat16 GEMMs (oneDNN: AMX or AVX512_BF16
where the CPU has them) at ``RATE_ROWS`` rows through the model's widest product, each
the best of a few tries, with the threads the runtimes get.

    python benchmarks/floor.py [--model DIR] [--threads 2] [--levels 1 4 16 64]
        [--context 100] [--prefill-tokens 512]

serving_peers.py prints the same floor beside its figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zmqllm.engine.memory_plan import BYTES_PER_WEIGHT
from zmqllm.models.model_args import ModelArgs

FLOOR_BYTES = 512 << 20  # larger than every cache of these machines
# Rows of the rate's GEMM: those of the serving benchmarks' prompt (512 tokens), since a
# prefill floor measured at fewer rows than the prefill runs was passed (1.15x at 256).
RATE_ROWS = 512
TRIES = 3
# How each runtime holds its weights: zmqllm's quantized layers keep a float32 scale and
# offset per block of 32 and an int8 head; vLLM's CPU backend serves bfloat16.
HEAD_WEIGHTS = {"int4": "int8", "int8": "int8"}
KV_ITEMSIZE = {"bfloat16": 2, "float16": 2}  # else float32, as zmqllm's CPU cache holds it


@dataclass(frozen=True)
class Machine:
    """What this machine did when measured: bytes/s of a read, flops/s per GEMM dtype."""

    read_bytes_per_s: float
    flops_per_s: dict[str, float]

    @property
    def best_rate(self) -> tuple[str, float]:
        return max(self.flops_per_s.items(), key=lambda kv: kv[1])

    def as_dict(self) -> dict[str, Any]:
        return {
            "read_gb_s": self.read_bytes_per_s / 1e9,
            "gflops": {k: v / 1e9 for k, v in self.flops_per_s.items()},
            "rate_rows": RATE_ROWS,
        }


@dataclass(frozen=True)
class Step:
    """One decode step's work: the bytes it must read and the flops it must do."""

    bytes_read: float
    flops: float

    def seconds(self, machine: Machine) -> float:
        return max(self.bytes_read / machine.read_bytes_per_s, self.flops / machine.best_rate[1])


def _best_seconds(fn: Callable[[], object]) -> float:
    fn()  # first call: allocation, oneDNN's kernel choice
    best = float("inf")
    for _ in range(TRIES):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth(threads: int) -> float:
    """Bytes per second of a sum over a filled buffer larger than every cache."""
    import torch

    torch.set_num_threads(threads)
    buf = torch.ones(FLOOR_BYTES // 4, dtype=torch.float32)
    return FLOOR_BYTES / _best_seconds(buf.sum)


def matrix_rate(threads: int, dtype: str, k: int, n: int, rows: int = RATE_ROWS) -> float:
    """Flops per second of PyTorch's (rows x k) @ (k x n) GEMM in ``dtype``."""
    import torch

    torch.set_num_threads(threads)
    t = getattr(torch, dtype)
    x = torch.randn(rows, k).to(t)
    w = torch.randn(k, n).to(t)
    return 2.0 * rows * k * n / _best_seconds(lambda: torch.mm(x, w))


def measure(
    args: ModelArgs, threads: int, dtypes: tuple[str, ...] = ("float32", "bfloat16")
) -> Machine:
    """This machine's read bandwidth and GEMM rates, through the model's gate+up product
    (hidden -> 2 x intermediate, its widest)."""
    k, n = args.hidden_size, 2 * args.intermediate_size
    rates = {d: matrix_rate(threads, d, k, n) for d in dtypes}
    return Machine(read_bandwidth(threads), rates)


def row_flops(args: ModelArgs, context: int) -> float:
    """Flops of one row through every layer and the head: 2 a weight, and attention's
    two products over ``context`` cached tokens (q.k and the weighted sum of v)."""
    weights = args.num_layers * args.layer_params + args.vocab_size * args.hidden_size
    attention = 4 * args.num_layers * args.num_heads * args.head_dim * context
    return 2.0 * weights + attention


def weight_bytes_read(args: ModelArgs, weights: str) -> float:
    """Bytes a step reads of the weights held as ``weights`` (a BYTES_PER_WEIGHT key):
    every layer's products and the head; the embedding gives a step one row a stream."""
    head = HEAD_WEIGHTS.get(weights, weights)
    layers = args.num_layers * args.layer_params * BYTES_PER_WEIGHT[weights]
    return layers + args.vocab_size * args.hidden_size * BYTES_PER_WEIGHT[head]


def decode_step(args: ModelArgs, weights: str, streams: int, context: int) -> Step:
    """A step of ``streams`` rows, each over ``context`` cached tokens."""
    kv_token = 2 * args.num_layers * args.num_kv_heads * args.head_dim * KV_ITEMSIZE.get(weights, 4)
    read = weight_bytes_read(args, weights) + streams * context * kv_token
    return Step(read, streams * row_flops(args, context))


def decode_floor(
    machine: Machine, args: ModelArgs, weights: str, streams: int, context: int
) -> float:
    """The most tokens/s ``streams`` decoding streams can make on this machine."""
    return streams / decode_step(args, weights, streams, context).seconds(machine)


def prefill_floor(machine: Machine, args: ModelArgs, tokens: int) -> float:
    """The most prompt tokens/s of a ``tokens``-token prompt: each token attends to half
    the prompt on average, and only the last one goes through the head."""
    head = 2.0 * args.vocab_size * args.hidden_size
    return machine.best_rate[1] / (row_flops(args, tokens // 2) - head + head / tokens)


def floors(
    machine: Machine,
    args: ModelArgs,
    weights: tuple[str, ...],
    levels: list[int],
    context: int,
    prefill_tokens: int,
) -> dict[str, Any]:
    """Every floor a serving table shows, per weight format: decode tokens/s per level
    and prefill tokens/s."""
    return {
        "machine": machine.as_dict(),
        "context": context,
        "decode_tokens_per_s": {
            w: {lv: decode_floor(machine, args, w, lv, context) for lv in levels} for w in weights
        },
        "prefill_tokens_per_s": prefill_floor(machine, args, prefill_tokens),
    }


def describe(f: dict[str, Any]) -> str:
    m = f["machine"]
    rates = ", ".join(f"{d} {g:.0f}" for d, g in m["gflops"].items())
    lines = [
        f"floor: read {m['read_gb_s']:.1f} GB/s; GEMM GFLOPS at {m['rate_rows']} rows: {rates}; "
        f"{f['context']} cached tokens a stream",
    ]
    for w, per_level in f["decode_tokens_per_s"].items():
        cells = ", ".join(f"{lv}: {v:.0f}" for lv, v in per_level.items())
        lines.append(f"  decode tok/s with {w} weights, by streams: {cells}")
    lines.append(f"  prefill tok/s: {f['prefill_tokens_per_s']:.0f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a Mistral checkpoint (default: the default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--context", type=int, default=100, help="cached tokens a stream")
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--weights", nargs="+", default=["int4", "int8", "bfloat16", "float32"])
    a = ap.parse_args()
    if a.model is None:
        from zmqllm.config.paths import default_model_dir
        from zmqllm.models.prepare import prepare_default_model

        a.model = prepare_default_model(default_model_dir())
    args = ModelArgs.from_dir(a.model)
    bad = [w for w in a.weights if w not in BYTES_PER_WEIGHT]
    if bad:
        ap.error(f"--weights: {bad} not among {sorted(BYTES_PER_WEIGHT)}")
    machine = measure(args, a.threads)
    print(describe(floors(machine, args, tuple(a.weights), a.levels, a.context, a.prefill_tokens)))


if __name__ == "__main__":
    main()
