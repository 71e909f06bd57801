"""CURVE between real processes: what crosses the wire, and the CLI's refusals.

A TCP relay of the test's own sits between a worker and the broker and keeps every byte
it forwards. With keys, an exact answer comes back while neither the prompt's token ids
nor the answer's messages appear in those bytes; the same relay on a plaintext cluster
sees both, which proves the search would find them.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from testbed.cluster import Cluster, free_port
from tests.e2e.expected import sent_text
from zmqllm.bus.keys import (
    PeerKeys,
    add_key,
    as_client,
    init_keys,
    load_broker_keys,
    load_peer_keys,
)
from zmqllm.bus.messages import Activation, Heartbeat, Status
from zmqllm.bus.protocol import encode
from zmqllm.bus.wire_types import Payload

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

PROMPT = "The lighthouse keeper opened the bottle and read"
MAX_TOKENS = 12


class Relay:
    """Accepts on a free port, forwards each connection to ``target`` and keeps a copy
    of everything forwarded either way."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.seen = bytearray()
        self.lock = threading.Lock()
        self.socks: list[socket.socket] = [self.server]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.server.accept()
            except OSError:
                return
            up = socket.create_connection(self.target)
            self.socks += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
                if not data:
                    break
                with self.lock:
                    self.seen += data
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        for s in self.socks:
            s.close()


def complete(c: Cluster) -> tuple[str, list[int]]:
    body = json.dumps(
        {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    ).encode()
    req = urllib.request.Request(
        f"{c.url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"], []


@pytest.fixture
def relayed(tmp_path: Path, e2e_model: Path, request: pytest.FixtureRequest) -> Iterator:
    """A one-worker cluster whose worker reaches the broker through a Relay; the
    parameter says whether it has keys."""
    keys = init_keys(tmp_path / "keys") if request.param else None
    c = Cluster(tmp_path / "cluster", e2e_model, keys=keys)
    relay: Relay | None = None
    try:
        c.start_broker()
        relay = Relay(int(c.backend.rsplit(":", 1)[1]))
        c.start_worker(":", broker=f"tcp://127.0.0.1:{relay.port}")
        c.start_gateway()
        c.wait_ready()
        yield c, relay
    finally:
        c.stop()
        if relay is not None:
            relay.close()


def markers(ids: list[int], answer: list[int]) -> dict[str, bytes]:
    """Byte strings a plaintext bus carries: the prompt's token ids as the OPEN's int32
    payload, and each answer token as its TOKEN header's field."""
    out = {"prompt ids": np.asarray(ids, dtype=np.int32).tobytes()}
    for i, t in enumerate(answer):
        out[f"answer token {i}"] = msgpack.packb("token") + msgpack.packb(t)
    return out


@pytest.mark.parametrize("relayed", [True, False], ids=["curve", "plaintext"], indirect=True)
def test_the_wire_shows_neither_prompt_nor_answer(relayed, reference, greedy_ids) -> None:
    c, relay = relayed
    tok = reference.tokenizer
    ids = tok.encode(PROMPT)
    want = greedy_ids(ids, MAX_TOKENS, stop_at_eos=False)
    text, _ = complete(c)
    assert text == sent_text(tok, want)
    with relay.lock:
        seen = bytes(relay.seen)
    assert len(seen) > 1000  # the relay did carry the session
    found = [name for name, needle in markers(ids, want).items() if needle in seen]
    if c.keys is not None:
        assert found == [], f"plaintext on a CURVE bus: {found}"
        assert c.status()["curve"] is True
    else:
        # The control: on a plaintext bus the same search finds them all.
        assert len(found) == 1 + len(want), found


def run_cli(*args: str, home: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, ZMQLLM_HOME=str(home))
    return subprocess.run(
        [sys.executable, "-m", "zmqllm.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_keyless_broker_will_not_bind_beyond_loopback(tmp_path: Path) -> None:
    done = run_cli("broker", "--frontend", f"tcp://0.0.0.0:{free_port()}", home=tmp_path)
    assert done.returncode == 2
    assert "zmqllm keys init" in done.stderr and "--insecure" in done.stderr


def test_keys_commands(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert run_cli("keys", "init", home=home).returncode == 0
    assert (home / "keys" / "broker.key_secret").is_file()
    again = run_cli("keys", "init", home=home)
    assert again.returncode == 2 and "already has keys" in again.stderr
    added = run_cli("keys", "add", "worker", "host-2", home=home)
    assert added.returncode == 0, added.stderr
    assert (home / "keys" / "issued" / "host-2" / "worker.key_secret").is_file()
    listed = run_cli("keys", "list", home=home)
    assert "host-2" in listed.stdout and "workers allowed (2)" in listed.stdout


def start_keyed(c: Cluster, first: str, second: str) -> None:
    """Start ``c`` (its key folder made, plus a worker key named "second"): broker, a
    worker for layers ``first`` with the folder's worker key, one for ``second`` with
    its own, and a gateway, ready."""
    assert c.keys is not None
    add_key(c.keys, "worker", "second")
    c.start_broker()
    c.start_worker(first, name="first")
    c.start_worker(second, name="second", keys=c.keys / "issued" / "second")
    c.start_gateway()
    c.wait_ready()


def term_within(ctx: zmq.Context, seconds: float = 10.0) -> None:
    """ctx.term(), given up on after ``seconds``: libzmq may keep a context whose sockets
    were closed mid CURVE handshake (once in CI, 50 minutes in term() past pytest's
    timeout). What the test checks comes after; a context left behind costs nothing else."""
    done = threading.Thread(target=ctx.term, daemon=True)
    done.start()
    done.join(seconds)


def send_as_strangers(
    ctx: zmq.Context, address: str, pairs: list[PeerKeys | None], msgs: list[Any]
) -> list[zmq.Socket]:
    """A DEALER per CURVE pair (None: no CURVE), each sending ``msgs`` to ``address``."""
    socks = []
    for pair in pairs:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if pair is not None:
            as_client(sock, pair)
        sock.connect(address)
        for msg in msgs:
            sock.send_multipart(encode(msg))
        socks.append(sock)
    return socks


@pytest.fixture
def keyed_cluster(tmp_path: Path, e2e_model: Path) -> Iterator[Cluster]:
    """Broker, two whole-model workers (the second with a key of its own) and a gateway,
    all with CURVE."""
    c = Cluster(tmp_path / "cluster", e2e_model, keys=init_keys(tmp_path / "keys"))
    try:
        start_keyed(c, ":", ":")
        c.wait_for(lambda: len(c.status()["workers"]) == 2, what="both workers registered")
        yield c
    finally:
        c.stop()


def test_strangers_reach_nothing_of_a_live_broker(keyed_cluster: Cluster) -> None:
    c = keyed_cluster
    before = c.status()
    server = load_broker_keys(c.keys).public
    public, secret = zmq.curve_keypair()
    unknown = PeerKeys(public=public, secret=secret, server=server)
    worker_keys = load_peer_keys(c.keys, "worker")
    ctx = zmq.Context()
    socks = []
    try:
        # No CURVE, an unknown key, and each role's key on the other role's socket.
        client_keys = load_peer_keys(c.keys, "client")
        socks += send_as_strangers(
            ctx, c.frontend, [None, unknown, worker_keys], [Status(request_id="x")]
        )
        socks += send_as_strangers(ctx, c.backend, [None, unknown, client_keys], [Heartbeat()])
        time.sleep(1.5)
        assert [s.poll(0) for s in socks] == [0] * len(socks)  # nothing came back
    finally:
        for s in socks:
            s.close(linger=0)
        term_within(ctx)
    after = c.status()
    assert after["dropped"] == before["dropped"]  # no handler saw them
    assert after["counters"] == before["counters"]
    failures = after["auth"]["handshake_failures"]
    for side in ("frontend", "backend"):
        # The two keys ZAP refused; the peer without CURVE fails as "protocol" or
        # "failed", as libzmq sees it.
        assert failures.get(f"{side}:denied", 0) >= 2, failures
        assert sum(v for k, v in failures.items() if k.startswith(side)) >= 3, failures


def test_a_revoked_worker_leaves_while_the_other_serves(
    keyed_cluster: Cluster, reference, greedy_ids
) -> None:
    c = keyed_cluster
    second = c.by_name("worker")[1]  # started second, with the "second" key
    (c.keys / "workers" / "second.key").unlink()
    # Seconds in fact (a rescan and a tick); 60 s only guards a hang.
    c.wait_for(lambda: not second.alive(), timeout=60.0, what="the revoked worker to exit")
    assert second.popen.returncode == 3  # refused by the broker
    assert len(c.status()["workers"]) == 1
    text, _ = complete(c)
    tok = reference.tokenizer
    assert text == sent_text(tok, greedy_ids(tok.encode(PROMPT), MAX_TOKENS, stop_at_eos=False))


def test_peer_links_are_curve_and_admit_only_the_named_stage(
    tmp_path: Path, e2e_model: Path, reference, greedy_ids
) -> None:
    """Two stages with keys of their own: activations and steps go over CURVE peer
    links, and strangers (no CURVE, an unknown key, the client's key) get nothing
    through to a worker's peer socket."""
    keys = init_keys(tmp_path / "keys")
    c = Cluster(tmp_path / "cluster", e2e_model, keys=keys)
    ctx = zmq.Context()
    socks = []
    try:
        start_keyed(c, "0:2", "2:4")
        tok = reference.tokenizer
        want = sent_text(tok, greedy_ids(tok.encode(PROMPT), MAX_TOKENS, stop_at_eos=False))
        assert complete(c)[0] == want  # the links are made by now
        before = c.status()["counters"]
        assert complete(c)[0] == want
        st = c.status()
        assert st["counters"]["tokens"] >= before["tokens"] + MAX_TOKENS
        assert st["counters"]["relayed"] == before["relayed"]

        (second,) = [w for w in st["workers"] if w["layers"] == [2, 4]]
        server = load_peer_keys(keys / "issued" / "second", "worker").public
        public, secret = zmq.curve_keypair()
        client = load_peer_keys(keys, "client")
        pairs = [
            None,
            PeerKeys(public, secret, server),
            PeerKeys(client.public, client.secret, server),
        ]
        hidden = Payload(np.zeros((1, 64), np.float32), "float32")
        acts = [Activation(session=f"s{i}", hidden=hidden) for i in range(20)]
        socks += send_as_strangers(ctx, second["peer"], pairs, acts)
        time.sleep(1.5)
        stats = next(w for w in c.status()["workers"] if w["id"] == second["id"])["stats"]
        # Nothing reached the worker's handlers: the handshakes failed.
        assert not {k: v for k, v in stats.items() if k.startswith("fault_") and v}, stats
        assert complete(c)[0] == want
        assert c.status()["counters"]["relayed"] == before["relayed"]
    finally:
        for s in socks:
            s.close(linger=0)
        term_within(ctx)
        c.stop()
