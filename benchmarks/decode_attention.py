"""The batched decode attention of one forward (the compiled kernel, every layer of a
stage in turn) with float32 and with bfloat16 KV caches (``[worker] kv_dtype``), in
alternating rounds, beside the time its cache bytes take at this machine's read bandwidth.

At many streams a decode forward reads every session's whole cache: 64 sessions of 256
tokens are 758 MB a forward of the default model in float32, more than its int4 weights.
Printed per sessions x context: the median ms of the layers' attention calls (min-max
over rounds), the floor (the cache's bytes at the read bandwidth of a 2-thread sum), and
float32 / bfloat16; the JSON also has the GB/s they read.

    python benchmarks/decode_attention.py [--model DIR] [--sessions 16 64] [--context 256 1024]
        [--layers N] [--rounds 5] [--threads 2] [--dtypes float32] [--one-layer]

Writes benchmarks/results/decode_attention.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import math
import time
from typing import Any

from benchmarks.floor import read_bandwidth
from benchmarks.report import cpu_name, write_json
from benchmarks.stats import spread

SIZES = {"float32": 4, "bfloat16": 2}  # bytes of a cached number
DTYPES = tuple(SIZES)


def caches(args: Any, sessions: int, context: int, layers: int, dtype: Any) -> Any:
    """A DecodeBatch of ``sessions`` caches holding ``context`` random positions each."""
    import torch

    from zmqllm.engine import native

    shape = (layers, args.num_kv_heads, context + 8, args.head_dim)
    k = [torch.randn(shape).to(dtype) for _ in range(sessions)]
    v = [torch.randn(shape).to(dtype) for _ in range(sessions)]
    module = native.load()
    assert module is not None, "the compiled kernels did not build"
    return module, module.DecodeBatch(
        k, v, list(range(sessions)), [context] * sessions, [0] * sessions
    )


def forward_seconds(
    args: Any, module: Any, batch: Any, sessions: int, layers: int, one_layer: bool = False
) -> float:
    """One forward's attention calls, every layer in turn (new rows written at the same
    position each time, so the context stays as built); ``one_layer``: every call reads
    layer 0's caches, which stay in cache: the kernel's own cost, not memory's."""
    import torch

    d = args.head_dim
    q = torch.randn(sessions, args.num_heads, d)
    k = torch.randn(sessions, args.num_kv_heads, d)
    out = torch.empty(sessions, args.num_heads * d)
    t = time.perf_counter()
    for layer in range(layers):
        module.decode_attention(out, q, k, k, batch, 0 if one_layer else layer, 1 / math.sqrt(d))
    return time.perf_counter() - t


def main() -> None:
    import torch

    from zmqllm.config.paths import default_model_dir
    from zmqllm.models.model_args import ModelArgs
    from zmqllm.models.prepare import prepare_default_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a model directory (default: the default model)")
    ap.add_argument("--sessions", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--layers", type=int, default=0, help="0: the model's")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--one-layer", action="store_true", help="every call reads layer 0 (held in cache)"
    )
    ap.add_argument(
        "--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES), help="the caches' dtypes"
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_attention.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model_dir = a.model or prepare_default_model(default_model_dir())
    args = ModelArgs.from_dir(model_dir)
    layers = a.layers or args.num_layers
    bandwidth = read_bandwidth(a.threads)
    heads = f"{args.num_heads}/{args.num_kv_heads} heads of {args.head_dim}"
    print(f"{model_dir.name}: {layers} layers, {heads}; {a.threads} threads; {cpu_name()}")
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s")
    dtypes = tuple(a.dtypes)
    print(f"{'sessions':>8} {'context':>7}" + "".join(f"{d + ' ms':>21}" for d in dtypes))
    results: list[dict[str, Any]] = []
    for n in a.sessions:
        for ctx in a.context:
            built = {d: caches(args, n, ctx, layers, getattr(torch, d)) for d in dtypes}
            times: dict[str, list[float]] = {d: [] for d in dtypes}
            for _ in range(a.rounds + 1):  # the first round warms: not kept
                for d in dtypes:
                    seconds = forward_seconds(args, *built[d], n, layers, a.one_layer)
                    times[d].append(seconds * 1e3)
            row: dict[str, Any] = {"sessions": n, "context": ctx}
            for d in dtypes:
                numbers = n * layers * args.num_kv_heads * (ctx + 1) * args.head_dim * 2
                cache_bytes = numbers * SIZES[d]
                s = spread(times[d][1:])
                row[d] = {**s, "gb_s": cache_bytes / s["median"] / 1e6}
                row[d]["floor_ms"] = cache_bytes / bandwidth * 1e3
            cells = [
                f"{row[d]['median']:.1f} ({row[d]['min']:.1f}-{row[d]['max']:.1f})" for d in dtypes
            ]
            floors = " / ".join(f"{row[d]['floor_ms']:.1f}" for d in dtypes) + " ms"
            if len(dtypes) == 2:
                row["ratio"] = row["float32"]["median"] / row["bfloat16"]["median"]
                floors += f"; float32 / bfloat16 {row['ratio']:.2f}"
            print(f"{n:8d} {ctx:7d}" + "".join(f"{c:>21}" for c in cells) + f"   floor {floors}")
            results.append(row)
            del built
    meta = {"model": str(model_dir), "layers": layers, "threads": a.threads, "cpu": cpu_name()}
    meta["one_layer"] = a.one_layer
    write_json(a.out, {"meta": {**meta, "read_gb_s": bandwidth / 1e9}, "results": results})


if __name__ == "__main__":
    main()
