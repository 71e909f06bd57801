"""What went wrong in a worker, counted by reason, and logged without flooding.

A hostile or broken peer can make the same failure happen thousands of times a second;
each one is counted (the counts travel in the worker's heartbeat load map), but only a
few lines a second reach the log, each with the exception's type, a truncated message and
where it was raised: never a traceback with locals (a prompt may sit in one).
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Any

from structlog.typing import FilteringBoundLogger

__all__ = ["FAULT_REASONS", "Faults", "describe"]

# Every reason a worker counts; the heartbeat reports each as "fault_<reason>".
FAULT_REASONS = (
    "malformed",  # a message that does not decode
    "unexpected",  # a valid message a worker has no use for
    "bad_request",  # a valid message this worker cannot process (bad token, shape, step)
    "internal",  # an exception while handling a message
    "forward_failed",  # a batched forward raised: its sessions failed
    "unsent",  # a message to the broker could not be queued: its session failed
    "overloaded",  # the compute loop's inbox was full: the session failed
)
LINES_PER_SECOND = 5
MAX_ERROR_CHARS = 200


def describe(exc: BaseException) -> dict[str, str]:
    """The exception's type, its message cut short, and the file:line it came from."""
    out = {"error": f"{type(exc).__name__}: {str(exc)[:MAX_ERROR_CHARS]}"}
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        out["where"] = f"{last.filename.rsplit('/', 1)[-1]}:{last.lineno} in {last.name}"
    return out


class Faults:
    """Counters by reason and a rate-limited warning log, shared by a worker's threads."""

    def __init__(self, log: FilteringBoundLogger, lines_per_second: int = LINES_PER_SECOND):
        self._log = log
        self._limit = lines_per_second
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(FAULT_REASONS, 0)
        self._window = 0.0  # start of the current one-second window
        self._lines = 0  # lines logged in it
        self._suppressed = 0  # lines not logged since the last one that was

    def report(
        self, reason: str, event: str, exc: BaseException | None = None, **fields: Any
    ) -> None:
        """Count one fault and log it unless this second's lines are spent."""
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1
            now = time.monotonic()
            if now - self._window >= 1.0:
                self._window, self._lines = now, 0
            if self._lines >= self._limit:
                self._suppressed += 1
                return
            self._lines += 1
            suppressed, self._suppressed = self._suppressed, 0
        if exc is not None:
            fields.update(describe(exc))
        if suppressed:
            fields["suppressed_before"] = suppressed
        self._log.warning(event, reason=reason, **fields)

    def count(self, reason: str) -> int:
        with self._lock:
            return self._counts.get(reason, 0)

    def load(self) -> dict[str, int]:
        """The counters as heartbeat load entries."""
        with self._lock:
            return {f"fault_{k}": v for k, v in self._counts.items()}
