"""Single-stream matrix-vector products: which kernel reads the weights fastest here.

One decode token of the default model multiplies one row through every linear
weight (30 layers' qkv, o, gate+up and down, and the lm_head: 538 MB in float32).
This times that whole set of products with each candidate, in alternating rounds
within one run (this machine's speed drifts), next to the memory floor: the same
bytes at the read bandwidth of a sum over a filled 512 MiB tensor. Quantized
candidates hold every one of those weights quantized: zmqllm's own int8 and int4
(group-32 with scale and minimum) and PyTorch's CPU ops for int8 (per output
channel) and int4 (group-32, float32 and bfloat16 activations).

    python benchmarks/linear_kernels.py [--threads 2] [--rounds 7]

Prints median and range of ms per token for each; writes JSON
(default benchmarks/results/linear_kernels.json).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.floor import read_bandwidth
from benchmarks.report import write_json
from benchmarks.stats import median
from zmqllm.config.paths import default_model_dir
from zmqllm.engine import native, quant
from zmqllm.engine.generator import load_shard
from zmqllm.models.prepare import prepare_default_model


def timed(fn: Callable[[], object], inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def torch_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8, as aten._weight_int8pack_mm takes it."""
    scale = w.abs().amax(1).clamp(min=1e-8) / 127
    return torch.round(w / scale[:, None]).to(torch.int8), scale


def torch_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-32 asymmetric int4 packed for aten._weight_int4pack_mm_for_cpu, with its
    [groups, out, 2] scales and zeros (w = (q - 8) * scale + zero)."""
    out, inn = w.shape
    g = w.reshape(out, inn // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo).clamp(min=1e-8) / 15
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(out, inn), 1)
    return packed, torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--inner", type=int, default=3, help="tokens timed per candidate per round")
    ap.add_argument("--out", default="benchmarks/results/linear_kernels.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    shard = load_shard(prepare_default_model(default_model_dir()), 0, 30)
    assert shard.lm_head is not None
    weights = [getattr(layer, n).weight.data for layer in shard.layers for n in _NAMES]
    weights.append(shard.lm_head)
    nbytes = sum(w.numel() * 4 for w in weights)
    xs = [torch.randn(1, w.shape[1]) for w in weights]
    kernel = native.load()
    bf16 = [w.to(torch.bfloat16) for w in weights]
    xs16 = [x.to(torch.bfloat16) for x in xs]
    npw = [w.numpy() for w in weights]
    npx = [x.numpy()[0] for x in xs]
    mkl = torch.ops.mkl
    packed = [mkl._mkl_reorder_linear_weight(w, 1) for w in weights]
    pairs = list(zip(xs, weights, strict=True))

    candidates: dict[str, Callable[[], object]] = {
        "F.linear fp32": lambda: [F.linear(x, w) for x, w in pairs],
        "torch.mv fp32": lambda: [torch.mv(w, x[0]) for x, w in pairs],
        "numpy (OpenBLAS) fp32": lambda: [w @ x for x, w in zip(npx, npw, strict=True)],
        "MKL packed fp32": lambda: [
            mkl._mkl_linear(x, p, w, None, 1) for x, p, w in zip(xs, packed, weights, strict=True)
        ],
        "F.linear bf16 (not exact)": lambda: [
            F.linear(x, w) for x, w in zip(xs16, bf16, strict=True)
        ],
    }
    sizes = {name: nbytes for name in candidates}
    sizes["F.linear bf16 (not exact)"] = nbytes // 2
    if kernel is not None:
        candidates["zmqllm gemv fp32 (AVX2)"] = lambda: [kernel.gemv(x, w) for x, w in pairs]
        sizes["zmqllm gemv fp32 (AVX2)"] = nbytes
        for kind, fn in (("int8", quant.quantize_int8), ("int4", quant.quantize_int4)):
            qts = [fn(w) for w in weights]
            mats = [kernel.Matrix(quant.KIND[kind], t.q, t.d, t.m) for t in qts]
            name = f"zmqllm {kind} (group-32)"
            candidates[name] = lambda mats=mats: [
                kernel.matmul(x, m) for x, m in zip(xs, mats, strict=True)
            ]
            sizes[name] = sum(t.nbytes for t in qts)
    q8 = [torch_int8(w) for w in weights]
    candidates["torch int8pack (per channel)"] = lambda: [
        torch.ops.aten._weight_int8pack_mm(x, q, sc) for x, (q, sc) in zip(xs, q8, strict=True)
    ]
    sizes["torch int8pack (per channel)"] = nbytes // 4
    q4 = [torch_int4(w) for w in weights]
    for dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        xd = [x.to(dtype) for x in xs]
        sz = [s.to(dtype) for _, s in q4]
        candidates[f"torch int4pack {label} x"] = lambda xd=xd, sz=sz: [
            torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, 32, s)
            for x, (p, _), s in zip(xd, q4, sz, strict=True)
        ]
        sizes[f"torch int4pack {label} x"] = nbytes // 8
    times: dict[str, list[float]] = {name: [] for name in [*candidates, "floor"]}
    for fn in candidates.values():
        fn()  # warm-up
    for r in range(a.rounds):
        order = list(candidates.items())
        if r % 2:
            order.reverse()
        for name, fn in order:
            times[name].append(timed(fn, a.inner) * 1e3)
        times["floor"].append(nbytes / read_bandwidth(a.threads) * 1e3)

    floor = median(times["floor"])
    print(
        f"\none token's matrix-vector products: {nbytes / 1e6:.0f} MB of float32 weights, "
        f"{a.threads} threads, {a.rounds} alternating rounds"
    )
    print(f"{'':28} {'ms median':>10} {'range':>15} {'GB/s':>6} {'x floor':>8}")
    print("(GB/s: the bytes each reads; x floor: against the float32 bytes' floor)")
    summary = {}
    for name, ts in times.items():
        med = median(ts)
        gbs = sizes.get(name, nbytes) / med / 1e6
        print(f"{name:28} {med:10.2f} {min(ts):7.2f}-{max(ts):<7.2f} {gbs:6.1f} {med / floor:8.2f}")
        summary[name] = {"median_ms": med, "min_ms": min(ts), "max_ms": max(ts), "gb_s": gbs}
    meta = {"threads": a.threads, "rounds": a.rounds, "weight_bytes": nbytes}
    write_json(Path(a.out), {"meta": meta, "results": summary, "rounds_ms": times})


_NAMES = ("wqkv", "wo", "w_gate_up", "w_down")

if __name__ == "__main__":
    np.random.seed(0)
    main()
