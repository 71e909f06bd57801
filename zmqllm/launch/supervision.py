"""When `zmqllm up` starts an exited child again, and when it gives up: bookkeeping over
child names, exit codes and times, with no processes in it (the launcher owns those).

Every exit the launcher did not ask for counts, whatever its code: a cluster missing its
broker, its gateway or the only worker of a layer range serves nothing, so the child is
started again after a backoff that doubles with each exit in a row (0.5 s, 1, 2, 4, 8,
then 10 s at most). A child that ran for a whole window (60 s) before it exited starts the
doubling over. A child that exits ``limit`` (5) times within one window is not going to
come up by itself (a broken model, a bad setting, a port taken by another program): the
launcher stops everything and says which child, how it ended and where its log is.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from zmqllm.launch.child_process import describe_exit

__all__ = [
    "BACKOFF_FIRST_S",
    "BACKOFF_MAX_S",
    "CRASH_LIMIT",
    "CRASH_WINDOW_S",
    "GiveUp",
    "Restart",
    "RestartPolicy",
]

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 10.0
CRASH_LIMIT = 5
CRASH_WINDOW_S = 60.0


@dataclass(frozen=True)
class Restart:
    """Start ``name`` again once ``delay`` seconds have passed."""

    name: str
    code: int
    delay: float
    crashes: int  # exits within the window, this one included
    limit: int
    window: float

    def message(self) -> str:
        return (
            f"{self.name} {describe_exit(self.code)}; restarting it in {self.delay:g} s "
            f"({_nth(self.crashes)} exit within {self.window:g} s; "
            f"the {_nth(self.limit)} stops everything)"
        )


@dataclass(frozen=True)
class GiveUp:
    """``name`` exits too often to be worth starting again: stop everything."""

    name: str
    code: int
    crashes: int
    window: float

    def message(self) -> str:
        return (
            f"{self.name} {describe_exit(self.code)}, its {_nth(self.crashes)} exit within "
            f"{self.window:g} s: it does not stay up, so `zmqllm up` stops everything"
        )


def _nth(count: int) -> str:
    """1st, 2nd, 3rd, 4th ... 11th, 12th, 13th ... 21st."""
    suffix = {1: "st", 2: "nd", 3: "rd"}.get(count % 10, "th")
    return f"{count}{'th' if count % 100 in (11, 12, 13) else suffix}"


@dataclass
class _Record:
    started: float  # when its current run began
    streak: int = 0  # exits in a row, each after a run shorter than the window
    due: float | None = None  # when to start it again; None while it runs


class RestartPolicy:
    """Per child name: when it started, how it exited, and what to do about it.

    The launcher calls ``started`` for every start, ``exited`` for every exit it did not
    cause, and ``due`` on each turn of its loop for the children whose backoff is over.
    Times are the caller's clock (``time.monotonic()``), so tests give their own.
    """

    def __init__(
        self,
        first: float = BACKOFF_FIRST_S,
        most: float = BACKOFF_MAX_S,
        limit: int = CRASH_LIMIT,
        window: float = CRASH_WINDOW_S,
    ) -> None:
        if first <= 0 or most < first or limit < 1 or window <= 0:
            raise ValueError("backoff needs 0 < first <= most, limit >= 1 and window > 0")
        self.first = first
        self.most = most
        self.limit = limit
        self.window = window
        self._records: dict[str, _Record] = {}
        self._exits: dict[str, deque[float]] = {}

    def started(self, name: str, now: float) -> None:
        record = self._records.get(name)
        if record is None:
            self._records[name] = _Record(started=now)
        else:
            record.started, record.due = now, None

    def exited(self, name: str, code: int, now: float) -> Restart | GiveUp:
        """What to do about ``name`` ending with ``code`` at ``now``."""
        record = self._records.setdefault(name, _Record(started=now))
        exits = self._exits.setdefault(name, deque())
        exits.append(now)
        while exits and exits[0] <= now - self.window:
            exits.popleft()
        if len(exits) >= self.limit:
            record.due = None
            return GiveUp(name, code, len(exits), self.window)
        # A run as long as the window was a healthy one: this exit is a first again.
        record.streak = 1 if now - record.started >= self.window else record.streak + 1
        delay = min(self.first * 2 ** (record.streak - 1), self.most)
        record.due = now + delay
        return Restart(name, code, delay, len(exits), self.limit, self.window)

    def due(self, now: float) -> list[str]:
        """The children whose backoff is over, the earliest due first. Each is told once
        (it no longer counts as waiting), so ``started`` should follow for each."""
        ready = sorted(
            (record.due, name)
            for name, record in self._records.items()
            if record.due is not None and record.due <= now
        )
        for _, name in ready:
            self._records[name].due = None
        return [name for _, name in ready]

    def next_due(self) -> float | None:
        """When the next waiting child is due (None when none waits): how long the
        launcher's loop may sleep."""
        times = [r.due for r in self._records.values() if r.due is not None]
        return min(times) if times else None

    def waiting(self) -> list[str]:
        """Children exited and not yet started again."""
        return sorted(name for name, record in self._records.items() if record.due is not None)
