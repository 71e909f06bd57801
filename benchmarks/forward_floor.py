"""The least CPU a Python ZeroMQ hop costs on this machine: a bare pyzmq ROUTER that
forwards each message between two DEALER processes, nothing else.

One peer sends a message the size of an activation (a header and a 2,304-byte payload:
576 float32 values, the default model's hidden state) and waits for it to come back
through the other peer, as a token's messages go round a pipeline. The forwarder counts
its own CPU time (its Python thread and libzmq's I/O thread) per forwarded message, with
frames received as zmq.Frame objects (``copy=False``, as the broker does) and as bytes.

The broker forwards three messages per decoded token of a 2-stage pipeline (stage 0's
activation to stage 1, the token to the gateway, the next step to stage 0): three times
this figure is what the bus costs per token before any of zmqllm's own work.

    python benchmarks/forward_floor.py [--messages 20000] [--repeats 3]

Writes benchmarks/results/forward_floor.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import multiprocessing as mp
import time

import zmq

from benchmarks.report import write_json
from benchmarks.stats import median

HEADER = b"h" * 60
PAYLOAD = b"x" * 2304


def peer(addr: str, name: str, n: int) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, name.encode())
    s.connect(addr)
    s.send_multipart([b"hello"])  # the forwarder learns both routing ids first
    s.recv_multipart()
    for _ in range(n):
        if name == "a":
            s.send_multipart([HEADER, PAYLOAD])
            s.recv_multipart()
        else:
            s.send_multipart(s.recv_multipart())
    s.close(linger=1000)
    ctx.term()


def forward(n: int, copy: bool) -> tuple[float, float]:
    """(CPU µs per forwarded message, wall µs per round trip)."""
    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    addr = f"tcp://127.0.0.1:{r.bind_to_random_port('tcp://127.0.0.1')}"
    procs = [mp.Process(target=peer, args=(addr, name, n)) for name in "ab"]
    for p in procs:
        p.start()
    hello = {r.recv_multipart()[0] for _ in range(2)}
    for ident in hello:
        r.send_multipart([ident, b"go"])
    poller = zmq.Poller()
    poller.register(r, zmq.POLLIN)
    cpu0, wall0, done = time.process_time(), time.perf_counter(), 0
    while done < 2 * n:
        if not poller.poll(5000):
            raise RuntimeError("the peers stopped")
        while True:
            try:
                frames = r.recv_multipart(zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                break
            ident = frames[0] if copy else frames[0].bytes
            r.send_multipart([b"b" if ident == b"a" else b"a", *frames[1:]], copy=False)
            done += 1
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    for p in procs:
        p.join()
    r.close(linger=0)
    ctx.term()
    return cpu / done * 1e6, wall / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--messages", type=int, default=20000, help="round trips per run")
    ap.add_argument("--repeats", type=int, default=3, help="runs per way of receiving")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    results = {}
    for copy in (False, True):
        runs = [forward(args.messages, copy) for _ in range(args.repeats)]
        cpu = [c for c, _ in runs]
        wall = [w for _, w in runs]
        name = "bytes" if copy else "frames"
        results[name] = {
            "cpu_us_per_message": round(median(cpu), 1),
            "cpu_us_range": [round(min(cpu), 1), round(max(cpu), 1)],
            "round_trip_us": round(median(wall), 1),
        }
        r = results[name]
        print(
            f"received as {name:6s}: {r['cpu_us_per_message']:6.1f} us CPU per forwarded "
            f"message ({r['cpu_us_range'][0]}-{r['cpu_us_range'][1]}), "
            f"{r['round_trip_us']:.0f} us per round trip (two hops)"
        )
    per_token = 3 * results["frames"]["cpu_us_per_message"]
    print(f"three forwards per token of a 2-stage pipeline: {per_token / 1e3:.2f} ms CPU")
    write_json(args.out / "forward_floor.json", {"zmq": zmq.zmq_version(), **results})


if __name__ == "__main__":
    main()
