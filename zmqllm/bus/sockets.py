"""Socket-side helpers every process uses on the bus: bounded receives, counted drops.

A peer decides how many frames it sends; ``recv_bounded`` (a plain socket) and
``recv_bounded_async`` (a zmq.asyncio one) read one message frame by frame under one rule
(``_keep``): a message with more frames than any message type allows is read to its end and
let go, without building the list up. ``Drops`` counts what a process threw away or failed on
by reason and logs each reason at most a few times a second (saying how many lines it
left out), so a flood of garbage can neither fill the disk nor hide in silence. The
broker, the client and each worker's threads share it.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterable
from typing import Any

import zmq
import zmq.asyncio
from structlog.typing import FilteringBoundLogger

from zmqllm.log import get_logger

__all__ = ["Drops", "describe", "recv_bounded", "recv_bounded_async"]

# Log lines per reason per second at most; the counters keep the full count.
LOG_PER_SECOND = 5
# Longest exception or error text put in a log line: a peer may choose the text.
MAX_LOGGED_TEXT = 200


def _keep(frames: list[Any] | None, frame: Any, max_frames: int) -> list[Any] | None:
    """The bound: ``frame`` added while the message has room, else None for the whole
    message (its remaining frames are still read, one by one, and let go)."""
    if frames is None or len(frames) >= max_frames:
        return None
    frames.append(frame)
    return frames


def recv_bounded(sock: zmq.Socket[Any], max_frames: int) -> list[Any] | None:
    """One whole message (zmq.Frame objects, not copied), or None when it had more than
    ``max_frames`` frames. Raises zmq.Again when none is waiting."""
    frame = sock.recv(zmq.NOBLOCK, copy=False)
    frames = _keep([], frame, max_frames)
    while frame.more:
        # ZeroMQ delivers a message whole: the remaining frames are already here.
        frame = sock.recv(copy=False)
        frames = _keep(frames, frame, max_frames)
    return frames


async def recv_bounded_async(sock: zmq.asyncio.Socket, max_frames: int) -> list[bytes] | None:
    """``recv_bounded`` on an asyncio socket: waits for a message; copied frames (small
    headers, where a copy beats zero-copy)."""
    frames = _keep([], await sock.recv(), max_frames)
    while sock.get(zmq.RCVMORE):
        frames = _keep(frames, await sock.recv(), max_frames)  # already here, as above
    return frames


def describe(exc: BaseException) -> dict[str, str]:
    """The exception's type, its message cut short and the file:line it came from: never
    a traceback with locals (a prompt may sit in one)."""
    out = {"error": f"{type(exc).__name__}: {str(exc)[:MAX_LOGGED_TEXT]}"}
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        out["where"] = f"{last.filename.rsplit('/', 1)[-1]}:{last.lineno} in {last.name}"
    return out


class Drops:
    """Messages dropped and failures, counted by reason, logged rate-limited per reason.

    Thread-safe: a worker's connection thread and compute loop report into one.
    """

    def __init__(
        self,
        logger: str | FilteringBoundLogger,
        reasons: Iterable[str] = (),
        lines_per_second: int = LOG_PER_SECOND,
    ) -> None:
        self._log = get_logger(logger) if isinstance(logger, str) else logger
        self._limit = lines_per_second
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter(dict.fromkeys(reasons, 0))
        self._window = 0.0
        self._logged: Counter[str] = Counter()
        self._suppressed: Counter[str] = Counter()

    def _admit(self, reason: str) -> int | None:
        """Count one; the lines left out of this reason since its last, or None when
        this one is left out too."""
        with self._lock:
            self.counts[reason] += 1
            now = time.monotonic()
            if now - self._window >= 1.0:
                self._window = now
                self._logged.clear()
            self._logged[reason] += 1
            if self._logged[reason] > self._limit:
                self._suppressed[reason] += 1
                return None
            return self._suppressed.pop(reason, 0)

    def report(
        self, reason: str, event: str, exc: BaseException | None = None, **fields: Any
    ) -> None:
        """Count one failure of ``reason``; log it as ``event`` unless this second's lines
        for that reason are spent."""
        left_out = self._admit(reason)
        if left_out is None:
            return
        shown: dict[str, Any] = {k: str(v)[:MAX_LOGGED_TEXT] for k, v in fields.items()}
        if exc is not None:
            shown.update(describe(exc))
        if left_out:
            shown["suppressed_before"] = left_out
        self._log.warning(event, reason=reason, **shown)

    def drop(self, reason: str, **details: Any) -> None:
        """A message thrown away (malformed, unknown peer, not allowed here...)."""
        self.report(reason, "message dropped", **details)

    def error(self, where: str, exc: BaseException) -> None:
        """An unexpected exception while handling one message: the loop goes on."""
        if self._admit(f"error:{where}") is None:
            return
        # A bug of ours: the traceback (never with locals) says where.
        self._log.error(
            "error handling a message",
            where=where,
            error=type(exc).__name__,
            detail=str(exc)[:MAX_LOGGED_TEXT],
            exc_info=exc,
        )

    def count(self, reason: str) -> int:
        with self._lock:
            return self.counts[reason]
