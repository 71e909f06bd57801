"""How an actor of `zmqllm ray up` keeps its role process running: started again after it
exits, with the backoff `zmqllm up` uses (``zmqllm.launch.supervision.RestartPolicy``:
0.5 s doubling to 10 s, failing after 5 exits within 60 s, then doubling to 60 s).

The actor used to end its own process whenever its role exited, for Ray to start both
again. Ray restarts an actor at once, with no backoff, so a role that cannot start (a
port in use, a stage that does not fit its memory) was started again and again as fast
as Python imports, for ever, and nothing said so. Here the actor stays up and restarts
only its role, and so knows what ``zmqllm ray status`` shows: running, restarting in N s,
or failing, with the exits within the window and the last one. Ray still restarts the
actor when the actor's own process or its node dies.

No role is essential here: on Ray there is nothing to stop "everything" (the driver has
gone home), so a broker or gateway in a crash loop is failing and tried again every
minute at most, like a worker, until a run of its lasts a whole window.

No Ray and no processes of its own: the actor gives it a way to start the role, tests a
fake process and a fake clock.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from zmqllm.launch.child_process import describe_exit
from zmqllm.launch.supervision import Restart, RestartPolicy
from zmqllm.log import get_logger

__all__ = ["SPAWN_FAILED", "STOP_GRACE_S", "ProcessLike", "RoleKeeper"]

log = get_logger("zmqllm.ray")

# The exit code counted for a role that could not even be started (as a shell says it).
SPAWN_FAILED = 127
# How long a role that was told to stop (SIGTERM) has before SIGKILL.
STOP_GRACE_S = 10.0


class ProcessLike(Protocol):
    """What the keeper uses of a ``subprocess.Popen``."""

    @property
    def pid(self) -> int: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class RoleKeeper:
    """Starts ``spawn()``, waits for it to exit, and starts it again once the policy's
    backoff is over, until ``stop``. ``run`` is the loop (the actor runs it on a thread
    of its own: the role's death signal follows that thread, see actor.py)."""

    def __init__(
        self,
        name: str,
        spawn: Callable[[], ProcessLike],
        policy: RestartPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], bool] | None = None,
        note: Callable[[str], None] | None = None,
    ) -> None:
        self.name = name
        self.policy = policy or RestartPolicy(essential=frozenset())
        self._spawn = spawn
        self._clock = clock
        self._stopping = threading.Event()
        # Sleeps out a backoff; true when a stop came meanwhile (tests: a fake clock).
        self._sleep = sleep or self._stopping.wait
        self._note = note or (lambda _line: None)
        # A start and a stop never cross; the policy is read and written under it too.
        self._lock = threading.Lock()
        self.proc: ProcessLike | None = None
        self.starts = 0  # attempts, the first included
        self.first_start = threading.Event()  # set once the first attempt is over

    def run(self) -> None:
        while True:
            with self._lock:
                if self._stopping.is_set():
                    return
                try:
                    self.proc = self._spawn()
                except OSError as err:  # counted as an exit: the backoff applies alike
                    self.proc = None
                    self._note(f"could not start {self.name}: {err}")
                self.starts += 1
                self.policy.started(self.name, self._clock())
            self.first_start.set()
            code = self.proc.wait() if self.proc is not None else SPAWN_FAILED
            if self._stopping.is_set():
                return
            with self._lock:
                decision = self.policy.exited(self.name, code, self._clock())
            # Nothing is essential here, so the policy never gives up; were it to, the
            # slowest retry is still better than a role left down with its actor up.
            delay = decision.delay if isinstance(decision, Restart) else self.policy.failing_most
            self._note(decision.message())
            log.warning(
                "role exited",
                actor=self.name,
                exit=describe_exit(code),
                restart_in_s=delay,
                failing=isinstance(decision, Restart) and decision.failing,
            )
            if self._sleep(delay):
                return

    def state(self) -> dict[str, Any]:
        """What ``zmqllm ray status`` shows of the role. Times are relative (seconds from
        now): the caller's clock is on another node."""
        with self._lock:  # status asks from another thread than the loop's
            now = self._clock()
            shown = self.policy.state_of(self.name, now)
            proc = self.proc
        running = proc is not None and proc.poll() is None
        return {
            "role_state": shown.state,
            "exits": shown.exits,
            "last_exit": None if shown.last_exit is None else describe_exit(shown.last_exit),
            "next_start_in": None if shown.due is None else round(max(0.0, shown.due - now), 1),
            "starts": self.starts,
            "child_pid": proc.pid if running and proc is not None else None,
        }

    def stop(self, grace: float = STOP_GRACE_S) -> bool:
        """No more starts; the role stopped (SIGTERM, then SIGKILL after ``grace``).
        Whether it was running."""
        with self._lock:
            self._stopping.set()
            proc = self.proc
        if proc is None or proc.poll() is not None:
            return False
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
        return True
