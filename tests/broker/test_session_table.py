"""The broker's session lifecycle without sockets: each SessionTable call returns the
messages to send, and these tests read them.

No torch here: the broker runs without the ML stack.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import pytest

from zmqllm.broker.registry import Registry, WorkerEntry
from zmqllm.broker.session_records import Out
from zmqllm.broker.session_table import MAX_ATTEMPTS, SessionTable
from zmqllm.bus.messages import (
    Activation,
    Ask,
    AskKind,
    Cached,
    Close,
    Delta,
    Error,
    ErrorCode,
    Finish,
    Open,
    Register,
    Step,
    Token,
)
from zmqllm.bus.prefix import prefix_chain
from zmqllm.bus.wire_types import Payload
from zmqllm.version import __version__

A, B = b"client-a", b"client-b"


def register(reg: Registry, wid: str, start: int, end: int, **kw: Any) -> WorkerEntry:
    values: dict[str, Any] = dict(
        start=start,
        end=end,
        num_layers=4,
        capacity=4,
        max_kv_tokens=1000,
        context=512,
        version=__version__,
        fingerprint="d1",
        served="m",
    )
    values.update(kw)
    return reg.add(wid.encode(), Register(**values))


def table(*ranges: tuple[str, int, int], **kw: Any) -> SessionTable:
    reg = Registry()
    for wid, start, end in ranges:
        register(reg, wid, start, end)
    return SessionTable(reg, "boot1", **kw)


def open_msg(session: str = "s1", prompt_len: int = 3, max_tokens: int = 5) -> Open:
    tokens = Payload(np.arange(prompt_len, dtype=np.int32), "int32")
    return Open(
        session=session,
        request_id="r1",
        max_tokens=max_tokens,
        prompt_len=prompt_len,
        tokens=tokens,
    )


def to(outs: list[Out], identity: bytes) -> list[Any]:
    return [o.msg if o.msg is not None else o.frames for o in outs if o.identity == identity]


def opens(outs: list[Out]) -> list[tuple[bytes, Open]]:
    return [(o.identity, o.msg) for o in outs if isinstance(o.msg, Open)]


def token(t: SessionTable, w: str, wire: str, step: int, attempt: int = 1, **kw: Any) -> list[Out]:
    worker = t.registry.workers[w]
    return t.on_token(worker, Token(session=wire, attempt=attempt, step=step, token=7, **kw), 0.0)


def test_open_sends_each_stage_its_open_later_stages_first() -> None:
    t = table(("w0", 0, 2), ("w1", 2, 4))
    outs = t.open(A, open_msg(), 0.0)
    sent = opens(outs)
    assert [ident for ident, _ in sent] == [b"w1", b"w0"]
    last, first = sent[0][1], sent[1][1]
    assert first.session == last.session != "s1"  # the broker's wire id, not the client's
    assert (first.attempt, first.stage, first.stages, first.next) == (1, 0, 2, "w1")
    assert (last.stage, last.next) == (1, "w0")  # the last stage's steps go to the first
    assert first.tokens is not None and last.tokens is None
    assert first.max_len == 8
    assert t.registry.workers["w0"].reserved_tokens == 8


def test_tokens_reach_the_client_and_the_next_step_goes_to_stage_0() -> None:
    t = table(("w0", 0, 2), ("w1", 2, 4))
    wire = opens(t.open(A, open_msg(), 0.0))[0][1].session
    outs = token(t, "w1", wire, 0, group=("g", 1))
    (to_client,) = to(outs, A)
    assert isinstance(to_client, Token)
    assert (to_client.session, to_client.step, to_client.route) == ("s1", 0, ("w0", "w1"))
    assert to_client.boot == "boot1"
    (step,) = to(outs, b"w0")
    assert isinstance(step, Step)
    assert (step.session, step.step, step.group) == (wire, 1, ("g", 1))
    assert outs[0].msg is step  # the next forward starts before the client is told
    # Later tokens carry no route; a repeated or skipped step is dropped.
    assert to(token(t, "w1", wire, 1), A)[0].route is None
    assert token(t, "w1", wire, 1) == []
    assert token(t, "w1", wire, 5) == []


def test_the_last_token_ends_the_session_everywhere() -> None:
    t = table(("w0", 0, 2), ("w1", 2, 4))
    wire = opens(t.open(A, open_msg(), 0.0))[0][1].session
    outs = token(t, "w1", wire, 0, finish=Finish.STOP)
    assert isinstance(to(outs, A)[0], Token)
    assert all(isinstance(m, Close) for m in to(outs, b"w0") + to(outs, b"w1"))
    assert not t.sessions and t.registry.workers["w0"].reserved_tokens == 0
    assert t.stats.finished == 1


def test_only_the_owner_can_cancel_and_is_told() -> None:
    t = table(("w", 0, 4))
    t.open(A, open_msg(), 0.0)
    assert t.cancel(B, "s1", 0.0) == []  # another client naming the same id
    assert len(t.sessions) == 1
    outs = t.cancel(A, "s1", 0.0)
    (err,) = to(outs, A)
    assert isinstance(err, Error) and err.code is ErrorCode.CANCELLED
    assert isinstance(to(outs, b"w")[0], Close)
    assert not t.sessions


def test_two_clients_may_use_the_same_session_id() -> None:
    t = table(("w", 0, 4))
    t.open(A, open_msg(), 0.0)
    outs = t.open(B, open_msg(), 0.0)
    assert len(opens(outs)) == 1 and len(t.sessions) == 2
    again = t.open(A, open_msg(), 0.0)
    assert to(again, A)[0].code is ErrorCode.BAD_REQUEST


def test_a_request_past_the_context_or_without_tokens_is_refused() -> None:
    t = table(("w", 0, 4))
    (err,) = to(t.open(A, open_msg(prompt_len=500, max_tokens=100), 0.0), A)
    assert err.code is ErrorCode.BAD_REQUEST and "context" in err.message
    bare = Open(session="s2", max_tokens=1, prompt_len=1)
    assert to(t.open(A, bare, 0.0), A)[0].code is ErrorCode.BAD_REQUEST
    assert not t.sessions and not t.queue


def test_a_full_queue_answers_busy() -> None:
    t = table(queue_size=1)
    assert t.open(A, open_msg("s1"), 0.0) == []  # queued: no worker yet
    (err,) = to(t.open(A, open_msg("s2"), 0.0), A)
    assert err.code is ErrorCode.BUSY


def test_full_before_the_first_token_retries_on_another_replica() -> None:
    t = table(("w0", 0, 4), ("w1", 0, 4))
    now = time.monotonic()  # the registry skips a full worker until now + full_backoff
    (first,) = opens(t.open(A, open_msg(), now))
    ident, msg = first
    w = t.registry.by_identity[ident]
    full = Error(code=ErrorCode.FULL, message="no room", session=msg.session, attempt=1)
    outs = t.on_worker_error(w, full, now)
    assert isinstance(to(outs, ident)[0], Close)  # attempt 1 freed there
    (retry,) = opens(outs)
    assert retry[0] != ident and retry[1].attempt == 2
    assert w.reserved_tokens == 0
    # A late message of attempt 1 matches nothing.
    assert t.on_token(w, Token(session=msg.session, attempt=1, step=0, token=1), 0.0) == []


def test_a_request_bounced_too_often_fails() -> None:
    t = table(("w", 0, 4))
    for attempt in range(1, MAX_ATTEMPTS + 1):
        s = next(iter(t.sessions.values()), None) if attempt > 1 else None
        if s is None:
            outs = t.open(A, open_msg(), 0.0)
            s = next(iter(t.sessions.values()))
        w = t.registry.workers["w"]
        w.full_until = 0.0
        err = Error(code=ErrorCode.FULL, message="", session=s.wire, attempt=s.attempt)
        outs = t.on_worker_error(w, err, 0.0)
    final = [m for m in to(outs, A) if isinstance(m, Error)]
    assert final and final[0].code is ErrorCode.NO_CAPACITY
    assert not t.sessions and not t.queue and t.registry.workers["w"].reserved_tokens == 0


def test_worker_lost_requeues_before_the_first_token_and_fails_after() -> None:
    t = table(("w0", 0, 4), ("w1", 0, 4))
    t.open(A, open_msg("s1"), 0.0)
    s1 = t.sessions[(A, "s1")]
    lost = s1.route[0]
    t.registry.remove(t.registry.workers[lost])
    outs = t.worker_lost(lost, "gone", 0.0)
    (retry,) = opens(outs)
    assert retry[1].attempt == 2 and retry[0] != lost.encode()
    assert to(outs, A) == []  # the client saw nothing

    s1 = t.sessions[(A, "s1")]
    token(t, s1.route[-1], s1.wire, 0, attempt=2)
    survivor = s1.route[0]
    t.registry.remove(t.registry.workers[survivor])
    (err,) = to(t.worker_lost(survivor, "gone too", 0.0), A)
    assert err.code is ErrorCode.WORKER_LOST and err.message == "gone too"
    assert not t.sessions


def test_activations_go_to_the_next_stage_only_from_the_route() -> None:
    t = table(("w0", 0, 2), ("w1", 2, 4), ("x", 0, 2))
    t.registry.workers["x"].full_until = 1e18  # keep it off the route
    wire = opens(t.open(A, open_msg(), 0.0))[0][1].session
    hidden = Payload(np.zeros((3, 8), np.float32), "float32")
    act = Activation(session=wire, attempt=1, hidden=hidden)
    outs = t.on_activation(t.registry.workers["w0"], act, ["frames"], 0.0)
    assert outs == [Out.to_worker(b"w1", frames=["frames"])]
    assert t.on_activation(t.registry.workers["x"], act, ["f"], 0.0) == []  # off the route
    assert t.on_activation(t.registry.workers["w1"], act, ["f"], 0.0) == []  # the last stage


KEY0, KEY1, KEY2 = ("0" * 39 + c for c in "abc")  # three CURVE public keys (Z85)


def peered_table(*ranges: tuple[str, int, int, str]) -> SessionTable:
    """Workers with peer links (id, start, end, endpoint; "" for none); keys by order."""
    reg = Registry()
    for (wid, start, end, peer), key in zip(ranges, (KEY0, KEY1, KEY2), strict=False):
        register(reg, wid, start, end, peer=peer).key = key
    return SessionTable(reg, "boot1")


def test_a_peered_route_names_each_stage_its_neighbours() -> None:
    t = peered_table(
        ("w0", 0, 1, "tcp://127.0.0.1:7000"),
        ("w1", 1, 3, "tcp://127.0.0.1:7001"),
        ("w2", 3, 4, "tcp://127.0.0.1:7002"),
    )
    got = {o.stage: (ident, o) for ident, o in opens(t.open(A, open_msg(), 0.0))}
    # Each stage: its results go to the next worker's endpoint under that worker's key,
    # and only the previous worker (with its key) may send it work; stage 0's previous
    # and the last stage's next are each other.
    want = {0: ("w1", 7001, KEY1, "w2", KEY2), 1: ("w2", 7002, KEY2, "w0", KEY0)}
    want[2] = ("w0", 7000, KEY0, "w1", KEY1)
    for stage, (nxt, port, key, prev, prev_key) in want.items():
        ident, o = got[stage]
        assert ident == f"w{stage}".encode()
        assert (o.next, o.next_peer, o.next_key) == (nxt, f"tcp://127.0.0.1:{port}", key)
        assert (o.prev, o.prev_key) == (prev, prev_key)


def test_a_route_with_a_worker_without_peer_link_goes_through_the_broker() -> None:
    t = peered_table(("w0", 0, 2, "tcp://127.0.0.1:7000"), ("w1", 2, 4, ""))
    for _, o in opens(t.open(A, open_msg(), 0.0)):
        assert (o.next_peer, o.next_key, o.prev, o.prev_key) == ("", "", "", "")
    # One stage alone needs no peer link.
    t = peered_table(("w", 0, 4, "tcp://127.0.0.1:7000"))
    ((_, o),) = opens(t.open(A, open_msg(), 0.0))
    assert (o.next_peer, o.prev) == ("", "")


def test_a_stepped_token_goes_to_the_client_only() -> None:
    t = peered_table(("w0", 0, 2, "tcp://127.0.0.1:7000"), ("w1", 2, 4, "tcp://127.0.0.1:7001"))
    wire = opens(t.open(A, open_msg(), 0.0))[0][1].session
    w1 = t.registry.workers["w1"]
    outs = t.on_token(w1, Token(session=wire, attempt=1, step=0, token=7, stepped=True), 1.0)
    assert [o.identity for o in outs] == [A] and outs[0].msg.token == 7
    assert t.stats.relayed == 0 and t.stats.tokens == 1
    # Unstepped (the peer link could not take it): the broker sends the step itself.
    outs = t.on_token(w1, Token(session=wire, attempt=1, step=1, token=8), 2.0)
    assert [o.identity for o in outs] == [b"w0", A]
    assert isinstance(outs[0].msg, Step) and outs[0].msg.step == 2
    assert t.stats.relayed == 1


def test_tick_fails_old_queued_requests_and_idle_sessions() -> None:
    t = table(("w", 0, 2), queue_timeout=5.0, session_timeout=10.0)
    t.open(A, open_msg("q"), 0.0)  # no complete route: waits
    (err,) = to(t.tick(6.0, "no capacity: test"), A)
    assert err.code is ErrorCode.NO_CAPACITY and err.message == "no capacity: test"

    register(t.registry, "v", 2, 4)
    t.open(A, open_msg("s"), 100.0)
    assert t.tick(105.0, "") == []
    outs = t.tick(111.0, "")
    (err,) = to(outs, A)
    assert err.code is ErrorCode.TIMEOUT
    assert isinstance(to(outs, b"w")[0], Close) and isinstance(to(outs, b"v")[0], Close)
    assert t.registry.workers["w"].reserved_tokens == 0 and not t.sessions


def test_a_lost_client_frees_its_sessions_and_queue_place() -> None:
    t = table(("w", 0, 4), ("h", 0, 2))
    t.registry.workers["w"].capacity = 1
    t.open(A, open_msg("s1"), 0.0)
    t.open(A, open_msg("s2"), 0.0)  # queued behind s1 (no room)
    t.open(B, open_msg("s3"), 0.0)
    outs = t.client_lost(A, ErrorCode.SLOW_CONSUMER, "not reading", 0.0)
    assert to(outs, A) == []  # nothing more is sent to a client that does not read
    assert [k[0] for k in t.sessions] == [B]
    assert all(p.client != A for p in t.queue)


@pytest.mark.parametrize("code", [ErrorCode.INTERNAL, ErrorCode.BAD_REQUEST])
def test_a_worker_error_fails_the_session_with_its_code(code: ErrorCode) -> None:
    t = table(("w", 0, 4))
    wire = opens(t.open(A, open_msg(), 0.0))[0][1].session
    err = Error(code=code, message="bad step", session=wire, attempt=1)
    outs = t.on_worker_error(t.registry.workers["w"], err, 0.0)
    (to_client,) = to(outs, A)
    assert to_client.code is code and to_client.session == "s1"
    assert t.stats.failed == 1


# -- prefix caching ----------------------------------------------------------------------


def test_every_stage_gets_the_prompts_prefix_keys() -> None:
    t = table(("w0", 0, 2), ("w1", 2, 4))
    msg = open_msg(prompt_len=40)
    sent = opens(t.open(A, msg, 0.0))
    assert msg.tokens is not None
    chain = prefix_chain(msg.tokens.array)
    assert len(chain) == 2
    assert all(o.prefix == chain for _, o in sent)
    # A prompt shorter than a block and its last token has none.
    assert all(o.prefix == () for _, o in opens(t.open(A, open_msg("s2", 16), 0.0)))


def test_what_a_later_stage_holds_is_told_to_stage_0_only() -> None:
    t = table(("w0", 0, 2), ("w1", 2, 4))
    wire = opens(t.open(A, open_msg(prompt_len=40), 0.0))[0][1].session
    w0, w1 = t.registry.workers["w0"], t.registry.workers["w1"]
    outs = t.on_cached(w1, Cached(session=wire, attempt=1, tokens=32), 1.0)
    (told,) = to(outs, b"w0")
    assert isinstance(told, Cached)
    assert (told.session, told.attempt, told.tokens, told.request_id) == (wire, 1, 32, "r1")
    assert len(outs) == 1
    # From stage 0 itself, of an earlier attempt, or for another session: dropped.
    assert t.on_cached(w0, Cached(session=wire, attempt=1, tokens=32), 1.0) == []
    assert t.on_cached(w1, Cached(session=wire, attempt=2, tokens=32), 1.0) == []
    assert t.on_cached(w1, Cached(session="nope", attempt=1, tokens=32), 1.0) == []


def test_a_session_goes_to_the_replicas_that_were_sent_its_prefix() -> None:
    t = table(("a0", 0, 2), ("a1", 2, 4), ("b0", 0, 2), ("b1", 2, 4))
    system = open_msg("s1", prompt_len=60, max_tokens=5)
    first = [ident for ident, _ in opens(t.open(A, system, 0.0))]
    # Busy with s1, those replicas are more loaded; a new prompt goes to the others.
    other = Open(
        session="s2",
        max_tokens=5,
        prompt_len=60,
        tokens=Payload(np.arange(100, 160, dtype=np.int32), "int32"),
    )
    second = [ident for ident, _ in opens(t.open(A, other, 0.0))]
    assert set(first).isdisjoint(second)
    # Both routes equally loaded now: the same prompt again follows its prefix.
    for name, route in (("s3", first), ("s4", second)):
        again = system if name == "s3" else other
        msg = Open(session=name, max_tokens=5, prompt_len=60, tokens=again.tokens, request_id="r")
        assert [ident for ident, _ in opens(t.open(B, msg, 0.0))] == route
    # A lost worker's keys are forgotten.
    t.registry.remove(t.registry.workers["a0"])
    t.worker_lost("a0", "gone", 0.0)
    assert t.prefixes.held("a0", prefix_chain(np.arange(60, dtype=np.int32))) == 0


def test_a_replays_last_stage_gets_the_tokens_so_far_when_it_needs_them() -> None:
    from zmqllm.bus.sampling_params import SamplingParams

    t = table(("w0", 0, 2), ("w1", 2, 4))
    tokens = Payload(np.arange(10, 20, dtype=np.int32), "int32")

    def replay(session: str, **sampling: Any) -> dict[bytes, Open]:
        msg = Open(
            session=session,
            max_tokens=5,
            prompt_len=10,
            tokens=tokens,
            sampling=SamplingParams(first_step=3, **sampling),
        )
        return dict(opens(t.open(A, msg, 0.0)))

    sent = replay("pen", frequency_penalty=1.0)
    assert sent[b"w1"].generated == (17, 18, 19)  # the last stage: the stream's 3 tokens
    assert sent[b"w0"].generated == ()
    assert replay("gram", grammar='{"grammars": []}')[b"w1"].generated == (17, 18, 19)
    assert replay("free")[b"w1"].generated == ()  # plain sampling needs no history


def test_prefix_affinity_gives_way_to_load_past_the_slack() -> None:
    t = table(("a0", 0, 4), ("b0", 0, 4))
    t.registry.affinity_slack = 2
    for w in t.registry.workers.values():
        w.capacity = 16
    tokens = Payload(np.arange(60, dtype=np.int32), "int32")
    routes = []
    for i in range(6):
        msg = Open(session=f"s{i}", max_tokens=5, prompt_len=60, tokens=tokens)
        routes += [ident for ident, _ in opens(t.open(A, msg, 0.0))]
    # The prefix follows a0 while it has at most 2 sessions more than b0; then load
    # decides (b0), b0 learns the prefix, and with both holding it load decides again.
    assert routes == [b"a0", b"a0", b"a0", b"b0", b"b0", b"b0"]


# -- many models, text sessions --------------------------------------------------------------


def two_models() -> SessionTable:
    """A two-stage model "tiny" and a remote text model "remote" with two workers."""
    reg = Registry()
    register(reg, "t0", 0, 2, served="tiny")
    register(reg, "t1", 2, 4, served="tiny")
    for wid in ("r1", "r2"):
        text = dict(num_layers=1, served="remote", text_model=True, fingerprint="r")
        register(reg, wid, 0, 1, **text)
    return SessionTable(reg, "boot1")


def ask_msg(session: str = "q1", model: str = "remote", max_tokens: int = 8) -> Ask:
    body = Payload(np.frombuffer(b'{"messages": []}', np.uint8).copy(), "uint8")
    return Ask(
        session=session,
        request_id="r2",
        model=model,
        kind=AskKind.CHAT,
        max_tokens=max_tokens,
        body=body,
    )


def delta(t: SessionTable, w: str, wire: str, step: int, attempt: int = 1, **kw: Any) -> list[Out]:
    msg = Delta(session=wire, attempt=attempt, step=step, text=f"p{step}", **kw)
    return t.on_delta(t.registry.workers[w], msg, 0.0)


def test_each_request_goes_to_the_model_it_names() -> None:
    t = two_models()
    # Unnamed with two models served: refused, naming them.
    (err,) = to(t.open(A, open_msg("s2"), 0.0), A)
    assert err.code is ErrorCode.BAD_REQUEST and "remote, tiny" in err.message
    outs = t.open(A, dataclasses.replace(open_msg("s3"), model="tiny"), 0.0)
    assert [m.model for _, m in opens(outs)] == ["tiny", "tiny"]
    (ask,) = to(t.open(B, ask_msg(), 0.0), b"r1")
    assert isinstance(ask, Ask) and ask.model == "remote" and ask.body.array.tobytes()
    assert ask.session != "q1" and ask.attempt == 1


def test_a_request_of_the_wrong_kind_for_its_model_is_refused() -> None:
    t = two_models()
    (err,) = to(t.open(A, ask_msg(model="tiny"), 0.0), A)
    assert err.code is ErrorCode.BAD_REQUEST and "'tiny'" in err.message
    (err,) = to(t.open(A, dataclasses.replace(open_msg(), model="remote"), 0.0), A)
    assert err.code is ErrorCode.BAD_REQUEST and "ASK" in err.message


def test_deltas_reach_the_client_in_order_and_the_last_ends_the_session() -> None:
    t = two_models()
    (ask,) = to(t.open(B, ask_msg(), 0.0), b"r1")
    assert delta(t, "r1", ask.session, 1) == []  # out of order
    assert delta(t, "r2", ask.session, 0) == []  # not on the route
    (first,) = to(delta(t, "r1", ask.session, 0), B)
    assert (first.session, first.step, first.text, first.route) == ("q1", 0, "p0", ("r1",))
    assert first.boot == "boot1"
    outs = delta(t, "r1", ask.session, 1, finish="stop", prompt_tokens=3, completion_tokens=2)
    (last,) = to(outs, B)
    assert (last.finish, last.prompt_tokens, last.completion_tokens, last.route) == (
        "stop",
        3,
        2,
        None,
    )
    assert [type(m) for m in to(outs, b"r1")] == [Close]
    assert not t.sessions and t.registry.workers["r1"].reserved_tokens == 0


def test_a_text_worker_lost_before_its_first_piece_requeues_the_request() -> None:
    t = two_models()
    to(t.open(B, ask_msg(), 0.0), b"r1")
    t.registry.remove(t.registry.workers["r1"])
    (again,) = to(t.worker_lost("r1", "gone", 0.0), b"r2")
    assert isinstance(again, Ask) and again.attempt == 2
    assert to(delta(t, "r2", again.session, 0, attempt=2), B)
    t.registry.remove(t.registry.workers["r2"])
    (err,) = to(t.worker_lost("r2", "gone", 0.0), B)
    assert err.code is ErrorCode.WORKER_LOST


def test_a_model_without_room_holds_back_only_its_own_requests() -> None:
    reg = Registry()
    register(reg, "t0", 0, 4, served="tiny", capacity=1)
    register(reg, "r1", 0, 1, num_layers=1, served="remote", text_model=True, capacity=1)
    t = SessionTable(reg, "boot1")
    tiny = dataclasses.replace(open_msg(), model="tiny")
    t.open(A, tiny, 0.0)
    assert to(t.open(A, dataclasses.replace(tiny, session="s2"), 0.0), b"t0") == []
    (ask,) = to(t.open(A, ask_msg(), 0.0), b"r1")  # behind the queued tiny request
    assert isinstance(ask, Ask)
    errs = to(t.tick(100.0, lambda model: f"none for {model}"), A)
    assert [e.message for e in errs] == ["none for tiny"]


def test_requests_for_models_nobody_serves_fill_only_their_share_of_the_queue() -> None:
    t = two_models()
    t.queue_size = 8
    for i in range(2):
        assert to(t.open(A, ask_msg(f"n{i}", model="nope"), 0.0), A) == []  # queued
    (err,) = to(t.open(A, ask_msg("n2", model="nope"), 0.0), A)
    assert err.code is ErrorCode.BUSY and "'nope'" in err.message
    # The served models still have the rest of the queue.
    full = Registry()
    register(full, "t0", 0, 4, served="tiny", capacity=1)
    t2 = SessionTable(full, "boot1", queue_size=8)
    tiny = dataclasses.replace(open_msg(), model="tiny")
    for i in range(5):
        t2.open(A, dataclasses.replace(tiny, session=f"s{i}"), 0.0)
    assert len(t2.queue) == 4 and len(t2.sessions) == 1


def test_a_request_queued_before_its_model_came_is_checked_when_it_does() -> None:
    """An ASK waiting for "m" when a model of layers registers as "m": refused, not sent
    to a worker that cannot take it."""
    reg = Registry()
    t = SessionTable(reg, "boot1")
    assert t.open(A, ask_msg(model="m"), 0.0) == []
    register(reg, "w", 0, 4, served="m")
    (err,) = to(t.dispatch(0.0), A)
    assert err.code is ErrorCode.BAD_REQUEST and "'m'" in err.message
    assert not t.queue and not t.sessions and reg.workers["w"].reserved_tokens == 0


def test_a_token_on_a_text_session_is_ignored() -> None:
    t = two_models()
    (ask,) = to(t.open(B, ask_msg(), 0.0), b"r1")
    assert token(t, "r1", ask.session, 0) == []
    assert t.sessions[(B, "q1")].next_step == 0


def test_a_speculative_pass_steps_once_with_the_next_proposals() -> None:
    # Speculative decoding: a pass's tokens reach the client in order; only the last,
    # with the last stage's proposals, steps stage 0.
    reg = Registry()
    register(reg, "w0", 0, 2)
    register(reg, "w1", 2, 4, proposes=True)
    t = SessionTable(reg, "boot1")
    sent = opens(t.open(A, open_msg(max_tokens=8), 0.0))
    last, first = sent[0][1], sent[1][1]
    # The last stage proposes from the prompt: it is given the prompt's ids too.
    assert last.tokens is not None and first.tokens is not None and last.speculative
    wire = first.session
    token(t, "w1", wire, 0, draft=(3, 4))
    outs = token(t, "w1", wire, 1, more=True)
    assert to(outs, b"w0") == [] and [m.step for m in to(outs, A)] == [1]
    outs = token(t, "w1", wire, 2, draft=(5,))
    (step,) = to(outs, b"w0")
    assert isinstance(step, Step) and (step.step, step.token, step.draft) == (3, 7, (5,))
    assert [m.step for m in to(outs, A)] == [2]
    assert t.sessions[(A, "s1")].next_step == 3


def test_a_request_without_speculation_keeps_the_prompt_from_the_last_stage() -> None:
    reg = Registry()
    register(reg, "w0", 0, 2)
    register(reg, "w1", 2, 4, proposes=True)
    t = SessionTable(reg, "boot1")
    msg = dataclasses.replace(open_msg(), speculative=False)
    last, first = (m for _, m in opens(t.open(A, msg, 0.0)))
    assert last.tokens is None and not last.speculative and first.tokens is not None
