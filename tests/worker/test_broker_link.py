"""The broker link on its own, against a ROUTER the test drives: the test plays the
compute loop, pumping the socket itself (or leaving it to the keeper thread, as during a
long forward). No model, no torch."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import zmq

import zmqllm.worker.broker_link as link_module
from zmqllm.bus.messages import Activation, Disconnect, Heartbeat, Register, Registered, Step
from zmqllm.bus.protocol import MAX_FRAMES, decode, encode
from zmqllm.bus.wire_types import Payload, SessionKey
from zmqllm.log import get_logger
from zmqllm.worker.broker_link import BrokerLink, LinkSettings
from zmqllm.worker.faults import Faults
from zmqllm.worker.inbox import Reset, named_key

TIMEOUT = 10.0
INTERVAL = 0.05
REGISTER = Register(
    start=0,
    end=2,
    num_layers=2,
    capacity=4,
    max_kv_tokens=64,
    context=64,
    version="t",
    fingerprint="f",
)


@dataclass
class Linked:
    router: zmq.Socket[bytes]
    link: BrokerLink
    identity: bytes = b""

    def recv(self) -> Any:
        """The next message the link sent the broker."""
        assert self.router.poll(int(TIMEOUT * 1000)), "nothing from the link"
        self.identity, *frames = self.router.recv_multipart()
        return decode(frames)

    def send(self, frames: list[Any]) -> None:
        self.router.send_multipart([self.identity, *frames])

    def from_link(self, pump: bool = True) -> Any:
        """The next event for the compute loop: pumped by the test, or (``pump=False``)
        taken in by the keeper."""
        return next_event(self.link, pump)

    def registered(self) -> None:
        assert isinstance(self.recv(), Register)
        self.send(encode(Registered(worker_id="w", boot="b1")))


def next_event(link: BrokerLink, pump: bool = True) -> Any:
    deadline = time.monotonic() + TIMEOUT
    while not link.inbox:
        assert time.monotonic() < deadline, "nothing from the link"
        if pump:
            with link.lock:
                link.pump(0.05)
        else:
            time.sleep(0.01)
    return link.inbox.popleft()


def start(ctx: zmq.Context[Any], address: str, liveness: int = 1000) -> BrokerLink:
    settings = LinkSettings(address, "w-test", INTERVAL, liveness, 1 << 20)
    return BrokerLink(ctx, settings, REGISTER, Faults(get_logger("test")))


@contextlib.contextmanager
def linked_to_a_router(liveness: int = 1000) -> Iterator[Linked]:
    ctx: zmq.Context[Any] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    link = start(ctx, router.getsockopt_string(zmq.LAST_ENDPOINT), liveness)
    link.start()
    try:
        yield Linked(router, link)
    finally:
        link.stop()
        assert not link.alive()
        router.close(linger=0)
        ctx.term()


@pytest.fixture
def linked() -> Iterator[Linked]:
    with linked_to_a_router() as linked:
        yield linked


def test_keys_name_one_try_of_one_session() -> None:
    assert SessionKey.of(Step(session="chat-1_x", attempt=3, token=1)) == ("chat-1_x", 3)
    assert named_key({"session": "s", "attempt": 2, "request_id": "r"}) == (SessionKey("s", 2), "r")
    assert named_key({"session": "s", "request_id": "bad id"}) == (SessionKey("s", 0), "")
    for bad in ({"session": "a/b"}, {"session": "s", "attempt": -1}, {"session": 5}, {}):
        assert named_key(bad) is None


def test_heartbeats_go_on_while_the_compute_loop_reads_nothing(linked: Linked) -> None:
    linked.registered()
    linked.link.publish({"sessions": 3}, draining=True)
    beats = 0
    deadline = time.monotonic() + TIMEOUT
    while beats < 10:
        assert time.monotonic() < deadline
        msg = linked.recv()
        linked.send(encode(Heartbeat(boot="b1")))  # and the broker's word comes back
        if isinstance(msg, Heartbeat):
            beats += 1
            assert msg.load is not None and msg.load["sessions"] == 3
            assert msg.draining is True


@pytest.mark.parametrize("pump", [True, False], ids=["pumped", "kept"])
def test_session_messages_go_to_the_compute_loop_whole(linked: Linked, pump: bool) -> None:
    linked.registered()
    hidden = np.arange(128, dtype=np.float32).reshape(2, 64)
    act = Activation(session="s", attempt=1, step=0, hidden=Payload(hidden, "float32"))
    linked.send(encode(act))
    got = linked.from_link(pump)  # delivered decoded
    assert isinstance(got, Activation) and got.attempt == 1
    np.testing.assert_array_equal(got.hidden.array, hidden)


def test_results_go_to_the_broker_from_the_compute_loop(linked: Linked) -> None:
    linked.registered()
    step = Step(session="s", step=1, token=5)
    with linked.link.lock:
        assert linked.link.send(encode(step), SessionKey("s", 0)) == ""
    while not isinstance(msg := linked.recv(), Step):
        assert isinstance(msg, Heartbeat)
    assert msg.token == 5


def test_an_over_long_message_is_dropped_and_the_next_one_delivered(linked: Linked) -> None:
    linked.registered()
    linked.send([b"x"] * (MAX_FRAMES + 100))
    linked.send(encode(Step(session="s", step=1, token=5)))
    assert isinstance(linked.from_link(), Step)
    assert linked.link.faults.count("malformed") == 1


def test_disconnect_resets_the_sessions_and_registers_again(linked: Linked) -> None:
    linked.registered()
    linked.send(encode(Disconnect(reason="unknown worker")))
    event = linked.from_link()
    assert isinstance(event, Reset) and "unknown worker" in event.reason
    while not isinstance(msg := linked.recv(), Register):
        assert isinstance(msg, Heartbeat)


def test_a_message_that_cannot_be_queued_fails_its_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Nobody listens at the address and the send queue holds one message (the REGISTER):
    # the next one cannot be queued, and the compute loop hears why, to fail its session.
    monkeypatch.setattr(link_module, "SOCKET_HWM", 1)
    ctx: zmq.Context[Any] = zmq.Context()
    probe = ctx.socket(zmq.ROUTER)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)
    link = start(ctx, f"tcp://127.0.0.1:{port}")
    link.start()
    try:
        step = encode(Step(session="s", step=1, token=5))
        with link.lock:
            why = ""
            for _ in range(100):
                why = link.send(step, "s/0")
                if why:
                    break
        assert "full" in why
        assert link.faults.count("unsent") >= 1
    finally:
        link.stop()
        ctx.term()


def test_a_silent_broker_is_left_and_rejoined() -> None:
    with linked_to_a_router(liveness=3) as linked:
        linked.registered()
        event = linked.from_link(pump=False)  # no word: gone after 3 intervals
        assert isinstance(event, Reset) and "no word" in event.reason
        # A fresh socket registers again (after the heartbeats the broker never read).
        while not isinstance(msg := linked.recv(), Register):
            assert isinstance(msg, Heartbeat)


def test_a_malformed_broker_address_ends_the_link() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    link = start(ctx, "nonsense://here")
    link.start()
    try:
        assert not link.alive()
    finally:
        link.stop()
        ctx.term()
