"""The worker against a fake broker: a ROUTER the test drives by hand, with a real tiny-model
stage behind the worker. The worker runs in a thread (its broker link in another); the test
stops it with on_sigint (what SIGINT does) and always joins it.

Waits are bounded and generous; the only timing assertion is the heartbeat deadline a long
forward must not miss, which is the requirement itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import numpy as np
import pytest
import zmq

torch = pytest.importorskip("torch")

from zmqllm.bus.messages import (  # noqa: E402
    Activation,
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
    Step,
    Token,
)
from zmqllm.bus.protocol import MAX_FRAMES, decode, encode  # noqa: E402
from zmqllm.bus.sampling_params import SamplingParams  # noqa: E402
from zmqllm.bus.wire_types import Payload, ProtocolError  # noqa: E402
from zmqllm.config.settings import Config  # noqa: E402
from zmqllm.engine.frames import payload_to_tensor  # noqa: E402
from zmqllm.engine.generator import Generator  # noqa: E402
from zmqllm.engine.runner import Output  # noqa: E402
from zmqllm.version import __version__  # noqa: E402
from zmqllm.worker.pipeline import Worker  # noqa: E402
from zmqllm.worker.shard_loader import load_stage, max_frame_bytes, register_message  # noqa: E402

pytestmark = pytest.mark.torch

TIMEOUT = 15.0  # bound on any single wait
INTERVAL = 0.1  # heartbeat interval, both ways
PUMP = 0.05  # how often the fake broker heartbeats the worker while the test waits
MAX_SESSIONS = 4
MAX_KV_TOKENS = 4096
HIDDEN = 64  # the tiny model's

M = TypeVar("M", bound=Message)


@dataclass
class Msg:
    identity: bytes
    msg: Message
    frames: list[bytes]  # header and payload frames as received
    at: float  # when it came (time.monotonic)


class FakeBroker:
    """A ROUTER standing in for the broker's backend. While the test waits it heartbeats
    the worker every ``pump`` seconds (unless ``alive`` is False) and notes the load and
    the time of each heartbeat the worker sends."""

    def __init__(self, ctx: zmq.Context[Any], pump: float = PUMP) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A reconnecting worker comes back under the same routing id.
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.bind("tcp://127.0.0.1:0")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.identity: bytes | None = None
        self.boot = "boot-1"
        self.alive = True
        self.pump = pump
        self.last_load: dict[str, Any] = {}
        self.last_draining = False
        self.beats: list[float] = []
        self._next_pump = 0.0

    def send(self, msg: Message) -> None:
        self.send_raw(encode(msg))

    def send_raw(self, frames: Sequence[Any]) -> None:
        assert self.identity is not None, "the worker has not said hello yet"
        self.sock.send_multipart([self.identity, *frames])

    def _pump(self) -> None:
        now = time.monotonic()
        if self.alive and self.identity is not None and now >= self._next_pump:
            self._next_pump = now + self.pump
            self.send(Heartbeat(boot=self.boot))

    def expect(
        self, kind: type[M], timeout: float = TIMEOUT, also_skip: tuple[type, ...] = ()
    ) -> tuple[M, Msg]:
        """The next message of interest; it must be a ``kind``. Heartbeats and REGISTERs
        are skipped unless asked for."""
        skip = tuple(t for t in (Heartbeat, Register, *also_skip) if t is not kind)
        deadline = time.monotonic() + timeout
        while True:
            got = self.next_message(max(0.0, deadline - time.monotonic()))
            if isinstance(got.msg, skip):
                continue
            assert isinstance(got.msg, kind), f"expected {kind.__name__}, got {got.msg}"
            return got.msg, got

    def next_message(self, timeout: float = TIMEOUT) -> Msg:
        """The next message whatever its type (heartbeating the worker meanwhile)."""
        deadline = time.monotonic() + timeout
        while True:
            self._pump()
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no message from the worker within {timeout}s")
            if self.sock.poll(int(min(left, self.pump) * 1000) + 1):
                break
        identity, *frames = self.sock.recv_multipart()
        self.identity = identity
        msg = decode(frames)
        now = time.monotonic()
        if isinstance(msg, Heartbeat):
            self.beats.append(now)
            # As sent: decoding keeps only messages.FIGURE_KEYS, and the fault counters are
            # not among them yet.
            self.last_load = msgpack.unpackb(frames[0]).get("load") or {}
            self.last_draining = msg.draining
        return Msg(identity, msg, frames, now)

    def register(self) -> Register:
        """Accept the worker's registration; returns its REGISTER."""
        reg, got = self.expect(Register)
        self.send(Registered(worker_id=got.identity.decode(), boot=self.boot))
        # A heartbeat only comes once the worker knows it is registered.
        self.expect(Heartbeat)
        return reg

    def wait_load(self, key: str, value: Any) -> None:
        deadline = time.monotonic() + TIMEOUT
        while self.last_load.get(key) != value:
            assert time.monotonic() < deadline, f"load never showed {key}={value!r}"
            self.expect(Heartbeat)


@dataclass
class Running:
    """A Worker in a thread; ``result`` gets run()'s return value (or its exception)."""

    worker: Worker
    thread: threading.Thread = field(init=False)
    result: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, name="worker", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result.append(self.worker.run())
        except BaseException as exc:  # surfaced by the test, not lost in the thread
            self.result.append(exc)

    def join(self) -> Any:
        self.thread.join(timeout=TIMEOUT)
        assert not self.thread.is_alive(), "worker thread did not stop"
        (result,) = self.result
        return result


@dataclass
class Setup:
    ctx: zmq.Context[Any]
    model_dir: Path
    brokers: list[FakeBroker] = field(default_factory=list)
    workers: list[Running] = field(default_factory=list)

    def config(self, broker: FakeBroker, layers: str, interval: float, liveness: int) -> Config:
        cfg = Config()
        cfg.model.path = str(self.model_dir)
        cfg.worker.layers = layers
        cfg.worker.broker = broker.address
        cfg.worker.name = "test"
        cfg.worker.max_sessions = MAX_SESSIONS
        cfg.worker.max_kv_tokens = MAX_KV_TOKENS
        cfg.worker.prefill_chunk = 16
        cfg.broker.heartbeat_interval = interval
        cfg.broker.heartbeat_liveness = liveness
        return cfg

    def worker(
        self, layers: str = "0:4", liveness: int = 30, interval: float = INTERVAL
    ) -> tuple[FakeBroker, Worker]:
        """A worker (not yet running) and the fake broker it will talk to."""
        broker = FakeBroker(self.ctx, pump=min(PUMP, interval / 2))
        self.brokers.append(broker)
        cfg = self.config(broker, layers, interval, liveness)
        return broker, Worker(cfg, load_stage(cfg), context=self.ctx)

    def run(self, worker: Worker) -> Running:
        running = Running(worker)
        self.workers.append(running)
        return running

    def start(self, layers: str = "0:4", liveness: int = 30) -> tuple[FakeBroker, Running]:
        broker, worker = self.worker(layers, liveness)
        return broker, self.run(worker)


@pytest.fixture
def setup(tiny_model_dir: Path) -> Iterator[Setup]:
    s = Setup(zmq.Context(), tiny_model_dir)
    yield s
    for r in s.workers:
        r.worker.on_sigint()
    for r in s.workers:
        r.thread.join(timeout=TIMEOUT)
    for b in s.brokers:
        b.sock.close(linger=0)
    stuck = [r for r in s.workers if r.thread.is_alive()]
    if not stuck:
        s.ctx.term()  # proves every socket was closed
    assert not stuck, "worker thread did not stop"


@pytest.fixture(scope="module")
def generator(tiny_model_dir: Path) -> Generator:
    return Generator(tiny_model_dir)


PROMPT = [5, 17, 42, 9, 101, 33]


def open_msg(
    session: str,
    *,
    stage: int = 0,
    stages: int = 1,
    max_tokens: int = 5,
    tokens: Sequence[int] | None = PROMPT,
    next_hop: str = "",
    attempt: int = 0,
    **fields: Any,
) -> Open:
    prompt_len = len(tokens) if tokens else len(PROMPT)
    values: dict[str, Any] = {
        "session": session,
        "attempt": attempt,
        "request_id": f"req-{session}",
        "max_tokens": max_tokens,
        "prompt_len": prompt_len,
        "sampling": SamplingParams(temperature=0.0),
        "stage": stage,
        "stages": stages,
        "max_len": prompt_len + max_tokens,
        "next": next_hop,
        "tokens": None if tokens is None else Payload(np.asarray(tokens, np.int32), "int32"),
    }
    values.update(fields)
    return Open(**values)


def step(session: str, n: int, token: int, attempt: int = 0) -> Step:
    return Step(session=session, attempt=attempt, request_id=f"req-{session}", step=n, token=token)


def activation(session: str, n: int, hidden: np.ndarray, final: bool = True) -> Activation:
    return Activation(
        session=session,
        request_id=f"req-{session}",
        step=n,
        final=final,
        hidden=Payload(hidden, "float32"),
    )


def decode_all(broker: FakeBroker, session: str, max_tokens: int) -> list[int]:
    """Drive a whole-model worker's session from its first TOKEN to its finish."""
    tokens: list[int] = []
    for n in range(max_tokens):
        tok, _ = broker.expect(Token)
        assert (tok.session, tok.attempt, tok.step) == (session, 0, n)
        tokens.append(tok.token)
        if n + 1 < max_tokens:
            assert tok.finish is None
            broker.send(step(session, n + 1, tokens[-1]))
        else:
            assert tok.finish is Finish.LENGTH
    return tokens


def expect_error(broker: FakeBroker, session: str, code: ErrorCode) -> Error:
    err, _ = broker.expect(Error)
    assert (err.session, err.code) == (session, code), err
    assert err.request_id == f"req-{session}"
    return err


# -- registration and serving ------------------------------------------------------------


def test_registers_with_fingerprint_and_capacity(setup: Setup) -> None:
    broker, running = setup.start()
    reg = broker.register()
    loaded = running.worker.loaded
    assert (reg.start, reg.end, reg.num_layers) == (0, 4, 4)
    assert reg.capacity == MAX_SESSIONS
    assert reg.version == __version__
    assert reg.fingerprint == loaded.fingerprint["digest"]
    assert reg.model["vocab_size"] == loaded.fingerprint["vocab_size"]
    assert reg.model["sliding_window"] == 8
    assert (reg.max_kv_tokens, reg.context) == (MAX_KV_TOKENS, 1024)
    assert (reg.dtype, reg.device) == ("float32", "cpu")
    assert reg.pid > 0 and reg.host
    assert running.worker.identity.startswith("w-test-0-4-")
    # Registered: heartbeats carry the stage's load and the fault counters.
    broker.wait_load("sessions", 0)
    assert broker.last_draining is False
    assert broker.last_load["fault_malformed"] == 0


def test_frames_are_bounded_by_the_largest_activation(setup: Setup) -> None:
    _, worker = setup.worker()
    stage = worker.stage
    # prefill_chunk 16 x hidden 64 x 4 bytes is less than a whole prompt's ids (1024 x 4).
    assert max_frame_bytes(stage, 1024) == 1024 * 4 + 64 * 1024
    assert max_frame_bytes(stage, 16) == 16 * HIDDEN * 4 + 64 * 1024


def test_open_and_steps_continue_the_greedy_sequence(setup: Setup, generator: Generator) -> None:
    broker, _ = setup.start()
    broker.register()
    broker.send(open_msg("s1", max_tokens=5))
    tokens = decode_all(broker, "s1", 5)
    assert tokens == list(generator.generate(PROMPT, 5))
    broker.wait_load("sessions", 1)  # finished, but only CLOSE frees the cache
    broker.send(Close(session="s1", request_id="req-s1"))
    broker.wait_load("sessions", 0)


def test_a_route_of_one_stage_steps_itself(setup: Setup, generator: Generator) -> None:
    """Named as its own next hop (the broker does so on a route of one stage), a worker
    queues each next step itself: every token says stepped, and no STEP is needed."""
    broker, running = setup.start()
    broker.register()
    broker.send(open_msg("s1", max_tokens=5, next_hop=running.worker.identity))
    tokens = []
    for n in range(5):
        tok, _ = broker.expect(Token)
        assert (tok.session, tok.step) == ("s1", n)
        assert tok.stepped is (n < 4)  # the last one (LENGTH) has no next step
        tokens.append(tok.token)
    assert tok.finish is Finish.LENGTH
    assert tokens == list(generator.generate(PROMPT, 5))
    # A STEP from elsewhere for a step it took itself is refused, and costs only s1.
    broker.send(step("s1", 2, tokens[1]))
    assert "expected" in expect_error(broker, "s1", ErrorCode.BAD_REQUEST).message


def test_attempts_of_one_session_are_separate_sessions(setup: Setup, generator: Generator) -> None:
    broker, _ = setup.start()
    broker.register()
    broker.send(open_msg("s1", max_tokens=2))
    broker.send(open_msg("s1", max_tokens=2, attempt=1))
    got = {}
    for _ in range(2):
        tok, _ = broker.expect(Token)
        got[tok.attempt] = tok.token
    (first,) = generator.generate(PROMPT, 1)
    assert got == {0: first, 1: first}
    broker.send(Close(session="s1", attempt=0))
    broker.send(step("s1", 1, got[1], attempt=1))
    tok, _ = broker.expect(Token)
    assert (tok.attempt, tok.step, tok.finish) == (1, 1, Finish.LENGTH)


def test_two_workers_make_a_pipeline(setup: Setup, generator: Generator) -> None:
    b0, _ = setup.start("0:2")
    b1, _ = setup.start("2:4")
    assert b0.register().end == 2
    assert b1.register().start == 2
    b1.send(open_msg("s1", stage=1, stages=2, max_tokens=4, tokens=None, next_hop="w-a"))
    b0.send(open_msg("s1", stage=0, stages=2, max_tokens=4, next_hop="w-b"))
    tokens: list[int] = []
    for n in range(4):
        act, got = b0.expect(Activation)
        assert (act.session, act.attempt, act.step, act.final) == ("s1", 0, n, True)
        assert act.request_id == "req-s1"
        assert act.group is not None and act.group[1] == 1  # one result for that next worker
        # Prefill carries one row per prompt token, a decode step one row.
        assert act.hidden.array.shape == (len(PROMPT) if n == 0 else 1, HIDDEN)
        b1.send_raw(got.frames)  # as the broker does: the frames go on untouched
        tok, _ = b1.expect(Token)
        assert tok.step == n
        tokens.append(tok.token)
        if tok.finish is None:
            assert tok.group is not None  # its STEP goes back to stage 0
            b0.send(step("s1", n + 1, tokens[-1]))
        else:
            assert tok.group is None  # no STEP follows a last token
    assert tok.finish is Finish.LENGTH
    assert tokens == list(generator.generate(PROMPT, 4))


def stage_0_stand_in(ctx: zmq.Context[Any]) -> tuple[zmq.Socket[Any], str, zmq.Socket[Any]]:
    """A ROUTER where a last stage's peer link can send stage 0's steps: the socket, its
    endpoint and a monitor of its handshakes."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"tcp://127.0.0.1:{port}", sock.get_monitor_socket()


def test_the_last_stage_steps_stage_0_over_its_peer_link(setup: Setup) -> None:
    """A token whose next step went over the peer link says so (stepped); where the link
    cannot take it, the token goes unstepped and the broker steps the rest."""
    from zmq.utils.monitor import recv_monitor_message

    b1, _ = setup.start("2:4")
    b1.register()
    stage0, up, monitor = stage_0_stand_in(setup.ctx)
    down = "tcp://127.0.0.1:9"  # discard: nothing listens, the link never comes up
    try:
        b1.send(open_msg("up", stage=1, stages=2, tokens=None, next_peer=up, prev="w-a"))
        b1.send(open_msg("down", stage=1, stages=2, tokens=None, next_peer=down, prev="w-a"))
        deadline = time.monotonic() + TIMEOUT
        while recv_monitor_message(monitor)["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED:
            assert time.monotonic() < deadline, "the peer link never connected"
        time.sleep(0.2)  # the worker's end of the handshake
        rows = np.random.default_rng(0).standard_normal((len(PROMPT), HIDDEN), np.float32)
        first: dict[str, int] = {}
        for session in ("up", "down"):
            b1.send(activation(session, 0, rows))
            tok, _ = b1.expect(Token)
            assert (tok.session, tok.step, tok.finish) == (session, 0, None)
            assert tok.stepped is (session == "up")
            first[session] = tok.token
        assert stage0.poll(int(TIMEOUT * 1000))
        _, *frames = stage0.recv_multipart()
        got = decode(frames)
        assert isinstance(got, Step)
        assert (got.session, got.step, got.token) == ("up", 1, first["up"])
        assert got.request_id == "req-up"
        # The session whose link failed goes on through the broker.
        b1.send(activation("down", 1, rows[:1]))
        tok, _ = b1.expect(Token)
        assert (tok.session, tok.step, tok.stepped) == ("down", 1, False)
        assert not stage0.poll(100)
    finally:
        monitor.close(linger=0)
        stage0.close(linger=0)


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_activations_leave_in_the_wire_dtype_and_the_next_stage_takes_them(
    setup: Setup, wire: str
) -> None:
    def stage_zero(wire_dtype: str) -> FakeBroker:
        broker = FakeBroker(setup.ctx)
        setup.brokers.append(broker)
        cfg = setup.config(broker, "0:2", INTERVAL, 30)
        cfg.worker.wire_dtype = wire_dtype
        setup.run(Worker(cfg, load_stage(cfg), context=setup.ctx))
        broker.register()
        broker.send(open_msg("s1", stage=0, stages=2, max_tokens=2, next_hop="w-b"))
        return broker

    plain, narrow = stage_zero("auto"), stage_zero(wire)
    full, _ = plain.expect(Activation)
    cast, got = narrow.expect(Activation)
    assert (full.hidden.dtype, cast.hidden.dtype) == ("float32", wire)
    assert cast.hidden.array.nbytes * 2 == full.hidden.array.nbytes
    # The same forward's hidden states, rounded once to the wire dtype.
    want = torch.from_numpy(full.hidden.array.copy()).to(getattr(torch, wire))
    assert torch.equal(payload_to_tensor(cast.hidden), want)
    b1, _ = setup.start("2:4")  # a float32 stage: it casts what comes back to its dtype
    b1.register()
    b1.send(open_msg("s1", stage=1, stages=2, max_tokens=2, tokens=None, next_hop="w-a"))
    b1.send_raw(got.frames)
    tok, _ = b1.expect(Token)
    assert (tok.session, tok.step, tok.finish) == ("s1", 0, None)


@pytest.mark.parametrize(("units", "int8"), [(True, True), (True, False), (False, True)])
def test_the_matrix_unit_settings_reach_the_kernel(setup: Setup, units: bool, int8: bool) -> None:
    """matrix_units and int8_activations as the int4 products of this process take them."""
    from zmqllm.engine import native

    kernel = native.load()
    if kernel is None:
        pytest.skip("the compiled kernels cannot be built here")
    broker = FakeBroker(setup.ctx)
    setup.brokers.append(broker)  # closed with the others
    cfg = setup.config(broker, "0:4", INTERVAL, 30)
    cfg.model.quant = "int4"
    cfg.worker.matrix_units, cfg.worker.int8_activations = units, int8
    try:
        loaded = load_stage(cfg)
    finally:
        native.use_matrix_units(True)
    got = loaded.matrix_units
    want = []
    if units and int8 and kernel.vnni_built():
        want.append("avx512_vnni")
    if units and kernel.bf16_built():
        want.append(got.split(",")[-1])
        assert want[-1] in ("amx", "avx512_bf16")
    assert got == ",".join(want)
    # The worker's build says so (drift, and failover's same-build rule, compare it).
    shown = register_message(cfg, loaded).build["matrix_units"]
    assert shown == ("off" if not want else got + ("+int8" if int8 else ""))


def test_results_are_tagged_with_their_group_per_next_worker(setup: Setup) -> None:
    _, worker = setup.worker()
    for sid, hop in (("a/0", "w1"), ("b/0", "w2"), ("c/0", "w1"), ("d/0", "w1")):
        s = worker.stage.open(sid, "", 20, 8, SamplingParams(), frozenset(), np.asarray([5]))
        s.next_hop = hop
    outs = [
        Output("a/0", "", 1, True, token=5),
        Output("b/0", "", 1, True, token=5),
        Output("c/0", "", 1, True, token=5, finish=Finish.LENGTH),  # no STEP follows
        Output("d/0", "", 1, True, token=5),
        Output("gone/0", "", 1, True, token=5),  # closed meanwhile
    ]
    a, b, c, d, gone = worker._tag_groups(outs)
    assert c is None
    assert a == d and a is not None and a[1] == 2
    assert b is not None and b[1] == 1 and b[0] != a[0]
    assert gone is not None and gone[1] == 1 and gone[0] not in (a[0], b[0])
    worker.stage.stats.forwards += 1
    assert worker._tag_groups(outs)[0] != a  # the next forward is another group
    # A speculative pass's tokens but its last: no STEP follows them, no group.
    more = [Output("a/0", "", 1, True, token=5, more=True), Output("a/0", "", 2, True, token=6)]
    first, last = worker._tag_groups(more)
    assert first is None and last is not None and last[1] == 1


# -- bad input: one message costs at most its own session --------------------------------


def with_header(msg: Message, **changes: Any) -> list[bytes]:
    """``msg`` encoded, then its header map changed as a broken or hostile peer would."""
    head, *payloads = encode(msg)
    fields = msgpack.unpackb(head)
    fields.update(changes)
    return [msgpack.packb(fields), *(bytes(p) for p in payloads)]


def test_garbage_is_dropped_and_the_worker_keeps_working(
    setup: Setup, generator: Generator
) -> None:
    broker, _ = setup.start()
    broker.register()
    broker.send(open_msg("s1", max_tokens=3))
    first, _ = broker.expect(Token)
    for frames in [
        [b"\xc1"],  # not msgpack
        [b"\x00\x01garbage"],
        [b""],
        with_header(Heartbeat(), v=99),  # another protocol version
        with_header(Heartbeat(), type="nonsense"),
        [*encode(Heartbeat()), b"trailing"],  # a payload no tensor spec announced
        [b"x"] * (MAX_FRAMES + 5),  # read frame by frame and let go unbuilt
    ]:
        broker.send_raw(frames)
    broker.send(step("s1", 1, first.token))
    second, _ = broker.expect(Token)
    assert second.step == 1
    assert [first.token, second.token] == list(generator.generate(PROMPT, 3))[:2]
    broker.wait_load("fault_malformed", 7)


def test_a_negative_token_is_refused_by_decode_and_fails_its_session(setup: Setup) -> None:
    bad = encode(step("s1", 1, -1))
    with pytest.raises(ProtocolError, match="token"):
        decode(bad)
    broker, _ = setup.start()
    broker.register()
    broker.send(open_msg("s1", max_tokens=3))
    broker.send(open_msg("s2", max_tokens=3))
    tokens = {}
    for _ in range(2):
        tok, _ = broker.expect(Token)
        tokens[tok.session] = tok.token
    broker.send_raw(bad)  # the header still names its session: it fails, not waits
    err = expect_error(broker, "s1", ErrorCode.BAD_REQUEST)
    assert "token" in err.message
    broker.wait_load("sessions", 1)
    broker.send(step("s2", 1, tokens["s2"]))
    tok, _ = broker.expect(Token)
    assert (tok.session, tok.step) == ("s2", 1)


def test_a_step_token_past_the_vocabulary_fails_only_its_session(
    setup: Setup, generator: Generator
) -> None:
    broker, running = setup.start()
    broker.register()
    vocab = running.worker.stage.shard.args.vocab_size
    for sid in ("s1", "s2", "s3"):
        broker.send(open_msg(sid, max_tokens=3))
    firsts: dict[str, int] = {}
    for _ in range(3):
        tok, _ = broker.expect(Token)
        firsts[tok.session] = tok.token
    # All three steps arrive together and would share one forward.
    broker.send(step("s1", 1, firsts["s1"]))
    broker.send(step("s2", 1, vocab))
    broker.send(step("s3", 1, firsts["s3"]))
    expected = list(generator.generate(PROMPT, 3))
    got = {"s1": [firsts["s1"]], "s3": [firsts["s3"]]}
    errors = []
    while any(len(v) < 3 for v in got.values()):
        msg = broker.next_message().msg
        if isinstance(msg, Error):
            errors.append(msg)
        elif isinstance(msg, Token):
            got[msg.session].append(msg.token)  # nothing for s2
            assert msg.step == len(got[msg.session]) - 1
            if msg.finish is None:
                broker.send(step(msg.session, msg.step + 1, msg.token))
    assert got == {"s1": expected, "s3": expected}
    (err,) = errors
    assert (err.session, err.code) == ("s2", ErrorCode.BAD_REQUEST)
    assert "not in" in err.message
    broker.wait_load("sessions", 2)  # s2 was closed here; s1 and s3 wait for CLOSE


def test_a_step_for_a_session_still_in_prefill_is_refused(setup: Setup) -> None:
    broker, worker = setup.worker()
    # The prompt takes two forwards (prefill_chunk 16); the first waits until the link
    # has handed the STEP to the compute loop, so the STEP is read between the two.
    stepped = threading.Event()
    deliver, run = worker.link._deliver, worker.stage.run

    def deliver_noting_steps(entry: Any) -> None:
        deliver(entry)
        if isinstance(entry, Step):
            stepped.set()

    def run_after_the_step() -> list[Output]:
        assert stepped.wait(TIMEOUT)
        return run()

    worker.link._deliver = deliver_noting_steps  # type: ignore[method-assign]
    worker.stage.run = run_after_the_step  # type: ignore[method-assign]
    setup.run(worker)
    broker.register()
    broker.send(open_msg("s1", tokens=list(range(3, 23)), max_tokens=3))
    broker.send(step("s1", 1, 5))  # before its first token: out of order
    err = expect_error(broker, "s1", ErrorCode.BAD_REQUEST)
    assert "prefill" in err.message
    broker.wait_load("sessions", 0)


@pytest.mark.parametrize(
    ("hidden", "problem"),
    [
        (np.zeros((1, HIDDEN + 1), np.float32), "expected"),
        (np.zeros((1, HIDDEN // 2), np.float32), "expected"),
        (np.zeros((17, HIDDEN), np.float32), "rows"),  # past prefill_chunk 16
    ],
    ids=["wide", "narrow", "rows"],
)
def test_a_bad_activation_fails_its_session(setup: Setup, hidden: np.ndarray, problem: str) -> None:
    broker, _ = setup.start("2:4")
    broker.register()
    broker.send(open_msg("s1", stage=1, stages=2, tokens=None))
    broker.send(open_msg("s2", stage=1, stages=2, tokens=None))
    broker.wait_load("sessions", 2)
    broker.send(activation("s1", 0, hidden))
    broker.send(activation("s2", 0, np.zeros((len(PROMPT), HIDDEN), np.float32)))
    err, _ = broker.expect(Error, also_skip=(Token,))
    assert (err.session, err.code) == ("s1", ErrorCode.BAD_REQUEST)
    assert problem in err.message
    tok, _ = broker.expect(Token, also_skip=(Error,))
    assert (tok.session, tok.step) == ("s2", 0)  # the other session's work ran
    broker.wait_load("sessions", 1)


def test_a_zero_row_activation_is_refused_by_decode_and_fails_its_session(
    setup: Setup,
) -> None:
    bad = encode(activation("s1", 0, np.zeros((0, HIDDEN), np.float32)))
    with pytest.raises(ProtocolError, match="hidden"):
        decode(bad)
    broker, _ = setup.start("2:4")
    broker.register()
    broker.send(open_msg("s1", stage=1, stages=2, tokens=None))
    broker.send_raw(bad)
    expect_error(broker, "s1", ErrorCode.BAD_REQUEST)
    broker.wait_load("sessions", 0)


def test_work_for_an_unknown_session_or_the_wrong_stage_answers_error(setup: Setup) -> None:
    broker, _ = setup.start("2:4")
    broker.register()
    broker.send(activation("ghost", 0, np.zeros((1, HIDDEN), np.float32)))
    err = expect_error(broker, "ghost", ErrorCode.BAD_REQUEST)
    assert "no such session" in err.message
    broker.send(open_msg("s1", stage=1, stages=2, tokens=None))
    broker.send(step("s1", 1, 5))  # a decode step belongs to stage 0
    err = expect_error(broker, "s1", ErrorCode.BAD_REQUEST)
    assert "stage 0" in err.message


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"sampling": {"temperature": -1.0}}, "temperature"),  # decode refuses these two
        ({"sampling": {"nucleus": 0.5}}, "nucleus"),
        ({"tokens": [5, 999_999]}, "vocab"),
        ({"tokens": None}, "int32"),
        ({"max_len": 5000}, "context"),
    ],
)
def test_a_bad_open_gets_bad_request(setup: Setup, fields: dict[str, Any], problem: str) -> None:
    broker, _ = setup.start()
    broker.register()
    if "sampling" in fields:
        broker.send_raw(with_header(open_msg("s1"), **fields))
    else:
        broker.send(open_msg("s1", **fields))
    err = expect_error(broker, "s1", ErrorCode.BAD_REQUEST)
    assert problem in err.message
    # The worker is fine: the next session works.
    broker.send(open_msg("s2", max_tokens=1))
    tok, _ = broker.expect(Token)
    assert tok.session == "s2"


def test_open_beyond_capacity_answers_full(setup: Setup) -> None:
    broker, _ = setup.start()
    broker.register()
    for i in range(MAX_SESSIONS):
        broker.send(open_msg(f"s{i}", max_tokens=2))
    broker.send(open_msg("extra", max_tokens=2))
    # The admitted sessions' first tokens may come before or after the refusal.
    err, _ = broker.expect(Error, also_skip=(Token,))
    assert (err.session, err.code) == ("extra", ErrorCode.FULL)


def test_a_forward_that_raises_fails_only_its_batch(setup: Setup) -> None:
    broker, worker = setup.worker()
    stage = worker.stage
    real_run = stage.run
    calls = {"n": 0}

    def run_failing_once() -> list[Output]:
        calls["n"] += 1
        if calls["n"] == 2:  # s2's prefill, after s1's first forward
            stage.shard = FailingShard(stage.shard)  # type: ignore[assignment]
            try:
                return real_run()
            finally:
                stage.shard = stage.shard._shard  # type: ignore[attr-defined]
        return real_run()

    stage.run = run_failing_once  # type: ignore[method-assign]
    setup.run(worker)
    broker.register()
    broker.send(open_msg("s1", max_tokens=3))
    first, _ = broker.expect(Token)
    broker.send(open_msg("s2", max_tokens=3))
    err = expect_error(broker, "s2", ErrorCode.INTERNAL)
    assert "forward failed" in err.message
    broker.send(step("s1", 1, first.token))  # s1 was not in that batch: it goes on
    tok, _ = broker.expect(Token)
    assert (tok.session, tok.step) == ("s1", 1)
    broker.wait_load("fault_forward_failed", 1)


def test_a_turn_that_raises_is_counted_and_the_loop_goes_on(setup: Setup) -> None:
    broker, worker = setup.worker()
    run, calls = worker.stage.run, []

    def run_raising_once() -> list[Output]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")  # not a forward's failure: a bug in the turn
        return run()

    worker.stage.run = run_raising_once  # type: ignore[method-assign]
    setup.run(worker)
    broker.register()
    broker.send(open_msg("s1", max_tokens=1))
    tok, _ = broker.expect(Token)
    assert tok.session == "s1" and len(calls) >= 2
    broker.wait_load("fault_internal", 1)


class FailingShard:
    def __init__(self, shard: Any) -> None:
        self._shard = shard

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shard, name)

    def __call__(self, *_: Any) -> Any:
        raise RuntimeError("injected")


# -- liveness while computing ------------------------------------------------------------


def test_a_long_forward_does_not_stop_the_heartbeats(setup: Setup) -> None:
    """A forward longer than the broker's deadline (heartbeat_interval 1 s x liveness 3)
    that lasts until the worker's heartbeats have come liveness + 1 times meanwhile: they
    keep coming while it computes, and the worker never re-registers."""
    liveness = 3
    guard_s = 120.0  # ends a forward whose heartbeats never come (then the test fails)
    broker, worker = setup.worker(interval=1.0, liveness=liveness)
    shard = worker.stage.shard
    beats_during: list[int] = []  # heartbeats that came while the forward ran

    class SlowShard:
        def __getattr__(self, name: str) -> Any:
            return getattr(shard, name)

        def __call__(self, *args: Any) -> Any:
            # The test's thread reads the worker's messages meanwhile (broker.beats). One
            # heartbeat may have been on its way already: the others were sent during it.
            before = len(broker.beats)
            deadline = time.monotonic() + guard_s
            a = torch.randn(256, 256)
            while len(broker.beats) - before <= liveness and time.monotonic() < deadline:
                a = torch.tanh(a @ a)  # busy in torch ops
            beats_during.append(len(broker.beats) - before)
            return shard(*args)

    worker.stage.shard = SlowShard()  # type: ignore[assignment]
    setup.run(worker)
    broker.register()
    broker.send(open_msg("s1", max_tokens=1))
    registers = 0
    while True:
        got = broker.next_message(timeout=guard_s + TIMEOUT)
        registers += isinstance(got.msg, Register)
        if isinstance(got.msg, Token):
            break
    assert got.msg.session == "s1"
    assert beats_during and beats_during[0] > liveness, beats_during
    assert registers == 0


# -- the broker's word -------------------------------------------------------------------


def test_refused_makes_run_return_3(setup: Setup) -> None:
    broker, running = setup.start()
    broker.expect(Register)
    broker.send(Refused(reason="sliding_window: 8 != 4"))
    assert running.join() == 3


def registers_until_registered(broker: FakeBroker) -> int:
    """Answer the first REGISTER, then count every REGISTER the worker sent before its
    first heartbeat (which proves it read the answer)."""
    count = 1
    broker.expect(Register)
    broker.send(Registered(worker_id="w", boot=broker.boot))
    while True:
        got = broker.next_message()
        if isinstance(got.msg, Heartbeat):
            return count
        assert isinstance(got.msg, Register), got.msg
        count += 1


def test_one_register_per_connection(setup: Setup) -> None:
    # A second REGISTER from a registered identity makes the broker drop the worker's
    # sessions (it looks like a restarted worker): a worker must not repeat itself.
    broker, _ = setup.start()
    assert registers_until_registered(broker) == 1


def test_disconnect_makes_it_register_again(setup: Setup) -> None:
    broker, _ = setup.start()
    broker.register()
    broker.send(open_msg("s1", max_tokens=3))
    broker.expect(Token)
    broker.send(Disconnect(reason="unknown worker: register again"))
    broker.register()
    # Its sessions belonged to the broker that forgot them: dropped.
    broker.wait_load("sessions", 0)


def test_repeated_disconnects_make_one_register(setup: Setup) -> None:
    broker, _ = setup.start()
    broker.register()
    # A restarted broker answers every message it does not know with DISCONNECT; two
    # heartbeats in flight give two DISCONNECTs for one worker.
    for _ in range(2):
        broker.send(Disconnect(reason="unknown worker"))
    assert registers_until_registered(broker) == 1


def test_a_new_broker_boot_id_makes_it_register_again(setup: Setup) -> None:
    broker, _ = setup.start()
    broker.register()
    broker.send(open_msg("s1", max_tokens=3))
    broker.expect(Token)
    broker.boot = "boot-2"  # the pumped heartbeats now say the broker restarted
    broker.register()
    broker.wait_load("sessions", 0)


def test_a_silent_broker_makes_it_reconnect_and_register_again(setup: Setup) -> None:
    # Horizon 3 x 0.1 s; the fake keeps heartbeating until the test silences it.
    broker, running = setup.start(liveness=3)
    broker.register()
    first = broker.identity
    broker.send(open_msg("s1", max_tokens=3))
    broker.expect(Token)
    broker.alive = False
    _, again = broker.expect(Register)
    assert again.identity == first  # the same worker, on a fresh socket
    broker.alive = True
    # The same broker (same boot id): it was only unreachable for a while.
    broker.send(Registered(worker_id=again.identity.decode(), boot=broker.boot))
    broker.wait_load("sessions", 0)  # the lost broker's sessions were dropped
    assert running.thread.is_alive()


# -- leaving -----------------------------------------------------------------------------


def test_sigterm_drains_then_leaves(setup: Setup, generator: Generator) -> None:
    broker, running = setup.start()
    broker.register()
    broker.send(open_msg("s1", max_tokens=4))
    first, _ = broker.expect(Token)
    running.worker.on_sigterm()

    # No new sessions while draining...
    broker.send(open_msg("s2", max_tokens=2))
    err, _ = broker.expect(Error)
    assert (err.session, err.code) == ("s2", ErrorCode.FULL)
    while not broker.last_draining:
        broker.expect(Heartbeat)

    # ... but the running one finishes.
    tokens = [first.token]
    for n in range(1, 4):
        broker.send(step("s1", n, tokens[-1]))
        tok, _ = broker.expect(Token)
        tokens.append(tok.token)
    assert tok.finish is Finish.LENGTH
    assert tokens == list(generator.generate(PROMPT, 4))

    broker.send(Close(session="s1", request_id="req-s1"))
    bye, _ = broker.expect(Disconnect)
    assert "shutting down" in bye.reason
    assert running.join() == 0


def test_a_second_sigterm_leaves_at_once(setup: Setup) -> None:
    broker, running = setup.start()
    broker.register()
    broker.send(open_msg("s1", max_tokens=50))
    broker.expect(Token)
    running.worker.on_sigterm()
    running.worker.on_sigterm()
    broker.expect(Disconnect)
    assert running.join() == 0


def test_sigint_leaves_with_disconnect(setup: Setup) -> None:
    broker, running = setup.start()
    broker.register()
    running.worker.on_sigint()
    broker.expect(Disconnect)
    assert running.join() == 0
