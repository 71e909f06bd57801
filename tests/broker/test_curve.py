"""The broker with CURVE keys, over real sockets (the harness of test_loop.py).

Peers without CURVE, with keys nobody allowed, or with the other socket's keys reach
none of the broker's handlers and get nothing back; a removed key file ends its peer's
say within seconds; a second key cannot speak as a registered worker.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import zmq

from tests.broker.test_loop import Harness, Peer, open_msg, register_msg
from zmqllm.broker.admission import MAX_KEY_WORKERS, OUT_OF_SCOPE
from zmqllm.bus.keys import PeerKeys, add_key, init_keys, load_broker_keys, load_peer_keys
from zmqllm.bus.messages import (
    Error,
    Heartbeat,
    Message,
    Open,
    Refused,
    Registered,
    Status,
    StatusReply,
)

QUIET_S = 1.0  # how long a refused peer is watched for any answer


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[tuple[Harness, Path]]:
    folder = init_keys(tmp_path / "keys")
    h = Harness(
        keys=load_broker_keys(folder),
        client_keys=load_peer_keys(folder, "client"),
        worker_keys=load_peer_keys(folder, "worker"),
    )
    try:
        yield h, folder
    finally:
        h.close()


def stranger() -> PeerKeys:
    """A CURVE pair nobody allowed (it knows the broker's public key: the worst case)."""
    public, secret = zmq.curve_keypair()
    return PeerKeys(public=public, secret=secret, server=b"")


def offer(peer: Peer, msg: Message) -> None:
    """Send if the socket takes it: once a refused handshake has dropped its only
    connection, a DEALER has nowhere to queue (that is the point of the test)."""
    with contextlib.suppress(zmq.Again):
        peer.send(msg)


def silent(peer: Peer, seconds: float = QUIET_S) -> bool:
    return not peer.sock.poll(int(seconds * 1000))


def untouched(st: dict) -> None:
    """Nothing a refused peer sent reached a handler."""
    assert st["dropped"] == {}
    assert st["workers"] == []
    assert st["counters"]["sessions_opened"] == 0


def test_status_needs_the_client_key(keyed: tuple[Harness, Path]) -> None:
    h, _ = keyed
    st = h.status()
    assert st["curve"] is True
    untouched(st)


def test_peers_without_an_allowed_key_reach_nothing(keyed: tuple[Harness, Path]) -> None:
    h, folder = keyed
    server = load_broker_keys(folder).public
    unknown = stranger()
    unknown = PeerKeys(public=unknown.public, secret=unknown.secret, server=server)
    peers = [
        h._dealer("plain-client", h.frontend, {}),  # no CURVE at all
        h._dealer("stranger-client", h.frontend, {}, unknown),
    ]
    for p in peers:
        offer(p, Status(request_id="x"))
        offer(p, open_msg("s1"))
    workers = [
        h._dealer("plain-worker", h.backend, {}),
        h._dealer("stranger-worker", h.backend, {}, unknown),
    ]
    for w in workers:
        offer(w, register_msg(0, 4))
        offer(w, Heartbeat())
    assert all(silent(p) for p in [*peers, *workers])
    st = h.status()
    untouched(st)
    failures = st["auth"]["handshake_failures"]
    # A peer without CURVE fails the protocol; an unknown key is denied by ZAP.
    for name in ("frontend:protocol", "backend:protocol", "frontend:denied", "backend:denied"):
        assert failures.get(name, 0) >= 1, failures
    assert st["auth"]["refused"].get("clients", 0) >= 1
    assert st["auth"]["refused"].get("workers", 0) >= 1


def test_a_worker_key_is_not_a_client_key(keyed: tuple[Harness, Path]) -> None:
    h, _ = keyed
    as_client = h.client("worker-as-client", curve=h.worker_keys)
    as_client.send(Status(request_id="x"))
    as_worker = h.worker("client-as-worker", curve=h.client_keys)
    as_worker.send(register_msg(0, 4))
    assert silent(as_client) and silent(as_worker)
    untouched(h.status())


def test_a_revoked_worker_is_refused_while_others_serve(
    keyed: tuple[Harness, Path],
) -> None:
    h, folder = keyed
    add_key(folder, "worker", "second")
    second_keys = load_peer_keys(folder / "issued" / "second", "worker")
    w1 = h.register("w1", 0, 4)
    w2 = h.register("w2", 0, 4, curve=second_keys)
    (folder / "workers" / "second.key").unlink()
    # A handshake right after (its rescan sees the change first) must not hide it. The
    # rescan and the broker's tick take about a second each: 30 s only guards a hang.
    h.client("probe").send(Status(request_id="probe"))
    refused = h.expect(w2, Refused, timeout=30.0)
    assert "revoked" in refused.reason
    w2.keepalive = False
    st = h.wait_status(lambda s: len(s["workers"]) == 1, "the revoked worker stayed")
    assert st["workers"][0]["id"] == "w1"
    # A new connection with the revoked key is turned away at the handshake.
    again = h.worker("w2-again", curve=second_keys)
    again.send(register_msg(0, 4))
    assert silent(again)
    # The other worker keeps serving.
    client = h.client("c")
    client.send(open_msg("after-revoke"))
    assert h.expect(w1, Open).request_id.startswith("req-after-revoke")


def test_another_key_cannot_take_over_a_worker_id(keyed: tuple[Harness, Path]) -> None:
    h, folder = keyed
    add_key(folder, "worker", "intruder")
    intruder_keys = load_peer_keys(folder / "issued" / "intruder", "worker")
    w1 = h.register("w1", 0, 4)
    # Same routing id, another allowed worker key.
    intruder = h.worker("w1", curve=intruder_keys)
    intruder.send(register_msg(0, 4))
    intruder.send(Heartbeat())
    assert silent(intruder)
    client = h.client("c")
    client.send(open_msg("mine"))
    assert h.expect(w1, Open).request_id.startswith("req-mine")
    assert silent(intruder, 0.5)
    st = h.status()
    assert [w["id"] for w in st["workers"]] == ["w1"]


def test_a_revoked_client_loses_its_sessions(keyed: tuple[Harness, Path]) -> None:
    h, folder = keyed
    add_key(folder, "client", "app")
    app = h.client("app", curve=load_peer_keys(folder / "issued" / "app", "client"))
    w1 = h.register("w1", 0, 4)
    app.send(open_msg("s1"))
    h.expect(w1, Open)
    (folder / "clients" / "app.key").unlink()
    h.wait_status(lambda s: s["sessions"] == 0, "the revoked client's session stayed")
    before = h.pending(app)  # its session's end, if it came
    assert all(isinstance(m, Error) for m in before), before
    app.send(Status(request_id="x"))
    time.sleep(QUIET_S)
    assert not any(isinstance(m, StatusReply) for m in h.pending(app))
    assert h.status()["dropped"].get("frontend:revoked", 0) >= 1


def test_garbage_handshakes_leave_the_broker_serving(keyed: tuple[Harness, Path]) -> None:
    """Raw TCP junk, and ZMTP greetings that ask for CURVE then send junk, on both
    sockets: the handshakes fail and the broker goes on serving keyed peers."""
    import random
    import socket

    h, _ = keyed
    rng = random.Random(7)
    # A ZMTP 3.0 greeting (signature, version 3.0, mechanism "CURVE", as-server 0, filler).
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\x00")
    greeting += b"\x00" + b"\x00" * 31
    for address in (h.frontend, h.backend):
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        for i in range(40):
            with socket.create_connection((host, int(port)), timeout=5) as s:
                junk = rng.randbytes(rng.randrange(1, 600))
                s.sendall(greeting + junk if i % 2 else junk)
    w = h.register("w1", 0, 4)
    client = h.client("c")
    client.send(open_msg("after-junk"))
    assert h.expect(w, Open).request_id.startswith("req-after-junk")
    st = h.status()
    assert st["dropped"] == {}  # nothing of it reached a handler


def test_a_worker_key_registers_only_what_it_was_issued_for(
    keyed: tuple[Harness, Path],
) -> None:
    """`zmqllm keys add worker NAME --model M --layers A:B`: that key's REGISTER for
    another model, or for layers outside A:B, is refused naming the claim; within them it
    joins the model a worker of an unscoped key defined."""
    h, folder = keyed
    add_key(folder, "worker", "half", {"model": "m", "layers": "0:2"})
    half = load_peer_keys(folder / "issued" / "half", "worker")
    h.broker.auth.refresh(force=True)  # type: ignore[union-attr]
    whole = h.worker("w-whole", curve=half)
    whole.send(register_msg(0, 4))
    reason = h.expect(whole, Refused).reason
    assert reason.startswith(OUT_OF_SCOPE)
    assert "issued for layers 0:2, not 0:4" in reason
    add_key(folder, "worker", "other-model", {"model": "mini"})
    other = load_peer_keys(folder / "issued" / "other-model", "worker")
    h.broker.auth.refresh(force=True)  # type: ignore[union-attr]
    named = h.worker("w-named", curve=other)
    named.send(register_msg(0, 4))
    assert "issued for model 'mini', not 'm'" in h.expect(named, Refused).reason
    h.register("w-def", 2, 4)  # the unscoped key: defines model m
    ok = h.worker("w-ok", curve=half)
    ok.send(register_msg(0, 2))
    h.expect(ok, Registered)
    assert sorted(w["id"] for w in h.status()["workers"]) == ["w-def", "w-ok"]


def test_a_scoped_key_without_pins_cannot_define_its_model(
    keyed: tuple[Harness, Path],
) -> None:
    """While its model has no worker (loading, or after a broker restart), a key scoped
    to a model and layers but pinning nothing of it can register it neither as a model
    of its own layer count (a one-hop route drawing every prompt, honest workers then
    refused) nor as a remote text model: its REGISTER goes unanswered, the worker tries
    again later, and joins once an unscoped worker has defined the model."""
    h, folder = keyed
    add_key(folder, "worker", "host-2", {"model": "m", "layers": "0:2"})
    scoped = load_peer_keys(folder / "issued" / "host-2", "worker")
    h.broker.auth.refresh(force=True)  # type: ignore[union-attr]
    one_hop = h.worker("w-one-hop", curve=scoped)
    one_hop.send(register_msg(0, 2, num_layers=2))
    as_text = h.worker("w-as-text", curve=scoped)
    as_text.send(replace(register_msg(0, 1, num_layers=1, digest="remote:x"), text_model=True))
    assert silent(one_hop) and silent(as_text)
    st = h.status()
    assert st["workers"] == [] and st["models"] == []
    assert st["dropped"].get("backend:register_waits") == 2
    honest = h.register("w-honest", 0, 4)  # unscoped: the model is m, 4 layers
    honest.keepalive = True
    one_hop.send(register_msg(0, 2, num_layers=2))
    assert "the cluster's has 4" in h.expect(one_hop, Refused).reason
    later = h.worker("w-later", curve=scoped)
    later.send(register_msg(0, 2))
    h.expect(later, Registered)
    models = h.status()["models"]
    assert [(m["name"], m["num_layers"], m["text_model"]) for m in models] == [("m", 4, False)]


def test_a_pinned_key_registers_only_the_model_it_was_issued_for(
    keyed: tuple[Harness, Path],
) -> None:
    """`--digest D --num-layers N --kind layers`: a REGISTER saying anything else of the
    model is refused as outside the key's scope, and the reply does not hold the pinned
    digest; one saying exactly that may define the model."""
    h, folder = keyed
    pins = {"model": "m", "layers": "0:2", "digest": "fp-1", "num_layers": "4", "kind": "layers"}
    add_key(folder, "worker", "pinned", pins)
    pinned = load_peer_keys(folder / "issued" / "pinned", "worker")
    h.broker.auth.refresh(force=True)  # type: ignore[union-attr]
    wrong = [
        register_msg(0, 2, digest="fp-other"),
        register_msg(0, 2, num_layers=2),
        replace(register_msg(0, 1, num_layers=1, digest="fp-1"), text_model=True),
    ]
    for i, reg in enumerate(wrong):
        w = h.worker(f"w-wrong-{i}", curve=pinned)
        w.send(reg)
        reason = h.expect(w, Refused).reason
        assert reason.startswith(OUT_OF_SCOPE), reason
        assert "fp-1" not in reason
    assert h.status()["workers"] == []
    right = h.worker("w-right", curve=pinned)
    right.send(register_msg(0, 2))
    h.expect(right, Registered)
    (model,) = h.status()["models"]
    assert (model["name"], model["num_layers"], model["digest"]) == ("m", 4, "fp-1")


def test_a_worker_key_holds_a_bounded_share_of_registrations(
    keyed: tuple[Harness, Path],
) -> None:
    """One key, however many routing ids it uses, holds at most MAX_KEY_WORKERS
    registrations; another key is not held back by it, and a worker registering again
    under its own id is not one more."""
    h, folder = keyed
    held = [h.register(f"w{i:02d}", 0, 4) for i in range(MAX_KEY_WORKERS)]
    extra = h.worker("w-extra")
    extra.send(register_msg(0, 4))
    assert f"holds {MAX_KEY_WORKERS} registrations" in h.expect(extra, Refused).reason
    held[0].send(register_msg(0, 4))
    h.expect(held[0], Registered)
    add_key(folder, "worker", "second")
    second = load_peer_keys(folder / "issued" / "second", "worker")
    h.broker.auth.refresh(force=True)  # type: ignore[union-attr]
    h.register("w-second", 0, 4, curve=second)
    assert len(h.status()["workers"]) == MAX_KEY_WORKERS + 1
