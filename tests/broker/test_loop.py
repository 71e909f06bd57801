"""The broker over real sockets: a Broker runs in a thread; fake workers and clients are
DEALER sockets the test drives by hand, so every message is visible and scripted.

No torch here: the broker runs without the ML stack. Waits are bounded and generous;
nothing asserts how long anything took (the cost of STATUS with 300 workers is counted
in lines of Python, not seconds).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack
import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from tests.broker.test_registry import steps
from zmqllm.broker.loop import Broker
from zmqllm.broker.session_table import MAX_ATTEMPTS, SessionTable
from zmqllm.bus.keys import BrokerKeys, PeerKeys, as_client
from zmqllm.bus.messages import (
    Activation,
    Cancel,
    Close,
    Disconnect,
    Error,
    ErrorCode,
    Finish,
    Heartbeat,
    Message,
    Open,
    Refused,
    Register,
    Registered,
    Status,
    StatusReply,
    Step,
    Token,
)
from zmqllm.bus.protocol import MAX_FRAMES, PROTOCOL_VERSION, decode, encode
from zmqllm.bus.sampling_params import SamplingParams
from zmqllm.bus.wire_types import MAX_ID_LEN, payload
from zmqllm.config.settings import BrokerSettings
from zmqllm.version import __version__

# Longest wait for one expected message. Generous: a loaded CI machine may stall a thread
# for a while, and a correct broker answers long before this anyway.
TIMEOUT = 10.0
INTERVAL = 0.1  # broker heartbeat interval in most tests: ticks (queue, liveness) come fast
KEEPALIVE = 0.05  # how often fake workers heartbeat while the test waits on something

SUMMARY: dict[str, Any] = {"num_layers": 4, "hidden_size": 64, "sliding_window": 8}
HIDDEN = 64

M = TypeVar("M", bound=Message)


SEND_TIMEOUT_MS = 5000


@dataclass
class Peer:
    """A DEALER playing a worker or a client."""

    name: str
    sock: zmq.Socket
    keepalive: bool = False  # heartbeat the broker whenever the test waits
    last: list[bytes] = field(default_factory=list)  # raw frames of the last expected message
    # What this worker's heartbeats say (each heartbeat replaces the last one's).
    load: dict[str, Any] = field(default_factory=dict)
    draining: bool = False

    def beat(self) -> None:
        self.send(Heartbeat(load=self.load or None, draining=self.draining))

    def send(self, msg: Message) -> None:
        self.sock.send_multipart(encode(msg))

    def send_raw(self, frames: Sequence[bytes]) -> None:
        self.sock.send_multipart(list(frames))


class Harness:
    """One broker in a thread plus the peers a test creates; ``close`` ends it all."""

    def __init__(
        self,
        keys: BrokerKeys | None = None,
        client_keys: PeerKeys | None = None,
        worker_keys: PeerKeys | None = None,
        **settings: Any,
    ) -> None:
        # With keys: CURVE on both sockets; peers use these pairs unless told otherwise.
        self.client_keys, self.worker_keys = client_keys, worker_keys
        values: dict[str, Any] = dict(
            frontend="tcp://127.0.0.1:0",
            backend="tcp://127.0.0.1:0",
            heartbeat_interval=INTERVAL,
            # 3 s without a heartbeat: only the liveness tests want a short horizon.
            heartbeat_liveness=30,
            queue_timeout=30.0,
        )
        values.update(settings)
        # A private context: term() at the end proves every socket was closed.
        self.ctx = zmq.Context()
        self.broker = Broker(BrokerSettings(**values), context=self.ctx, keys=keys)
        self.frontend, self.backend = self.broker.endpoints
        self.peers: list[Peer] = []
        self._next_keepalive = 0.0
        self._marker = 0
        self.crashed: BaseException | None = None  # what ended the broker's loop, if anything
        self.thread = threading.Thread(target=self._run, name="broker", daemon=True)
        self.thread.start()
        self.admin = self.client("admin")

    def _run(self) -> None:
        try:
            self.broker.run()
        except BaseException as exc:
            self.crashed = exc
            raise

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
        # Whatever a test sent, the loop ended only because it was asked to.
        assert self.crashed is None, f"the broker died: {self.crashed!r}"

    # -- peers ---------------------------------------------------------------------------
    def _dealer(
        self, name: str, address: str, options: dict[int, int], curve: PeerKeys | None = None
    ) -> Peer:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # A DEALER with no completed connection (a refused handshake) blocks on send:
        # a test then fails with zmq.Again instead of hanging.
        sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        sock.setsockopt(zmq.IDENTITY, name.encode())
        if curve is not None:
            as_client(sock, curve)
        for option, value in options.items():
            sock.setsockopt(option, value)
        sock.connect(address)
        peer = Peer(name, sock)
        self.peers.append(peer)
        return peer

    def client(self, name: str = "client", curve: PeerKeys | None = None, **options: int) -> Peer:
        """A frontend peer; ``options`` are zmq socket options by name (RCVHWM=10)."""
        return self._dealer(name, self.frontend, _options(options), curve or self.client_keys)

    def worker(self, name: str, curve: PeerKeys | None = None, **options: int) -> Peer:
        return self._dealer(name, self.backend, _options(options), curve or self.worker_keys)

    def register(
        self, name: str, start: int, end: int, curve: PeerKeys | None = None, **kw: Any
    ) -> Peer:
        w = self.worker(name, curve)
        w.send(register_msg(start, end, **kw))
        assert self.expect(w, Registered).worker_id == name
        w.keepalive = True
        return w

    # -- receiving -----------------------------------------------------------------------
    def keep_alive(self) -> None:
        now = time.monotonic()
        if now < self._next_keepalive:
            return
        self._next_keepalive = now + KEEPALIVE
        for p in self.peers:
            if p.keepalive:
                p.beat()

    def expect(self, peer: Peer, kind: type[M], timeout: float = TIMEOUT) -> M:
        """The next message to ``peer`` other than a broker heartbeat; it must be a
        ``kind``. Keeps the fake workers alive meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            self.keep_alive()
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{peer.name}: no {kind.__name__} within {timeout}s")
            if not peer.sock.poll(int(min(left, KEEPALIVE) * 1000) + 1):
                continue
            frames = peer.sock.recv_multipart()
            msg = decode(frames)
            if isinstance(msg, Heartbeat) and kind is not Heartbeat:
                continue
            assert isinstance(msg, kind), f"{peer.name}: expected {kind.__name__}, got {msg}"
            peer.last = frames
            return msg

    def pending(self, peer: Peer) -> list[Message]:
        """Every message already waiting for ``peer``, heartbeats left out."""
        out: list[Message] = []
        while peer.sock.poll(0):
            msg = decode(peer.sock.recv_multipart())
            if not isinstance(msg, Heartbeat):
                out.append(msg)
        return out

    def sync(self, worker: Peer) -> None:
        """Return once the broker has handled everything ``worker`` sent so far: messages
        of one socket are handled in order, so a marker in its heartbeat load proves it."""
        self._marker += 1
        marker = self._marker
        worker.load = {"forwards": marker}
        worker.beat()
        self.wait_status(
            lambda st: any(w["stats"].get("forwards") == marker for w in st["workers"]),
            f"the broker never handled {worker.name}'s marker",
        )

    def status(self, via: Peer | None = None) -> dict[str, Any]:
        """Ask over ``via`` (default the admin client): on the same socket as an earlier
        request, the broker handles that request first."""
        peer = via or self.admin
        peer.send(Status(request_id="st"))
        reply = self.expect(peer, StatusReply)
        assert reply.request_id == "st"
        return reply.status()

    def wait_status(self, done: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        """The first status for which ``done`` holds (messages of different peers are
        handled in no promised order, so a test waits for their effect)."""
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            st = self.status()
            if done(st):
                return st
            time.sleep(0.01)
        raise AssertionError(what)


def _options(named: dict[str, int]) -> dict[int, int]:
    return {getattr(zmq, k): v for k, v in named.items()}


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


def register_msg(
    start: int,
    end: int,
    *,
    digest: str = "fp-1",
    summary: dict[str, Any] | None = None,
    capacity: int = 4,
    num_layers: int = 4,
    max_kv_tokens: int = 4096,
    context: int = 1024,
    version: str = __version__,
    build: dict[str, Any] | None = None,
    served: str = "m",
) -> Register:
    return Register(
        start=start,
        end=end,
        num_layers=num_layers,
        capacity=capacity,
        max_kv_tokens=max_kv_tokens,
        context=context,
        version=version,
        fingerprint=digest,
        model=summary if summary is not None else SUMMARY,
        host="test-host",
        pid=4242,
        build=build if build is not None else {},
        served=served,
    )


def request_id_of(session: str) -> str:
    return f"req-{session}"[:MAX_ID_LEN]


def open_msg(
    session: str, prompt: Sequence[int] = (5, 6, 7), max_tokens: int = 4, **fields: Any
) -> Open:
    tokens = np.asarray(prompt, dtype=np.int32)
    values: dict[str, Any] = dict(
        session=session,
        request_id=request_id_of(session),
        max_tokens=max_tokens,
        prompt_len=len(tokens),
        sampling=SamplingParams(temperature=0.0),
        stop_ids=(2,),
        tokens=payload(tokens),
    )
    values.update(fields)
    return Open(**values)


@dataclass(frozen=True)
class Wire:
    """How the route knows one attempt of a session: the broker's id, the attempt."""

    session: str
    attempt: int
    request_id: str

    @classmethod
    def of(cls, msg: Open) -> Wire:
        return cls(msg.session, msg.attempt, msg.request_id)

    def token(self, step: int, token: int, finish: Finish | None = None, **kw: Any) -> Token:
        return Token(
            session=self.session,
            attempt=self.attempt,
            request_id=self.request_id,
            step=step,
            token=token,
            finish=finish,
            **kw,
        )

    def activation(self, step: int, rows: int) -> Activation:
        hidden = np.random.default_rng(step).standard_normal((rows, HIDDEN)).astype(np.float32)
        return Activation(
            session=self.session,
            attempt=self.attempt,
            request_id=self.request_id,
            step=step,
            hidden=payload(hidden),
        )

    def close(self) -> Close:
        return Close(session=self.session, attempt=self.attempt, request_id=self.request_id)


def pipeline(h: Harness) -> tuple[Peer, Peer, Peer]:
    """A client and a registered 2-stage pipeline (layers 0:2 and 2:4)."""
    return h.client(), h.register("w0", 0, 2), h.register("w1", 2, 4)


def open_on(h: Harness, client: Peer, stages: Sequence[Peer], session: str, **kw: Any) -> Wire:
    """Open a session and wait until every stage has its OPEN; its wire id and attempt."""
    client.send(open_msg(session, **kw))
    return expect_open(h, stages)


def expect_open(h: Harness, stages: Sequence[Peer]) -> Wire:
    wires = {Wire.of(h.expect(w, Open)) for w in stages}
    assert len(wires) == 1, f"the stages got different OPENs: {wires}"
    return wires.pop()


def stream_token(h: Harness, client: Peer, last: Peer, stage0: Peer, wire: Wire, step: int) -> int:
    """The last stage samples a token: the client gets it and stage 0 the next step."""
    token = 100 + step
    last.send(wire.token(step, token))
    assert h.expect(client, Token).token == token
    assert h.expect(stage0, Step) == Step(
        session=wire.session,
        attempt=wire.attempt,
        request_id=wire.request_id,
        step=step + 1,
        token=token,
    )
    return token


def header(**fields: Any) -> bytes:
    """A raw header frame, for what ``encode`` refuses to build."""
    head: dict[str, Any] = {"v": PROTOCOL_VERSION, **fields}
    packed: bytes = msgpack.packb(head, use_bin_type=True)
    return packed


def idle(st: dict[str, Any]) -> bool:
    """Nothing left: no session, nothing queued, nothing reserved on any worker."""
    return (
        st["sessions"] == 0
        and st["queue"] == 0
        and all(w["sessions"] == 0 and w["kv_tokens_reserved"] == 0 for w in st["workers"])
    )


# -- registration ------------------------------------------------------------------------


def test_register_gets_registered_with_the_boot_id(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    w = h.worker("w0")
    w.send(register_msg(0, 4))
    assert h.expect(w, Registered) == Registered(worker_id="w0", boot=h.broker.boot)
    st = h.status()
    assert [x["id"] for x in st["workers"]] == ["w0"]
    assert st["workers"][0]["layers"] == [0, 4]
    assert st["workers"][0]["info"]["host"] == "test-host"
    assert st["workers"][0]["info"]["pid"] == 4242
    assert st["num_layers"] == 4
    assert st["complete_route"] is True


def test_a_worker_of_another_model_is_refused_naming_the_difference(
    cluster: Callable[..., Harness],
) -> None:
    h = cluster()
    h.register("w0", 0, 2)
    other = h.worker("w1")
    other.send(register_msg(2, 4, digest="fp-2", summary=dict(SUMMARY, sliding_window=4)))
    assert "sliding_window: 8 != 4" in h.expect(other, Refused).reason
    # The cluster is unharmed: the first worker stays, the refused one never joined.
    st = h.status()
    assert [x["id"] for x in st["workers"]] == ["w0"]
    assert st["complete_route"] is False
    assert st["dropped"]["backend:refused"] == 1


def test_a_worker_of_another_version_is_refused(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    w = h.worker("w0")
    w.send(register_msg(0, 4, version="0.0.0-other"))
    assert "0.0.0-other" in h.expect(w, Refused).reason
    assert h.status()["workers"] == []


def test_a_register_of_another_protocol_version_is_refused_naming_both(
    cluster: Callable[..., Harness],
) -> None:
    h = cluster()
    w = h.worker("w0")
    head, *rest = encode(register_msg(0, 4))
    fields = msgpack.unpackb(head)
    w.send_raw([msgpack.packb({**fields, "v": PROTOCOL_VERSION + 1}), *rest])
    reason = h.expect(w, Refused).reason
    assert (
        f"protocol version {PROTOCOL_VERSION + 1} differs from the broker's {PROTOCOL_VERSION}"
        in reason
    )
    # Any other message of another version is only dropped (and counted).
    w.send_raw([header(type="status", v=PROTOCOL_VERSION + 99)])
    st = h.wait_status(
        lambda s: s["dropped"].get("backend:version") == 2, "the second message not counted"
    )
    assert st["workers"] == []


def test_a_replica_of_another_quant_or_dtype_is_refused(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    first = h.worker("w0")
    first.send(register_msg(0, 4, build={"quant": "int8", "dtype": "float32", "torch": "2.13.0"}))
    h.expect(first, Registered)
    for key, value in (("quant", "int4"), ("dtype", "bfloat16")):
        other = h.worker(f"w-{key}")
        build = {"quant": "int8", "dtype": "float32", key: value}
        other.send(register_msg(0, 4, build=build))
        reason = h.expect(other, Refused).reason
        assert f"{key} {value} differs from its pool's" in reason and "w0" in reason
    # Another layer range is another pool: its quant is its own business.
    elsewhere = h.worker("w-half")
    elsewhere.send(register_msg(0, 2, build={"quant": "int4", "dtype": "float32"}))
    h.expect(elsewhere, Registered)


def test_replicas_that_differ_elsewhere_join_and_show_as_drift(
    cluster: Callable[..., Harness],
) -> None:
    h = cluster()
    same = {"quant": "none", "dtype": "float32", "python": "3.11.7"}
    for name, torch_version in (("w0", "2.13.0"), ("w1", "2.13.0"), ("w2", "2.12.1")):
        w = h.worker(name)
        w.send(register_msg(0, 4, build={**same, "torch": torch_version}))
        h.expect(w, Registered)
    st = h.status()
    assert st["drift"] == [
        {
            "model": "m",
            "layers": [0, 4],
            "field": "torch",
            "values": {"2.13.0": ["w0", "w1"], "2.12.1": ["w2"]},
            "workers": 3,
        }
    ]
    assert {w["id"]: w["build"]["torch"] for w in st["workers"]}["w2"] == "2.12.1"


def test_a_message_from_an_unknown_worker_gets_disconnect(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    w = h.worker("stranger")
    w.send(Heartbeat())
    assert "register" in h.expect(w, Disconnect).reason


# -- one session's path ------------------------------------------------------------------


def test_a_session_flows_through_both_stages(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    client, w0, w1 = pipeline(h)
    sent_open = open_msg("s1", prompt=[5, 6, 7], max_tokens=2)
    client.send(sent_open)

    # Every stage gets the OPEN with its position on the route, under the broker's wire
    # id for the session (not the client's: two clients may both call theirs "s1").
    open1 = h.expect(w1, Open)
    assert open1.tokens is None
    assert (open1.stage, open1.stages, open1.next) == (1, 2, "w0")  # STEPs go to stage 0
    open0 = h.expect(w0, Open)
    assert open0.session == open1.session != "s1"
    assert open0.attempt == open1.attempt == 1
    assert open0.request_id == "req-s1"
    assert (open0.stage, open0.stages, open0.next) == (0, 2, "w1")
    assert open0.max_len == 3 + 2
    assert open0.max_tokens == 2
    assert open0.sampling == SamplingParams(temperature=0.0)
    assert open0.stop_ids == (2,)
    assert open0.tokens is not None
    assert w0.last[1] == sent_open.tokens.array.tobytes()  # type: ignore[union-attr]
    wire = Wire.of(open0)

    # Stage 0's activations reach stage 1 byte for byte, header included.
    act = wire.activation(0, rows=3)
    sent = [bytes(f) for f in encode(act)]
    w0.send_raw(sent)
    got = h.expect(w1, Activation)
    assert w1.last == sent
    np.testing.assert_array_equal(got.hidden.array, act.hidden.array)

    # A token that does not finish: to the client (with the route and the broker's boot
    # on step 0) under the client's session id, and the next step straight to stage 0
    # with the group it was computed in.
    w1.send(wire.token(0, 42, group=("w-x/7/w0", 3)))
    first = h.expect(client, Token)
    # ... and the route's build, hop for hop (route_build.py).
    assert [hop.rpartition(":")[0] for hop in first.build or ()] == ["0:2", "2:4"]
    assert dataclasses.replace(first, build=None) == Token(
        session="s1",
        request_id="req-s1",
        step=0,
        token=42,
        route=("w0", "w1"),
        boot=h.broker.boot,
    )
    assert h.expect(w0, Step) == Step(
        session=wire.session,
        attempt=1,
        request_id="req-s1",
        step=1,
        token=42,
        group=("w-x/7/w0", 3),
    )

    # The last token: to the client, then every stage frees the session.
    w1.send(wire.token(1, 43, Finish.LENGTH))
    assert h.expect(client, Token) == Token(
        session="s1", request_id="req-s1", step=1, token=43, finish=Finish.LENGTH
    )
    assert h.expect(w0, Close) == wire.close()
    assert h.expect(w1, Close) == wire.close()

    st = h.status()
    assert idle(st)
    assert st["counters"]["sessions_opened"] == 1
    assert st["counters"]["sessions_finished"] == 1
    assert st["counters"]["tokens"] == 2


def test_two_clients_may_use_the_same_session_id(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    a, w0, w1 = pipeline(h)
    b = h.client("other")
    wa = open_on(h, a, [w1, w0], "s1")
    wb = open_on(h, b, [w1, w0], "s1")
    assert wa.session != wb.session
    w1.send(wb.token(0, 7, Finish.STOP))
    assert h.expect(b, Token).token == 7
    w1.send(wa.token(0, 8, Finish.STOP))
    assert h.expect(a, Token).token == 8
    assert idle(h.wait_status(idle, "sessions left open"))


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


def test_cancel_tells_the_client_and_closes_every_stage(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    client, w0, w1 = pipeline(h)
    wire = open_on(h, client, [w1, w0], "s1")
    client.send(Cancel(session="s1", request_id="req-s1"))
    err = h.expect(client, Error)
    assert (err.session, err.code, err.request_id) == ("s1", ErrorCode.CANCELLED, "req-s1")
    assert h.expect(w0, Close) == wire.close()
    assert h.expect(w1, Close) == wire.close()
    st = h.status(via=client)
    assert idle(st)
    assert st["counters"]["sessions_finished"] == 1


def test_a_token_after_cancel_is_dropped(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    client, w0, w1 = pipeline(h)
    wire = open_on(h, client, [w1, w0], "s1")
    client.send(Cancel(session="s1"))
    assert h.expect(client, Error).code is ErrorCode.CANCELLED
    h.expect(w1, Close)
    # A token already in flight when the session ended: not forwarded, no STEP.
    w1.send(wire.token(0, 42))
    h.sync(w1)
    # The client's next message is the status reply (expect fails on a stray token).
    assert h.status(via=client)["counters"]["tokens"] == 0
    # Stage 0's next message is the CLOSE, not a STEP.
    assert h.expect(w0, Close) == wire.close()


def test_a_worker_error_fails_the_session(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    client, w0, w1 = pipeline(h)
    wire = open_on(h, client, [w1, w0], "s1")
    w1.send(Error.of(ErrorCode.INTERNAL, "boom", wire.session, attempt=wire.attempt))
    err = h.expect(client, Error)
    assert (err.session, err.code, err.message) == ("s1", ErrorCode.INTERNAL, "boom")
    assert h.expect(w0, Close) == wire.close()
    assert h.expect(w1, Close) == wire.close()
    st = h.status()
    assert st["counters"]["sessions_failed"] == 1
    assert idle(st)


def test_an_undecodable_open_is_dropped_and_counted(cluster: Callable[..., Harness]) -> None:
    # The broker cannot trust the session id of a message it cannot decode, so it tells
    # no one (the client's own deadline ends its wait) and counts it.
    h = cluster()
    client, _, _ = pipeline(h)
    bad = [
        open_msg(""),  # no session id
        open_msg("s1.2"),  # "." is not an id character
        open_msg("s" * (MAX_ID_LEN + 1)),
        open_msg("s1", prompt=[5, 6], prompt_len=3),  # ids disagree with prompt_len
        open_msg("s1", max_tokens=0),
    ]
    for msg in bad:
        client.send(msg)
    st = h.status(via=client)  # the client's next message is the status reply
    assert st["dropped"]["frontend:malformed"] == len(bad)
    assert st["sessions"] == st["queue"] == 0


@pytest.mark.parametrize(
    ("msg", "problem"),
    [
        (open_msg("s1", prompt=[5, 6], max_tokens=1023), "context"),
        (open_msg("s1", tokens=None), "token ids"),
    ],
)
def test_a_bad_open_gets_bad_request(
    cluster: Callable[..., Harness], msg: Open, problem: str
) -> None:
    h = cluster()
    client, _, _ = pipeline(h)
    client.send(msg)
    err = h.expect(client, Error)
    assert (err.session, err.code) == ("s1", ErrorCode.BAD_REQUEST)
    assert problem in err.message
    assert h.status(via=client)["sessions"] == 0


def test_a_second_open_of_the_same_session_gets_bad_request(
    cluster: Callable[..., Harness],
) -> None:
    h = cluster()
    client, w0, w1 = pipeline(h)
    open_on(h, client, [w1, w0], "s1")
    client.send(open_msg("s1"))
    err = h.expect(client, Error)
    assert err.code is ErrorCode.BAD_REQUEST
    assert "already open" in err.message
    assert h.status(via=client)["sessions"] == 1


# -- queueing ----------------------------------------------------------------------------


def test_open_without_a_route_waits_then_fails_with_no_capacity(
    cluster: Callable[..., Harness],
) -> None:
    h = cluster(queue_timeout=0.5)
    client = h.client()
    h.register("w0", 0, 2)  # layers 2:4 have no worker
    client.send(open_msg("s1"))
    st = h.status(via=client)  # same socket: the OPEN was handled first
    assert st["queue"] == 1
    assert st["sessions"] == 0
    assert st["complete_route"] is False
    err = h.expect(client, Error)
    assert (err.session, err.code) == ("s1", ErrorCode.NO_CAPACITY)
    assert "2:4" in err.message
    assert h.status()["queue"] == 0


def test_open_with_no_worker_at_all_fails_with_no_capacity(
    cluster: Callable[..., Harness],
) -> None:
    h = cluster(queue_timeout=0.5)
    client = h.client()
    client.send(open_msg("s1"))
    err = h.expect(client, Error)
    assert err.code is ErrorCode.NO_CAPACITY
    assert "no worker" in err.message


def test_a_queued_request_is_served_when_the_missing_worker_registers(
    cluster: Callable[..., Harness],
) -> None:
    h = cluster()
    client = h.client()
    w0 = h.register("w0", 0, 2)
    msg = open_msg("s1")
    client.send(msg)
    assert h.status(via=client)["queue"] == 1

    w1 = h.register("w1", 2, 4)
    expect_open(h, [w1, w0])
    assert w0.last[1] == msg.tokens.array.tobytes()  # type: ignore[union-attr]
    st = h.status()
    assert (st["queue"], st["sessions"]) == (0, 1)


def test_a_full_queue_answers_busy(cluster: Callable[..., Harness]) -> None:
    h = cluster(queue_size=1)
    client = h.client()
    client.send(open_msg("s1"))  # waits: no worker at all
    client.send(open_msg("s2"))
    err = h.expect(client, Error)
    assert (err.session, err.code) == ("s2", ErrorCode.BUSY)
    assert h.status(via=client)["queue"] == 1


def test_a_cancelled_queued_request_leaves_the_queue(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    client = h.client()
    h.register("w0", 0, 2)
    client.send(open_msg("s1"))
    client.send(Cancel(session="s1"))
    err = h.expect(client, Error)
    assert (err.session, err.code) == ("s1", ErrorCode.CANCELLED)
    assert h.status(via=client)["queue"] == 0


# -- failures ----------------------------------------------------------------------------


def test_a_silent_worker_is_removed_and_its_sessions_fail(
    cluster: Callable[..., Harness],
) -> None:
    # Horizon 5 x 0.2 s: the worker keeps heartbeating until its session is open.
    h = cluster(heartbeat_interval=0.2, heartbeat_liveness=5)
    client = h.client()
    w = h.register("w0", 0, 4)
    wire = open_on(h, client, [w], "s1")
    # A token has reached the client: the session cannot start over elsewhere.
    stream_token(h, client, w, w, wire, 0)
    w.keepalive = False  # the worker hangs from here on

    err = h.expect(client, Error)
    assert (err.session, err.code) == ("s1", ErrorCode.WORKER_LOST)
    assert "stopped answering" in err.message
    st = h.status()
    assert st["workers"] == []
    assert idle(st)
    assert st["counters"]["sessions_failed"] == 1


def test_a_leaving_worker_fails_its_sessions(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    client, w0, w1 = pipeline(h)
    wire = open_on(h, client, [w1, w0], "s1")
    stream_token(h, client, w1, w0, wire, 0)
    w1.send(Disconnect(reason="worker shutting down"))
    err = h.expect(client, Error)
    assert err.code is ErrorCode.WORKER_LOST
    assert "shutting down" in err.message
    # The surviving stage frees the session.
    assert h.expect(w0, Close) == wire.close()
    st = h.status()
    assert [x["id"] for x in st["workers"]] == ["w0"]
    assert idle(st)


# A client's session id of the greatest length: a retry must not make it longer (the old
# "<id>.2" retry id of a 128-character id was illegal and killed the broker in tick()).
LONG_ID = ("Ab0_-" * MAX_ID_LEN)[:MAX_ID_LEN]


@pytest.mark.parametrize("how", ["leaves", "goes silent"])
def test_a_worker_lost_before_the_first_token_requeues_the_request(
    cluster: Callable[..., Harness], how: str
) -> None:
    # No token has reached the client: the request starts again on another replica
    # (e.g. a drained worker left while the OPEN for it was on its way). Going silent is
    # noticed in the broker's tick, leaving in its message handler.
    h = cluster(heartbeat_interval=0.2, heartbeat_liveness=5)
    client = h.client()
    wa = h.register("wa", 0, 4)
    wb = h.register("wb", 0, 4)
    msg = open_msg(LONG_ID)
    client.send(msg)
    first = Wire.of(h.expect(wa, Open))  # equal load: the lowest id
    assert first.attempt == 1
    if how == "leaves":
        wa.send(Disconnect(reason="worker shutting down"))
    else:
        wa.keepalive = False
    again = Wire.of(h.expect(wb, Open))
    assert again.attempt == 2
    assert again.request_id == first.request_id == request_id_of(LONG_ID)
    assert wb.last[1] == msg.tokens.array.tobytes()  # type: ignore[union-attr]
    wb.send(again.token(0, 9, Finish.STOP))
    tok = h.expect(client, Token)  # the client never saw the loss
    assert (tok.session, tok.route) == (LONG_ID, ("wb",))
    assert h.expect(wb, Close) == again.close()
    st = h.status()
    assert st["counters"]["sessions_failed"] == 0
    assert [x["id"] for x in st["workers"]] == ["wb"]
    assert idle(st)
    assert h.thread.is_alive()


def test_a_worker_registering_again_fails_its_sessions(cluster: Callable[..., Harness]) -> None:
    # A worker that reconnected has dropped its caches: its sessions cannot go on.
    h = cluster()
    client = h.client()
    w = h.register("w0", 0, 4)
    wire = open_on(h, client, [w], "s1")
    stream_token(h, client, w, w, wire, 0)
    w.send(register_msg(0, 4))
    assert h.expect(w, Registered).worker_id == "w0"
    err = h.expect(client, Error)
    assert err.code is ErrorCode.WORKER_LOST
    st = h.status()
    assert [x["id"] for x in st["workers"]] == ["w0"]
    assert idle(st)


def test_full_during_open_requeues_on_another_replica(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    client = h.client()
    # Equal load: the lowest id goes first, so w0a is tried first.
    w0a = h.register("w0a", 0, 2)
    w0b = h.register("w0b", 0, 2)
    w1 = h.register("w1", 2, 4)
    msg = open_msg(LONG_ID)
    client.send(msg)
    first = expect_open(h, [w1, w0a])

    w0a.send(Error.of(ErrorCode.FULL, "stage full: 4/4 sessions", first.session, attempt=1))
    # The first route is undone on both of its stages...
    assert h.expect(w0a, Close) == first.close()
    assert h.expect(w1, Close) == first.close()
    # ... and the session opens again on the other replica, with the same prompt, as
    # attempt 2: messages of the first attempt still in flight now match nothing.
    again = expect_open(h, [w1, w0b])
    assert again.attempt == 2
    assert w0b.last[1] == msg.tokens.array.tobytes()  # type: ignore[union-attr]

    w0a.send(first.activation(0, rows=3))  # stale: from the undone attempt
    w0b.send(again.activation(0, rows=3))
    assert h.expect(w1, Activation).attempt == 2
    w1.send(again.token(0, 9, Finish.STOP))
    tok = h.expect(client, Token)
    # The client never saw the refusal: its first message is the token.
    assert (tok.session, tok.route) == (LONG_ID, ("w0b", "w1"))
    # Nothing of either attempt is left holding a place or KV tokens.
    st = h.wait_status(idle, "a finished request still holds its reservation")
    assert st["counters"]["sessions_failed"] == 0


def test_a_request_every_replica_refuses_as_full_fails_and_holds_nothing(
    cluster: Callable[..., Harness],
) -> None:
    h = cluster()
    client = h.client()
    workers = [h.register("wa", 0, 4), h.register("wb", 0, 4)]
    client.send(open_msg(LONG_ID))
    attempts: list[int] = []
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        # Each attempt goes to one replica (whichever is not backing off); it says full.
        h.keep_alive()
        for w in workers:
            for msg in h.pending(w):
                if isinstance(msg, Open):
                    attempts.append(msg.attempt)
                    w.send(Error.of(ErrorCode.FULL, "full", msg.session, attempt=msg.attempt))
        if client.sock.poll(10):
            break
    err = h.expect(client, Error)
    assert (err.session, err.code) == (LONG_ID, ErrorCode.NO_CAPACITY)
    assert attempts == list(range(1, MAX_ATTEMPTS + 1))
    st = h.wait_status(idle, "a refused request still holds its reservation")
    assert st["counters"]["sessions_failed"] == 1


# -- hostile and broken input ------------------------------------------------------------


def malformed_messages() -> list[list[bytes]]:
    """Messages a broker must drop, each as the frames a peer sends."""
    status = encode(Status())[0]
    return [
        [b"\x00\x01garbage\xff"],  # bytes after a complete msgpack value
        [b"\xc1"],  # never valid msgpack
        [msgpack.packb([1, 2])],  # msgpack, but not a map
        [header(type="no-such-type")],
        [status, b"an extra frame no tensor declares"],
        [header(type="status", tensors=[["float32", [2]]])],  # tensor but no frame
        [b""],  # a single empty frame
        [header(type="heartbeat", load={"forwards": float("nan")})],
        [header(type="error", code=5, message="x")],
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
    assert st["dropped"]["frontend:malformed"] == len(bad)
    assert st["dropped"]["backend:malformed"] == len(bad)
    assert st["counters"]["dropped_messages"] == 2 * len(bad)
    assert [x["id"] for x in st["workers"]] == ["w0", "w1"]

    # A normal request still works end to end.
    wire = open_on(h, client, [w1, w0], "s1", max_tokens=1)
    w0.send(wire.activation(0, rows=3))
    h.expect(w1, Activation)
    w1.send(wire.token(0, 7, Finish.LENGTH))
    assert h.expect(client, Token).token == 7


# Tensor specs that lie about their payload; each comes with an empty payload frame. The
# first made numpy raise a plain ValueError that killed the broker.
LYING_SPECS = [
    ["float32", [0, 2**64 - 1]],
    ["float32", [2**64 - 1, 0]],
    ["float32", [0, 2**30]],  # a legal spec: 0 rows, which no activation has
    ["float32", [-1, 64]],
    ["float32", [2**20, 2**20]],  # 4 TiB claimed
    ["float64", [0, 64]],
    ["float32", [0, 1, 1, 1, 1]],
    ["float32", "0,64"],
]


def test_lying_tensor_specs_are_dropped_on_both_sockets_and_the_stream_goes_on(
    cluster: Callable[..., Harness],
) -> None:
    h = cluster()
    client, w0, w1 = pipeline(h)
    wire = open_on(h, client, [w1, w0], "s1", max_tokens=8)
    stream_token(h, client, w1, w0, wire, 0)
    for spec in LYING_SPECS:
        # Each names the live session, as its own client and its own stage would.
        fields = dict(session=wire.session, attempt=wire.attempt, step=1, tensors=[spec])
        w0.send_raw([header(type="activation", **fields), b""])
        opening = dict(session="s1", max_tokens=4, prompt_len=3, tensors=[spec])
        client.send_raw([header(type="open", **opening), b""])
    h.sync(w0)
    st = h.status(via=client)
    assert st["dropped"]["backend:malformed"] == len(LYING_SPECS)
    assert st["dropped"]["frontend:malformed"] == len(LYING_SPECS)
    assert not any(k.startswith("error:") for k in st["dropped"])
    assert h.thread.is_alive()
    # The session they named goes on as if nothing had been sent.
    assert st["sessions"] == 1
    w0.send(wire.activation(1, rows=1))
    assert h.expect(w1, Activation).step == 1
    stream_token(h, client, w1, w0, wire, 1)
    w1.send(wire.token(2, 5, Finish.STOP))
    assert h.expect(client, Token).finish is Finish.STOP


@pytest.mark.parametrize("side", ["frontend", "backend"])
def test_a_message_of_too_many_frames_is_dropped_and_the_next_one_handled(
    cluster: Callable[..., Harness], side: str
) -> None:
    h = cluster()
    client, w0, w1 = pipeline(h)
    wire = open_on(h, client, [w1, w0], "s1")
    peer = client if side == "frontend" else w1
    status = encode(Status())[0]
    peer.send_raw([status] + [b"x"] * MAX_FRAMES)  # one frame too many
    peer.send_raw([status] + [b""] * 10_000)
    # The next message on the same socket is handled.
    if side == "frontend":
        st = h.status(via=client)
    else:
        stream_token(h, client, w1, w0, wire, 0)
        st = h.status()
    assert st["dropped"][f"{side}:frames"] == 2
    assert h.thread.is_alive()


def test_message_size_limits_are_per_socket(cluster: Callable[..., Harness]) -> None:
    # ZeroMQ drops the connection of a peer sending more than its socket takes, before
    # the broker reads any of it; the frontend takes far less than activations need.
    h = cluster(frontend_max_message_bytes=4096, max_message_bytes=8 << 20)
    client, w0, w1 = pipeline(h)
    wire = open_on(h, client, [w1, w0], "s1")
    big = h.client("big")
    monitor = big.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        big.send(open_msg("huge", prompt=[1] * (64 << 10), max_tokens=1))  # 256 KiB
        assert monitor.poll(int(TIMEOUT * 1000)), "the oversized peer was not disconnected"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    finally:
        big.sock.disable_monitor()
        monitor.close(linger=0)
    # A 1 MiB activation is well within what the backend takes.
    act = Activation(
        session=wire.session,
        attempt=wire.attempt,
        step=0,
        hidden=payload(np.ones((4096, HIDDEN), np.float32)),
    )
    w0.send(act)
    got = h.expect(w1, Activation)
    assert got.hidden.array.shape == (4096, HIDDEN)
    st = h.status(via=client)
    assert st["sessions"] == 1
    assert h.thread.is_alive()


def test_a_client_sending_a_worker_verb_gets_bad_request(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    client, w0, w1 = pipeline(h)
    wire = open_on(h, client, [w1, w0], "s1")
    # A client naming its own session by its wire id is still not a worker.
    client.send(wire.token(0, 1))
    err = h.expect(client, Error)
    assert err.code is ErrorCode.BAD_REQUEST
    assert h.status(via=client)["sessions"] == 1


def test_worker_messages_for_unknown_or_foreign_sessions_are_ignored(
    cluster: Callable[..., Harness],
) -> None:
    h = cluster()
    client, w0, w1 = pipeline(h)
    spare = h.register("w9", 2, 4)  # a replica of stage 1, not on this route
    wire = open_on(h, client, [w1, w0], "s1")
    unknown = Wire("no-such-session", 1, "req-x")
    stale = Wire(wire.session, wire.attempt + 1, wire.request_id)
    by_client_id = Wire("s1", wire.attempt, wire.request_id)
    # Unknown ids, another attempt, the client's id instead of the wire id, a worker
    # that is not on the route, the wrong stage for the message: none of them has any
    # effect on the session.
    for w in (w0, w1, spare):
        for other in (unknown, stale, by_client_id):
            w.send(other.token(0, 66))
            w.send(other.activation(0, rows=1))
            w.send(Error.of(ErrorCode.INTERNAL, "boom", other.session, attempt=other.attempt))
    spare.send(wire.token(0, 66))
    spare.send(wire.activation(0, rows=1))
    spare.send(Error.of(ErrorCode.INTERNAL, "boom", wire.session, attempt=wire.attempt))
    w0.send(wire.token(0, 66))  # a token only comes from the last stage
    w1.send(wire.activation(0, rows=1))  # the last stage has no next stage
    w1.send(wire.token(5, 66))  # not the step the session is at
    for w in (w0, w1, spare):
        h.sync(w)
    assert h.pending(w0) == h.pending(w1) == h.pending(spare) == []
    st = h.status(via=client)  # the client got nothing before this reply
    assert st["sessions"] == 1
    assert st["counters"]["tokens"] == 0
    # The session is unharmed.
    stream_token(h, client, w1, w0, wire, 0)
    w0.send(wire.activation(1, rows=1))
    assert h.expect(w1, Activation).step == 1


def test_a_peer_with_a_live_clients_routing_id_cannot_take_over_its_pipe(
    cluster: Callable[..., Harness],
) -> None:
    h = cluster()
    owner, w0, w1 = pipeline(h)  # owner's routing id is "client"
    wire = open_on(h, owner, [w1, w0], "s1")
    impostor = h.client("client")  # the same routing id, from another connection
    impostor.send(Cancel(session="s1"))
    st = h.status()
    assert st["sessions"] == 1  # no handover on the frontend: its cancel never arrived
    assert h.pending(w0) == h.pending(w1) == []
    stream_token(h, owner, w1, w0, wire, 0)  # and the owner still gets its tokens
    w1.send(wire.token(1, 5, Finish.STOP))
    assert h.expect(owner, Token).finish is Finish.STOP


def test_a_cancel_from_another_client_does_not_touch_the_session(
    cluster: Callable[..., Harness],
) -> None:
    h = cluster()
    owner, w0, w1 = pipeline(h)
    wire = open_on(h, owner, [w1, w0], "s1")
    intruder = h.client("intruder")
    intruder.send(Cancel(session="s1"))
    intruder.send(Cancel(session=wire.session))  # the wire id names nothing of its own
    st = h.status(via=intruder)  # its cancels were handled first
    assert st["sessions"] == 1
    assert st["counters"]["sessions_finished"] == st["counters"]["sessions_failed"] == 0
    assert h.pending(w0) == h.pending(w1) == []
    stream_token(h, owner, w1, w0, wire, 0)
    w1.send(wire.token(1, 5, Finish.STOP))
    assert h.expect(owner, Token).finish is Finish.STOP


def test_an_exception_in_a_handler_costs_only_its_session(
    cluster: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    h = cluster()
    client = h.client()
    w = h.register("w0", 0, 4)
    doomed = open_on(h, client, [w], "doomed")
    fine = open_on(h, client, [w], "fine")
    real = SessionTable.on_token
    raised: list[str] = []

    def on_token_once(self: SessionTable, *args: Any) -> Any:
        if not raised:
            raised.append("once")
            raise RuntimeError("a bug in a handler")
        return real(self, *args)

    monkeypatch.setattr(SessionTable, "on_token", on_token_once)
    w.send(doomed.token(0, 1))
    err = h.expect(client, Error)
    assert (err.session, err.code) == ("doomed", ErrorCode.INTERNAL)
    assert h.expect(w, Close) == doomed.close()
    # The broker goes on serving the other session.
    stream_token(h, client, w, w, fine, 0)
    w.send(fine.token(1, 2, Finish.STOP))
    assert h.expect(client, Token).finish is Finish.STOP
    st = h.wait_status(idle, "a session was left open")
    assert st["dropped"]["error:backend:token"] == 1
    assert st["counters"]["sessions_failed"] == 1
    assert st["counters"]["sessions_finished"] == 1
    assert h.thread.is_alive()


def test_an_exception_opening_a_session_tells_its_client(
    cluster: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The request never reached the session table: its client is told all the same,
    # instead of waiting out its own deadline, and nothing of it stays queued.
    h = cluster()
    client = h.client()
    w = h.register("w0", 0, 4)
    real = SessionTable.dispatch
    raised: list[str] = []

    def dispatch_once(self: SessionTable, *args: Any) -> Any:
        # Only for the doomed OPEN: every tick dispatches too, and a tick that came first
        # would take the one failure (seen under load).
        if not raised and any(p.key[1] == "doomed" for p in self.queue):
            raised.append("once")
            raise RuntimeError("a bug in a handler")
        return real(self, *args)

    monkeypatch.setattr(SessionTable, "dispatch", dispatch_once)
    client.send(open_msg("doomed"))
    err = h.expect(client, Error)
    assert (err.session, err.code) == ("doomed", ErrorCode.INTERNAL)
    st = h.status(via=client)
    assert idle(st)
    assert st["dropped"]["error:frontend:open"] == 1
    # The next request is served.
    wire = open_on(h, client, [w], "fine")
    w.send(wire.token(0, 3, Finish.STOP))
    assert h.expect(client, Token).session == "fine"


def test_a_route_gone_silent_fails_the_session_and_frees_every_stage(
    cluster: Callable[..., Harness],
) -> None:
    # The workers keep heartbeating, but no message about the session ever comes back
    # (lost at a full queue, say): it must not hold its slots and KV tokens forever.
    h = cluster(session_timeout=0.5)
    client, w0, w1 = pipeline(h)
    wire = open_on(h, client, [w1, w0], "s1")
    err = h.expect(client, Error)
    assert (err.session, err.code) == ("s1", ErrorCode.TIMEOUT)
    assert h.expect(w0, Close) == wire.close()
    assert h.expect(w1, Close) == wire.close()
    st = h.status()
    assert idle(st)
    assert [x["id"] for x in st["workers"]] == ["w0", "w1"]  # the workers stay
    assert st["counters"]["sessions_failed"] == 1


def test_a_client_gone_loses_its_sessions_and_every_stage_is_freed(
    cluster: Callable[..., Harness],
) -> None:
    h = cluster()
    client, w0, w1 = pipeline(h)
    wire = open_on(h, client, [w1, w0], "s1", max_tokens=1000)
    client.sock.close(linger=0)
    h.peers.remove(client)
    # The broker learns the client is gone when a token for it cannot be delivered;
    # until its connection drops, tokens still go into the pipe.
    closed = False
    step = 0
    deadline = time.monotonic() + TIMEOUT
    while not closed and time.monotonic() < deadline:
        w1.send(wire.token(step, 7))
        step += 1
        h.sync(w1)
        for msg in h.pending(w0):
            assert isinstance(msg, Step | Close)
            closed = closed or msg == wire.close()
    assert closed, "the stages never got a CLOSE"
    assert h.expect(w1, Close) == wire.close()
    st = h.status()
    assert idle(st)
    assert st["counters"]["sessions_failed"] == 1


def test_a_client_that_never_reads_loses_its_sessions_and_stalls_no_one(
    cluster: Callable[..., Harness],
) -> None:
    # The broker's sends never block: once a peer's queue is full, that peer is not
    # reading and its sessions fail, while everyone else's keep streaming.
    # A short queue per peer (workers' too: a round sends the fake worker a few STEPs).
    h = cluster(peer_queue=50)
    w = h.register("w0", 0, 4, capacity=64, max_kv_tokens=1 << 20, context=1 << 16)
    good = h.client("good")
    slow = h.client("slow", RCVHWM=10, RCVBUF=4096)
    steps = 50_000
    fine = open_on(h, good, [w], "fine", max_tokens=steps)
    stuck = [open_on(h, slow, [w], f"s{i}", max_tokens=steps) for i in range(8)]
    live = {x.session for x in stuck}
    step = 0
    while live and step < steps:
        for x in stuck:
            if x.session in live:
                w.send(x.token(step, 7))
        # It asks for status too, and reads no reply either: the kernel buffers megabytes
        # of a peer's messages before the broker's queue to it fills, and replies fill
        # them faster than tokens.
        for _ in range(100):
            slow.send(Status())
        # The good client reads every token of its own stream, one a round.
        w.send(fine.token(step, 100 + step))
        assert h.expect(good, Token).step == step
        while True:  # the STEPs of the round, any CLOSE of a failed session among them
            msg = h.expect(w, Message)
            if isinstance(msg, Close):
                live.discard(msg.session)
            elif isinstance(msg, Step) and msg.session == fine.session:
                assert msg.step == step + 1
                break
        if step % 10 == 0:
            assert h.status()["sessions"] >= 1  # STATUS answers throughout
        step += 1
    assert not live, "the peer that never reads kept its sessions"
    st = h.status()
    assert st["sessions"] == 1  # only the good client's
    assert st["counters"]["sessions_failed"] == len(stuck)
    assert st["dropped"]["frontend:slow_consumer"] >= 1
    assert st["workers"][0]["sessions"] == 1
    # The good stream is still fine after the slow peer lost everything.
    stream_token(h, good, w, w, fine, step)
    good.send(Cancel(session="fine"))
    assert h.expect(good, Error).code is ErrorCode.CANCELLED
    assert idle(h.wait_status(idle, "sessions left open"))


def test_status_with_300_workers_of_distinct_ranges_is_fast(
    cluster: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ranges of one and two layers chain in Fibonacci-many ways (an exponential route
    # search never ends), and STATUS carries every worker (past one header's 64 KiB).
    # Its cost is counted in lines of Python (tests/broker/test_registry.py), not seconds.
    layers = 150
    ranges = [(i, i + 1) for i in range(layers)] + [(i, i + 2) for i in range(layers - 1)]
    ranges.append((0, 3))
    assert len(set(ranges)) == 300
    # Slow heartbeats and a long horizon: 300 fake workers do not heartbeat back.
    h = cluster(max_workers=300, heartbeat_interval=1.0, heartbeat_liveness=120)
    workers = []
    for i, (start, end) in enumerate(ranges):
        w = h.worker(f"w{i:03d}")
        w.send(register_msg(start, end, num_layers=layers))
        workers.append(w)
    for i, w in enumerate(workers):
        assert h.expect(w, Registered).worker_id == f"w{i:03d}"

    budget = 500 * 300  # lines of Python per worker: about 130 today
    costs: list[int] = []
    real = Broker.status

    def counted(self: Broker) -> dict[str, Any]:
        built: list[dict[str, Any]] = []
        # Past the budget the build stops (OverBudget); the broker then answers nothing
        # and h.status() fails.
        costs.append(steps(lambda: built.append(real(self)), budget))
        return built[0]

    monkeypatch.setattr(Broker, "status", counted)
    st = h.status()
    assert costs and max(costs) <= budget, costs
    assert len(st["workers"]) == 300
    assert st["complete_route"] is True
    assert st["num_layers"] == layers

    # One past max_workers is refused; a REGISTER with an absurd num_layers does not
    # even decode.
    extra = h.worker("w300")
    extra.send(register_msg(0, 1, num_layers=layers))
    assert "300" in h.expect(extra, Refused).reason
    huge = h.worker("huge")
    huge.send(register_msg(0, 1, num_layers=2**40))
    st = h.wait_status(
        lambda s: s["dropped"].get("backend:malformed") == 1, "the huge REGISTER was not dropped"
    )
    assert len(st["workers"]) == 300
    assert st["num_layers"] == layers
    assert h.pending(huge) == []

    # A route through them still serves a request: one chain of workers from 0 to L.
    client = h.client()
    client.send(open_msg("s1"))
    st = h.wait_status(lambda s: s["sessions"] == 1, "the request found no route")
    hops = sorted(tuple(x["layers"]) for x in st["workers"] if x["sessions"] == 1)
    assert [a for a, _ in hops] == [0] + [b for _, b in hops[:-1]]
    assert hops[-1][1] == layers
    assert h.thread.is_alive()


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
        assert {"id", "layers", "sessions", "kv_tokens_reserved", "draining", "info"} <= set(w)
        assert {"capacity", "load", "last_heartbeat_s"} <= set(w)


def test_worker_heartbeat_load_reaches_status(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    w = h.register("w0", 0, 4)
    w.load, w.draining = {"mean_batch": 2.5}, True
    w.beat()
    (entry,) = h.wait_status(lambda st: st["workers"][0]["draining"], "never draining")["workers"]
    assert entry["stats"]["mean_batch"] == 2.5
    # A draining worker takes no new session: the request waits.
    client = h.client()
    client.send(open_msg("s1"))
    assert h.status(via=client)["queue"] == 1


def test_client_heartbeat_gets_the_boot_id(cluster: Callable[..., Harness]) -> None:
    h = cluster()
    w = h.worker("w0")
    w.send(register_msg(0, 4))
    boot = h.expect(w, Registered).boot
    client = h.client()
    client.send(Heartbeat())
    assert h.expect(client, Heartbeat).boot == boot


def test_a_status_flood_reuses_one_status_until_something_happens(
    cluster: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    h = cluster(heartbeat_interval=5.0)  # no tick in between to refresh it
    client, w0, w1 = pipeline(h)
    built = 0
    real = Broker.status

    def counting(self: Broker) -> dict[str, Any]:
        nonlocal built
        built += 1
        return real(self)

    monkeypatch.setattr(Broker, "status", counting)
    flood = h.client("flood")
    for i in range(200):
        flood.send(Status(request_id=f"q{i}"))
    replies = [h.expect(flood, StatusReply) for _ in range(200)]
    assert [r.request_id for r in replies] == [f"q{i}" for i in range(200)]
    assert all(r.status()["sessions"] == 0 for r in replies)
    assert built <= 2  # not one per request
    # Anything else happening makes the next STATUS fresh.
    open_on(h, client, [w1, w0], "s1")
    assert h.status(via=client)["sessions"] == 1


def test_a_small_client_queue_does_not_apply_to_workers(cluster: Callable[..., Harness]) -> None:
    h = cluster(peer_queue=8)
    client, w0, w1 = pipeline(h)
    wires = [open_on(h, client, [w1, w0], f"s{i}") for i in range(3)]
    # A burst to one worker far past the clients' queue bound: it is not dropped as slow.
    for _ in range(40):
        for wire in wires:
            w1.send(wire.activation(0, rows=1))  # forwarded nowhere (last stage): ignored
    client.send(Cancel(session="s0"))
    st = h.wait_status(lambda st: st["sessions"] == 2, "the cancel was not handled")
    assert len(st["workers"]) == 2


def test_heartbeats_the_broker_has_not_read_yet_are_not_taken_for_silence() -> None:
    # A flood can leave the broker behind on its backend: a worker is judged silent only
    # up to the last time everything that had arrived was read.
    ctx = zmq.Context()
    broker = Broker(
        BrokerSettings(
            frontend="tcp://127.0.0.1:0",
            backend="tcp://127.0.0.1:0",
            heartbeat_interval=1.0,
            heartbeat_liveness=3,
        ),
        context=ctx,
    )
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.IDENTITY, b"w0")
    peer.connect(broker.endpoints[1])
    try:
        w = broker.registry.add(b"w0", register_msg(0, 4))
        peer.send_multipart(encode(Heartbeat()))  # so the broker knows its connection
        assert broker.backend.poll(int(TIMEOUT * 1000))
        broker._drain(broker.backend, broker.on_worker_message, "backend")
        now = time.monotonic()
        w.last_seen = now - 10.0  # its heartbeats since then still wait unread
        broker._backend_read_at = now - 9.0
        broker._beat_workers(now)
        assert "w0" in broker.registry.workers
        broker._backend_read_at = now  # all read, and nothing from it for 10 s
        broker._beat_workers(now)
        assert "w0" not in broker.registry.workers
    finally:
        peer.close()
        broker.close()
        ctx.term()
