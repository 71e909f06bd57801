"""The engine's decode latency under each OpenMP spin count, in fresh processes.

libgomp reads ``GOMP_SPINCOUNT`` once, when it loads: how long a thread that finished a
parallel region spins before it sleeps. Workers spin briefly (10000, zmqllm/cli.py), or
a stage's idle threads would steal the next stage's CPU; this measures what that costs a
process that has the cores to itself. Each setting
runs in a fresh process (greedy int4 decode of the default model, 3 generations of
``--new-tokens``, the median inter-token time), the settings in turn, round after
round with the order rotated.

    python benchmarks/omp_spin.py [--spins default 10000 100000] [--rounds 3]

Writes benchmarks/results/omp_spin.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import os
import subprocess

from benchmarks.paired import against
from benchmarks.report import write_json

CHILD = """
import statistics, sys, time
import torch
torch.set_num_threads(int(sys.argv[1]))
from zmqllm.config.paths import default_model_dir
from zmqllm.engine.generator import Generator
gen = Generator(default_model_dir(), quant=sys.argv[2])
ids = list(range(100, 160))
itl = []
for _ in range(3):
    stamps = [time.perf_counter()]
    for _ in gen.generate(ids, int(sys.argv[3])):
        stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]
    itl.append(statistics.median(gaps) * 1e3)
print(statistics.median(itl))
"""


def run_once(spin: str, a: argparse.Namespace) -> float:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if spin != "default":
        env["GOMP_SPINCOUNT"] = spin
    args = [sys.executable, "-c", CHILD, str(a.threads), a.quant, str(a.new_tokens)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spins", nargs="+", default=["default", "10000", "100000"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quant", default="int4", choices=["none", "int8", "int4"])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/results/omp_spin.json")
    a = ap.parse_args()
    from zmqllm.config.paths import default_model_dir
    from zmqllm.models.prepare import prepare_default_model

    prepare_default_model(default_model_dir())
    itl: dict[str, list[float]] = {s: [] for s in a.spins}
    for r in range(a.rounds):
        shift = r % len(a.spins)
        for spin in a.spins[shift:] + a.spins[:shift]:
            itl[spin].append(run_once(spin, a))
            print(f"  round {r + 1}: GOMP_SPINCOUNT={spin} {itl[spin][-1]:.2f} ms", flush=True)
    print(f"\nITL p50 ms, {a.quant} engine, {a.threads} threads, {a.rounds} rounds")
    rows = against(itl, a.spins[0], "itl_ms")
    write_json(Path(a.out), {"args": vars(a), "rows": rows})


if __name__ == "__main__":
    main()
