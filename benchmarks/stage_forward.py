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

    python benchmarks/stage_forward.py [--quant int8] [--stages 1 2] [--rows 1 4 8 16 32]
        [--threads 1]

Writes benchmarks/results/stage_forward[_QUANT].json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import time
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


def time_rows(shard: Any, pool: Any, m: int, context: int, reps: int) -> list[float]:
    """Seconds per decode forward of m sessions, each ``context`` tokens in."""
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
        times = []
        for _ in range(reps + 2):
            t = time.perf_counter()
            shard(x, segments)
            times.append(time.perf_counter() - t)
    for name in names:
        pool.free(name)
    return times[2:]  # the first two warm the kernels' paths for this m


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
            del shard, pool
    meta = {"model": str(model_dir), "quant": a.quant, "context": a.context, "reps": a.reps}
    meta["threads"] = a.threads
    meta["cpu"] = cpu_name()
    suffix = "" if a.quant == "none" else f"_{a.quant}"
    out = a.out or Path(f"benchmarks/results/stage_forward{suffix}.json")
    write_json(out, {"meta": meta, "results": results})


if __name__ == "__main__":
    main()
