"""``--join``'s checks against a live broker (the harness of tests/broker/test_loop.py): a
ticket the broker takes stores its keys, 0600; forged, for another broker, expired,
revoked or unanswered, it is refused with a message saying which and nothing is stored."""

from __future__ import annotations

import io
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.cluster import free_port
from tests.broker.test_loop import Harness
from zmqllm.bus.keys import init_keys, load_broker_keys, load_peer_keys
from zmqllm.bus.ticket_keys import issue_ticket, revoke_key
from zmqllm.bus.tickets import TicketError, encode_ticket
from zmqllm.client.join import join, read_ticket


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


def refused(line: str, home: Path, role: str = "worker", timeout: float = 5.0) -> TicketError:
    with pytest.raises(TicketError) as caught:
        join(line, role, timeout=timeout, home=home)
    assert not (home / "tickets").exists(), "a refused ticket stored something"
    return caught.value


def test_a_ticket_the_broker_takes_is_stored(keyed: tuple[Harness, Path], tmp_path: Path) -> None:
    h, folder = keyed
    t = issue_ticket(folder, "worker", "gpu-2", h.backend, 60, model="tiny", layers="2:4")
    joined = join(encode_ticket(t), "worker", home=tmp_path / "home")
    assert joined.keys == tmp_path / "home" / "tickets" / "gpu-2"
    assert stat.S_IMODE((joined.keys / "worker.key_secret").stat().st_mode) == 0o600
    assert load_peer_keys(joined.keys, "worker").secret == t.secret
    assert joined.overrides() == {
        "worker": {"broker": h.backend, "join": "", "layers": "2:4"},
        "model": {"path": "tiny"},
        "security": {"keys": str(joined.keys), "insecure": False},
    }
    assert t.secret.decode() not in repr(joined) + joined.describe()
    app = issue_ticket(folder, "client", "app", h.frontend, 60)
    joined = join(encode_ticket(app), "client", home=tmp_path / "home")
    assert joined.overrides()["gateway"] == {"broker": h.frontend, "join": ""}
    assert h.status()["workers"] == []  # a probe registers nothing


def test_a_forged_ticket_is_refused(keyed: tuple[Harness, Path], tmp_path: Path) -> None:
    h, folder = keyed
    # Made with another key folder that copied this broker's public key: well formed,
    # checksum right, but a key this broker never issued.
    other = init_keys(tmp_path / "other")
    (other / "broker.key").write_bytes((folder / "broker.key").read_bytes())
    forged = issue_ticket(other, "worker", "gpu-2", h.backend, 60)
    err = refused(encode_ticket(forged), tmp_path / "home")
    assert err.kind == "forged" and "does not know this ticket's key" in str(err)
    # A ticket of another broker, pointed at this one: the handshake itself fails.
    elsewhere = issue_ticket(init_keys(tmp_path / "third"), "worker", "w", h.backend, 60)
    err = refused(encode_ticket(elsewhere), tmp_path / "home")
    assert err.kind == "forged" and "not the broker this ticket names" in str(err)


def test_expired_and_revoked_tickets_are_refused(
    keyed: tuple[Harness, Path], tmp_path: Path
) -> None:
    h, folder = keyed
    late = issue_ticket(folder, "worker", "late", h.backend, 1, now=time.time() - 5)
    err = refused(encode_ticket(late), tmp_path / "home")
    assert err.kind == "expired" and "ticket 'late' expired at" in str(err)
    gone = issue_ticket(folder, "client", "gone", h.frontend, 60)
    revoke_key(folder, "gone")
    err = refused(encode_ticket(gone), tmp_path / "home", role="client")
    assert err.kind == "revoked" and "'gone' was revoked" in str(err)
    assert h.status()["workers"] == []


def test_no_broker_and_the_wrong_role(tmp_path: Path) -> None:
    folder = init_keys(tmp_path / "keys")
    t = issue_ticket(folder, "worker", "w", f"tcp://127.0.0.1:{free_port()}", 60)
    err = refused(encode_ticket(t), tmp_path / "home", timeout=0.5)
    assert err.kind == "unreachable" and "no answer" in str(err)
    err = refused(encode_ticket(t), tmp_path / "home", role="client")
    assert err.kind == "role" and "zmqllm ticket --client" in str(err)


def test_a_ticket_is_read_from_a_file_or_stdin(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("zmqllm-ticket-1.abc.def\n")
    assert read_ticket(f"@{tmp_path / 't'}").strip() == "zmqllm-ticket-1.abc.def"
    assert read_ticket("-", io.StringIO("zmqllm-ticket-1.x.y\n")) == "zmqllm-ticket-1.x.y\n"
    assert read_ticket("zmqllm-ticket-1.x.y") == "zmqllm-ticket-1.x.y"
    with pytest.raises(TicketError, match="cannot read"):
        read_ticket(f"@{tmp_path / 'missing'}")
