"""The worker shell (worker.shell) under a small application of its own: identity, link
settings, the dispatch tables, failures in isolation, the turn loop's exits. The broker
link is a fake that keeps what is sent. No torch."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from zmqllm.bus.messages import (
    Cached,
    Cancel,
    Close,
    Delta,
    Error,
    ErrorCode,
    Heartbeat,
    Message,
    Register,
    Step,
)
from zmqllm.bus.protocol import decode, encode
from zmqllm.bus.wire_types import ProtocolError, SessionKey
from zmqllm.config.settings import Config
from zmqllm.worker.broker_link import LinkLost
from zmqllm.worker.inbox import Refusal, Reset, take_in
from zmqllm.worker.shell import (
    Handler,
    WorkerShell,
    host_name,
    link_settings,
    worker_identity,
)

REGISTER = Register(
    start=0,
    end=1,
    num_layers=1,
    capacity=4,
    max_kv_tokens=64,
    context=64,
    version="t",
    fingerprint="f",
)
KEY = SessionKey("s1", 1)


class FakeLink:
    """What the shell uses of BrokerLink: lock, inbox, send (kept decoded), publish."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.inbox: deque[Any] = deque()
        self.sent: list[tuple[SessionKey | None, Message]] = []
        self.published: list[dict[str, Any]] = []
        self.refuse = ""
        self.up = True

    def send(self, frames: list[Any], key: SessionKey | None = None) -> str:
        if self.refuse:
            return self.refuse
        self.sent.append((key, decode(frames)))
        return ""

    def publish(self, figures: dict[str, Any], draining: bool) -> None:
        self.published.append(figures)

    def alive(self) -> bool:
        return self.up

    def errors(self) -> list[Error]:
        return [m for _, m in self.sent if isinstance(m, Error)]


class StepWorker(WorkerShell):
    """An application that takes STEPs for the sessions in ``open``."""

    bad_message = (ValueError,)

    def __init__(self, cfg: Config, ctx: zmq.Context[Any]) -> None:
        super().__init__(cfg, "test", REGISTER, context=ctx)
        self.open: set[SessionKey] = {KEY}
        self.steps: list[Step] = []
        self.turns: list[str] = []  # what each turn does: "ok", "raise", "lost"
        self.closed = False

    def message_handlers(self) -> dict[type[Message], Handler]:
        return {Step: self.on_step}

    def on_step(self, msg: Step) -> None:
        if msg.token == 666:
            raise RuntimeError("boom")
        if msg.token == 13:
            raise ValueError("unlucky token")
        self.steps.append(msg)

    def sessions(self) -> int:
        return len(self.open)

    def close_session(self, key: SessionKey) -> bool:
        if key not in self.open:
            return False
        self.open.discard(key)
        return True

    def drop_sessions(self) -> None:
        self.open.clear()

    def heartbeat_figures(self) -> dict[str, Any]:
        return {"sessions": len(self.open)}

    def _turn(self) -> None:
        self.tend_link()
        what = self.turns.pop(0) if self.turns else "stop"
        if what == "raise":
            raise RuntimeError("a bad turn")
        if what == "stop":
            self._stop = True
        if what == "drain":
            self.open.clear()

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def worker() -> Iterator[StepWorker]:
    ctx: zmq.Context[Any] = zmq.Context()
    cfg = Config()
    cfg.worker.name = "unit"
    w = StepWorker(cfg, ctx)
    w.link = FakeLink()  # type: ignore[assignment]
    yield w
    ctx.term()


def link_of(w: StepWorker) -> FakeLink:
    assert isinstance(w.link, FakeLink)
    return w.link


def deliver(w: StepWorker, frames: list[Any]) -> None:
    """As a link takes a message in: decoded once, then dispatched by the shell."""
    entry = take_in(frames, w.faults, "the test")
    if entry is not None:
        w.dispatch(entry)


def step(token: int = 5, session: str = "s1") -> Step:
    return Step(session=session, attempt=1, request_id="r1", step=1, token=token)


# -- identity and link settings ----------------------------------------------------------
def test_identity_names_the_worker_and_what_it_serves() -> None:
    cfg = Config()
    cfg.worker.name = "gpu1"
    one, two = worker_identity(cfg, "0-4"), worker_identity(cfg, "0-4")
    assert one.startswith("w-gpu1-0-4-") and len(one) == len("w-gpu1-0-4-") + 6
    assert one != two  # a restarted worker is a new one to the broker
    cfg.worker.name = ""  # none: the host and the pid name it
    unnamed = worker_identity(cfg, "remote")
    assert unnamed.startswith("w-") and str(os.getpid()) in unnamed
    assert unnamed.rsplit("-", 2)[1] == "remote"


def test_link_settings_come_from_the_config_and_a_frame_cap_only_lowers() -> None:
    cfg = Config()
    cfg.worker.broker = "tcp://127.0.0.1:5555"
    cfg.broker.heartbeat_interval = 0.5
    cfg.broker.heartbeat_liveness = 4
    s = link_settings(cfg, "w-x", None)
    assert (s.address, s.identity) == ("tcp://127.0.0.1:5555", "w-x")
    assert (s.interval, s.liveness) == (0.5, 4)
    assert s.max_message_bytes == cfg.broker.max_message_bytes and s.keys is None
    assert link_settings(cfg, "w-x", None, frame_cap=1000).max_message_bytes == 1000
    big = cfg.broker.max_message_bytes * 2
    assert link_settings(cfg, "w-x", None, frame_cap=big).max_message_bytes == big // 2


def test_the_shell_settings_are_the_links(worker: StepWorker) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        w = StepWorker(Config(), ctx)
        assert w.link.settings.identity == w.identity and w.link.register == REGISTER
    finally:
        ctx.term()


def test_host_name_is_one_register_takes() -> None:
    name = host_name()
    assert name == "unknown" or (0 < len(name) <= 255 and " " not in name and name.isascii())


# -- the dispatch tables ------------------------------------------------------------------
def test_a_message_goes_to_the_handler_its_type_names(worker: StepWorker) -> None:
    deliver(worker, encode(step()))
    assert [s.token for s in worker.steps] == [5] and link_of(worker).sent == []


def test_an_unknown_message_type_is_dropped_and_counted_not_raised(worker: StepWorker) -> None:
    worker.handle(Heartbeat())
    deliver(worker, encode(Cached(session="s1", attempt=1, request_id="r1", tokens=4)))
    assert worker.faults.count("unexpected") == 2
    assert link_of(worker).sent == [] and worker.open == {KEY}  # its session lives on


@pytest.mark.parametrize("kind", [Close, Cancel])
def test_close_and_cancel_are_the_shells(worker: StepWorker, kind: type[Close | Cancel]) -> None:
    worker.handle(kind(session="s1", attempt=1, request_id="r1"))
    assert worker.open == set() and link_of(worker).sent == []
    worker.handle(kind(session="s1", attempt=1, request_id="r1"))  # already gone: nothing


def test_a_handler_that_raises_costs_its_session_alone(worker: StepWorker) -> None:
    worker.open.add(SessionKey("s2", 1))
    deliver(worker, encode(step(666)))
    (err,) = link_of(worker).errors()
    assert (err.session, err.code) == ("s1", ErrorCode.INTERNAL) and "RuntimeError" in err.message
    assert worker.open == {SessionKey("s2", 1)} and worker.faults.count("internal") == 1
    deliver(worker, encode(step(5, "s2")))
    assert [s.session for s in worker.steps] == ["s2"]


def test_a_bad_message_answers_bad_request(worker: StepWorker) -> None:
    deliver(worker, encode(step(13)))
    (err,) = link_of(worker).errors()
    assert err.code is ErrorCode.BAD_REQUEST and "unlucky" in err.message
    assert worker.faults.count("bad_request") == 1 and worker.open == set()


def undecodable() -> list[bytes]:
    """A STEP whose header names its session but whose token does not decode."""
    head, *payloads = encode(step())
    fields = msgpack.unpackb(head)
    fields["token"] = -1
    return [msgpack.packb(fields), *(bytes(p) for p in payloads)]


def test_an_undecodable_message_is_counted_and_by_default_fails_nothing(
    worker: StepWorker,
) -> None:
    with pytest.raises(ProtocolError):
        decode(undecodable())
    deliver(worker, undecodable())
    deliver(worker, [b"\xc1"])
    assert worker.faults.count("malformed") == 2
    assert link_of(worker).sent == [] and worker.open == {KEY}


def test_an_undecodable_message_fails_the_session_it_names_when_asked(
    worker: StepWorker,
) -> None:
    worker.refuses_undecodable = True
    deliver(worker, undecodable())
    deliver(worker, [b"\xc1"])  # names no session: nothing to fail
    (err,) = link_of(worker).errors()
    assert (err.session, err.attempt, err.code) == ("s1", 1, ErrorCode.BAD_REQUEST)
    assert worker.open == set()


def test_the_inbox_goes_by_its_table(worker: StepWorker) -> None:
    link = link_of(worker)
    link.inbox.extend([decode(encode(step())), Reset("the broker restarted")])
    worker.drain_inbox()
    assert len(worker.steps) == 1 and worker.open == set() and not link.inbox
    link.inbox.append(Refusal("another model"))
    with pytest.raises(Exception, match="another model") as refused:
        worker.drain_inbox()
    assert type(refused.value).__name__ == "WorkerRefused"


# -- sending -----------------------------------------------------------------------------
def test_a_message_the_link_cannot_queue_drops_its_session(worker: StepWorker) -> None:
    link_of(worker).refuse = "send queue to the broker is full"
    worker.send(step(), KEY)
    assert worker.open == set()
    worker.send(None, KEY)  # nothing to send: nothing happens


@pytest.mark.parametrize("tells", [False, True])
def test_a_reply_that_cannot_be_encoded_drops_its_session(worker: StepWorker, tells: bool) -> None:
    worker.tells_unencodable = tells
    bad = Delta(session="s1", attempt=1, request_id="r1", step=0, text="a\ud800b")
    worker.send(bad, KEY)
    assert worker.open == set() and worker.faults.count("unsent") == 1
    errors = link_of(worker).errors()
    assert [e.code for e in errors] == ([ErrorCode.INTERNAL] if tells else [])


# -- the loop ----------------------------------------------------------------------------
def test_a_turn_that_raises_is_counted_and_the_loop_goes_on(worker: StepWorker) -> None:
    worker.turns = ["raise", "ok", "stop"]
    assert worker.run_turns() == 0
    assert worker.faults.count("internal") == 1 and worker.closed
    assert link_of(worker).published == [{"sessions": 1}]  # once: not due again so soon


def test_a_dead_link_ends_the_loop_with_status_1(worker: StepWorker) -> None:
    link_of(worker).up = False
    worker.turns = ["ok"] * 5
    assert worker.run_turns() == 1 and worker.closed


def test_a_refusal_ends_the_loop_with_status_3(worker: StepWorker) -> None:
    link_of(worker).inbox.append(Refusal("another model"))

    def refused_turn() -> None:
        worker.drain_inbox()

    worker._turn = refused_turn  # type: ignore[method-assign]
    assert worker.run_turns() == 3 and worker.closed


def test_sigterm_drains_then_leaves_and_a_second_one_stops(worker: StepWorker) -> None:
    worker.on_sigterm()
    assert worker.draining and not worker._stop
    worker.turns = ["ok", "ok", "drain", "ok", "ok"]
    assert worker.run_turns() == 0 and worker.turns == ["ok", "ok"]
    worker.on_sigterm()
    assert worker._stop


def test_the_shell_needs_neither_torch_nor_the_engine() -> None:
    code = (
        "import sys, zmqllm.worker.shell, zmqllm.worker.routing\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('zmqllm.engine')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]"


def test_link_lost_is_what_a_dead_link_raises(worker: StepWorker) -> None:
    link_of(worker).up = False
    with pytest.raises(LinkLost):
        worker.tend_link()
