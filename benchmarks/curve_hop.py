"""What CURVE adds to one hop of the bus, measured in microseconds.

A cluster's inter-token time swings by several percent from run to run on a shared
machine, far more than encryption costs, so the end-to-end comparison
(`per_token_latency.py --curve`) can only bound it. This measures the hop itself: a
DEALER sends a message shaped like a decode step's activation (a small header and one
hidden state of the default model, 576 float32) to a ROUTER on loopback TCP that echoes
it back; once plaintext and once with CURVE (the broker's ZAP handler admitting the
key), in alternating blocks. Half a round trip is one hop; a token crosses 2 × stages
hops.

    python benchmarks/curve_hop.py [--blocks 10] [--trips 500]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # see benchmarks/__init__.py

import argparse
import tempfile
import threading
import time
from typing import Any

import zmq

from benchmarks.stats import median
from zmqllm.bus.auth import Authenticator
from zmqllm.bus.keys import (
    ALLOWED_FOLDERS,
    as_client,
    as_server,
    init_keys,
    load_broker_keys,
    load_peer_keys,
)

HEADER = b"h" * 120  # about a STEP/ACTIVATION header
HIDDEN = b"\0" * (576 * 4)  # one float32 hidden state of SmolLM2-135M


class Echo:
    """A ROUTER in a thread that sends every message back to its sender."""

    def __init__(self, ctx: zmq.Context[Any], keys: Any = None) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            as_server(self.sock, keys, ALLOWED_FOLDERS["worker"])
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop:
            if self.sock.poll(100):
                self.sock.send_multipart(self.sock.recv_multipart(copy=False), copy=False)

    def close(self) -> None:
        self.stop = True
        self.thread.join()
        self.sock.close()


def trips(sock: zmq.Socket[Any], n: int) -> float:
    """Mean round trip in microseconds over ``n`` trips."""
    t0 = time.perf_counter()
    for _ in range(n):
        sock.send_multipart([HEADER, HIDDEN], copy=False)
        sock.recv_multipart(copy=False)
    return (time.perf_counter() - t0) / n * 1e6


def measure(blocks: int, n: int) -> dict[str, Any]:
    ctx: zmq.Context[Any] = zmq.Context()
    with tempfile.TemporaryDirectory() as tmp:
        folder = init_keys(Path(tmp) / "keys")
        auth = Authenticator(ctx, {d: folder / d for d in ALLOWED_FOLDERS.values()})
        auth.start()
        plain_echo, curve_echo = Echo(ctx), Echo(ctx, load_broker_keys(folder))
        plain, curve = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        as_client(curve, load_peer_keys(folder, "worker"))
        plain.connect(f"tcp://127.0.0.1:{plain_echo.port}")
        curve.connect(f"tcp://127.0.0.1:{curve_echo.port}")
        trips(plain, 50), trips(curve, 50)  # connect, handshake, warm up
        rtt: dict[str, list[float]] = {"plain": [], "curve": []}
        for b in range(blocks):
            order = [("plain", plain), ("curve", curve)]
            for name, sock in order if b % 2 == 0 else order[::-1]:
                rtt[name].append(trips(sock, n))
        for s in (plain, curve):
            s.close(linger=0)
        plain_echo.close()
        curve_echo.close()
        auth.stop()
    ctx.term()
    extra = [(c - p) / 2 for p, c in zip(rtt["plain"], rtt["curve"], strict=True)]
    return {
        "rtt_us": {k: median(v) for k, v in rtt.items()},
        "curve_us_per_hop": median(extra),
        "curve_us_per_hop_range": [min(extra), max(extra)],
        "message_bytes": len(HEADER) + len(HIDDEN),
    }


def describe(r: dict[str, Any], stages: int = 2) -> str:
    hop = r["curve_us_per_hop"]
    lo, hi = r["curve_us_per_hop_range"]
    return (
        f"one hop of a {r['message_bytes']}-byte message: round trip "
        f"{r['rtt_us']['plain']:.0f} us plaintext, {r['rtt_us']['curve']:.0f} us CURVE; "
        f"CURVE adds {hop:.1f} us per hop (range {lo:.1f}-{hi:.1f}), "
        f"{hop * 2 * stages / 1000:.3f} ms per token at {stages} stages"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--trips", type=int, default=500)
    a = ap.parse_args()
    print(describe(measure(a.blocks, a.trips)))


if __name__ == "__main__":
    main()
