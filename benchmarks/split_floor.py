"""The least a same-host 2-stage split costs: two bare processes, no broker, no worker loop.

This process holds both halves of the model (layers [0, n/2) with the embedding, and
[n/2, n) with the head) and a second process holds the second half again. Each decode
step runs the first half here, then the second half either here too (``one``: the
engine's step) or in the other process, the hidden state going there and the greedy
token coming back over:

- ``pipe``: a socket pair (multiprocessing's Connection), one blocking read per side;
- ``zmq-tcp``, ``zmq-ipc``: a ZeroMQ PAIR socket over loopback TCP or ipc://, as the
  peer links between co-located workers (each message passes each side's I/O thread).

The variants run in interleaved blocks of ``--block`` tokens (the order rotated every
block, each block's first two steps left out), so the cores' drift cancels within a
round; each round is a fresh pair of processes. Reported: each variant's median step
time per round and its ratio to ``one`` in the same round, median and range over the
rounds. Both processes spin their OpenMP threads as workers do (``GOMP_SPINCOUNT``, see
zmqllm/cli.py) unless the environment says otherwise. What is over 1.0 here is what the
same cores cost a split before any of zmqllm's own work (messages, sessions, the broker,
the gateway, HTTP).

    python benchmarks/split_floor.py [--rounds 4] [--quant int4] [--threads 2]

Writes benchmarks/results/split_floor.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import tempfile
from multiprocessing.connection import Connection
from typing import Any

from benchmarks.paired import against
from benchmarks.report import write_json
from benchmarks.stats import median

VARIANTS = ("one", "pipe", "zmq-tcp", "zmq-ipc")
PROMPT = list(range(100, 160))


def load_half(first: bool, quant: str, threads: int) -> tuple[Any, Any]:
    """One half of the default model (compiled kernels on) and a cache for one session."""
    import torch

    from zmqllm.config.paths import default_model_dir
    from zmqllm.engine import native
    from zmqllm.engine.cache import CachePool
    from zmqllm.engine.generator import load_shard
    from zmqllm.models.model_args import ModelArgs

    torch.set_num_threads(threads)
    d = default_model_dir()
    args = ModelArgs.from_dir(d)
    half = args.num_layers // 2
    start, end = (0, half) if first else (half, args.num_layers)
    shard = load_shard(d, start, end, "float32", "cpu", args, quant)
    shard.use_kernel(native.load())
    pool = CachePool(args, shard.num_local_layers, shard.dtype, "cpu")
    return shard, pool


def step(shard: Any, pool: Any, session: str, x: Any) -> Any:
    from zmqllm.engine.decoder_layer import Segment

    if session not in pool:
        pool.allocate(session, 4096)
    return shard(x, [Segment(pool.get(session), int(x.shape[0]))])


def second_half(ctrl: Connection, data: Connection, endpoints: dict[str, str], a: Any) -> None:
    """The other process: told a variant per block, it serves that block's steps."""
    import numpy as np
    import torch
    import zmq

    shard, pool = load_half(False, a.quant, a.threads)
    ctx = zmq.Context()
    socks = {}
    for name, address in endpoints.items():
        socks[name] = ctx.socket(zmq.PAIR)
        socks[name].connect(address)
    ctrl.send("ready")
    while (variant := ctrl.recv()) != "stop":
        n = ctrl.recv()
        for _ in range(n):
            if variant == "pipe":
                raw = data.recv_bytes()
                hidden = np.frombuffer(raw, np.float32)
            else:
                hidden = np.frombuffer(socks[variant].recv(copy=False).buffer, np.float32)
            x = torch.from_numpy(hidden.reshape(-1, shard.args.hidden_size))
            token = int(step(shard, pool, variant, x).argmax()).to_bytes(4, "little")
            if variant == "pipe":
                data.send_bytes(token)
            else:
                socks[variant].send(token)
    for s in socks.values():
        s.close(linger=0)
    ctx.term()


def one_round(a: Any) -> dict[str, float]:
    """Every variant's median step time (ms) in one fresh pair of processes."""
    import time

    import torch
    import zmq

    with tempfile.TemporaryDirectory() as tmp:
        ctx = zmq.Context()
        socks = {"zmq-tcp": ctx.socket(zmq.PAIR), "zmq-ipc": ctx.socket(zmq.PAIR)}
        port = socks["zmq-tcp"].bind_to_random_port("tcp://127.0.0.1")
        socks["zmq-ipc"].bind(f"ipc://{tmp}/split")
        endpoints = {"zmq-tcp": f"tcp://127.0.0.1:{port}", "zmq-ipc": f"ipc://{tmp}/split"}
        spawn = mp.get_context("spawn")
        ctrl, ctrl_child = spawn.Pipe()
        data, data_child = spawn.Pipe()
        child = spawn.Process(target=second_half, args=(ctrl_child, data_child, endpoints, a))
        child.start()
        first, pool_first = load_half(True, a.quant, a.threads)
        second, pool_second = load_half(False, a.quant, a.threads)
        if ctrl.recv() != "ready":
            raise RuntimeError("the second process did not start")

        def run_steps(variant: str, ids: list[int], n: int) -> tuple[int, list[float]]:
            """n steps of ``variant``, the first over ``ids``; the time of each."""
            if variant != "one":
                ctrl.send(variant)
                ctrl.send(n)
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                hidden = step(first, pool_first, variant, torch.tensor(ids))
                if variant == "one":
                    token = int(step(second, pool_second, variant, hidden).argmax())
                elif variant == "pipe":
                    data.send_bytes(hidden.numpy())  # no copy, as zmq sends it
                    token = int.from_bytes(data.recv_bytes(), "little")
                else:
                    socks[variant].send(hidden.numpy())
                    token = int.from_bytes(socks[variant].recv(), "little")
                times.append(time.perf_counter() - t0)
                ids = [token]
            return token, times

        try:
            tokens = {v: run_steps(v, PROMPT, 1)[0] for v in VARIANTS}  # each one's prompt
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for b in range(a.blocks):
                order = VARIANTS[b % len(VARIANTS) :] + VARIANTS[: b % len(VARIANTS)]
                for v in order:
                    tokens[v], got = run_steps(v, [tokens[v]], a.block)
                    times[v].extend(got[2:])
        finally:
            ctrl.send("stop")
            child.join(30)
            for s in socks.values():
                s.close(linger=0)
            ctx.term()
        return {v: median(ts) * 1e3 for v, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=12, help="blocks of each variant per round")
    ap.add_argument("--block", type=int, default=16, help="decode steps per block")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quant", default="int4", choices=["none", "int8", "int4"])
    ap.add_argument("--out", default="benchmarks/results/split_floor.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:  # one round, in a fresh process: its medians on stdout
        print(json.dumps(one_round(a)))
        return
    from zmqllm.cli import WORKER_THREAD_ENV
    from zmqllm.config.paths import default_model_dir
    from zmqllm.models.prepare import prepare_default_model

    prepare_default_model(default_model_dir())
    rounds: list[dict[str, float]] = []
    for r in range(a.rounds):
        args = [sys.executable, __file__, "--child", *sys.argv[1:]]
        env = {**WORKER_THREAD_ENV, **os.environ}  # the OpenMP spin workers run with
        done = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
        rounds.append(json.loads(done.stdout.strip().splitlines()[-1]))
        got = rounds[-1]
        print(f"  round {r + 1}: " + ", ".join(f"{v} {got[v]:.2f} ms" for v in VARIANTS))
    print(f"\ndecode step ms, {a.quant}, {a.threads} threads, {a.rounds} rounds")
    rows = against({v: [r[v] for r in rounds] for v in VARIANTS}, "one", "step_ms")
    write_json(Path(a.out), {"args": vars(a), "rows": rows})


if __name__ == "__main__":
    main()
