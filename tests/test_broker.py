"""The broker over real sockets: a Broker runs in a thread; fake workers and clients are
DEALER sockets the test drives by hand, so every message is visible and scripted.

No torch here: the broker runs without the ML stack. Waits are bounded and generous;
nothing asserts how long anything took.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from zmqllm import PROTOCOL_VERSION, __version__
from zmqllm.broker import Broker
from zmqllm.config import BrokerSettings
from zmqllm.protocol import Header, MsgType, Payload, decode, encode, encode_header

# Longest wait for one expected message. Generous: a loaded CI machine may stall a thread
# for a while, and a correct broker answers long before this anyway.
TIMEOUT = 10.0
INTERVAL = 0.1  # broker heartbeat interval in most tests: ticks (queue, liveness) come fast
KEEPALIVE = 0.05  # how often fake workers heartbeat while the test waits on something

SUMMARY: dict[str, Any] = {"num_layers": 4, "hidden_size": 64, "sliding_window": 8}
HIDDEN = 64


@dataclass
class Msg:
    header: Header
    payloads: list[Payload]
    frames: list[bytes]  # raw frames as received, header first


@dataclass
class Peer:
    """A DEALER playing a worker or a client."""

    name: str
    sock: zmq.Socket
    keepalive: bool = False  # heartbeat the broker whenever the test waits

    def send(self, header: Header, payloads: Sequence[Payload] = ()) -> None:
        self.sock.send_multipart(encode(header, payloads))

    def send_raw(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)


class Harness:
    """One broker in a thread plus the peers a test creates; ``close`` ends it all."""

    def __init__(self, **settings: Any) -> None:
        values: dict[str, Any] = dict(
            frontend="tcp://127.0.0.1:0",
            backend="tcp://127.0.0.1:0",
            heartbeat_interval=INTERVAL,
            # 3 s without a heartbeat: only the liveness test wants a short horizon.
            heartbeat_liveness=30,
            queue_timeout=30.0,
        )
        values.update(settings)
        # A private context: term() at the end proves every socket was closed.
        self.ctx = zmq.Context()
        self.broker = Broker(BrokerSettings(**values), context=self.ctx)
        self.frontend, self.backend = self.broker.endpoints
        self.peers: list[Peer] = []
        self._next_keepalive = 0.0
        self._marker = 0
        self.thread = threading.Thread(target=self.broker.run, name="broker", daemon=True)
        self.thread.start()
        self.admin = self.client("admin")

    def close(self) -> None:
        self.broker.stop()
        # The loop wakes at least once per heartbeat interval to see the flag.
        self.thread.join(timeout=TIMEOUT)
        for p in self.peers:
            p.sock.close(linger=0)
        alive = self.thread.is_alive()
        if not alive:
            self.ctx.term()
        assert not alive, "broker thread did not stop"

    # -- peers ---------------------------------------------------------------------------
    def _dealer(self, name: str, address: str) -> Peer:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, name.encode())
        sock.connect(address)
        peer = Peer(name, sock)
        self.peers.append(peer)
        return peer

    def client(self, name: str = "client") -> Peer:
        return self._dealer(name, self.frontend)

    def worker(self, name: str) -> Peer:
        return self._dealer(name, self.backend)

    def register(self, name: str, start: int, end: int, **kw: Any) -> Peer:
        w = self.worker(name)
        w.send(register_header(start, end, **kw))
        reply = self.expect(w, MsgType.REGISTERED)
        assert reply.header.fields["worker_id"] == name
        w.keepalive = True
        return w

    # -- receiving -----------------------------------------------------------------------
    def _keepalive(self) -> None:
        now = time.monotonic()
        if now < self._next_keepalive:
            return
        self._next_keepalive = now + KEEPALIVE
        for p in self.peers:
            if p.keepalive:
                p.send(Header(MsgType.HEARTBEAT))

    def expect(self, peer: Peer, msg_type: MsgType, timeout: float = TIMEOUT) -> Msg:
        """The next message to ``peer`` other than a broker heartbeat; it must be of
        ``msg_type``. Keeps the fake workers alive meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            self._keepalive()
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{peer.name}: no {msg_type.value} within {timeout}s")
            if not peer.sock.poll(int(min(left, KEEPALIVE) * 1000) + 1):
                continue
            frames = peer.sock.recv_multipart()
            header, payloads = decode(frames)
            if header.type is MsgType.HEARTBEAT and msg_type is not MsgType.HEARTBEAT:
                continue
            assert header.type is msg_type, (
                f"{peer.name}: expected {msg_type.value}, got {header.type.value} {header}"
            )
            return Msg(header, payloads, frames)

    def sync(self, worker: Peer) -> None:
        """Return once the broker has handled everything ``worker`` sent so far: messages
        of one socket are handled in order, so a marker in its heartbeat load proves it."""
        self._marker += 1
        marker = f"{worker.name}-{self._marker}"
        worker.send(Header(MsgType.HEARTBEAT, fields={"load": {"marker": marker}}))
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            st = self.status()
            if any(w["stats"].get("marker") == marker for w in st["workers"]):
                return
        raise AssertionError(f"the broker never handled {worker.name}'s marker")

    def status(self, via: Peer | None = None) -> dict[str, Any]:
        """Ask over ``via`` (default the admin client): on the same socket as an earlier
        request, the broker handles that request first."""
        peer = via or self.admin
        peer.send(Header(MsgType.STATUS, request_id="st"))
        reply = self.expect(peer, MsgType.STATUS_REPLY)
        assert reply.header.request_id == "st"
        status: dict[str, Any] = reply.header.fields["status"]
        return status


@pytest.fixture
def cluster() -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(**settings: Any) -> Harness:
        h = Harness(**settings)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


# -- message builders --------------------------------------------------------------------


def register_header(
    start: int,
    end: int,
    *,
    digest: str = "fp-1",
    summary: dict[str, Any] | None = None,
    capacity: int = 4,
    num_layers: int = 4,
    version: str = __version__,
) -> Header:
    info = {
        "fingerprint": summary if summary is not None else SUMMARY,
        "max_kv_tokens": 4096,
        "context": 1024,
    }
    fields = {
        "start": start,
        "end": end,
        "num_layers": num_layers,
        "capacity": capacity,
        "version": version,
        "fingerprint": digest,
        "info": info,
    }
    return Header(MsgType.REGISTER, fields=fields)


def open_message(
    session: str, prompt: Sequence[int] = (5, 6, 7), max_tokens: int = 4, **fields: Any
) -> tuple[Header, list[Payload]]:
    tokens = np.asarray(prompt, dtype=np.int32)
    values: dict[str, Any] = {
        "max_tokens": max_tokens,
        "prompt_len": len(tokens),
        "sampling": {"temperature": 0.0},
        "stop_ids": [2],
    }
    values.update(fields)
    return Header(MsgType.OPEN, session, f"req-{session}", 0, values), [Payload(tokens, "int32")]


def token_header(session: str, step: int, token: int, finish: str | None = None) -> Header:
    fields = {"token": token, "finish": finish}
    return Header(MsgType.TOKEN, session, f"req-{session}", step, fields)


def activation(session: str, step: int, rows: int) -> tuple[Header, list[Payload]]:
    hidden = np.random.default_rng(step).standard_normal((rows, HIDDEN)).astype(np.float32)
    header = Header(MsgType.ACTIVATION, session, f"req-{session}", step, {"final": True})
    return header, [Payload(hidden, "float32")]


def pipeline(h: Harness) -> tuple[Peer, Peer, Peer]:
    """A client and a registered 2-stage pipeline (layers 0:2 and 2:4)."""
    return h.client(), h.register("w0", 0, 2), h.register("w1", 2, 4)


def open_on(h: Harness, client: Peer, stages: Sequence[Peer], session: str, **kw: Any) -> None:
    """Open a session and wait until every stage has its OPEN."""
    client.send(*open_message(session, **kw))
    for w in stages:
        assert h.expect(w, MsgType.OPEN).header.session == session


# -- registration ------------------------------------------------------------------------


def test_register_gets_registered_with_the_boot_id(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    w = h.worker("w0")
    w.send(register_header(0, 4))
    reply = h.expect(w, MsgType.REGISTERED)
    assert reply.header.fields["worker_id"] == "w0"
    assert reply.header.fields["boot"] == h.broker.boot
    st = h.status()
    assert [x["id"] for x in st["workers"]] == ["w0"]
    assert st["workers"][0]["layers"] == [0, 4]
    assert st["num_layers"] == 4
    assert st["complete_route"] is True


def test_a_worker_of_another_model_is_refused_naming_the_difference(
    cluster: Callable[..., Harness],
) -> None:
    h = cluster()
    h.register("w0", 0, 2)
    other = h.worker("w1")
    other.send(register_header(2, 4, digest="fp-2", summary=dict(SUMMARY, sliding_window=4)))
    reason = h.expect(other, MsgType.REFUSED).header.fields["reason"]
    assert "sliding_window: 8 != 4" in reason
    # The cluster is unharmed: the first worker stays, the refused one never joined.
    st = h.status()
    assert [x["id"] for x in st["workers"]] == ["w0"]
    assert st["complete_route"] is False


def test_a_worker_of_another_version_is_refused(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    w = h.worker("w0")
    w.send(register_header(0, 4, version="0.0.0-other"))
    assert "0.0.0-other" in h.expect(w, MsgType.REFUSED).header.fields["reason"]


def test_a_message_from_an_unknown_worker_gets_disconnect(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    w = h.worker("stranger")
    w.send(Header(MsgType.HEARTBEAT))
    reason = h.expect(w, MsgType.DISCONNECT).header.fields["reason"]
    assert "register" in reason


# -- one session's path ------------------------------------------------------------------


def test_a_session_flows_through_both_stages(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    client, w0, w1 = pipeline(h)
    header, prompt = open_message("s1", prompt=[5, 6, 7], max_tokens=2)
    client.send(header, prompt)

    # Every stage gets the OPEN with its position on the route; stage 0 also the prompt.
    open1 = h.expect(w1, MsgType.OPEN)
    assert open1.payloads == []
    assert open1.header.fields["stage"] == 1
    assert open1.header.fields["stages"] == 2
    assert open1.header.fields["next"] == "w0"  # the last stage's STEPs go to stage 0
    open0 = h.expect(w0, MsgType.OPEN)
    assert open0.header.session == "s1"
    assert open0.header.request_id == "req-s1"
    assert open0.header.fields["stage"] == 0
    assert open0.header.fields["max_len"] == 3 + 2
    assert open0.header.fields["max_tokens"] == 2
    assert open0.header.fields["next"] == "w1"
    assert [p.dtype for p in open0.payloads] == ["int32"]
    assert open0.frames[1] == prompt[0].array.tobytes()

    # Stage 0's activations reach stage 1 byte for byte, header included.
    act_header, act = activation("s1", 0, rows=3)
    sent = encode(act_header, act)
    w0.send_raw([bytes(f) for f in sent])
    got = h.expect(w1, MsgType.ACTIVATION)
    assert got.frames == [bytes(f) for f in sent]
    np.testing.assert_array_equal(got.payloads[0].array, act[0].array)

    # A token that does not finish: to the client (with the route on step 0), and the
    # next step straight to stage 0, with the group it was computed in.
    tagged = token_header("s1", 0, 42)
    tagged.fields["group"] = ["w-x/7/w0", 3]
    w1.send(tagged)
    tok = h.expect(client, MsgType.TOKEN)
    assert tok.header.step == 0
    boot = tok.header.fields.pop("boot")
    assert isinstance(boot, str) and boot == h.status()["boot"]  # tells brokers apart
    assert tok.header.fields == {"token": 42, "finish": None, "route": ["w0", "w1"]}
    step = h.expect(w0, MsgType.STEP)
    assert (step.header.session, step.header.step, step.header.fields["token"]) == ("s1", 1, 42)
    assert step.header.fields["group"] == ["w-x/7/w0", 3]

    # The last token: to the client, then every stage frees the session.
    w1.send(token_header("s1", 1, 43, finish="length"))
    tok = h.expect(client, MsgType.TOKEN)
    assert tok.header.step == 1
    assert tok.header.fields == {"token": 43, "finish": "length"}
    assert h.expect(w0, MsgType.CLOSE).header.session == "s1"
    assert h.expect(w1, MsgType.CLOSE).header.session == "s1"

    st = h.status()
    assert st["sessions"] == 0
    assert all(w["sessions"] == 0 and w["kv_tokens_reserved"] == 0 for w in st["workers"])
    assert st["counters"]["sessions_opened"] == 1
    assert st["counters"]["sessions_finished"] == 1
    assert st["counters"]["tokens"] == 2


def test_status_counts_an_open_session_on_its_route(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    client, w0, w1 = pipeline(h)
    open_on(h, client, [w1, w0], "s1", max_tokens=4)
    st = h.status()
    assert st["sessions"] == 1
    assert st["queue"] == 0
    for w in st["workers"]:
        assert w["sessions"] == 1
        assert w["kv_tokens_reserved"] == 3 + 4


def test_cancel_closes_every_stage(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    client, w0, w1 = pipeline(h)
    open_on(h, client, [w1, w0], "s1")
    client.send(Header(MsgType.CANCEL, "s1", "req-s1"))
    assert h.expect(w0, MsgType.CLOSE).header.session == "s1"
    assert h.expect(w1, MsgType.CLOSE).header.session == "s1"
    st = h.status(via=client)
    assert st["sessions"] == 0
    assert st["counters"]["sessions_finished"] == 1


def test_a_token_after_cancel_is_dropped(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    client, w0, w1 = pipeline(h)
    open_on(h, client, [w1, w0], "s1")
    client.send(Header(MsgType.CANCEL, "s1", "req-s1"))
    h.expect(w1, MsgType.CLOSE)
    # A token already in flight when the session ended: not forwarded, no STEP.
    w1.send(token_header("s1", 0, 42))
    h.sync(w1)
    # The client's next message is the status reply (expect fails on a stray token).
    assert h.status(via=client)["counters"]["tokens"] == 0
    # Stage 0's next message is the CLOSE, not a STEP.
    h.expect(w0, MsgType.CLOSE)


def test_a_worker_error_fails_the_session(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    client, w0, w1 = pipeline(h)
    open_on(h, client, [w1, w0], "s1")
    w1.send(Header(MsgType.ERROR, "s1", "req-s1", fields={"code": "internal", "message": "boom"}))
    err = h.expect(client, MsgType.ERROR)
    assert (err.header.session, err.header.fields["code"]) == ("s1", "internal")
    assert err.header.fields["message"] == "boom"
    h.expect(w0, MsgType.CLOSE)
    h.expect(w1, MsgType.CLOSE)
    assert h.status()["counters"]["sessions_failed"] == 1


@pytest.mark.parametrize(
    ("session", "prompt", "fields", "problem"),
    [
        ("", [5, 6], {}, "session id"),
        ("s1", [5, 6], {"prompt_len": 3}, "prompt_len"),
        ("s1", [5, 6], {"max_tokens": 0}, "positive"),
        ("s1", [5, 6], {"max_tokens": 1023}, "context"),
    ],
)
def test_a_bad_open_gets_bad_request(
    cluster: Callable[..., Harness],
    session: str,
    prompt: list[int],
    fields: dict[str, Any],
    problem: str,
) -> None:
    h = cluster()
    client, _, _ = pipeline(h)
    client.send(*open_message(session, prompt=prompt, **fields))
    err = h.expect(client, MsgType.ERROR)
    assert err.header.fields["code"] == "bad_request"
    assert problem in err.header.fields["message"]
    assert h.status(via=client)["sessions"] == 0


def test_a_second_open_of_the_same_session_gets_bad_request(
    cluster: Callable[..., Harness],
) -> None:
    h = cluster()
    client, w0, w1 = pipeline(h)
    open_on(h, client, [w1, w0], "s1")
    client.send(*open_message("s1"))
    err = h.expect(client, MsgType.ERROR)
    assert err.header.fields["code"] == "bad_request"
    assert "already open" in err.header.fields["message"]


# -- queueing ----------------------------------------------------------------------------


def test_open_without_a_route_waits_then_fails_with_no_capacity(
    cluster: Callable[..., Harness],
) -> None:
    h = cluster(queue_timeout=0.5)
    client = h.client()
    h.register("w0", 0, 2)  # layers 2:4 have no worker
    client.send(*open_message("s1"))
    st = h.status(via=client)  # same socket: the OPEN was handled first
    assert st["queue"] == 1
    assert st["sessions"] == 0
    assert st["complete_route"] is False
    err = h.expect(client, MsgType.ERROR)
    assert err.header.session == "s1"
    assert err.header.fields["code"] == "no_capacity"
    assert "2:4" in err.header.fields["message"]
    assert h.status()["queue"] == 0


def test_open_with_no_worker_at_all_fails_with_no_capacity(
    cluster: Callable[..., Harness],
) -> None:
    h = cluster(queue_timeout=0.5)
    client = h.client()
    client.send(*open_message("s1"))
    err = h.expect(client, MsgType.ERROR)
    assert err.header.fields["code"] == "no_capacity"
    assert "no worker" in err.header.fields["message"]


def test_a_queued_request_is_served_when_the_missing_worker_registers(
    cluster: Callable[..., Harness],
) -> None:
    h = cluster()
    client = h.client()
    w0 = h.register("w0", 0, 2)
    header, prompt = open_message("s1")
    client.send(header, prompt)
    assert h.status(via=client)["queue"] == 1

    w1 = h.register("w1", 2, 4)
    assert h.expect(w1, MsgType.OPEN).header.session == "s1"
    open0 = h.expect(w0, MsgType.OPEN)
    assert open0.frames[1] == prompt[0].array.tobytes()
    st = h.status()
    assert (st["queue"], st["sessions"]) == (0, 1)


def test_a_full_queue_answers_busy(cluster: Callable[..., Harness]) -> None:
    h = cluster(queue_size=1)
    client = h.client()
    client.send(*open_message("s1"))  # waits: no worker at all
    client.send(*open_message("s2"))
    err = h.expect(client, MsgType.ERROR)
    assert (err.header.session, err.header.fields["code"]) == ("s2", "busy")
    assert h.status(via=client)["queue"] == 1


def test_a_cancelled_queued_request_leaves_the_queue(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    client = h.client()
    h.register("w0", 0, 2)
    client.send(*open_message("s1"))
    client.send(Header(MsgType.CANCEL, "s1", "req-s1"))
    assert h.status(via=client)["queue"] == 0


# -- failures ----------------------------------------------------------------------------


def test_a_silent_worker_is_removed_and_its_sessions_fail(
    cluster: Callable[..., Harness],
) -> None:
    # Horizon 3 x 0.2 s: the worker keeps heartbeating until its session is open.
    h = cluster(heartbeat_interval=0.2, heartbeat_liveness=3)
    client = h.client()
    w = h.register("w0", 0, 4)
    open_on(h, client, [w], "s1")
    # A token has reached the client: the session cannot start over elsewhere.
    w.send(token_header("s1", 0, 42))
    h.expect(client, MsgType.TOKEN)
    h.expect(w, MsgType.STEP)
    w.keepalive = False  # the worker hangs from here on

    err = h.expect(client, MsgType.ERROR)
    assert err.header.session == "s1"
    assert err.header.fields["code"] == "worker_lost"
    assert "stopped answering" in err.header.fields["message"]
    st = h.status()
    assert st["workers"] == []
    assert st["sessions"] == 0
    assert st["counters"]["sessions_failed"] == 1


def test_a_leaving_worker_fails_its_sessions(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    client, w0, w1 = pipeline(h)
    open_on(h, client, [w1, w0], "s1")
    # A token has reached the client: the session cannot start over elsewhere.
    w1.send(token_header("s1", 0, 42))
    h.expect(client, MsgType.TOKEN)
    h.expect(w0, MsgType.STEP)
    w1.send(Header(MsgType.DISCONNECT, fields={"reason": "worker shutting down"}))
    err = h.expect(client, MsgType.ERROR)
    assert err.header.fields["code"] == "worker_lost"
    assert "shutting down" in err.header.fields["message"]
    # The surviving stage frees the session.
    assert h.expect(w0, MsgType.CLOSE).header.session == "s1"
    assert [x["id"] for x in h.status()["workers"]] == ["w0"]


def test_a_worker_lost_before_the_first_token_requeues_the_request(
    cluster: Callable[..., Harness],
) -> None:
    # No token has reached the client: the request starts again on another replica
    # (e.g. a drained worker left while the OPEN for it was on its way).
    h = cluster()
    client = h.client()
    wa = h.register("wa", 0, 4)
    wb = h.register("wb", 0, 4)
    header, prompt = open_message("s1")
    client.send(header, prompt)
    assert h.expect(wa, MsgType.OPEN).header.session == "s1"  # equal load: the lowest id
    wa.send(Header(MsgType.DISCONNECT, fields={"reason": "worker shutting down"}))
    reopen = h.expect(wb, MsgType.OPEN)
    assert reopen.header.session == "s1.2"
    assert reopen.frames[1] == prompt[0].array.tobytes()
    wb.send(token_header("s1.2", 0, 9, finish="stop"))
    tok = h.expect(client, MsgType.TOKEN)  # the client never saw the loss
    assert tok.header.fields["route"] == ["wb"]
    st = h.status()
    assert st["counters"]["sessions_failed"] == 0 and st["sessions"] == 0


def test_a_worker_registering_again_fails_its_sessions(cluster: Callable[..., Harness]) -> None:
    # A worker that reconnected has dropped its caches: its sessions cannot go on.
    h = cluster()
    client = h.client()
    w = h.register("w0", 0, 4)
    open_on(h, client, [w], "s1")
    # A token has reached the client: the session cannot start over elsewhere.
    w.send(token_header("s1", 0, 42))
    h.expect(client, MsgType.TOKEN)
    h.expect(w, MsgType.STEP)
    w.send(register_header(0, 4))
    assert h.expect(w, MsgType.REGISTERED).header.fields["worker_id"] == "w0"
    err = h.expect(client, MsgType.ERROR)
    assert err.header.fields["code"] == "worker_lost"
    st = h.status()
    assert [x["id"] for x in st["workers"]] == ["w0"]
    assert st["sessions"] == 0


def test_full_during_open_requeues_on_another_replica(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    client = h.client()
    # Equal load: the lowest id goes first, so w0a is tried first.
    w0a = h.register("w0a", 0, 2)
    w0b = h.register("w0b", 0, 2)
    w1 = h.register("w1", 2, 4)
    header, prompt = open_message("s1")
    client.send(header, prompt)
    h.expect(w1, MsgType.OPEN)
    h.expect(w0a, MsgType.OPEN)

    full = {"code": "full", "message": "stage full: 4/4 sessions"}
    w0a.send(Header(MsgType.ERROR, "s1", "req-s1", fields=full))
    # The first route is undone on both of its stages...
    assert h.expect(w0a, MsgType.CLOSE).header.session == "s1"
    assert h.expect(w1, MsgType.CLOSE).header.session == "s1"
    # ... and the session opens again on the other replica, with the same prompt, under
    # a new wire id: messages of the first attempt still in flight now match nothing.
    assert h.expect(w1, MsgType.OPEN).header.session == "s1.2"
    reopen = h.expect(w0b, MsgType.OPEN)
    assert reopen.header.session == "s1.2"
    assert reopen.frames[1] == prompt[0].array.tobytes()

    w0a.send(*activation("s1", 0, rows=3))  # stale: from the undone attempt
    w0b.send(*activation("s1.2", 0, rows=3))
    got = h.expect(w1, MsgType.ACTIVATION)
    assert got.header.session == "s1.2"
    w1.send(token_header("s1.2", 0, 9, finish="stop"))
    tok = h.expect(client, MsgType.TOKEN)
    # The client never saw the refusal: its first message is the token.
    assert tok.header.fields["route"] == ["w0b", "w1"]
    st = h.status()
    assert st["counters"]["sessions_failed"] == 0


# -- robustness --------------------------------------------------------------------------


def malformed_messages() -> list[list[bytes]]:
    """Messages a broker must drop, each as the frames a peer sends."""

    def packed(head: Any) -> bytes:
        data: bytes = msgpack.packb(head, use_bin_type=True)
        return data

    status = encode_header(Header(MsgType.STATUS))
    return [
        [b"\x00\x01garbage\xff"],  # bytes after a complete msgpack value
        [b"\xc1"],  # never valid msgpack
        [packed([1, 2])],  # msgpack, but not a map
        [packed({"v": PROTOCOL_VERSION + 99, "type": "status"})],
        [packed({"v": PROTOCOL_VERSION, "type": "no-such-type"})],
        [status, b"an extra frame no tensor declares"],
        [encode_header(Header(MsgType.STATUS), [("float32", [2])])],  # tensor but no frame
        [b""],  # a single empty frame
    ]


def test_malformed_messages_are_dropped_and_the_broker_keeps_serving(
    cluster: Callable[..., Harness],
) -> None:
    h = cluster()
    client, w0, w1 = pipeline(h)
    bad = malformed_messages()
    for frames in bad:
        client.send_raw(frames)
        w0.send_raw(frames)
    h.sync(w0)
    st = h.status(via=client)  # after the client's garbage on its socket
    assert st["counters"]["dropped_messages"] == 2 * len(bad)
    assert [x["id"] for x in st["workers"]] == ["w0", "w1"]

    # A normal request still works end to end.
    open_on(h, client, [w1, w0], "s1", max_tokens=1)
    w0.send(*activation("s1", 0, rows=3))
    h.expect(w1, MsgType.ACTIVATION)
    w1.send(token_header("s1", 0, 7, finish="length"))
    assert h.expect(client, MsgType.TOKEN).header.fields["token"] == 7


def test_a_client_sending_a_worker_verb_gets_bad_request(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    client = h.client()
    client.send(token_header("s1", 0, 1))
    err = h.expect(client, MsgType.ERROR)
    assert err.header.fields["code"] == "bad_request"


def test_status_reports_workers_pools_and_route(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    h.register("w0", 0, 2)
    h.register("w0b", 0, 2)
    assert h.status()["complete_route"] is False
    h.register("w1", 2, 4)
    st = h.status()
    assert st["boot"] == h.broker.boot
    assert st["version"] == __version__
    assert st["complete_route"] is True
    assert sorted(x["id"] for x in st["workers"]) == ["w0", "w0b", "w1"]
    assert st["pools"] == [
        {"layers": [0, 2], "workers": ["w0", "w0b"]},
        {"layers": [2, 4], "workers": ["w1"]},
    ]
    for w in st["workers"]:
        assert {"layers", "sessions", "capacity", "load", "last_heartbeat_s"} <= set(w)


def test_worker_heartbeat_load_reaches_status(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    w = h.register("w0", 0, 4)
    w.send(Header(MsgType.HEARTBEAT, fields={"load": {"mean_batch": 2.5, "draining": True}}))
    deadline = time.monotonic() + TIMEOUT
    while True:
        (entry,) = h.status()["workers"]
        if entry["draining"] or time.monotonic() > deadline:
            break
    assert entry["draining"] is True
    # A draining worker takes no new session: the request waits.
    client = h.client()
    client.send(*open_message("s1"))
    assert h.status(via=client)["queue"] == 1
    assert entry["stats"]["mean_batch"] == 2.5


def test_client_heartbeat_gets_the_boot_id(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    w = h.worker("w0")
    w.send(register_header(0, 4))
    boot = h.expect(w, MsgType.REGISTERED).header.fields["boot"]
    client = h.client()
    client.send(Header(MsgType.HEARTBEAT))
    reply = h.expect(client, MsgType.HEARTBEAT)
    assert reply.header.fields["boot"] == boot
