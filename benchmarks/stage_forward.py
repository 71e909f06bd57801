"""What one decode forward of a stage costs at each batch size: the roofline of a pipeline.

Each stage of the split "k/n" gives (``--stages``, default 1 and 2) is loaded as a worker
loads it (compiled kernels on, packed weights for float32 as ``packed_rows`` 16 keeps
them), on one thread (``--threads``); then, for each row count m (``--rows``), m sessions of a
``--context``-token prompt each take decode steps together, one forward of m rows each.
Printed per stage and m: the median forward time over ``--reps`` forwards and its
min-max, and the time per row.

Why it matters (docs/pipeline.md): K stages moving a route's sessions in K groups give
each stage forwards of 1/K of the rows. Where a stage's forward costs the same at m/K
rows as at m (the weights' bytes bound it, as float32 at 8-16 rows here), the split
adds nothing; where the time per row is flat (int8 here, compute-bound), K stages on K
cores give up to K times the aggregate.

``--parts`` times, inside the same forwards, where each one's time goes: every layer's
four products, the decode attention, the head, the few-row path's one call (up to its
rows it runs every layer), and the rest (norms, rope, silu, residual adds, Python).

    python benchmarks/stage_forward.py [--quant int8] [--stages 1 2] [--rows 1 4 8 16 32]
        [--threads 1] [--parts]

Writes benchmarks/results/stage_forward[_QUANT].json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import time
from collections.abc import Callable
from typing import Any

from benchmarks.report import cpu_name, write_json
from benchmarks.stats import median


def load(model_dir: Path, start: int, end: int, quant: str) -> tuple[Any, Any]:
    from zmqllm.engine import native
    from zmqllm.engine.cache import CachePool
    from zmqllm.engine.generator import load_shard
    from zmqllm.models.model_args import ModelArgs

    args = ModelArgs.from_dir(model_dir)
    shard = load_shard(model_dir, start, end, "float32", "cpu", args, quant)
    shard.use_kernel(native.load())
    if quant == "none":
        shard.pack(16)
    return shard, CachePool(args, shard.num_local_layers, shard.dtype, "cpu")


def time_rows(
    shard: Any,
    pool: Any,
    m: int,
    context: int,
    reps: int,
    before_timed: Callable[[], None] | None = None,
) -> list[float]:
    """Seconds per decode forward of m sessions, each ``context`` tokens in (``reps`` of
    them, after two that warm the kernels' paths for this m and a call of ``before_timed``)."""
    import torch

    from zmqllm.engine.decoder_layer import Segment

    hidden = shard.args.hidden_size
    names = [f"s{m}-{i}" for i in range(m)]
    for name in names:
        pool.allocate(name, context + reps + 8)
    prompt = torch.arange(context) + 100 if shard.is_first else torch.randn(context, hidden)
    with torch.inference_mode():
        for name in names:  # the prompts, one at a time
            shard(prompt, [Segment(pool.get(name), context)])
        x = torch.arange(m) + 200 if shard.is_first else torch.randn(m, hidden)
        segments = [Segment(pool.get(name), 1) for name in names]
        for _ in range(2):
            shard(x, segments)
        if before_timed is not None:
            before_timed()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            shard(x, segments)
            times.append(time.perf_counter() - t)
    for name in names:
        pool.free(name)
    return times


PARTS = ("products", "attention", "head", "few-row path")
LAYER_PRODUCTS = ("wqkv", "wo", "w_gate_up", "w_down")


def _timed(fn: Callable[..., Any], tally: dict[str, float], part: str) -> Callable[..., Any]:
    """``fn``, its calls' wall time added to ``tally[part]``."""

    def call(*args: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            tally[part] += time.perf_counter() - t

    return call


class _TimedKernel:
    """The compiled kernels with their attention and few-row calls timed."""

    def __init__(self, kernel: Any, tally: dict[str, float]) -> None:
        self._kernel = kernel
        self.decode_attention = _timed(kernel.decode_attention, tally, "attention")
        self.decode_layers = _timed(kernel.decode_layers, tally, "few-row path")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kernel, name)


def time_parts(shard: Any, pool: Any, m: int, context: int, reps: int) -> dict[str, float]:
    """ms per forward of m decode rows (median), and the mean ms of each of its PARTS and
    of the rest, timed within the same forwards (each wrapped call costs ~1 us more)."""
    tally = dict.fromkeys(PARTS, 0.0)
    modules = [getattr(layer, n) for layer in shard.layers for n in LAYER_PRODUCTS]
    kernel = shard.kernel
    # An instance's own ``forward`` is what nn.Module calls: set here, deleted after.
    for module in modules:
        module.forward = _timed(module.forward, tally, "products")
    if shard.head is not None:
        shard.head.forward = _timed(shard.head.forward, tally, "head")
    if kernel is not None:
        shard.kernel = _TimedKernel(kernel, tally)
    try:
        times = time_rows(
            shard, pool, m, context, reps, lambda: tally.update(dict.fromkeys(PARTS, 0.0))
        )
    finally:
        for module in [*modules, *([shard.head] if shard.head is not None else [])]:
            del module.forward
        shard.kernel = kernel
    parts = {k: tally[k] / reps * 1e3 for k in PARTS}
    mean = sum(times) / len(times) * 1e3
    return {"ms": median([t * 1e3 for t in times]), **parts, "rest": mean - sum(parts.values())}


def main() -> None:
    import torch

    from zmqllm.config.paths import default_model_dir
    from zmqllm.models.model_args import ModelArgs
    from zmqllm.models.prepare import prepare_default_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a model directory (default: the default model)")
    ap.add_argument("--quant", default="none", choices=["none", "int8", "int4"])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--context", type=int, default=64, help="prompt tokens of each session")
    ap.add_argument("--reps", type=int, default=12, help="timed forwards per row count")
    ap.add_argument("--threads", type=int, default=1, help="threads of the forward")
    ap.add_argument("--parts", action="store_true", help="also where each forward's time goes")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model_dir = a.model or prepare_default_model(default_model_dir())
    args = ModelArgs.from_dir(model_dir)
    results: dict[str, dict[int, dict[str, float]]] = {}
    print(f"{model_dir.name}, quant {a.quant}, {a.threads} thread(s), {a.context}-token contexts")
    print(cpu_name())
    print(f"{'stage':>8} {'rows':>5} {'ms/forward':>10} {'(min-max)':>15} {'ms/row':>7}")
    for k in a.stages:
        for start, end in args.stage_ranges(k):
            shard, pool = load(model_dir, start, end, a.quant)
            span = f"{start}:{end}"
            results[span] = {}
            for m in a.rows:
                ts = [t * 1e3 for t in time_rows(shard, pool, m, a.context, a.reps)]
                med = median(ts)
                lo, hi = min(ts), max(ts)
                results[span][m] = {"ms": med, "min": lo, "max": hi, "ms_per_row": med / m}
                spread = f"({lo:.1f}-{hi:.1f})"
                print(f"{span:>8} {m:5d} {med:10.1f} {spread:>15} {med / m:7.2f}")
                if a.parts:
                    parts = time_parts(shard, pool, m, a.context, a.reps)
                    results[span][m]["parts"] = parts
                    shown = ", ".join(f"{k} {parts[k]:.1f}" for k in (*PARTS, "rest") if parts[k])
                    print(f"{'':>14} another {a.reps}: {parts['ms']:.1f} ms, of which ms: {shown}")
            del shard, pool
    meta = {"model": str(model_dir), "quant": a.quant, "context": a.context, "reps": a.reps}
    meta["threads"] = a.threads
    meta["cpu"] = cpu_name()
    suffix = "" if a.quant == "none" else f"_{a.quant}"
    out = a.out or Path(f"benchmarks/results/stage_forward{suffix}.json")
    write_json(out, {"meta": meta, "results": results})


if __name__ == "__main__":
    main()
