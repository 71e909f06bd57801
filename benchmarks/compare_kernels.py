"""Two builds of the compiled kernels, the working tree's and an older revision's,
timed in alternating fresh processes.

A kernel change moves a decode step by a few percent at most, less than this shared
machine's drift between runs minutes apart. This script builds the older revision's
csrc/ into a temporary folder (the working tree's build is the usual cached one), then
times each build in turn, in a fresh process that imports only that module, round
after round with the order flipped, and reports both medians and every round's ratio:

- ``int4``: one token's one-row products through every layer weight of the default
  model, quantized to int4 (group-32, scale and minimum), 120 products;
- ``attention``: decode attention of one session over ``--context`` tokens, 30 layers
  of 9 query heads on 3 kv heads of 64 (the default model's shape);
- ``int4x16`` / ``int8x16``: the four products of one Mistral-7B-shaped layer (random
  weights) for 16 rows, a batched decode step's many-row path.

``--march`` builds both for another target than this CPU (``ZMQLLM_NATIVE_MARCH``):
``x86-64-v3`` is what an AVX2-only machine builds, ``x86-64-v4`` an AVX-512 one without
BF16, VNNI or AMX; so a change's effect on those machines is measured here.

    python benchmarks/compare_kernels.py --before 615e014 [--rounds 6] [--threads 2]
        [--march x86-64-v3] [--what int4 attention int4x16 int8x16]

Writes benchmarks/results/compare_kernels.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import os
import subprocess
import tempfile
import time
from typing import Any

from benchmarks.paired import alternate, compare, describe
from benchmarks.report import cpu_name, write_json
from benchmarks.stats import median
from zmqllm.engine import native
from zmqllm.engine.native import NAME

REPO = Path(__file__).resolve().parent.parent
ITERATIONS = 15  # timed repetitions per process; the median is its figure
KINDS = ("int4", "attention", "int4x16", "int8x16")
# One Mistral-7B layer's products, (inputs, outputs): qkv, o, gate+up, down.
LAYER_7B = ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096))


def build_revision(rev: str, into: Path) -> Path:
    """REV's csrc/ compiled into ``into``; the module's path."""
    src = into / "src"
    src.mkdir(parents=True, exist_ok=True)
    # REV's own file list: the csrc/ files of one revision need not be another's.
    csrc = native.CSRC.relative_to(REPO).as_posix()
    listing = ["git", "-C", str(REPO), "ls-tree", "--name-only", f"{rev}:{csrc}"]
    names = subprocess.run(listing, capture_output=True, check=True, text=True).stdout.split()
    for name in (n for n in names if n.endswith((".cpp", ".h"))):
        show = ["git", "-C", str(REPO), "show", f"{rev}:{csrc}/{name}"]
        (src / name).write_bytes(subprocess.run(show, capture_output=True, check=True).stdout)
    print(f"building {rev}'s kernels (1-2 minutes)...", flush=True)
    return native.build_from(src, into / "build")


def time_build(so: str, what: str, threads: int, context: int) -> float:
    """(In the child process.) Median ms of ``what`` with the module at ``so``."""
    import torch

    torch.set_num_threads(threads)
    kernel = native.import_built(Path(so))
    g = torch.Generator().manual_seed(0)
    if what == "int4":
        from zmqllm.config.paths import default_model_dir
        from zmqllm.engine import quant
        from zmqllm.engine.generator import load_shard
        from zmqllm.models.model_args import ModelArgs

        directory = default_model_dir()
        shard = load_shard(directory, 0, ModelArgs.from_dir(directory).num_layers)
        weights = [p.detach() for p in shard.layers.parameters() if p.dim() == 2]
        mats = []
        for w in weights:
            t = quant.quantize_int4(w)
            mats.append(kernel.Matrix(quant.KIND["int4"], t.q, t.d, t.m))
        xs = [torch.randn(1, w.shape[1], generator=g) for w in weights]

        def once() -> None:
            for x, m in zip(xs, mats, strict=True):
                kernel.matmul(x, m)

    elif what in ("int4x16", "int8x16"):
        from zmqllm.engine import quant

        kind = what[:4]
        quantize = quant.quantize_int4 if kind == "int4" else quant.quantize_int8
        mats, xs = [], []
        for inputs, outputs in LAYER_7B:
            t = quantize(torch.randn(outputs, inputs, generator=g) * 0.02)
            mats.append(kernel.Matrix(quant.KIND[kind], t.q, t.d, t.m))
            xs.append(torch.randn(16, inputs, generator=g))

        def once() -> None:
            for x, m in zip(xs, mats, strict=True):
                kernel.matmul(x, m)

    else:
        layers, kv_heads, heads, dim = 30, 3, 9, 64
        caches = [torch.randn(layers, kv_heads, context + 1, dim, generator=g) for _ in (0, 1)]
        batch = kernel.DecodeBatch(caches[:1], caches[1:], [0], [context], [0])
        q = torch.randn(1, heads, dim, generator=g)
        k, v = torch.randn(1, kv_heads, dim, generator=g), torch.randn(1, kv_heads, dim)
        out = torch.empty(1, heads * dim)

        def once() -> None:
            for layer in range(layers):
                kernel.decode_attention(out, q, k, v, batch, layer, dim**-0.5)

    for _ in range(3):
        once()
    times = []
    for _ in range(ITERATIONS):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return median(times) * 1e3


def run_child(so: Path, what: str, a: argparse.Namespace) -> float:
    cmd = [sys.executable, __file__, "--child", str(so), "--child-what", what]
    cmd += ["--threads", str(a.threads), "--context", str(a.context)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--before", default="HEAD", help="the older revision (any git rev)")
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=400, help="tokens the attention reads")
    ap.add_argument("--march", default="", help="build both for this -march (default: native)")
    ap.add_argument("--what", nargs="+", choices=KINDS, default=["int4", "attention"])
    ap.add_argument("--out", default="benchmarks/results/compare_kernels.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument(
        "--keep-build", default="", help="build the older revision here, or reuse it from here"
    )
    ap.add_argument("--build-only", action="store_true", help="build both, time nothing")
    ap.add_argument("--child-what", default="int4", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(f"{time_build(a.child, a.child_what, a.threads, a.context):.4f}")
        return
    if a.march:
        os.environ[native.MARCH_ENV] = a.march  # both builds, and the children that time them
    after = native.load()
    if after is None or after.__file__ is None:
        raise SystemExit("the working tree's kernels cannot be built here")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        kept = Path(a.keep_build) / "build" / f"{NAME}.so" if a.keep_build else None
        if kept is not None and kept.is_file():
            before = kept
        else:
            before = build_revision(a.before, Path(a.keep_build or tmp))
        if a.build_only:
            return
        for what in a.what:
            print(f"{what}, ms:", flush=True)
            values = alternate(
                a.rounds,
                ("before", lambda w=what: run_child(before, w, a)),
                ("after", lambda w=what: run_child(Path(str(after.__file__)), w, a)),
            )
            results[what] = compare(values, "before", "after")
            print(describe(results[what], "before", "after", "ms"), flush=True)
    meta = {"before": a.before, "threads": a.threads, "context": a.context, "rounds": a.rounds}
    meta |= {"march": a.march or "native", "cpu": cpu_name()}
    write_json(Path(a.out), {"meta": meta, "results": results})


if __name__ == "__main__":
    main()
