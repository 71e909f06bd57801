"""Many-row products of one Mistral-7B-shaped layer: which path wins from how many rows.

Batched decode (one row per stream) and prefill (one row per prompt token) multiply many
rows through the same weights. This times one 7B layer's four products (qkv 4096->6144,
o 4096->4096, gate+up 4096->28672, down 14336->4096; random weights) at each row count
with every candidate, in alternating rounds: zmqllm's own int4 and int8 products as
chosen for the row count (from 8 rows, 12 on AMX, the bfloat16 matrix-unit path where
the build has it; on AVX512_BF16 without AMX the codes path at 8-16 and 24-32 rows),
int4 and int8 through oneDNN's bfloat16 micro-kernel and through the codes path at
every row count (where each wins sets the codes path's rows), without the matrix
units (16-bit activations in passes of 16 rows, dequantize + float32 GEMM from 128
rows) and with int8 activations (VNNI from 5 rows, bfloat16 from 12 on AMX), PyTorch's
float32 and bfloat16 GEMMs (oneDNN: AVX512_BF16 or AMX where the CPU has them),
int4 widened to bfloat16 on every call then the bfloat16 GEMM (the cost of widening a
whole weight per forward), and PyTorch's own int4 and int8 weight-only CPU ops. It prints
ms per layer, GFLOPS and the ratio to zmqllm int4 without the matrix units (where built;
else zmqllm int4) at each row count, and names the CPU.

    python benchmarks/many_rows.py [--rows 1 4 16 64 128] [--rounds 3] [--threads 2]

Writes benchmarks/results/many_rows.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import platform
import time
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from benchmarks.linear_kernels import torch_int4, torch_int8
from benchmarks.report import write_json
from benchmarks.stats import median
from zmqllm.engine import native, quant

# The ratios' reference: zmqllm int4 as it was before the matrix units, where this build has them.
BASES = ("zmqllm int4, no matrix units", "zmqllm int4")
# One Mistral-7B layer's products: (out, in); qkv is 32 query heads + 2 x 8 KV heads of 128.
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def cpu_name() -> str:
    """The CPU's model and the matrix features that decide these figures."""
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")
    return f"{model} ({', '.join(f for f in wanted if f in flags) or 'no AVX2'})"


def candidates(weights: dict[str, torch.Tensor]) -> dict[str, Callable[[torch.Tensor], None]]:
    """Each candidate multiplies float32 rows [rows, in] through the whole layer."""
    w32 = list(weights.values())
    w16 = [w.to(torch.bfloat16) for w in w32]
    q4 = [quant.quantize_int4(w) for w in w32]
    q8 = [quant.quantize_int8(w) for w in w32]
    t4 = [torch_int4(w) for w in w32]
    t4s = [s.to(torch.bfloat16) for _, s in t4]
    t8 = [torch_int8(w) for w in w32]
    found: dict[str, Callable[[torch.Tensor], None]] = {}
    kernel = native.load()
    if kernel is not None:
        m4 = [kernel.Matrix(quant.KIND["int4"], t.q, t.d, t.m) for t in q4]
        m8 = [kernel.Matrix(quant.KIND["int8"], t.q, t.d, t.m) for t in q8]
        found["zmqllm int4"] = lambda xs: [kernel.matmul(x, m) for x, m in zip(xs, m4, strict=True)]
        found["zmqllm int8"] = lambda xs: [kernel.matmul(x, m) for x, m in zip(xs, m8, strict=True)]
        if kernel.bf16_built():  # each matrix-unit path by name, and the paths before them
            # int4 and int8 through oneDNN's bfloat16 micro-kernel at every row count (the
            # codes path takes 8-16 and 24-32 rows on AVX512_BF16 without AMX).
            found["zmqllm int4, brgemm"] = lambda xs: [
                kernel.matmul_path(x, m, "brgemm") for x, m in zip(xs, m4, strict=True)
            ]
            found["zmqllm int8, brgemm"] = lambda xs: [
                kernel.matmul_path(x, m, "brgemm") for x, m in zip(xs, m8, strict=True)
            ]
            # And the codes path at every row count: where it wins sets its rows.
            found["zmqllm int4, codes"] = lambda xs: [
                kernel.matmul_path(x, m, "codes") for x, m in zip(xs, m4, strict=True)
            ]
            found["zmqllm int8, codes"] = lambda xs: [
                kernel.matmul_path(x, m, "codes") for x, m in zip(xs, m8, strict=True)
            ]
            found["zmqllm int4, no matrix units"] = with_units(kernel, m4, False, False)
            found["zmqllm int8, no matrix units"] = with_units(kernel, m8, False, False)
        if kernel.vnni_built():  # int8_activations: VNNI at 5-11 rows on AMX, from 5 elsewhere
            found["zmqllm int4, int8 activations"] = with_units(kernel, m4, True, True)
            found["zmqllm int8, int8 activations"] = with_units(kernel, m8, True, True)
    found["torch fp32"] = lambda xs: [F.linear(x, w) for x, w in zip(xs, w32, strict=True)]
    found["torch bf16"] = lambda xs: [
        F.linear(x.to(torch.bfloat16), w) for x, w in zip(xs, w16, strict=True)
    ]
    found["int4 -> bf16 + torch bf16"] = lambda xs: [
        F.linear(x.to(torch.bfloat16), quant.dequantize(t).to(torch.bfloat16))
        for x, t in zip(xs, q4, strict=True)
    ]
    found["torch int4pack bf16"] = lambda xs: [
        torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), p, 32, s)
        for x, (p, _), s in zip(xs, t4, t4s, strict=True)
    ]
    found["torch int8pack"] = lambda xs: [
        torch.ops.aten._weight_int8pack_mm(x, q, sc) for x, (q, sc) in zip(xs, t8, strict=True)
    ]
    return found


def with_units(
    kernel: ModuleType, mats: list[object], units: bool, int8: bool
) -> Callable[[list], None]:
    """zmqllm's product as the worker settings matrix_units and int8_activations make it."""

    def run(xs: list[torch.Tensor]) -> None:
        kernel.set_matrix_units(units, int8)
        try:
            for x, m in zip(xs, mats, strict=True):
                kernel.matmul(x, m)
        finally:
            kernel.set_matrix_units(True)

    return run


def timed(fn: Callable[[torch.Tensor], None], xs: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    fn(xs)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 128])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/many_rows.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    weights = {k: torch.randn(shape, generator=g) * 0.02 for k, shape in SHAPES.items()}
    params = sum(w.numel() for w in weights.values())
    paths = candidates(weights)
    base = next((n for n in BASES if n in paths), next(iter(paths)))
    times: dict[int, dict[str, list[float]]] = {r: {n: [] for n in paths} for r in a.rows}
    for rows in a.rows:
        xs = [torch.randn(rows, w.shape[1], generator=g) for w in weights.values()]
        for fn in paths.values():
            fn(xs)  # warm-up: packing, thread pools, kernel caches
        for r in range(a.rounds):
            order = list(paths.items())
            for name, fn in order[::-1] if r % 2 else order:
                times[rows][name].append(timed(fn, xs) * 1e3)
    print(f"\n{cpu_name()}, {a.threads} threads, one 7B layer ({params / 1e6:.0f} M weights)")
    print(f"median ms of {a.rounds} alternating rounds (range), GFLOPS, x {base}'s time")
    rows_out = []
    for rows in a.rows:
        print(f"\n{rows} rows")
        ref = median(times[rows][base])
        for name, ts in times[rows].items():
            med = median(ts)
            gflops = 2 * rows * params / (med / 1e3) / 1e9
            print(
                f"  {name:28} {med:9.2f} ({min(ts):.2f}-{max(ts):.2f}) "
                f"{gflops:7.1f} GFLOPS {med / ref:6.2f}x"
            )
            rows_out.append(
                {"rows": rows, "path": name, "median_ms": med, "min_ms": min(ts),
                 "max_ms": max(ts), "gflops": gflops, "x_base": med / ref}
            )  # fmt: skip
    meta = {"cpu": cpu_name(), "threads": a.threads, "rounds": a.rounds, "weights": params}
    write_json(a.out, {"meta": meta, "rows": rows_out})


if __name__ == "__main__":
    main()
