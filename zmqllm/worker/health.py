"""The figures of a worker's process its heartbeat carries beside the stage's: memory,
CPU time, and the bytes it moved on the bus (counted where its links send and receive),
so `zmqllm status`, the cluster page and /metrics show which node is in trouble."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from zmqllm.config.machine import rss_bytes

__all__ = ["NET", "Traffic", "frames_bytes", "process_figures"]


def frames_bytes(frames: Iterable[Any]) -> int:
    """The bytes of a message's frames (bytes, memoryviews, zmq.Frame or arrays)."""
    total = 0
    for frame in frames:
        try:
            total += memoryview(frame).nbytes
        except TypeError:
            total += len(frame)
    return total


class Traffic:
    """Bytes in and out of this process on the bus (the broker link's and the peer links'
    threads add to it; a lost increment under a race would only undercount a heartbeat)."""

    def __init__(self) -> None:
        self.rx = 0
        self.tx = 0

    def received(self, frames: Iterable[Any]) -> None:
        self.rx += frames_bytes(frames)

    def sent(self, frames: Iterable[Any]) -> None:
        self.tx += frames_bytes(frames)


NET = Traffic()


def process_figures() -> dict[str, Any]:
    times = os.times()
    return {
        "rss_bytes": rss_bytes(),
        "cpu_s": round(times.user + times.system, 3),
        "net_rx_bytes": NET.rx,
        "net_tx_bytes": NET.tx,
    }
