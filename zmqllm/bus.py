"""Socket-side helpers every process uses on the bus: bounded receives, counted drops.

A peer decides how many frames it sends; ``recv_bounded`` reads one message frame by
frame and discards the rest of one that has more frames than any message type allows,
without building the list up. ``Drops`` counts what a process threw away by reason and
logs it at most a few times a second, so a flood of garbage can neither fill the disk
nor hide in silence.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import zmq

from zmqllm.log import get_logger

__all__ = ["Drops", "recv_bounded"]

# Log lines per reason per second at most; the counters keep the full count.
LOG_PER_SECOND = 5
# Longest exception or error text put in a log line: a peer may choose the text.
MAX_LOGGED_TEXT = 200


def recv_bounded(sock: zmq.Socket, max_frames: int) -> list[Any] | None:
    """One whole message (zmq.Frame objects, not copied), or None when it had more than
    ``max_frames`` frames (the rest read and discarded). Raises zmq.Again when none is
    waiting."""
    frames = [sock.recv(zmq.NOBLOCK, copy=False)]
    while frames[-1].more:
        if len(frames) >= max_frames:
            # ZeroMQ delivers a message whole: the remaining frames are already here.
            while sock.recv(copy=False).more:
                pass
            return None
        frames.append(sock.recv(copy=False))
    return frames


class Drops:
    """Messages dropped and handler errors, counted by reason, logged rate-limited."""

    def __init__(self, logger_name: str) -> None:
        self.counts: Counter[str] = Counter()
        self._log = get_logger(logger_name)
        self._window = 0.0
        self._logged: Counter[str] = Counter()

    def _may_log(self, reason: str) -> bool:
        now = time.monotonic()
        if now - self._window >= 1.0:
            self._window = now
            self._logged.clear()
        self._logged[reason] += 1
        return self._logged[reason] <= LOG_PER_SECOND

    def drop(self, reason: str, **details: Any) -> None:
        """A message thrown away (malformed, unknown peer, not allowed here...)."""
        self.counts[reason] += 1
        if self._may_log(reason):
            shown = {k: str(v)[:MAX_LOGGED_TEXT] for k, v in details.items()}
            self._log.warning("message dropped", reason=reason, **shown)

    def error(self, where: str, exc: BaseException) -> None:
        """An unexpected exception while handling one message: the loop goes on."""
        reason = f"error:{where}"
        self.counts[reason] += 1
        if self._may_log(reason):
            # A bug of ours: the traceback (never with locals) says where.
            self._log.error(
                "error handling a message",
                where=where,
                error=type(exc).__name__,
                detail=str(exc)[:MAX_LOGGED_TEXT],
                exc_info=exc,
            )
