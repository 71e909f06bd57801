"""The broker's CURVE gate without sockets: the key a message came with, and which
clients lose their sessions when their key is revoked (the ZAP handler itself runs over
real sockets in tests/broker/test_curve.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import zmq

from zmqllm.bus import auth as auth_module
from zmqllm.bus.auth import CLIENTS, WORKERS, Authenticator, ClientKeys, peer_key
from zmqllm.bus.keys import add_key, init_keys, load_peer_keys


class Frame:
    """A received frame as far as peer_key looks: its ZAP user id property."""

    def __init__(self, user_id: str) -> None:
        self.user_id = user_id

    def get(self, name: str) -> str:
        assert name == "User-Id"
        return self.user_id


def test_peer_key_is_the_zap_user_id_of_the_last_frame() -> None:
    assert peer_key([Frame("other"), Frame("mine")]) == "mine"
    assert peer_key([Frame("")]) is None
    assert peer_key([b"header"]) is None  # plain bytes: no connection properties


def authenticator(folder: Path) -> Authenticator:
    # Not started: refresh(), allowed() and admits() need no thread and no socket.
    auth = Authenticator(zmq.Context.instance(), {d: folder / d for d in (CLIENTS, WORKERS)})
    auth.refresh(force=True)
    return auth


def test_revoked_clients_are_named_once_and_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = init_keys(tmp_path / "keys")
    app = load_peer_keys(add_key(folder, "client", "app"), "client").public.decode()
    ours = load_peer_keys(folder, "client").public.decode()
    auth = authenticator(folder)
    keys = ClientKeys()
    keys.opened(b"a", [Frame(ours)])
    keys.opened(b"b", [Frame(app)])
    keys.opened(b"gone", [Frame(app)])
    assert keys.keys == {b"a": ours, b"b": app, b"gone": app}

    # Nothing revoked; clients without a session left are forgotten.
    assert keys.revoked(auth, {b"a", b"b"}) == []
    assert set(keys.keys) == {b"a", b"b"}

    (folder / CLIENTS / "app.key").unlink()
    assert auth.refresh(force=True)
    assert not auth.allowed(CLIENTS, app)  # new handshakes: refused at once
    assert keys.revoked(auth, {b"a", b"b"}) == []  # connected: a moment's grace
    monkeypatch.setattr(auth_module, "GRACE_S", 0.0)
    assert keys.revoked(auth, {b"a", b"b"}) == [b"b"]
    assert keys.keys == {b"a": ours}
    assert keys.revoked(auth, {b"a"}) == []  # named once
    assert keys.revoked(auth, set()) == []
    assert keys.keys == {}


def test_a_key_missing_for_a_moment_is_not_revoked(tmp_path: Path) -> None:
    folder = init_keys(tmp_path / "keys")
    worker = load_peer_keys(folder, "worker").public
    auth = authenticator(folder)
    path = folder / WORKERS / "worker.key"
    text = path.read_bytes()
    path.write_bytes(text[: len(text) // 2])  # rewritten in place: half there
    auth.refresh(force=True)
    assert not auth.allowed(WORKERS, worker) and auth.admits(WORKERS, worker)
    path.write_bytes(text)
    auth.refresh(force=True)
    assert auth.allowed(WORKERS, worker)
    assert auth._removed_at == {}


def test_an_unreadable_folder_keeps_the_last_keys(tmp_path: Path) -> None:
    folder = init_keys(tmp_path / "keys")
    worker = load_peer_keys(folder, "worker").public
    auth = authenticator(folder)
    (folder / WORKERS).rename(tmp_path / "elsewhere")  # a copy under way, say
    auth.refresh(force=True)
    assert auth.allowed(WORKERS, worker)


def test_junk_key_files_do_not_stop_a_rescan(tmp_path: Path) -> None:
    folder = init_keys(tmp_path / "keys")
    (folder / CLIENTS / "broken.key").write_text("curve\n    public-key\n")  # no "="
    auth = authenticator(folder)
    ours = load_peer_keys(folder, "client").public
    assert auth.allowed(CLIENTS, ours)
    (folder / CLIENTS / "client.key").unlink()
    auth.refresh(force=True)
    assert not auth.allowed(CLIENTS, ours)


def test_a_key_added_in_the_same_clock_tick_is_seen_at_once(tmp_path: Path) -> None:
    """The folder's mtime moves in coarse ticks: a key file added in the tick of the last
    change leaves it as it was, and the names must show the change."""
    folder = init_keys(tmp_path / "keys")
    auth = authenticator(folder)
    workers = folder / WORKERS
    before = workers.stat()
    new = load_peer_keys(add_key(folder, "worker", "second"), "worker").public
    os.utime(workers, ns=(before.st_atime_ns, before.st_mtime_ns))  # the same tick
    assert not auth.allowed(WORKERS, new)
    assert auth.refresh()  # no force, RESCAN_S not passed
    assert auth.allowed(WORKERS, new)


def test_a_key_file_written_after_a_scan_saw_it_empty_is_read_at_once(tmp_path: Path) -> None:
    """A copy creates the file (the folder changes), then writes it (only the file
    does): a handshake's scan in between must not leave the key out for RESCAN_S."""
    folder = init_keys(tmp_path / "keys")
    auth = authenticator(folder)
    issued = add_key(folder, "worker", "second")
    new = load_peer_keys(issued, "worker").public
    target = folder / WORKERS / "second.key"
    content = target.read_bytes()
    target.write_bytes(b"")  # created, not yet written
    auth.refresh()
    assert not auth.allowed(WORKERS, new)
    before = (folder / WORKERS).stat()
    target.write_bytes(content)
    os.utime(folder / WORKERS, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert auth.refresh()  # no force, RESCAN_S not passed
    assert auth.allowed(WORKERS, new)
