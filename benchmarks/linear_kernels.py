"""Single-stream matrix-vector products: which kernel reads the weights fastest here.

One decode token of the default model multiplies one row through every linear
weight (30 layers' qkv, o, gate+up and down, and the lm_head: 538 MB in float32).
This times that whole set of products with each candidate, in alternating rounds
within one run (this machine's speed drifts), next to the memory floor: the same
bytes at the read bandwidth of a sum over a filled 512 MiB tensor.

    python benchmarks/linear_kernels.py [--threads 2] [--rounds 7]

Prints median and range of ms per token for each; writes JSON
(default benchmarks/results/linear_kernels.json).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import repo_root  # noqa: F401  (this checkout first on sys.path)
import torch
import torch.nn.functional as F
from report import write_json

from zmqllm.config import default_model_dir
from zmqllm.engine import native
from zmqllm.engine.generator import load_shard
from zmqllm.models import prepare_default_model

FLOOR_BYTES = 512 << 20


def timed(fn: Callable[[], object], inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def floor_seconds_per_byte(buf: torch.Tensor) -> float:
    """Seconds per byte of a streaming read (a sum) over a buffer beyond every cache."""
    return timed(buf.sum, 3) / (buf.numel() * buf.element_size())


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
    if kernel is not None:
        candidates["zmqllm gemv fp32 (AVX2)"] = lambda: [kernel.gemv(x, w) for x, w in pairs]
    buf = torch.ones(FLOOR_BYTES // 4)
    times: dict[str, list[float]] = {name: [] for name in [*candidates, "floor"]}
    for fn in candidates.values():
        fn()  # warm-up
    for r in range(a.rounds):
        order = list(candidates.items())
        if r % 2:
            order.reverse()
        for name, fn in order:
            times[name].append(timed(fn, a.inner) * 1e3)
        times["floor"].append(floor_seconds_per_byte(buf) * nbytes * 1e3)

    floor = statistics.median(times["floor"])
    print(
        f"\none token's matrix-vector products: {nbytes / 1e6:.0f} MB of float32 weights, "
        f"{a.threads} threads, {a.rounds} alternating rounds"
    )
    print(f"{'':28} {'ms median':>10} {'range':>15} {'GB/s':>6} {'x floor':>8}")
    summary = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        gbs = (nbytes if "bf16" not in name else nbytes / 2) / med / 1e6
        print(f"{name:28} {med:10.2f} {min(ts):7.2f}-{max(ts):<7.2f} {gbs:6.1f} {med / floor:8.2f}")
        summary[name] = {"median_ms": med, "min_ms": min(ts), "max_ms": max(ts), "gb_s": gbs}
    meta = {"threads": a.threads, "rounds": a.rounds, "weight_bytes": nbytes}
    write_json(Path(a.out), {"meta": meta, "results": summary, "rounds_ms": times})


_NAMES = ("wqkv", "wo", "w_gate_up", "w_down")

if __name__ == "__main__":
    np.random.seed(0)
    main()
