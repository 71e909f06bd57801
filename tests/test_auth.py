"""The broker's CURVE gate without sockets: the key a message came with, and which
clients lose their sessions when their key is revoked (the ZAP handler itself runs over
real sockets in test_broker_curve.py)."""

from __future__ import annotations

from pathlib import Path

import zmq

from zmqllm.auth import CLIENTS, WORKERS, Authenticator, ClientKeys, peer_key
from zmqllm.keys import add_key, init_keys, load_peer_keys


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


def test_revoked_clients_are_named_once_and_forgotten(tmp_path: Path) -> None:
    folder = init_keys(tmp_path / "keys")
    app = load_peer_keys(add_key(folder, "client", "app"), "client").public.decode()
    ours = load_peer_keys(folder, "client").public.decode()
    # Not started: refresh() and allowed() need no thread and no socket.
    auth = Authenticator(zmq.Context.instance(), {d: folder / d for d in (CLIENTS, WORKERS)})
    auth.refresh(force=True)
    keys = ClientKeys()
    keys.opened(b"a", [Frame(ours)])
    keys.opened(b"b", [Frame(app)])
    keys.opened(b"gone", [Frame(app)])
    keys.opened(b"plain", [b"no curve"])
    assert keys.keys == {b"a": ours, b"b": app, b"gone": app, b"plain": ""}

    # The allowed keys did not change: nobody is revoked, not even a client without a
    # key; clients without a session left are forgotten.
    assert keys.revoked(auth, False, {b"a", b"b", b"plain"}) == []
    assert set(keys.keys) == {b"a", b"b", b"plain"}

    (folder / CLIENTS / "app.key").unlink()
    assert auth.refresh(force=True)
    assert keys.revoked(auth, True, {b"a", b"b", b"plain"}) == [b"b", b"plain"]
    assert keys.keys == {b"a": ours}
    assert keys.revoked(auth, True, {b"a"}) == []  # named once
    assert keys.revoked(auth, False, set()) == []
    assert keys.keys == {}
