"""Taking turns on shared cores (cpu_lock): when a stage computes, and how long it waits.

Co-located workers hold one lock file while they run a forward, so stages sharing the
cores run one at a time with all their threads instead of oversubscribing them. Ready
work may also wait a little for the sessions now on another stage, so that batches merge
(a forward of 16 rows costs little more than one of 8). No sockets here: the worker tells
:class:`CpuTurns` what arrived and asks it how long to wait.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from zmqllm.engine.micro_batches import GROUP_WAIT_S
from zmqllm.engine.stage import Stage

__all__ = ["HOP_GRACE_S", "LOCK_POLL_S", "LOCK_WAIT_MAX_S", "CpuTurns"]

# How often a waiting stage looks at the lock, and the quiet time after which no more
# untagged results of another stage's forward are on their way (they come worker ->
# broker -> worker, one message per session). Tagged ones say how many of their group
# come: the stage counts them (engine.micro_batches.Arrivals).
LOCK_POLL_S = 0.001
HOP_GRACE_S = 0.003
# A stage polling the lock for its turn might never see it free if others let go only for
# an instant between forwards: past this, it blocks on the lock instead. (Past its own
# wait bound it keeps the lock as soon as it sees it free, so this is only the last
# resort.)
LOCK_WAIT_MAX_S = 2.0


class CpuTurns:
    """The cpu_lock policy of one stage. Constants are read from this module at each
    call, so tests can scale them."""

    def __init__(self, path: str, stage: Stage) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self.stage = stage
        self.lock_busy_at = 0.0  # when another stage was last seen holding the lock
        self.held_at: float | None = None  # we hold the lock while results come in
        self.last_work_at = 0.0  # when the last untagged STEP or ACTIVATION arrived

    def close(self) -> None:
        os.close(self.fd)  # drops the lock if we hold it

    @property
    def holding(self) -> bool:
        return self.held_at is not None

    def note_arrival(self, group: tuple[str, int] | None) -> None:
        """An untagged STEP or ACTIVATION restarts the quiet time (HOP_GRACE_S); the
        stage counts tagged ones towards their group."""
        if group is None:
            self.last_work_at = time.monotonic()

    def wait(self) -> float:
        """Seconds the ready work should wait for more sessions (0: run it now).

        While another stage holds the lock we could not compute anyway: wait, and take
        in what arrives (this time does not count against the stage's bound, or a long
        prefill elsewhere would make us run a fraction of the sessions just before the
        rest come back). Once it lets go, its results for our missing sessions are one
        hop through the broker away, one message per session: wait HOP_GRACE_S for the
        first, then for the rest of every group seen in part (the stage's group_wait),
        or, for untagged messages, until none has come for HOP_GRACE_S. Within the
        stage's own bound that wait leaves the lock free (the other stage may need a
        turn to send us its sessions); past it, the stage keeps the lock while it waits
        (GROUP_WAIT_S at most), or a third worker sharing the cores could take it back
        before every grace ends, again and again. Two stages waiting for each other's
        sessions both run once that is over.
        """
        if not self.stage.others_pending():
            return 0.0
        now = time.monotonic()
        if self.held_at is None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another stage is computing
                self.lock_busy_at = now
                if now - self.stage.oldest_ready() > LOCK_WAIT_MAX_S:
                    return 0.0  # queue on the lock like any forward (see LOCK_WAIT_MAX_S)
                return LOCK_POLL_S
            if self.stage.coalesce_wait(now):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            else:
                self.held_at = now
        limit = self.stage.coalesce_wait(now, since=self.lock_busy_at)
        if self.held_at is not None:
            limit = min(limit, self.held_at + GROUP_WAIT_S - now)
        wait = max(self.lock_busy_at, self.last_work_at) + HOP_GRACE_S - now
        wait = max(wait, self.stage.group_wait(now))
        return min(limit, wait) if wait > 0 and limit > 0 else 0.0

    def take(self) -> None:
        """Our turn for a forward: blocks while another stage computes (a sibling on
        this machine, never a remote peer; already ours if we kept it while waiting)."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.held_at = None
