"""Tickets' keys at the broker, over real sockets (the harness of test_loop.py): an expired
ticket's key and a revoked key are told why and register nothing; a ticket used in time
stays good past its expiry (also after a broker restart); revoking drops a registered
worker within a tick, with no grace."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.broker.test_curve import silent
from tests.broker.test_loop import INTERVAL, Harness, open_msg, register_msg
from zmqllm.bus.keys import PeerKeys, init_keys, load_broker_keys, load_peer_keys
from zmqllm.bus.messages import Disconnect, Heartbeat, Open, Refused, Registered, Status
from zmqllm.bus.ticket_keys import issue_ticket, key_file_name, revoke_key
from zmqllm.bus.tickets import Ticket

ENDPOINT = "tcp://127.0.0.1:1"  # what the ticket says; the harness connects its own way


def harness(folder: Path) -> Harness:
    return Harness(
        keys=load_broker_keys(folder),
        client_keys=load_peer_keys(folder, "client"),
        worker_keys=load_peer_keys(folder, "worker"),
    )


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[tuple[Harness, Path]]:
    folder = init_keys(tmp_path / "keys")
    h = harness(folder)
    try:
        yield h, folder
    finally:
        h.close()


def keys_of(t: Ticket) -> PeerKeys:
    return PeerKeys(public=t.public, secret=t.secret, server=t.server)


def ticket(folder: Path, name: str, lifetime_s: int, role: str = "worker", **kw: object) -> Ticket:
    return issue_ticket(folder, role, name, ENDPOINT, lifetime_s, **kw)  # type: ignore[arg-type]


def test_an_expired_ticket_is_told_so_and_registers_nothing(keyed: tuple[Harness, Path]) -> None:
    h, folder = keyed
    t = ticket(folder, "late", 1, now=time.time() - 10)
    h.broker.auth.refresh(force=True)  # type: ignore[union-attr]
    w = h.worker("late", curve=keys_of(t))
    w.send(register_msg(0, 4))
    reason = h.expect(w, Refused).reason
    assert "ticket 'late' expired at" in reason and "before it was used" in reason
    w.send(Heartbeat())
    assert "expired" in h.expect(w, Refused).reason
    st = h.status()
    assert st["workers"] == [] and st["dropped"].get("backend:revoked", 0) >= 2
    assert not (folder / "used").exists() or list((folder / "used").iterdir()) == []
    # A client ticket the same, on the frontend.
    c = ticket(folder, "late-app", 1, role="client", now=time.time() - 10)
    h.broker.auth.refresh(force=True)  # type: ignore[union-attr]
    app = h.client("late-app", curve=keys_of(c))
    app.send(Status(request_id="x"))
    assert "ticket 'late-app' expired" in h.expect(app, Refused).reason


def test_a_ticket_used_in_time_stays_good(tmp_path: Path) -> None:
    folder = init_keys(tmp_path / "keys")
    t = ticket(folder, "soon", 2)
    h = harness(folder)
    try:
        w = h.worker("joiner", curve=keys_of(t))
        w.send(Heartbeat())  # what `--join` sends first: answered as to any new worker
        h.expect(w, Disconnect)
        assert (folder / "used" / key_file_name(t.public)).is_file()
        time.sleep(2.5)  # past its expiry
        w.send(register_msg(0, 4))
        h.expect(w, Registered)
    finally:
        h.close()
    # A broker started again reads the use back.
    h = harness(folder)
    try:
        w = h.worker("joiner-again", curve=keys_of(t))
        w.send(register_msg(0, 4))
        h.expect(w, Registered)
    finally:
        h.close()


def test_revoking_drops_a_registered_worker_within_a_tick(keyed: tuple[Harness, Path]) -> None:
    h, folder = keyed
    t = ticket(folder, "gpu-2", 3600)
    h.broker.auth.refresh(force=True)  # type: ignore[union-attr]
    w1 = h.register("w1", 0, 4)
    w2 = h.register("w2", 0, 4, curve=keys_of(t))
    revoked_at = time.monotonic()
    revoke_key(folder, "gpu-2")
    refused = h.expect(w2, Refused)
    took = time.monotonic() - revoked_at
    assert "the key 'gpu-2' was revoked" in refused.reason
    w2.keepalive = False
    # No grace (a key file merely missing has 1.5 s): the next tick or two, not seconds.
    assert took < 1.0 + 10 * INTERVAL, took
    st = h.wait_status(lambda s: len(s["workers"]) == 1, "the revoked worker stayed")
    assert st["workers"][0]["id"] == "w1"
    # Connecting again with it: told it was revoked, and nothing registered.
    again = h.worker("w2-again", curve=keys_of(t))
    again.send(register_msg(0, 4))
    assert "revoked" in h.expect(again, Refused).reason
    assert silent(again, 0.3)
    h.client("c").send(open_msg("after"))
    assert h.expect(w1, Open).request_id.startswith("req-after")
