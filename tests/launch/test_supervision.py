"""RestartPolicy as a state machine: exits and times in, restart-after-X or give-up out.
No processes: the times are the test's own numbers."""

from __future__ import annotations

import signal

import pytest

from zmqllm.launch.supervision import (
    BACKOFF_FIRST_S,
    BACKOFF_MAX_S,
    CRASH_LIMIT,
    CRASH_WINDOW_S,
    ChildState,
    GiveUp,
    Restart,
    RestartPolicy,
)


def crash_loop(
    policy: RestartPolicy, name: str, run_s: float, exits: int, t: float = 0.0
) -> tuple[list[Restart | GiveUp], float]:
    """``exits`` exits of ``name``, each after a run of ``run_s`` seconds and restarted as
    soon as its backoff ends; the decisions, and the time after the last one."""
    policy.started(name, t)
    decisions: list[Restart | GiveUp] = []
    for _ in range(exits):
        t += run_s
        decision = policy.exited(name, 1, t)
        decisions.append(decision)
        if isinstance(decision, GiveUp):
            break
        t += decision.delay
        assert policy.due(t) == [name]
        policy.started(name, t)
    return decisions, t


def test_the_issue_numbers() -> None:
    assert (BACKOFF_FIRST_S, BACKOFF_MAX_S, CRASH_LIMIT, CRASH_WINDOW_S) == (0.5, 10.0, 5, 60.0)


def test_backoff_doubles_and_the_fifth_exit_of_the_broker_within_a_minute_gives_up() -> None:
    policy = RestartPolicy()
    decisions, _ = crash_loop(policy, "broker", run_s=1.0, exits=5)
    assert [d.delay for d in decisions if isinstance(d, Restart)] == [0.5, 1.0, 2.0, 4.0]
    assert [d.crashes for d in decisions if isinstance(d, Restart)] == [1, 2, 3, 4]
    give_up = decisions[-1]
    assert isinstance(give_up, GiveUp)
    assert (give_up.name, give_up.code, give_up.crashes) == ("broker", 1, 5)
    assert policy.waiting() == []  # nothing is started again after giving up
    assert policy.next_due() is None


def test_a_crash_loop_of_a_worker_marks_it_failing_and_stops_nothing() -> None:
    policy = RestartPolicy()
    decisions, t = crash_loop(policy, "remote-0-0", run_s=1.0, exits=9)
    assert all(isinstance(d, Restart) for d in decisions)
    # Past the 5th exit the backoff goes on doubling, to 60 s at most.
    assert [d.delay for d in decisions] == [0.5, 1, 2, 4, 8, 16, 32, 60, 60]
    assert [d.failing for d in decisions] == [False] * 4 + [True] * 5
    assert decisions[0].message() == (
        "remote-0-0 exited with code 1; restarting it in 0.5 s "
        "(1st exit within 60 s; the 5th marks it failing)"
    )
    assert decisions[4].message() == (
        "remote-0-0 exited with code 1, its 5th exit within 60 s: it is failing; restarting "
        "it in 8 s (backing off up to 60 s), everything else keeps serving"
    )
    # Running again: failing (exits in the window) until a run lasts a whole window.
    trouble = policy.failing(t + 1.0)["remote-0-0"]
    assert trouble.last_exit == 1 and trouble.due is None
    assert "remote-0-0" not in policy.failing(t + CRASH_WINDOW_S)
    healthy = policy.exited("remote-0-0", 1, t + CRASH_WINDOW_S + 1.0)
    assert isinstance(healthy, Restart) and not healthy.failing
    assert healthy.delay == BACKOFF_FIRST_S


def test_a_failing_child_waiting_to_start_says_when() -> None:
    policy = RestartPolicy()
    for t in range(5):
        decision = policy.exited("worker-1of1-0", 3, float(t))
    assert isinstance(decision, Restart) and decision.failing
    trouble = policy.failing(4.5)["worker-1of1-0"]
    assert (trouble.exits, trouble.last_exit, trouble.due) == (5, 3, 4.0 + decision.delay)


def test_the_give_up_message_names_the_child_how_it_ended_and_the_window() -> None:
    policy = RestartPolicy()
    for t in range(4):
        assert isinstance(policy.exited("broker", 2, float(t)), Restart)
    give_up = policy.exited("broker", -signal.SIGKILL, 4.0)
    assert isinstance(give_up, GiveUp)
    assert give_up.message() == (
        "broker killed by SIGKILL, its 5th exit within 60 s: it does not stay up, "
        "so `zmqllm up` stops everything"
    )


def test_the_restart_message_says_when_and_how_many() -> None:
    policy = RestartPolicy()
    policy.started("gateway", 0.0)
    first = policy.exited("gateway", 3, 1.0)
    assert isinstance(first, Restart)
    assert first.message() == (
        "gateway exited with code 3; restarting it in 0.5 s "
        "(1st exit within 60 s; the 5th stops everything)"
    )
    policy.started("gateway", 1.5)
    second = policy.exited("gateway", -signal.SIGKILL, 2.0)
    assert isinstance(second, Restart)
    assert second.message().startswith("gateway killed by SIGKILL; restarting it in 1 s (2nd")


def test_backoff_stops_growing_at_ten_seconds() -> None:
    # Runs of 20 s: never 5 exits within a minute, never a run long enough to reset.
    decisions, _ = crash_loop(RestartPolicy(), "worker-a", run_s=20.0, exits=8)
    assert [d.delay for d in decisions if isinstance(d, Restart)] == [0.5, 1, 2, 4, 8, 10, 10, 10]


def test_a_run_as_long_as_the_window_starts_the_backoff_over() -> None:
    policy = RestartPolicy()
    decisions, t = crash_loop(policy, "broker", run_s=1.0, exits=3)
    assert [d.delay for d in decisions if isinstance(d, Restart)] == [0.5, 1.0, 2.0]
    healthy = policy.exited("broker", 1, t + CRASH_WINDOW_S)
    assert isinstance(healthy, Restart)
    assert healthy.delay == BACKOFF_FIRST_S
    assert healthy.crashes == 1  # the earlier exits are out of the window too


def test_exits_older_than_the_window_do_not_count() -> None:
    policy = RestartPolicy()
    for t in (0.0, 1.0, 2.0, 3.0):
        assert isinstance(policy.exited("gateway", 1, t), Restart)
    late = policy.exited("gateway", 1, 3.0 + CRASH_WINDOW_S)
    assert isinstance(late, Restart)  # the 5th exit, but the first four are over a minute old
    assert late.crashes == 1


def test_each_child_is_counted_on_its_own() -> None:
    policy = RestartPolicy()
    for t in range(4):
        policy.exited("worker-1of2-0", 1, float(t))
        policy.exited("worker-2of2-0", 1, float(t))
    broker = policy.exited("broker", -signal.SIGKILL, 4.0)
    assert isinstance(broker, Restart)
    assert (broker.delay, broker.crashes) == (BACKOFF_FIRST_S, 1)
    fifth = policy.exited("worker-2of2-0", 1, 4.0)
    assert isinstance(fifth, Restart) and fifth.failing
    assert list(policy.failing(4.0)) == ["worker-2of2-0"]


def test_due_tells_each_waiting_child_once_the_earliest_first() -> None:
    policy = RestartPolicy()
    for name in ("broker", "worker-a"):
        policy.started(name, 0.0)
    policy.exited("worker-a", 1, 10.0)  # due at 10.5
    policy.exited("worker-a", 1, 10.25)  # exits again before a start: 1 s now, due 11.25
    policy.exited("broker", 1, 10.6)  # due at 11.1
    assert policy.waiting() == ["broker", "worker-a"]
    assert policy.next_due() == pytest.approx(11.1)
    assert policy.due(11.0) == []
    assert policy.due(12.0) == ["broker", "worker-a"]
    assert policy.due(13.0) == []  # told once
    assert policy.waiting() == [] and policy.next_due() is None
    policy.started("broker", 12.0)
    policy.started("worker-a", 12.0)
    assert policy.due(100.0) == []


def test_a_child_never_seen_starting_is_still_counted() -> None:
    decision = RestartPolicy().exited("stranger", 1, 5.0)
    assert isinstance(decision, Restart) and decision.delay == BACKOFF_FIRST_S


def test_settings_are_checked() -> None:
    bad: dict[str, float]
    for bad in (
        {"first": 0.0},
        {"first": 2.0, "most": 1.0},
        {"limit": 0},
        {"window": 0.0},
    ):
        with pytest.raises(ValueError):
            RestartPolicy(**bad)
    with pytest.raises(ValueError):
        RestartPolicy(most=20.0, failing_most=10.0)
    policy = RestartPolicy(first=0.1, most=0.3, limit=2, window=5.0, essential=frozenset({"x"}))
    assert isinstance(policy.exited("x", 1, 0.0), Restart)
    assert isinstance(policy.exited("x", 1, 1.0), GiveUp)


def test_state_of_is_the_one_rule_for_running_restarting_and_failing() -> None:
    """What both `zmqllm up`'s state file and `zmqllm ray status` show of a child."""
    policy = RestartPolicy()
    assert policy.state_of("worker-a", 0.0) == ChildState("running", 0, None, None)
    policy.started("worker-a", 0.0)
    policy.exited("worker-a", 3, 1.0)
    assert policy.state_of("worker-a", 1.2) == ChildState("restarting", 1, 3, 1.5)
    policy.started("worker-a", 1.5)
    assert policy.state_of("worker-a", 2.0) == ChildState("running", 1, 3, None)
    _, t = crash_loop(policy, "worker-a", run_s=0.1, exits=4, t=2.0)
    failing = policy.state_of("worker-a", t)
    assert (failing.state, failing.exits, failing.due) == ("failing", 5, None)
    assert policy.failing(t)["worker-a"].exits == 5  # the same rule
    # A whole window of running ends it; the exits have left the window by then.
    assert policy.state_of("worker-a", t + CRASH_WINDOW_S) == ChildState("running", 0, 1, None)
    assert policy.failing(t + CRASH_WINDOW_S) == {}
