"""What went wrong in a worker, counted by reason (bus.sockets.Drops), for its heartbeat.

A hostile or broken peer can make the same failure happen thousands of times a second;
each one is counted (the counts travel in the worker's heartbeat figures), but only a
few lines a second per reason reach the log.
"""

from __future__ import annotations

from structlog.typing import FilteringBoundLogger

from zmqllm.bus.sockets import LOG_PER_SECOND, Drops

__all__ = ["FAULT_REASONS", "Faults"]

# Every reason a worker counts; the heartbeat reports each as "fault_<reason>".
FAULT_REASONS = (
    "malformed",  # a message that does not decode
    "unexpected",  # a valid message a worker has no use for
    "bad_request",  # a valid message this worker cannot process (bad token, shape, step)
    "internal",  # an exception while handling a message
    "forward_failed",  # a batched forward raised: its sessions failed
    "unsent",  # a message to the broker could not be queued: its session failed
    "overloaded",  # the compute loop's inbox was full: the session failed
    "peer_refused",  # a peer-link message not from its session's previous stage: dropped
)


class Faults(Drops):
    """A worker's counters by reason; they travel in its heartbeat figures."""

    def __init__(self, log: FilteringBoundLogger, lines_per_second: int = LOG_PER_SECOND):
        super().__init__(log, FAULT_REASONS, lines_per_second)

    def heartbeat_figures(self) -> dict[str, int]:
        """The counters as heartbeat figures."""
        with self._lock:
            return {f"fault_{k}": v for k, v in self.counts.items()}
