"""The Ray actor's restarts of its role: `zmqllm up`'s backoff, not a tight loop.

The keeper runs with a fake process and a fake clock (no Ray, no waiting); the actor
itself, without Ray, with a real role process that exits at once (as one whose port is
taken does): it starts the role again after the backoff and never ends its own process,
which is what made Ray restart it at once, for ever.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from zmqllm.launch.supervision import RestartPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class QuickExit:
    """A role that runs ``run_s`` seconds of the fake clock, then exits with ``code``."""

    pid = 4242

    def __init__(self, clock: Clock, run_s: float, code: int) -> None:
        self.clock, self.run_s, self.code = clock, run_s, code
        self.done = False

    def wait(self, timeout: float | None = None) -> int:
        if not self.done:
            self.clock.now += self.run_s
            self.done = True
        return self.code

    def poll(self) -> int | None:
        return self.code if self.done else None

    def terminate(self) -> None:
        self.done = True

    def kill(self) -> None:
        self.done = True


def crash_loop(
    exits: int, name: str = "worker-1of2-0", runs: list[float] | None = None
) -> tuple[list[float], list[dict[str, Any]]]:
    """A keeper whose role exits ``exits`` times, each after its run in ``runs`` (0.1 s
    each by default): the backoffs it slept and its state as status saw it in each."""
    from zmqllm.onray.role_keeper import RoleKeeper

    clock = Clock()
    lengths = iter(runs or [0.1] * exits)
    slept: list[float] = []
    seen: list[dict[str, Any]] = []
    keeper: RoleKeeper

    def sleep(delay: float) -> bool:
        seen.append(keeper.state())
        slept.append(delay)
        clock.now += delay
        return len(slept) >= exits  # then a stop: the loop ends

    keeper = RoleKeeper(name, lambda: QuickExit(clock, next(lengths), 1), None, clock, sleep)
    keeper.run()
    assert keeper.starts == exits
    return slept, seen


def test_a_role_that_exits_at_once_backs_off_as_up_does_then_is_failing() -> None:
    slept, seen = crash_loop(9)
    # zmqllm up's numbers: 0.5 s doubling, failing at the 5th exit within 60 s, then
    # doubling on to 60 s at most.
    assert slept == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert [s["role_state"] for s in seen] == ["restarting"] * 4 + ["failing"] * 5
    assert [s["exits"] for s in seen[:5]] == [1, 2, 3, 4, 5]
    assert seen[0]["next_start_in"] == 0.5 and seen[7]["next_start_in"] == 60.0
    assert all(s["last_exit"] == "exited with code 1" for s in seen)
    assert all(s["child_pid"] is None for s in seen)  # it is not running meanwhile


def test_a_whole_window_of_running_ends_failing_and_the_doubling() -> None:
    slept, seen = crash_loop(7, "broker", [0.1] * 5 + [61.0, 0.1])
    # The run of 61 s was a healthy one: its exit is a first again, and not failing.
    assert slept == [0.5, 1.0, 2.0, 4.0, 8.0, 0.5, 1.0]
    assert [s["role_state"] for s in seen][4:] == ["failing", "restarting", "restarting"]


def test_no_role_is_essential_on_ray_a_failing_broker_is_still_tried_again() -> None:
    # `zmqllm up` stops everything at the broker's 5th exit; on Ray nothing is there to
    # stop everything, so it goes on being tried, every minute at most.
    slept, seen = crash_loop(12, "broker")
    assert slept[-4:] == [60.0] * 4 and seen[-1]["role_state"] == "failing"


def test_a_start_that_fails_counts_as_an_exit() -> None:
    from zmqllm.onray.role_keeper import SPAWN_FAILED, RoleKeeper

    clock = Clock()
    slept: list[float] = []

    def spawn() -> QuickExit:
        raise FileNotFoundError("no such python")

    def sleep(delay: float) -> bool:
        slept.append(delay)
        return True  # a stop: the loop ends

    keeper = RoleKeeper("gateway", spawn, None, clock, sleep)
    keeper.run()
    assert slept == [0.5]
    assert keeper.state()["last_exit"] == f"exited with code {SPAWN_FAILED}"


def test_a_stop_during_the_backoff_starts_nothing_more() -> None:
    from zmqllm.onray.role_keeper import RoleKeeper

    clock = Clock()
    policy = RestartPolicy(first=3600, most=3600, failing_most=3600, essential=frozenset())
    keeper = RoleKeeper("worker-2of2-0", lambda: QuickExit(clock, 0.1, 1), policy)
    thread = threading.Thread(target=keeper.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while keeper.state()["exits"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert keeper.state()["role_state"] == "restarting"
    assert keeper.stop() is False  # nothing was running
    thread.join(5)
    assert not thread.is_alive() and keeper.starts == 1


def test_the_actor_starts_its_role_again_itself_and_does_not_end_its_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from zmqllm.onray import actor as actor_module

    monkeypatch.setenv("ZMQLLM_HOME", str(tmp_path))
    monkeypatch.setattr(actor_module, "node_address", lambda: "127.0.0.1")
    ended: list[int] = []
    # What ending the actor's process was: Ray restarts an actor at once, for ever.
    monkeypatch.setattr(os, "_exit", ended.append)
    quits = "import sys; print('Address already in use', flush=True); sys.exit(3)"
    monkeypatch.setattr(
        actor_module.RoleActor, "_command", lambda self: [sys.executable, "-c", quits]
    )
    role = actor_module.RoleActor("gateway", "gateway", ["--model", "tiny"])
    log = tmp_path / "logs" / "ray" / "gateway.log"
    try:
        deadline = time.monotonic() + 20
        while log.read_text().count("Address already in use") < 3 and not ended:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        time.sleep(0.1)  # its third exit noted
    finally:
        role.stop()
    assert ended == [], "the actor ended its own process: Ray would restart it at once"
    state = role.role_state()
    # Started at once, then after 0.5 s and 1 s more: not as fast as Python starts.
    assert state["exits"] == 3 and state["starts"] == 3, state
    assert state["role_state"] == "restarting" and state["last_exit"] == "exited with code 3"
    assert 0 < state["next_start_in"] <= 2.0
    text = log.read_text()
    assert "[zmqllm ray] gateway exited with code 3; restarting it in 0.5 s" in text
    assert "restarting it in 2 s (3rd exit within 60 s" in text
