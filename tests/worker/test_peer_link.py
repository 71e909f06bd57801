"""Peer links between workers on real sockets in one process: where they bind, who gets
through (routing id, CURVE key, ZAP), and the bounds on what waits for an OPEN."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from zmqllm.bus.keys import PeerKeys
from zmqllm.bus.messages import Activation, Step
from zmqllm.bus.protocol import decode, encode
from zmqllm.bus.wire_types import Payload, SessionKey
from zmqllm.config.settings import ConfigError
from zmqllm.log import get_logger
from zmqllm.worker import peer_link
from zmqllm.worker.faults import Faults
from zmqllm.worker.peer_link import PeerLink, PeerMessage, PeerRoute, peer_bind

HIDDEN = Payload(np.arange(8, dtype=np.float32).reshape(2, 4), "float32")


def pair() -> PeerKeys:
    public, secret = zmq.curve_keypair()
    return PeerKeys(public=public, secret=secret, server=b"")


def send_when_linked(link: PeerLink, endpoint: str, msg: Any, timeout: float = 3.0) -> bool:
    """Send once the link's handshake is done (until then a send fails at once)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if link.send(endpoint, encode(msg)):
            return True
        time.sleep(0.02)
    return False


def receive_all(link: PeerLink, want: int, timeout: float = 3.0) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        assert link.sock is not None
        link.sock.poll(50)
        got += link.receive()
    return got


@pytest.fixture
def ctxs() -> Iterator[list[zmq.Context[Any]]]:
    """One context per worker (each its own ZAP handler), terminated after."""
    made: list[zmq.Context[Any]] = []
    yield made
    for c in made:
        c.term()


def link(ctxs: list[zmq.Context[Any]], identity: str, keys: PeerKeys | None = None) -> PeerLink:
    ctxs.append(zmq.Context())
    return PeerLink(ctxs[-1], identity, 1 << 20, Faults(get_logger("test")), keys=keys)


def test_where_a_peer_link_binds() -> None:
    assert peer_bind("off", "tcp://127.0.0.1:5556", secure=True) == ""
    assert peer_bind("auto", "tcp://127.0.0.1:5556", secure=False) == "tcp://127.0.0.1:*"
    assert peer_bind("auto", "tcp://localhost:5556", secure=False) == "tcp://127.0.0.1:*"
    assert peer_bind("auto", "ipc:///tmp/broker", secure=False) == "tcp://127.0.0.1:*"
    # A remote broker: the address this host reaches it from (a UDP connect sends
    # nothing), and only with CURVE.
    assert peer_bind("auto", "tcp://198.18.0.1:5556", secure=False) == ""
    bound = peer_bind("auto", "tcp://198.18.0.1:5556", secure=True)
    assert bound.startswith("tcp://") and bound.endswith(":*") and "127.0.0.1" not in bound
    remote = "tcp://198.18.0.1:5556"  # only parsed: nothing is sent to it
    assert peer_bind("tcp://127.0.0.1:7000", remote, secure=False).endswith(":7000")
    assert peer_bind("tcp://198.18.0.2:*", remote, secure=True) == "tcp://198.18.0.2:*"
    with pytest.raises(ConfigError, match="loopback only"):
        peer_bind("tcp://198.18.0.2:7000", "tcp://127.0.0.1:1", secure=False)
    with pytest.raises(ConfigError, match="off, auto or"):
        peer_bind("ipc:///tmp/x", "tcp://127.0.0.1:1", secure=True)


def test_messages_arrive_with_the_sender_id_and_only_the_named_sender_is_accepted(
    ctxs: list[zmq.Context[Any]],
) -> None:
    a, b = link(ctxs, "w-a"), link(ctxs, "w-b")
    try:
        endpoint = b.start("tcp://127.0.0.1:*")
        assert endpoint.startswith("tcp://127.0.0.1:")
        a.connect(endpoint, "")
        a.connect(endpoint, "")  # the same link kept, not a second one
        assert len(a.links) == 1
        act = Activation(session="s", attempt=1, step=3, hidden=HIDDEN)
        assert send_when_linked(a, endpoint, act)
        assert a.send(endpoint, encode(Step(session="s", attempt=1, step=4, token=9)))
        assert not a.send("tcp://127.0.0.1:1", encode(act))  # no link there: the broker's
        got = receive_all(b, 2)
        assert [(m.sender, m.user) for m in got] == [("w-a", None)] * 2
        first = got[0].entry  # decoded once, as received
        assert isinstance(first, Activation) and first.step == 3
        assert np.array_equal(first.hidden.array, HIDDEN.array)
        assert isinstance(got[1].entry, Step)
        route = PeerRoute(next_peer="", prev="w-a", prev_key="")
        assert PeerLink.accepts(route, "w-a", None)
        assert not PeerLink.accepts(route, "w-x", None)
        assert not PeerLink.accepts(None, "w-a", None)
        keyed = PeerRoute(next_peer="", prev="w-a", prev_key="k" * 40)
        assert PeerLink.accepts(keyed, "w-a", "k" * 40)
        assert not PeerLink.accepts(keyed, "w-a", "j" * 40)
        assert not PeerLink.accepts(keyed, "w-a", None)
    finally:
        a.close()
        b.close()


def test_curve_peer_links_admit_only_keys_the_broker_named(
    ctxs: list[zmq.Context[Any]],
) -> None:
    ka, kb, kx = pair(), pair(), pair()
    a, b, x = link(ctxs, "w-a", ka), link(ctxs, "w-b", kb), link(ctxs, "w-x", kx)
    try:
        endpoint = b.start("tcp://127.0.0.1:*")
        b.expect(ka.public.decode())  # the broker named a as a previous stage
        a.connect(endpoint, kb.public.decode())
        x.connect(endpoint, kb.public.decode())  # x was never named
        assert send_when_linked(a, endpoint, Step(session="s", token=1))
        # x's link never completes: nothing it sends is even queued.
        assert not send_when_linked(x, endpoint, Step(session="s", token=1), timeout=0.5)
        got = receive_all(b, 2, timeout=1.5)
        # Only a's message, stamped with a's key; x's handshake is refused once it has
        # waited ZAP_HOLD_S for an OPEN naming its key.
        assert [(m.sender, m.user) for m in got] == [("w-a", ka.public.decode())]
        assert b.zap is not None
        deadline = time.monotonic() + peer_link.ZAP_HOLD_S + 2
        while not b.zap.denied.counts.get(peer_link.PEERS) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.zap.denied.counts.get(peer_link.PEERS, 0) >= 1
        assert receive_all(b, 1, timeout=0.2) == []
    finally:
        for one in (a, b, x):
            one.close()


def test_messages_held_for_an_open_are_bounded(
    ctxs: list[zmq.Context[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    b = link(ctxs, "w-b")
    monkeypatch.setattr(peer_link, "EARLY_MAX", 3)
    frames = [zmq.Frame(f) for f in encode(Step(session="s", token=1))]
    size = sum(len(f.buffer) for f in frames)
    msg = PeerMessage("w-a", None, decode(frames), size)
    for i in range(5):
        b.hold(SessionKey(f"s{i % 2}", 0), msg)
    assert len(b.early) == 3 and b.faults.count("peer_refused") == 2
    assert [m[0] for m in b.take_held(SessionKey("s0", 0))] == ["w-a", "w-a"]
    assert [e[0] for e in b.early] == [SessionKey("s1", 0)]
    assert b.take_held(SessionKey("s0", 0)) == []
    b.expire(time.monotonic() + peer_link.EARLY_S + 1)
    assert not b.early and b.early_bytes == 0
    monkeypatch.setattr(peer_link, "EARLY_BYTES", 10)
    b.hold(SessionKey("s2", 0), msg)  # larger than all the room there is
    assert not b.early and b.faults.count("peer_refused") == 3


def test_outgoing_links_are_bounded(
    ctxs: list[zmq.Context[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peer_link, "MAX_LINKS", 2)
    a = link(ctxs, "w-a")
    try:
        for port in (7001, 7002, 7003):
            a.connect(f"tcp://127.0.0.1:{port}", "")
        assert list(a.links) == ["tcp://127.0.0.1:7002", "tcp://127.0.0.1:7003"]
    finally:
        a.close()


def test_a_link_whose_key_is_named_late_gets_through_once_it_is(
    ctxs: list[zmq.Context[Any]],
) -> None:
    """The previous stage may connect before this one has read the OPEN that names it
    (they come on other connections): the handshake waits for it (libzmq would not try
    a refused one again)."""
    ka, kb = pair(), pair()
    a, b = link(ctxs, "w-a", ka), link(ctxs, "w-b", kb)
    try:
        endpoint = b.start("tcp://127.0.0.1:*")
        a.connect(endpoint, kb.public.decode())
        # Not named yet: the handshake waits, and a send fails at once meanwhile (the
        # worker sends through the broker then).
        assert not send_when_linked(a, endpoint, Step(session="s", token=1), timeout=0.5)
        b.expect(ka.public.decode())
        assert send_when_linked(a, endpoint, Step(session="s", token=1))
        got = receive_all(b, 1, timeout=5.0)
        assert [(m.sender, m.user) for m in got] == [("w-a", ka.public.decode())]
    finally:
        a.close()
        b.close()
