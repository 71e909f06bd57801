"""The worker's socket loop against a fake broker: a ROUTER the test drives by hand, with a
real tiny-model stage behind the worker. The worker runs in a thread; the test stops it
with on_sigint (what SIGINT does) and always joins it.

Waits are bounded and generous; nothing asserts how long anything took.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import zmq

torch = pytest.importorskip("torch")

from zmqllm import __version__  # noqa: E402
from zmqllm.config import Config  # noqa: E402
from zmqllm.engine.generator import Generator  # noqa: E402
from zmqllm.protocol import (  # noqa: E402
    Header,
    MsgType,
    Payload,
    decode,
    encode,
    encode_header,
)
from zmqllm.worker import Worker, load_stage  # noqa: E402

pytestmark = pytest.mark.torch

TIMEOUT = 15.0  # bound on any single wait
INTERVAL = 0.1  # heartbeat interval, both ways
PUMP = 0.05  # how often the fake broker heartbeats the worker while the test waits
MAX_SESSIONS = 4
MAX_KV_TOKENS = 4096


@dataclass
class Msg:
    identity: bytes
    header: Header
    payloads: list[Payload]
    frames: list[bytes]  # header and payload frames as received


class FakeBroker:
    """A ROUTER standing in for the broker's backend. While the test waits it heartbeats
    the worker (unless ``alive`` is False) and notes the load the worker reports."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A reconnecting worker comes back under the same routing id.
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.bind("tcp://127.0.0.1:0")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.identity: bytes | None = None
        self.boot = "boot-1"
        self.alive = True
        self.last_load: dict[str, Any] = {}
        self._next_pump = 0.0

    def send(self, header: Header, payloads: Sequence[Payload] = ()) -> None:
        assert self.identity is not None, "the worker has not said hello yet"
        self.sock.send_multipart([self.identity, *encode(header, payloads)])

    def send_raw(self, frames: Sequence[bytes]) -> None:
        assert self.identity is not None
        self.sock.send_multipart([self.identity, *frames])

    def _pump(self) -> None:
        now = time.monotonic()
        if self.alive and self.identity is not None and now >= self._next_pump:
            self._next_pump = now + PUMP
            self.send(Header(MsgType.HEARTBEAT, fields={"boot": self.boot}))

    def expect(
        self,
        msg_type: MsgType,
        timeout: float = TIMEOUT,
        also_skip: frozenset[MsgType] = frozenset(),
    ) -> Msg:
        """The next message of interest; it must be of ``msg_type``. Heartbeats and repeated
        REGISTERs (a worker repeats it until answered) are skipped unless asked for."""
        skip = ({MsgType.HEARTBEAT, MsgType.REGISTER} | also_skip) - {msg_type}
        deadline = time.monotonic() + timeout
        while True:
            msg = self.next_message(max(0.0, deadline - time.monotonic()))
            if msg.header.type in skip:
                continue
            assert msg.header.type is msg_type, f"expected {msg_type.value}, got {msg.header}"
            return msg

    def next_message(self, timeout: float = TIMEOUT) -> Msg:
        """The next message whatever its type (heartbeating the worker meanwhile)."""
        deadline = time.monotonic() + timeout
        while True:
            self._pump()
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no message from the worker within {timeout}s")
            if self.sock.poll(int(min(left, PUMP) * 1000) + 1):
                break
        identity, *frames = self.sock.recv_multipart()
        self.identity = identity
        header, payloads = decode(frames)
        if header.type is MsgType.HEARTBEAT and isinstance(header.fields.get("load"), dict):
            self.last_load = header.fields["load"]
        return Msg(identity, header, payloads, frames)

    def register(self) -> Msg:
        """Accept the worker's registration; returns its REGISTER."""
        reg = self.expect(MsgType.REGISTER)
        self.send(
            Header(
                MsgType.REGISTERED, fields={"worker_id": reg.identity.decode(), "boot": self.boot}
            )
        )
        # A heartbeat with a load only comes once the worker knows it is registered.
        self.expect(MsgType.HEARTBEAT)
        return reg

    def wait_load(self, key: str, value: Any) -> None:
        deadline = time.monotonic() + TIMEOUT
        while self.last_load.get(key) != value:
            assert time.monotonic() < deadline, f"load never showed {key}={value!r}"
            self.expect(MsgType.HEARTBEAT)


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
    ctx: zmq.Context
    model_dir: Path
    brokers: list[FakeBroker] = field(default_factory=list)
    workers: list[Running] = field(default_factory=list)

    def start(self, layers: str = "0:4", liveness: int = 30) -> tuple[FakeBroker, Running]:
        broker = FakeBroker(self.ctx)
        self.brokers.append(broker)
        cfg = Config()
        cfg.model.path = str(self.model_dir)
        cfg.worker.layers = layers
        cfg.worker.broker = broker.address
        cfg.worker.name = "test"
        cfg.worker.max_sessions = MAX_SESSIONS
        cfg.worker.max_kv_tokens = MAX_KV_TOKENS
        cfg.broker.heartbeat_interval = INTERVAL
        cfg.broker.heartbeat_liveness = liveness
        running = Running(Worker(cfg, load_stage(cfg), context=self.ctx))
        self.workers.append(running)
        return broker, running


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


def open_header(
    session: str,
    *,
    stage: int = 0,
    stages: int = 1,
    max_tokens: int = 5,
    prompt_len: int = 6,
    next_hop: str | None = None,
) -> Header:
    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        "prompt_len": prompt_len,
        "sampling": {"temperature": 0.0},
        "stop_ids": [],
        "stage": stage,
        "stages": stages,
        "max_len": prompt_len + max_tokens,
    }
    if next_hop is not None:
        fields["next"] = next_hop
    return Header(MsgType.OPEN, session, f"req-{session}", 0, fields)


def prompt_payload(tokens: Sequence[int] = PROMPT) -> list[Payload]:
    return [Payload(np.asarray(tokens, np.int32), "int32")]


def step(session: str, n: int, token: int) -> Header:
    return Header(MsgType.STEP, session, f"req-{session}", n, {"token": token})


def decode_all(broker: FakeBroker, session: str, max_tokens: int) -> list[int]:
    """Drive a whole-model worker's session from its first TOKEN to its finish."""
    tokens: list[int] = []
    for n in range(max_tokens):
        tok = broker.expect(MsgType.TOKEN)
        assert (tok.header.session, tok.header.step) == (session, n)
        tokens.append(tok.header.fields["token"])
        finish = tok.header.fields["finish"]
        if n + 1 < max_tokens:
            assert finish is None
            broker.send(step(session, n + 1, tokens[-1]))
        else:
            assert finish == "length"
    return tokens


# -- registration ------------------------------------------------------------------------


def test_registers_with_fingerprint_and_capacity(setup: Setup) -> None:
    broker, running = setup.start()
    reg = broker.register()
    f = reg.header.fields
    loaded = running.worker.loaded
    assert (f["start"], f["end"], f["num_layers"]) == (0, 4, 4)
    assert f["capacity"] == MAX_SESSIONS
    assert f["version"] == __version__
    assert f["fingerprint"] == loaded.fingerprint["digest"]
    assert f["info"]["fingerprint"] == loaded.fingerprint
    assert f["info"]["max_kv_tokens"] == MAX_KV_TOKENS
    assert f["info"]["context"] == 1024
    assert reg.identity.decode().startswith("w-test-0-4-")
    # Registered: heartbeats carry the stage's load.
    assert broker.last_load["sessions"] == 0
    assert broker.last_load["draining"] is False


def test_open_and_steps_continue_the_greedy_sequence(setup: Setup, generator: Generator) -> None:
    broker, _ = setup.start()
    broker.register()
    broker.send(open_header("s1", max_tokens=5), prompt_payload())
    tokens = decode_all(broker, "s1", 5)
    assert tokens == list(generator.generate(PROMPT, 5))
    broker.wait_load("sessions", 1)  # finished, but only CLOSE frees the cache
    broker.send(Header(MsgType.CLOSE, "s1", "req-s1"))
    broker.wait_load("sessions", 0)


def test_two_workers_make_a_pipeline(setup: Setup, generator: Generator) -> None:
    b0, _ = setup.start("0:2")
    b1, _ = setup.start("2:4")
    assert b0.register().header.fields["end"] == 2
    assert b1.register().header.fields["start"] == 2
    b1.send(open_header("s1", stage=1, stages=2, max_tokens=4, next_hop="w-a"))
    b0.send(open_header("s1", stage=0, stages=2, max_tokens=4, next_hop="w-b"), prompt_payload())
    tokens: list[int] = []
    for n in range(4):
        act = b0.expect(MsgType.ACTIVATION)
        assert (act.header.session, act.header.step) == ("s1", n)
        assert act.header.fields["final"] is True
        # Its forward's group: one result for the next worker the OPEN named.
        gid, size = act.header.fields["group"]
        assert gid.endswith("/w-b") and size == 1
        (hidden,) = act.payloads
        # Prefill carries one row per prompt token, a decode step one row.
        assert hidden.array.shape == (len(PROMPT) if n == 0 else 1, 64)
        b1.send_raw(act.frames)  # as the broker does: the frames go on untouched
        tok = b1.expect(MsgType.TOKEN)
        assert tok.header.step == n
        tokens.append(tok.header.fields["token"])
        if tok.header.fields["finish"] is None:
            assert tok.header.fields["group"][0].endswith("/w-a")  # its STEP goes to stage 0
            b0.send(step("s1", n + 1, tokens[-1]))
        else:
            assert "group" not in tok.header.fields  # no STEP follows a last token
    assert tok.header.fields["finish"] == "length"
    assert tokens == list(generator.generate(PROMPT, 4))


# -- bad input ---------------------------------------------------------------------------


def test_a_malformed_message_is_dropped_and_the_worker_keeps_working(
    setup: Setup, generator: Generator
) -> None:
    broker, _ = setup.start()
    broker.register()
    broker.send(open_header("s1", max_tokens=3), prompt_payload())
    first = broker.expect(MsgType.TOKEN)
    for frames in [
        [b"\xc1"],  # not msgpack
        [b"\x00\x01garbage"],
        [encode_header(step("s1", 1, 5), [("float32", [2])])],  # a tensor without a frame
        [b""],
    ]:
        broker.send_raw(frames)
    # An activation is meaningless to stage 0: dropped, not fatal.
    hidden = np.zeros((1, 64), np.float32)
    broker.send(Header(MsgType.ACTIVATION, "s1", "req-s1", 1, {}), [Payload(hidden, "float32")])
    broker.send(step("s1", 1, first.header.fields["token"]))
    second = broker.expect(MsgType.TOKEN)
    assert second.header.step == 1
    expected = list(generator.generate(PROMPT, 3))
    assert [first.header.fields["token"], second.header.fields["token"]] == expected[:2]


@pytest.mark.parametrize(
    ("fields", "payloads", "problem"),
    [
        ({"sampling": {"temperature": -1.0}}, None, "temperature"),
        ({"sampling": {"nucleus": 0.5}}, None, "nucleus"),
        ({}, [Payload(np.asarray([5, 999_999], np.int32), "int32")], "vocab"),
        ({}, [], "int32"),
        ({"max_len": 5000}, None, "context"),
    ],
)
def test_a_bad_open_gets_bad_request(
    setup: Setup, fields: dict[str, Any], payloads: list[Payload] | None, problem: str
) -> None:
    broker, _ = setup.start()
    broker.register()
    h = open_header("s1")
    h.fields.update(fields)
    broker.send(h, prompt_payload() if payloads is None else payloads)
    err = broker.expect(MsgType.ERROR)
    assert err.header.session == "s1"
    assert err.header.fields["code"] == "bad_request"
    assert problem in err.header.fields["message"]
    # The worker is fine: the next session works.
    broker.send(open_header("s2", max_tokens=1), prompt_payload())
    assert broker.expect(MsgType.TOKEN).header.session == "s2"


def test_open_beyond_capacity_answers_full(setup: Setup) -> None:
    broker, _ = setup.start()
    broker.register()
    for i in range(MAX_SESSIONS):
        broker.send(open_header(f"s{i}", max_tokens=2), prompt_payload())
    broker.send(open_header("extra", max_tokens=2), prompt_payload())
    # The admitted sessions' first tokens may come before or after the refusal.
    err = broker.expect(MsgType.ERROR, also_skip=frozenset({MsgType.TOKEN}))
    assert (err.header.session, err.header.fields["code"]) == ("extra", "full")


# -- the broker's word -------------------------------------------------------------------


def test_refused_makes_run_return_3(setup: Setup) -> None:
    broker, running = setup.start()
    broker.expect(MsgType.REGISTER)
    broker.send(Header(MsgType.REFUSED, fields={"reason": "sliding_window: 8 != 4"}))
    assert running.join() == 3


def registers_until_registered(broker: FakeBroker) -> int:
    """Answer the first REGISTER, then count every REGISTER the worker sent before its
    first heartbeat (which proves it read the answer)."""
    count = 1
    broker.expect(MsgType.REGISTER)
    broker.send(Header(MsgType.REGISTERED, fields={"worker_id": "w", "boot": broker.boot}))
    while True:
        msg = broker.next_message()
        if msg.header.type is MsgType.HEARTBEAT:
            return count
        assert msg.header.type is MsgType.REGISTER, msg.header
        count += 1


def test_one_register_per_connection(setup: Setup) -> None:
    # A second REGISTER from a registered identity makes the broker drop the worker's
    # sessions (it looks like a restarted worker): a worker must not repeat itself.
    broker, _ = setup.start()
    assert registers_until_registered(broker) == 1


def test_disconnect_makes_it_register_again(setup: Setup) -> None:
    broker, _ = setup.start()
    broker.register()
    broker.send(open_header("s1", max_tokens=3), prompt_payload())
    broker.expect(MsgType.TOKEN)
    broker.send(Header(MsgType.DISCONNECT, fields={"reason": "unknown worker: register again"}))
    broker.register()
    # Its sessions belonged to the broker that forgot them: dropped.
    broker.wait_load("sessions", 0)


def test_repeated_disconnects_make_one_register(setup: Setup) -> None:
    broker, _ = setup.start()
    broker.register()
    # A restarted broker answers every message it does not know with DISCONNECT; two
    # heartbeats in flight give two DISCONNECTs for one worker.
    for _ in range(2):
        broker.send(Header(MsgType.DISCONNECT, fields={"reason": "unknown worker"}))
    assert registers_until_registered(broker) == 1


def test_a_new_broker_boot_id_makes_it_register_again(setup: Setup) -> None:
    broker, _ = setup.start()
    broker.register()
    broker.send(open_header("s1", max_tokens=3), prompt_payload())
    broker.expect(MsgType.TOKEN)
    broker.boot = "boot-2"  # the pumped heartbeats now say the broker restarted
    broker.register()
    broker.wait_load("sessions", 0)


def test_a_silent_broker_makes_it_reconnect_and_register_again(setup: Setup) -> None:
    # Horizon 3 x 0.1 s; the fake keeps heartbeating until the test silences it.
    broker, running = setup.start(liveness=3)
    first = broker.register()
    broker.send(open_header("s1", max_tokens=3), prompt_payload())
    broker.expect(MsgType.TOKEN)
    broker.alive = False
    again = broker.expect(MsgType.REGISTER)
    assert again.identity == first.identity  # the same worker, on a fresh socket
    broker.alive = True
    # The same broker (same boot id): it was only unreachable for a while.
    broker.send(
        Header(
            MsgType.REGISTERED, fields={"worker_id": again.identity.decode(), "boot": broker.boot}
        )
    )
    broker.wait_load("sessions", 0)  # the lost broker's sessions were dropped
    assert running.thread.is_alive()


# -- leaving -----------------------------------------------------------------------------


def test_sigterm_drains_then_leaves(setup: Setup, generator: Generator) -> None:
    broker, running = setup.start()
    broker.register()
    broker.send(open_header("s1", max_tokens=4), prompt_payload())
    first = broker.expect(MsgType.TOKEN)
    running.worker.on_sigterm()

    # No new sessions while draining...
    broker.send(open_header("s2", max_tokens=2), prompt_payload())
    err = broker.expect(MsgType.ERROR)
    assert (err.header.session, err.header.fields["code"]) == ("s2", "full")
    broker.wait_load("draining", True)

    # ... but the running one finishes.
    tokens = [first.header.fields["token"]]
    for n in range(1, 4):
        broker.send(step("s1", n, tokens[-1]))
        tok = broker.expect(MsgType.TOKEN)
        tokens.append(tok.header.fields["token"])
    assert tok.header.fields["finish"] == "length"
    assert tokens == list(generator.generate(PROMPT, 4))

    broker.send(Header(MsgType.CLOSE, "s1", "req-s1"))
    bye = broker.expect(MsgType.DISCONNECT)
    assert "shutting down" in bye.header.fields["reason"]
    assert running.join() == 0


def test_a_second_sigterm_leaves_at_once(setup: Setup) -> None:
    broker, running = setup.start()
    broker.register()
    broker.send(open_header("s1", max_tokens=50), prompt_payload())
    broker.expect(MsgType.TOKEN)
    running.worker.on_sigterm()
    running.worker.on_sigterm()
    broker.expect(MsgType.DISCONNECT)
    assert running.join() == 0


def test_sigint_leaves_with_disconnect(setup: Setup) -> None:
    broker, running = setup.start()
    broker.register()
    running.worker.on_sigint()
    broker.expect(MsgType.DISCONNECT)
    assert running.join() == 0


# -- taking turns on shared cores (cpu_lock) ---------------------------------------------


def locked_stage_worker(tiny_model_dir: Path, tmp_path: Path, sessions: Sequence[str]) -> Worker:
    """A stage-0 worker with cpu_lock whose sessions' prompts have run: all of them
    are "on the next stage" until a STEP comes back."""
    from zmqllm.sampling_params import SamplingParams

    cfg = Config()
    cfg.model.path = str(tiny_model_dir)
    cfg.worker.layers = "0:2"
    cfg.worker.cpu_lock = str(tmp_path / "cpu.lock")
    worker = Worker(cfg, load_stage(cfg), context=zmq.Context.instance())
    for sid in sessions:
        worker.stage.open(
            sid, "", 20, 8, SamplingParams(), frozenset(), np.asarray([5, 6], np.int32)
        )
    worker.stage.run()
    return worker


@pytest.fixture
def slow_waits(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """The wait constants scaled far above scheduling noise: no assertion below
    depends on two statements running within a few milliseconds."""
    import zmqllm.engine.stage as stage_module
    import zmqllm.worker as worker_module

    t = SimpleNamespace(hop=1.0, group=5.0, bound=30.0, lock_max=300.0)
    monkeypatch.setattr(worker_module, "HOP_GRACE_S", t.hop)
    monkeypatch.setattr(worker_module, "GROUP_WAIT_S", t.group)
    monkeypatch.setattr(worker_module, "LOCK_WAIT_MAX_S", t.lock_max)
    monkeypatch.setattr(stage_module, "COALESCE_MAX_S", t.bound)
    return t


def lock_is_free(path: str) -> bool:
    """Whether another process could take the lock now (and leave it as it was)."""
    import fcntl
    import os

    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing the descriptor drops a lock taken through it
    return True


def test_cpu_lock_waits_for_sessions_while_another_stage_computes(
    tiny_model_dir: Path, tmp_path: Path, slow_waits: SimpleNamespace
) -> None:
    """Ready work waits while another stage holds the lock and, once it lets go, until
    the other sessions' messages stop coming; then it runs. Without cpu_lock: never."""
    import fcntl
    import os

    from zmqllm.worker import LOCK_POLL_S

    t = slow_waits
    worker = locked_stage_worker(tiny_model_dir, tmp_path, ("a", "b"))
    cfg, stage = worker.cfg, worker.stage
    stage.step("a", 1, 9)
    other = os.open(cfg.worker.cpu_lock, os.O_RDWR)  # another stage's lock handle
    try:
        fcntl.flock(other, fcntl.LOCK_EX)
        assert worker._coalesce_wait() == LOCK_POLL_S  # it computes: b is coming
        fcntl.flock(other, fcntl.LOCK_UN)
        assert 0.0 < worker._coalesce_wait() <= t.hop  # just let go: b is on its way
        assert lock_is_free(cfg.worker.cpu_lock)  # within our bound: others may go first
        worker._lock_busy_at -= 2 * t.hop
        assert worker._coalesce_wait() == 0.0  # quiet for longer than the grace: run
        worker._last_work_at = time.monotonic()  # a message just came: more may follow
        assert 0.0 < worker._coalesce_wait() <= t.hop
        worker._last_work_at -= 2 * t.hop

        # Time spent while another stage computes does not count against the bound...
        for w in stage._ready:
            w.ready_at -= 2 * t.bound
        fcntl.flock(other, fcntl.LOCK_EX)
        assert worker._coalesce_wait() == LOCK_POLL_S
        fcntl.flock(other, fcntl.LOCK_UN)
        # ... and past the bound, the stage keeps the turn it sees while b comes in
        # (a third worker sharing the cores could otherwise take every turn).
        assert 0.0 < worker._coalesce_wait() <= t.hop
        assert not lock_is_free(cfg.worker.cpu_lock)
        worker._lock_busy_at -= 2 * t.hop
        assert worker._coalesce_wait() == 0.0
        sent: list[Header] = []
        worker.send = lambda h, payloads=None: sent.append(h)  # type: ignore[method-assign]
        worker.run_batch()  # its forward lets go of the lock
        assert lock_is_free(cfg.worker.cpu_lock)
        assert [(h.type, h.session) for h in sent] == [(MsgType.ACTIVATION, "a")]
        stage.step("a", 2, 9)

        # A stage that never lets go for long is queued on, not polled, forever.
        fcntl.flock(other, fcntl.LOCK_EX)
        for w in stage._ready:
            w.ready_at -= t.lock_max
        assert worker._coalesce_wait() == 0.0
        fcntl.flock(other, fcntl.LOCK_UN)
        cfg.worker.cpu_lock = ""
        plain = Worker(cfg, worker.loaded, context=zmq.Context.instance())
        assert plain._coalesce_wait() == 0.0  # stages computing at once never wait
        stage.step("b", 2, 9)
        assert worker._coalesce_wait() == 0.0  # everyone is ready
    finally:
        os.close(other)


def test_a_stage_waits_for_the_rest_of_a_group_it_has_seen_part_of(
    tiny_model_dir: Path, tmp_path: Path, slow_waits: SimpleNamespace
) -> None:
    """Tagged results say how many of their forward come here: the stage waits for
    the rest (a few ms late is no reason to split the batch) and runs once they are
    all in; a malformed tag counts as none (the quiet-time rule)."""
    from zmqllm.worker import MAX_GROUPS

    t = slow_waits
    worker = locked_stage_worker(tiny_model_dir, tmp_path, ("a", "b", "c", "d"))
    worker.stage.step("a", 1, 9)  # b, c, d are elsewhere
    assert worker._coalesce_wait() == 0.0  # nothing says they are coming
    worker._note_arrival(["w-1/7/w0", 3])
    assert t.hop < worker._coalesce_wait() <= t.group  # 2 more of group 7
    worker._note_arrival(["w-1/7/w0", 3])
    assert worker._coalesce_wait() > t.hop
    worker._note_arrival(["w-1/7/w0", 3])
    assert worker._groups == {}
    assert worker._coalesce_wait() == 0.0  # the group is complete: run now
    worker._note_arrival(["w-1/8/w0", 2])
    worker._groups["w-1/8/w0"][2] -= t.group  # the rest never came (cancelled)
    assert worker._coalesce_wait() == 0.0
    for bad in (["g"], "g", [1, 2], ["g", True], ["g", 2.5], None):
        worker._last_work_at -= 2 * t.hop
        worker._note_arrival(bad)
        assert worker._groups.keys() == {"w-1/8/w0"}
        assert 0.0 < worker._coalesce_wait() <= t.hop  # untagged: quiet-time rule
    # Groups that never complete do not pile up.
    for i in range(3 * MAX_GROUPS):
        worker._note_arrival([f"w-2/{i}/w0", 2])
        worker._groups[f"w-2/{i}/w0"][2] -= t.group
    assert len(worker._groups) <= MAX_GROUPS


def test_results_are_tagged_with_their_group_per_next_worker(tiny_model_dir: Path) -> None:
    from zmqllm.sampling_params import SamplingParams
    from zmqllm.engine.stage import Output

    cfg = Config()
    cfg.model.path = str(tiny_model_dir)
    worker = Worker(cfg, load_stage(cfg), context=zmq.Context.instance())
    for sid, hop in (("a", "w1"), ("b", "w2"), ("c", "w1"), ("d", "w1")):
        s = worker.stage.open(sid, "", 20, 8, SamplingParams(), frozenset(), None)
        s.next_hop = hop
    worker.stage.stats.forwards = 12
    outs = [
        Output("a", "", 1, True, token=5),
        Output("b", "", 1, True, token=5),
        Output("c", "", 1, True, token=5, finish="length"),  # the broker ends it: no STEP
        Output("d", "", 1, True, token=5),
        Output("gone", "", 1, True, token=5),  # closed meanwhile
    ]
    g = f"{worker.identity}/12"
    assert worker._tag_groups(outs) == [
        [f"{g}/w1", 2],
        [f"{g}/w2", 1],
        None,
        [f"{g}/w1", 2],
        [f"{g}/", 1],
    ]
