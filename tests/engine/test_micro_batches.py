"""Micro-batches without sockets or tensors: which of a route's sessions each stage-0
forward takes, as sessions join, finish, fail and are cancelled, and how a stage waits
for the rest of a group it has seen part of."""

from __future__ import annotations

import pytest

from zmqllm.engine.micro_batches import (
    GROUP_WAIT_S,
    HOLD_MAX_S,
    MAX_GROUPS,
    Arrivals,
    Member,
    MicroBatches,
)

HOLD = 0.5  # seconds a left-over may wait in these tests


class Route:
    """Plays stage 0's view of one route: every session's group and where it is."""

    def __init__(self, groups: int = 0, stages: int = 2) -> None:
        self.policy = MicroBatches(groups)
        self.stages = stages
        self.group: dict[str, int] = {}
        self.ready: dict[str, float] = {}  # session -> since when its work is here
        self.prompts: set[str] = set()
        self.forwards = 0

    def join(self, *ids: str, at: float = 0.0) -> None:
        for sid in ids:
            self.group[sid] = -1
            self.ready[sid] = at
            self.prompts.add(sid)

    def leave(self, sid: str) -> None:
        """Finished, failed or cancelled: it is no longer on the route."""
        self.group.pop(sid)
        self.ready.pop(sid, None)
        self.prompts.discard(sid)

    def members(self) -> list[Member]:
        return [
            Member(sid, g, self.ready.get(sid), sid in self.prompts)
            for sid, g in self.group.items()
        ]

    def forward(self, now: float = 1.0) -> tuple[list[str], float]:
        """Stage 0's next forward: the sessions it took (they leave for the next stage),
        or none and how long they wait."""
        share = self.policy.share(self.members(), self.stages, now, HOLD)
        if share.run:
            self.forwards += 1
        for sid in share.run:
            self.group[sid] = self.forwards
            self.ready.pop(sid)
            self.prompts.discard(sid)
        return list(share.run), share.wait

    def back(self, ids: list[str], at: float = 1.0) -> None:
        """Their next steps came back to stage 0."""
        for sid in ids:
            self.ready[sid] = at


def sessions(n: int, prefix: str = "s") -> list[str]:
    return [f"{prefix}{i:02d}" for i in range(n)]


def test_sixteen_sessions_fill_two_stages_with_a_group_each() -> None:
    r = Route()
    r.join(*sessions(16))
    a, _ = r.forward()
    b, _ = r.forward()  # right after: the first group is on stage 1 now
    assert len(a) == len(b) == 8 and not set(a) & set(b)
    for _ in range(5):  # steady state: each group comes back and goes on whole
        r.back(a)
        assert sorted(r.forward()[0]) == sorted(a)
        r.back(b)
        assert sorted(r.forward()[0]) == sorted(b)


def test_three_stages_take_three_groups() -> None:
    r = Route(stages=3)
    r.join(*sessions(16))
    sizes = [len(r.forward()[0]) for _ in range(3)]
    assert sizes == [6, 6, 4]
    assert r.forward() == ([], 0.0)  # everything is elsewhere


def test_one_group_policy_takes_every_ready_session() -> None:
    r = Route(groups=1)
    r.join(*sessions(16))
    assert len(r.forward()[0]) == 16
    assert MicroBatches(1).wanted(4) == 1
    assert MicroBatches(2).wanted(4) == 2 and MicroBatches(0).wanted(4) == 4


def test_a_single_session_runs_alone_every_time() -> None:
    r = Route()
    r.join("only")
    for _ in range(3):
        assert r.forward() == (["only"], 0.0)
        r.back(["only"])


def test_sessions_joining_go_with_the_next_forward_and_groups_stay_balanced() -> None:
    r = Route()
    r.join(*sessions(4))
    a, b = r.forward()[0], r.forward()[0]
    assert len(a) == len(b) == 2
    # Four more arrive while both groups are elsewhere: a prompt never waits.
    r.join(*sessions(4, "n"), at=0.5)
    newcomers, _ = r.forward()
    assert len(newcomers) == 4  # cap = 8 / 2
    # Three groups of 2, 2 and 4 for two stages: the first back waits for the next
    # and they go on as one, 4 and 4.
    r.back(a)
    assert r.forward()[0] == []
    r.back(b, at=1.01)
    assert sorted(r.forward()[0]) == sorted(a + b)
    r.back(newcomers, at=1.02)
    assert sorted(r.forward()[0]) == sorted(newcomers)


def shrunk_group() -> tuple[Route, list[str], list[str]]:
    """16 sessions in groups A and B; two of A finish, B (8) comes back at t=2 and 7 of
    it run (the cap is 14 / 2): (route, what is left of A, B's left-over)."""
    r = Route()
    r.join(*sessions(16))
    a, b = r.forward()[0], r.forward()[0]
    for sid in a[:2]:
        r.leave(sid)
    r.back(b, at=2.0)
    taken, _ = r.forward(now=2.0)
    assert len(taken) == 7
    return r, a[2:], [sid for sid in b if sid not in taken]


def test_a_group_shrunk_by_finishes_is_refilled_from_the_larger_one() -> None:
    """B's left-over waits (both groups are elsewhere) and joins A when it comes back:
    7 and 7 instead of 6, 7 and a group of one."""
    r, a, left = shrunk_group()
    run, wait = r.forward(now=2.01)
    assert run == [] and wait == pytest.approx(HOLD - 0.01)
    r.back(a, at=2.1)
    merged, _ = r.forward(now=2.1)
    assert sorted(merged) == sorted(a + left) and len(merged) == 7


def test_a_left_over_runs_alone_once_its_wait_is_over() -> None:
    r, _, left = shrunk_group()
    assert r.forward(now=2.0 + HOLD) == (left, 0.0)


def test_a_prompt_is_never_held_back() -> None:
    r, _, left = shrunk_group()
    r.join("new", at=2.05)
    run, _ = r.forward(now=2.06)
    assert run == [*left, "new"]


def test_a_session_failing_mid_group_leaves_the_rest_of_its_group_whole() -> None:
    r = Route()
    r.join(*sessions(8))
    a, _ = r.forward()[0], r.forward()[0]
    r.leave(a[1])  # its forward failed on stage 1: closed everywhere
    r.back([sid for sid in a if sid != a[1]])
    run, _ = r.forward()
    assert sorted(run) == sorted(set(a) - {a[1]})


def test_the_wait_of_a_left_over_is_bounded_by_the_stages_forwards() -> None:
    assert MicroBatches.hold_limit(0.0) == pytest.approx(2 * GROUP_WAIT_S)
    assert MicroBatches.hold_limit(0.1) == pytest.approx(0.3 + GROUP_WAIT_S)
    assert MicroBatches.hold_limit(60.0) == HOLD_MAX_S


# -- arrivals of a group ------------------------------------------------------------------


def test_a_stage_waits_for_the_rest_of_a_group_then_runs() -> None:
    arr = Arrivals()
    assert arr.wait(0.0) == 0.0
    arr.note(None, 0.0)  # untagged: no group to wait for
    assert arr.wait(0.0) == 0.0
    arr.note(("g1", 3), 1.0)
    arr.note(("g1", 3), 1.001)
    assert arr.wait(1.002) == pytest.approx(GROUP_WAIT_S - 0.001)
    arr.note(("g1", 3), 1.003)
    assert arr.groups == {} and arr.wait(1.003) == 0.0


def test_a_group_split_by_a_cancel_is_waited_for_only_briefly() -> None:
    """A member cancelled on its way never comes: the others run GROUP_WAIT_S after the
    last of them came."""
    arr = Arrivals()
    arr.note(("g2", 4), 1.0)
    arr.note(("g2", 4), 1.0)
    arr.note(("g2", 4), 1.0)
    assert arr.wait(1.0) == pytest.approx(GROUP_WAIT_S)
    assert arr.wait(1.0 + GROUP_WAIT_S) == 0.0


def test_groups_that_never_complete_do_not_pile_up() -> None:
    arr = Arrivals()
    for i in range(3 * MAX_GROUPS):
        arr.note((f"x{i}", 2), float(i))  # each a second apart: the old ones expired
    assert len(arr.groups) <= MAX_GROUPS
    for i in range(3 * MAX_GROUPS):  # a flood of live ones from a confused peer
        arr.note((f"y{i}", 2), 1e6)
    assert len(arr.groups) <= MAX_GROUPS
