"""When `zmqllm up` starts an exited child again, and when it gives up: bookkeeping over
child names, exit codes and times, with no processes in it (the launcher owns those).

Every exit the launcher did not ask for counts, whatever its code: a cluster missing its
broker, its gateway or the only worker of a layer range serves nothing, so the child is
started again after a backoff that doubles with each exit in a row (0.5 s, 1, 2, 4, 8,
then 10 s at most). A child that ran for a whole window (60 s) before it exited starts the
doubling over. A child that exits ``limit`` (5) times within one window is not going to
come up by itself (a broken model, a bad setting, an upstream that is down):

- an essential one (the broker, the only gateway: nothing serves without them) stops
  everything, and the launcher says which child, how it ended and where its log is;
- any other (a worker, a remote model's worker) is marked failing and started again with
  a backoff that goes on doubling up to 60 s, while the rest keeps serving; it is failing
  until a run of its lasts a whole window.
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
    "FAILING_BACKOFF_MAX_S",
    "ChildState",
    "ChildTrouble",
    "GiveUp",
    "Restart",
    "RestartPolicy",
]

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 10.0
CRASH_LIMIT = 5
CRASH_WINDOW_S = 60.0
FAILING_BACKOFF_MAX_S = 60.0


@dataclass(frozen=True)
class Restart:
    """Start ``name`` again once ``delay`` seconds have passed."""

    name: str
    code: int
    delay: float
    crashes: int  # exits within the window, this one included
    limit: int
    window: float
    essential: bool = True  # its crash loop stops everything
    failing: bool = False  # it exited ``limit`` times within the window (not essential)

    def message(self) -> str:
        head = f"{self.name} {describe_exit(self.code)}"
        if self.failing:
            return (
                f"{head}, its {_nth(self.crashes)} exit within {self.window:g} s: it is "
                f"failing; restarting it in {self.delay:g} s (backing off up to "
                f"{FAILING_BACKOFF_MAX_S:g} s), everything else keeps serving"
            )
        then = "stops everything" if self.essential else "marks it failing"
        return (
            f"{head}; restarting it in {self.delay:g} s "
            f"({_nth(self.crashes)} exit within {self.window:g} s; the {_nth(self.limit)} {then})"
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


@dataclass(frozen=True)
class ChildTrouble:
    """A failing child, as status shows it."""

    exits: int  # within the window
    last_exit: int | None
    due: float | None  # when it starts again (the policy's clock); None while it runs


@dataclass(frozen=True)
class ChildState:
    """One child as `zmqllm up`'s state file and `zmqllm ray status` show it."""

    state: str  # "running", "restarting" (in its backoff) or "failing"
    exits: int  # within the window
    last_exit: int | None  # the code of its last exit, None if it never exited
    due: float | None  # when it starts again (the policy's clock); None while it runs


def _nth(count: int) -> str:
    """1st, 2nd, 3rd, 4th ... 11th, 12th, 13th ... 21st."""
    suffix = {1: "st", 2: "nd", 3: "rd"}.get(count % 10, "th")
    return f"{count}{'th' if count % 100 in (11, 12, 13) else suffix}"


@dataclass
class _Record:
    started: float  # when its current run began
    streak: int = 0  # exits in a row, each after a run shorter than the window
    due: float | None = None  # when to start it again; None while it runs
    failing: bool = False  # ``limit`` exits within a window, and no whole run since
    last_exit: int | None = None  # the code of its last exit


class RestartPolicy:
    """Per child name: when it started, how it exited, and what to do about it.

    The launcher calls ``started`` for every start, ``exited`` for every exit it did not
    cause, and ``due`` on each turn of its loop for the children whose backoff is over.
    Times are the caller's clock (``time.monotonic()``), so tests give their own.
    ``essential`` names the children whose crash loop stops everything.
    """

    def __init__(
        self,
        first: float = BACKOFF_FIRST_S,
        most: float = BACKOFF_MAX_S,
        limit: int = CRASH_LIMIT,
        window: float = CRASH_WINDOW_S,
        essential: frozenset[str] = frozenset({"broker", "gateway"}),
        failing_most: float = FAILING_BACKOFF_MAX_S,
    ) -> None:
        if first <= 0 or most < first or limit < 1 or window <= 0 or failing_most < most:
            raise ValueError(
                "backoff needs 0 < first <= most <= failing_most, limit >= 1 and window > 0"
            )
        self.first = first
        self.most = most
        self.limit = limit
        self.window = window
        self.essential = essential
        self.failing_most = failing_most
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
        record.last_exit = code
        exits = self._exits.setdefault(name, deque())
        exits.append(now)
        while exits and exits[0] <= now - self.window:
            exits.popleft()
        essential = name in self.essential
        if len(exits) >= self.limit and essential:
            record.due = None
            return GiveUp(name, code, len(exits), self.window)
        # A run as long as the window was a healthy one: this exit is a first again.
        healthy = now - record.started >= self.window
        record.streak = 1 if healthy else record.streak + 1
        record.failing = len(exits) >= self.limit or (record.failing and not healthy)
        most = self.failing_most if record.failing else self.most
        delay = min(self.first * 2 ** (record.streak - 1), most)
        record.due = now + delay
        return Restart(
            name, code, delay, len(exits), self.limit, self.window, essential, record.failing
        )

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

    def state_of(self, name: str, now: float) -> ChildState:
        """``name`` now: failing (``limit`` exits within a window and no whole run since:
        a run of a whole window ends it), restarting (in its backoff) or running."""
        record = self._records.get(name)
        if record is None:
            return ChildState("running", 0, None, None)
        if record.failing and record.due is None and now - record.started >= self.window:
            record.failing = False
        recent = sum(1 for t in self._exits.get(name, ()) if t > now - self.window)
        state = (
            "failing" if record.failing else "restarting" if record.due is not None else "running"
        )
        return ChildState(state, recent, record.last_exit, record.due)

    def failing(self, now: float) -> dict[str, ChildTrouble]:
        """The children failing now: each with its exits within the window, its last exit
        code and when it starts again (None while it runs)."""
        out = {}
        for name in list(self._records):
            child = self.state_of(name, now)
            if child.state == "failing":
                out[name] = ChildTrouble(child.exits, child.last_exit, child.due)
        return out

    def waiting(self) -> list[str]:
        """Children exited and not yet started again."""
        return sorted(name for name, record in self._records.items() if record.due is not None)
