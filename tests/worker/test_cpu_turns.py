"""cpu_lock turns without sockets: a real tiny-model stage, the lock file taken by hand as
another stage would. CpuTurns reads a clock that stands still unless a test moves it (to
the stage's own timestamp of new work, right after it is made; timestamps are then moved
by hand), and the wait constants are scaled far above scheduling noise besides: no
assertion depends on how fast two statements follow."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import zmqllm.engine.batching as batching_module  # noqa: E402
import zmqllm.engine.micro_batches as micro_module  # noqa: E402
import zmqllm.worker.cpu_turns as turns_module  # noqa: E402
from zmqllm.bus.sampling_params import SamplingParams  # noqa: E402
from zmqllm.engine.generator import load_shard  # noqa: E402
from zmqllm.engine.stage import Stage  # noqa: E402
from zmqllm.worker.cpu_turns import LOCK_POLL_S, CpuTurns  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture
def slow_waits(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    t = SimpleNamespace(hop=1.0, group=5.0, bound=30.0, lock_max=300.0)
    monkeypatch.setattr(turns_module, "HOP_GRACE_S", t.hop)
    monkeypatch.setattr(turns_module, "GROUP_WAIT_S", t.group)
    monkeypatch.setattr(micro_module, "GROUP_WAIT_S", t.group)
    monkeypatch.setattr(turns_module, "LOCK_WAIT_MAX_S", t.lock_max)
    monkeypatch.setattr(batching_module, "COALESCE_MAX_S", t.bound)
    return t


class Clock:
    """A monotonic clock that moves only when told."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def catch_up(self) -> None:
        """To the real time: past the timestamps of the work the stage has just taken."""
        self.now = max(self.now, time.monotonic())


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """CpuTurns' time: from the real one now, then standing still."""
    c = Clock(time.monotonic())
    monkeypatch.setattr(turns_module, "time", SimpleNamespace(monotonic=c))
    return c


def stage_with(tiny_model_dir: Path, sessions: Sequence[str]) -> Stage:
    """A stage-0 stage whose sessions' prompts have run: all of them are "on the next
    stage" until a STEP comes back."""
    stage = Stage(load_shard(tiny_model_dir, 0, 2))
    for sid in sessions:
        stage.open(sid, "", 20, 8, SamplingParams(), frozenset(), np.asarray([5, 6], np.int32))
    stage.run()
    return stage


@pytest.fixture
def lock_path(tmp_path: Path) -> str:
    return str(tmp_path / "locks" / "cpu.lock")


@pytest.fixture
def other(lock_path: str) -> Iterator[int]:
    """Another stage's handle on the lock file."""
    Path(lock_path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT)
    yield fd
    os.close(fd)


def lock_is_free(path: str) -> bool:
    """Whether another process could take the lock now (and leave it as it was)."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing the descriptor drops a lock taken through it
    return True


def test_waits_for_sessions_while_another_stage_computes(
    tiny_model_dir: Path, lock_path: str, other: int, slow_waits: SimpleNamespace, clock: Clock
) -> None:
    """Ready work waits while another stage holds the lock and, once it lets go, until
    the other sessions' messages stop coming; then it runs."""
    t = slow_waits
    stage = stage_with(tiny_model_dir, ("a", "b"))
    turns = CpuTurns(lock_path, stage)
    stage.step("a", 1, 9)
    clock.catch_up()
    fcntl.flock(other, fcntl.LOCK_EX)
    assert turns.wait() == LOCK_POLL_S  # it computes: b is coming
    fcntl.flock(other, fcntl.LOCK_UN)
    assert 0.0 < turns.wait() <= t.hop  # just let go: b is on its way
    assert lock_is_free(lock_path)  # within our bound: others may go first
    turns.lock_busy_at -= 2 * t.hop
    assert turns.wait() == 0.0  # quiet for longer than the grace: run
    turns.note_arrival(None)  # an untagged message just came: more may follow
    assert 0.0 < turns.wait() <= t.hop
    turns.last_work_at -= 2 * t.hop

    # Time spent while another stage computes does not count against the bound...
    for w in stage.scheduler.ready:
        w.ready_at -= 2 * t.bound
    fcntl.flock(other, fcntl.LOCK_EX)
    assert turns.wait() == LOCK_POLL_S
    fcntl.flock(other, fcntl.LOCK_UN)
    # ... and past the bound, the stage keeps the turn it sees while b comes in (a third
    # worker sharing the cores could otherwise take every turn).
    assert 0.0 < turns.wait() <= t.hop
    assert turns.holding and not lock_is_free(lock_path)
    turns.lock_busy_at -= 2 * t.hop
    assert turns.wait() == 0.0
    turns.take()  # the forward's turn: ours already
    assert [o.session for o in stage.run()] == ["a"]
    turns.release()
    assert not turns.holding and lock_is_free(lock_path)
    stage.step("a", 2, 9)
    clock.catch_up()

    # A stage that never lets go for long is queued on, not polled, forever.
    fcntl.flock(other, fcntl.LOCK_EX)
    for w in stage.scheduler.ready:
        w.ready_at -= t.lock_max
    assert turns.wait() == 0.0
    fcntl.flock(other, fcntl.LOCK_UN)
    stage.step("b", 1, 9)
    clock.catch_up()
    assert turns.wait() == 0.0  # everyone is ready
    turns.close()


def test_no_wait_when_every_session_is_ready(tiny_model_dir: Path, lock_path: str) -> None:
    stage = stage_with(tiny_model_dir, ("a", "b"))
    turns = CpuTurns(lock_path, stage)
    stage.step("a", 1, 9)
    stage.step("b", 1, 9)
    assert turns.wait() == 0.0
    turns.close()


def test_waits_for_the_rest_of_a_group_it_has_seen_part_of(
    tiny_model_dir: Path, lock_path: str, slow_waits: SimpleNamespace, clock: Clock
) -> None:
    """Tagged results say how many of their forward come here: the stage waits for the
    rest (a few ms late is no reason to split the batch) and runs once they are all in."""
    t = slow_waits
    stage = stage_with(tiny_model_dir, ("a", "b", "c", "d"))
    turns = CpuTurns(lock_path, stage)
    stage.step("a", 1, 9)  # b, c, d are elsewhere
    clock.catch_up()
    assert turns.wait() == 0.0  # nothing says they are coming
    stage.note_arrival(("g7", 3), clock.now)
    assert t.hop < turns.wait() <= t.group  # 2 more of group 7
    stage.note_arrival(("g7", 3), clock.now)
    assert turns.wait() > t.hop
    stage.note_arrival(("g7", 3), clock.now)
    assert stage.scheduler.arrivals.groups == {}
    assert turns.wait() == 0.0  # the group is complete: run now
    stage.note_arrival(("g8", 2), clock.now)
    stage.scheduler.arrivals.groups["g8"].last -= t.group  # the rest never came (cancelled)
    assert turns.wait() == 0.0
    turns.close()


def test_the_lock_file_is_made_where_it_is_asked_for(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = tmp_path / "a" / "b" / "cpu.lock"
    turns = CpuTurns(str(path), Stage(load_shard(tiny_model_dir, 2, 4)))
    assert path.exists()
    turns.take()
    assert not lock_is_free(str(path))
    turns.release()
    assert lock_is_free(str(path))
    assert turns.wait() == 0.0  # no work: no wait
    turns.close()
