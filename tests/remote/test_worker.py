"""The remote worker (zmqllm/remote/worker.py; remote/main.py starts it) without a broker:
its messages go through a fake link, its upstream is a fake OpenAI-compatible server in
this process. No torch.

The broker loop's part (``handle``, ``drain_inbox``, ``flush_outbox``) runs in the test's
thread, as the worker's own loop would; the streams run on the worker's upstream thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import zmq

from testbed.fake_upstream import FakeUpstream
from zmqllm.bus.messages import (
    Ask,
    AskKind,
    Cancel,
    Close,
    Delta,
    Error,
    ErrorCode,
    Message,
    Step,
)
from zmqllm.bus.protocol import decode, encode
from zmqllm.bus.wire_types import Payload, SessionKey
from zmqllm.config.settings import Config, ConfigError
from zmqllm.log import configure_logging
from zmqllm.remote.main import MAX_KEY_BYTES, read_api_key, serve
from zmqllm.remote.upstream import Upstream, UpstreamSettings
from zmqllm.remote.worker import RemoteWorker, TokenFloor
from zmqllm.worker.inbox import Reset, take_in

KEY = "sk-unit-SECRET-31337"
SETTLE_S = 10.0  # the longest any session here may take to end


class FakeLink:
    """What the worker uses of BrokerLink: the lock, the inbox, and a send that keeps
    each message, decoded as the broker would."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.inbox: deque[Any] = deque()
        self.sent: list[tuple[SessionKey | None, Message]] = []
        self.refuse = ""  # when set: why send fails

    def send(self, frames: list[Any], key: SessionKey | None = None) -> str:
        if self.refuse:
            return self.refuse
        self.sent.append((key, decode(frames)))
        return ""

    def stop(self, reason: str = "") -> None:
        pass

    def of(self, session: str) -> list[Message]:
        return [m for _, m in self.sent if getattr(m, "session", None) == session]


@pytest.fixture
def up() -> Iterator[FakeUpstream]:
    with FakeUpstream(model_id="m1") as fake:
        yield fake


def make_worker(url: str, max_sessions: int = 4, **upstream: Any) -> RemoteWorker:
    cfg = Config()
    cfg.worker.max_sessions = max_sessions
    values: dict[str, Any] = {
        "url": url,
        "model": "m1",
        "api_key": KEY,
        "backoff": 0.01,
        "retries": 0,
        "stall_timeout": 1.0,
    }
    values.update(upstream)
    return RemoteWorker(cfg, UpstreamSettings(**values), "served-m1", context=zmq.Context())


@pytest.fixture
def worker(up: FakeUpstream) -> Iterator[RemoteWorker]:
    w = make_worker(up.url)
    w.link = FakeLink()  # type: ignore[assignment]
    w._thread.start()
    try:
        yield w
    finally:
        w.close()
        w.ctx.term()


def link_of(w: RemoteWorker) -> FakeLink:
    assert isinstance(w.link, FakeLink)
    return w.link


def ask(
    session: str = "s1",
    fields: dict[str, Any] | None = None,
    kind: AskKind = AskKind.CHAT,
    max_tokens: int = 16,
    raw: bytes | None = None,
    request_id: str = "r1",
) -> Ask:
    if fields is None:
        fields = (
            {"messages": [{"role": "user", "content": "hi there"}]}
            if kind is AskKind.CHAT
            else {"prompt": "once upon"}
        )
    data = json.dumps(fields).encode() if raw is None else raw
    return Ask(
        session=session,
        attempt=1,
        request_id=request_id,
        model="served-m1",
        kind=kind,
        max_tokens=max_tokens,
        body=Payload(np.frombuffer(data, np.uint8).copy(), "uint8"),
    )


def settle(w: RemoteWorker, session: str = "s1", timeout: float = SETTLE_S) -> list[Message]:
    """Run the broker loop's side until the session is over; what it sent."""
    key = SessionKey(session, 1)
    deadline = time.monotonic() + timeout
    while key in w.tasks:
        assert time.monotonic() < deadline, "the session did not end"
        w.flush_outbox()
        time.sleep(0.002)
    return link_of(w).of(session)


def pump_until(w: RemoteWorker, enough: int, session: str = "s1") -> list[Message]:
    deadline = time.monotonic() + SETTLE_S
    while len(link_of(w).of(session)) < enough:
        assert time.monotonic() < deadline, "too few messages"
        w.flush_outbox()
        time.sleep(0.002)
    return link_of(w).of(session)


def only_error(sent: list[Message]) -> Error:
    errors = [m for m in sent if isinstance(m, Error)]
    assert len(errors) == 1 and sent[-1] is errors[0], sent
    return errors[0]


# -- the key file ------------------------------------------------------------------------
def test_no_key_file_is_no_key() -> None:
    assert read_api_key("") == ""


def test_a_key_is_read_without_its_line_end(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text(f"  {KEY}\r\n\n")
    assert read_api_key(str(path)) == KEY


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"", "one key on one line"),
        (b" \n\t\n", "one key on one line"),
        (f"{KEY}\nsecond-line-SECRET".encode(), "one key on one line"),
        (f"{KEY} trailing-SECRET".encode(), "one key on one line"),
        (b"k" * (MAX_KEY_BYTES + 1), "one key on one line"),
        ("sk-\u00e9t\u00e9-SECRET".encode(), "printable ASCII"),
        (b"sk-\x00-SECRET", "printable ASCII"),
        (b"sk-\xff\xfe-SECRET", "printable ASCII"),
    ],
)
def test_an_unusable_key_file_is_named_never_shown(
    tmp_path: Path, content: bytes, why: str
) -> None:
    path = tmp_path / "key"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=why) as caught:
        read_api_key(str(path))
    message = str(caught.value)
    assert str(path) in message
    assert "SECRET" not in message and "kkkk" not in message


def test_a_missing_key_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read it") as caught:
        read_api_key(str(tmp_path / "absent"))
    assert "absent" in str(caught.value)
    with pytest.raises(ConfigError, match="cannot read it"):
        read_api_key(str(tmp_path))  # a folder


def test_an_endless_key_file_is_not_read_whole() -> None:
    # /dev/zero never ends: reading it all would hang and fill memory.
    with pytest.raises(ConfigError, match="one key on one line"):
        read_api_key("/dev/zero")


# -- what the broker sees ----------------------------------------------------------------
def test_the_registration_holds_no_key_and_no_url(up: FakeUpstream) -> None:
    url = up.url.replace("http://", f"http://user:{KEY}@") + f"?key={KEY}"
    w = make_worker(url)
    try:
        reg = w.link.register
        assert reg.text_model and reg.served == "served-m1" and reg.device == "remote"
        assert reg.model == {"remote_model": "m1"} and reg.fingerprint == "remote:m1"
        assert reg.capacity == 4
        wire = b"".join(bytes(f) for f in encode(reg))
        assert KEY.encode() not in wire and str(up.port).encode() not in wire
    finally:
        w.ctx.term()


def test_the_start_line_shows_no_credentials(up: FakeUpstream, restore_logging: None) -> None:
    stream = io.StringIO()
    configure_logging("worker", "debug", "json", stream=stream)
    url = up.url.replace("http://", f"http://user:{KEY}@") + f"?key={KEY}"
    w = make_worker(url)
    # The real link, never connected: the loop ends before its first turn.
    w.link.start = lambda: None  # type: ignore[method-assign]
    w.on_sigint()  # the loop ends before its first turn
    assert w.run() == 0
    w.ctx.term()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    (started,) = [line for line in lines if line["event"] == "remote worker started"]
    assert started["upstream"] == f"http://127.0.0.1:{up.port}/v1"
    assert KEY not in stream.getvalue()


# -- sessions ----------------------------------------------------------------------------
def test_a_chat_streams_its_deltas_then_the_finish(worker: RemoteWorker, up: FakeUpstream) -> None:
    worker.handle(ask())
    sent = settle(worker)
    assert all(isinstance(m, Delta) for m in sent), sent
    deltas = [m for m in sent if isinstance(m, Delta)]
    assert "".join(d.text for d in deltas) == "echo: hi there"
    assert [d.step for d in deltas] == list(range(len(deltas)))
    assert {(d.attempt, d.request_id) for d in deltas} == {(1, "r1")}
    last = deltas[-1]
    assert (last.finish, last.prompt_tokens, last.completion_tokens) == ("stop", 2, 3)
    assert [d.finish for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    (body,) = up.requests
    assert body["messages"] == [{"role": "user", "content": "hi there"}]
    assert (body["model"], body["max_tokens"], body["stream"]) == ("m1", 16, True)
    assert up.headers[-1]["authorization"] == f"Bearer {KEY}"
    assert worker.tasks == {} and not worker.outbox


def test_a_long_piece_goes_in_deltas_the_wire_takes(worker: RemoteWorker) -> None:
    """10,000 three-byte characters in one upstream chunk: cut into DELTAs each of which
    decodes (a header string holds 16 KiB), together the whole text in order."""
    content = "字" * 10_000
    worker.handle(ask(fields={"messages": [{"role": "user", "content": content}]}, max_tokens=100))
    deltas = [m for m in settle(worker) if isinstance(m, Delta)]
    assert len(deltas) >= 3
    for d in deltas:
        assert decode(encode(d)) == d
    assert "".join(d.text for d in deltas) == "echo: " + content


def test_an_upstream_past_max_tokens_is_cut(worker: RemoteWorker, up: FakeUpstream) -> None:
    """2,000 pieces of a word each for max_tokens 4: the worker stops reading past the
    slack (16 tokens, a word being one at least) and ends the session with "length"."""
    up.mode = "flood"
    worker.handle(ask(max_tokens=4))
    deltas = [m for m in settle(worker) if isinstance(m, Delta)]
    texts = [d for d in deltas if d.text]
    assert 4 <= len(texts) <= 4 + 16
    assert deltas[-1].finish == "length"


def test_a_completion_is_asked_of_the_completions_endpoint(
    worker: RemoteWorker, up: FakeUpstream
) -> None:
    worker.handle(ask(kind=AskKind.COMPLETION, max_tokens=2))
    deltas = settle(worker)
    assert "".join(m.text for m in deltas if isinstance(m, Delta)) == "echo: once"
    assert isinstance(deltas[-1], Delta) and deltas[-1].finish == "length"
    assert up.paths[-1] == "POST /v1/completions"
    assert up.requests[-1]["prompt"] == "once upon"


@pytest.mark.parametrize("closing", [Close, Cancel])
def test_close_and_cancel_end_the_upstream_stream(
    worker: RemoteWorker, up: FakeUpstream, closing: type[Close | Cancel]
) -> None:
    up.mode = "slow"
    worker.handle(ask())
    pump_until(worker, 2)
    worker.handle(closing(session="s1", attempt=1, request_id="r1"))
    assert worker.tasks == {}
    assert up.wait_disconnect(5)
    # Nothing more goes out for it, whatever the task had left in the outbox.
    count = len(link_of(worker).sent)
    for _ in range(50):
        worker.flush_outbox()
        time.sleep(0.005)
    assert len(link_of(worker).sent) == count
    assert not any(isinstance(m, Error) for _, m in link_of(worker).sent)


def test_a_close_of_another_attempt_leaves_the_session(
    worker: RemoteWorker, up: FakeUpstream
) -> None:
    up.mode = "slow"
    worker.handle(ask())
    worker.handle(Close(session="s1", attempt=2, request_id="r1"))
    assert SessionKey("s1", 1) in worker.tasks
    worker.handle(Close(session="s1", attempt=1, request_id="r1"))
    assert worker.tasks == {}


@pytest.mark.parametrize(
    ("mode", "code"),
    [
        ("status_400", ErrorCode.BAD_REQUEST),
        ("status_401", ErrorCode.UPSTREAM_ERROR),
        ("status_429", ErrorCode.BUSY),
        ("status_500", ErrorCode.UPSTREAM_ERROR),
        ("error_mid_stream", ErrorCode.UPSTREAM_ERROR),
        ("close_early", ErrorCode.UPSTREAM_ERROR),
        ("stall", ErrorCode.TIMEOUT),
    ],
)
def test_an_upstream_failure_fails_the_session_with_its_code(
    worker: RemoteWorker, up: FakeUpstream, mode: str, code: ErrorCode
) -> None:
    up.mode = mode
    worker.handle(ask())
    sent = settle(worker)
    error = only_error(sent)
    assert (error.code, error.session, error.attempt, error.request_id) == (code, "s1", 1, "r1")
    assert KEY not in error.message
    texts = "".join(m.text for m in sent if isinstance(m, Delta))
    assert texts == ("echo: hi" if mode in ("error_mid_stream", "close_early", "stall") else "")
    assert not any(isinstance(m, Delta) and m.finish for m in sent)


def test_a_full_worker_refuses_a_session(up: FakeUpstream) -> None:
    w = make_worker(up.url, max_sessions=1)
    w.link = FakeLink()  # type: ignore[assignment]
    w._thread.start()
    try:
        up.mode = "slow"
        w.handle(ask("s1"))
        w.handle(ask("s2"))
        assert only_error(link_of(w).of("s2")).code is ErrorCode.FULL
        assert list(w.tasks) == [SessionKey("s1", 1)]
    finally:
        w.close()
        w.ctx.term()


def test_a_draining_worker_takes_no_session(worker: RemoteWorker, up: FakeUpstream) -> None:
    worker.on_sigterm()
    worker.handle(ask())
    assert only_error(link_of(worker).of("s1")).code is ErrorCode.FULL
    assert up.requests == []
    worker.on_sigterm()  # the second one stops the loop
    assert worker._stop


@pytest.mark.parametrize(
    ("fields", "raw", "named"),
    [
        ({"messages": "hi"}, None, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "top_p": 9}, None, "top_p"),
        (None, b"not json", "not JSON"),
        (None, b"[1, 2]", "JSON object"),
    ],
)
def test_a_bad_request_is_refused_before_the_upstream(
    worker: RemoteWorker,
    up: FakeUpstream,
    fields: dict[str, Any] | None,
    raw: bytes | None,
    named: str,
) -> None:
    worker.handle(ask(fields=fields, raw=raw))
    error = only_error(link_of(worker).of("s1"))
    assert error.code is ErrorCode.BAD_REQUEST and named in error.message
    assert worker.tasks == {} and up.requests == []


def test_a_repeated_ask_runs_once(worker: RemoteWorker, up: FakeUpstream) -> None:
    worker.handle(ask())
    worker.handle(ask())
    settle(worker)
    assert len(up.requests) == 1
    assert sum(isinstance(m, Delta) and bool(m.finish) for m in link_of(worker).of("s1")) == 1


def test_a_layer_message_is_refused(worker: RemoteWorker) -> None:
    worker.handle(Step(session="s1", attempt=1, request_id="r1", token=5))
    error = only_error(link_of(worker).of("s1"))
    assert error.code is ErrorCode.BAD_REQUEST and "step" in error.message


def test_a_malformed_message_costs_nothing(worker: RemoteWorker) -> None:
    entry = take_in([b"garbage"], worker.faults, "the test")  # as the link takes it in
    assert entry is None
    assert link_of(worker).sent == []
    assert worker.faults.counts["malformed"] == 1


def test_a_reset_forgets_every_session_but_not_a_new_one(
    worker: RemoteWorker, up: FakeUpstream
) -> None:
    up.mode = "slow"
    worker.handle(ask())
    pump_until(worker, 1)  # the upstream stream is open
    link_of(worker).inbox.append(Reset("the broker restarted"))
    worker.drain_inbox()
    assert worker.tasks == {}
    assert up.wait_disconnect(5)
    # The same key, taken anew before the old task's end mark was flushed.
    worker.handle(ask())
    worker.flush_outbox()
    assert SessionKey("s1", 1) in worker.tasks
    # It runs on: its pieces go out (the old task's were dropped with it).
    before = len(link_of(worker).of("s1"))
    pump_until(worker, before + 2)


def test_a_reply_that_cannot_be_encoded_fails_its_session(
    worker: RemoteWorker, up: FakeUpstream
) -> None:
    up.mode = "slow"
    worker.handle(ask())
    pump_until(worker, 1)
    bad = Delta(session="s1", attempt=1, request_id="r1", step=0, text="a\ud800b")
    worker.send(bad, SessionKey("s1", 1))
    assert worker.tasks == {}
    error = only_error(link_of(worker).of("s1"))
    assert error.code is ErrorCode.INTERNAL
    assert up.wait_disconnect(5)


def test_a_message_the_link_cannot_queue_ends_its_session(
    worker: RemoteWorker, up: FakeUpstream
) -> None:
    up.mode = "slow"
    worker.handle(ask())
    link_of(worker).refuse = "send queue to the broker is full"
    deadline = time.monotonic() + SETTLE_S
    while worker.tasks:
        assert time.monotonic() < deadline
        worker.flush_outbox()
        time.sleep(0.002)
    assert up.wait_disconnect(5)


def test_the_session_log_holds_no_key(
    worker: RemoteWorker, up: FakeUpstream, restore_logging: None
) -> None:
    stream = io.StringIO()
    configure_logging("worker", "debug", "json", stream=stream)
    for mode in ("ok", "status_401", "error_mid_stream"):
        up.mode = mode
        worker.handle(ask())
        settle(worker)
    assert "session finished" in stream.getvalue()
    assert "upstream failed; session failed" in stream.getvalue()
    assert KEY not in stream.getvalue()


# -- what an upstream sends: canned bytes -------------------------------------------------
def sse(*chunks: dict[str, Any], done: bool = True) -> bytes:
    events = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks)
    return events + (b"data: [DONE]\n\n" if done else b"")


def chat_chunk(text: str | None = None, finish: str | None = None) -> dict[str, Any]:
    delta = {} if text is None else {"content": text}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


@contextlib.contextmanager
def canned_worker(answer: Callable[[str], bytes]) -> Iterator[RemoteWorker]:
    """A worker whose upstream streams, in reads of 4 KiB, the bytes ``answer`` gives for
    the request's last message."""

    async def handler(request: httpx.Request) -> httpx.Response:
        raw = answer(json.loads(request.content)["messages"][-1]["content"])

        async def body() -> Any:
            for start in range(0, len(raw), 4096):
                yield raw[start : start + 4096]

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    w = make_worker("http://upstream.test/v1")
    asyncio.run(w.upstream.aclose())
    w.upstream = Upstream(w.upstream.settings, transport=httpx.MockTransport(handler))
    w.link = FakeLink()  # type: ignore[assignment]
    w._thread.start()
    try:
        yield w
    finally:
        w.close()
        w.ctx.term()


def say(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}]}


def test_an_answer_sent_a_character_an_event_comes_whole() -> None:
    """47 events of one character each for max_tokens 16: more events than max_tokens and
    its slack, but 12 words, 12 tokens by the upstream's count. Nothing is cut, and the
    finish is the upstream's own."""
    text = "the cat sat on the mat and then the dog came by"
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 12}}
    raw = sse(*(chat_chunk(c) for c in text), chat_chunk(finish="stop"), usage)
    with canned_worker(lambda _: raw) as w:
        w.handle(ask(max_tokens=16))
        deltas = [m for m in settle(w) if isinstance(m, Delta)]
    assert len(text) > 16 + 16
    assert "".join(d.text for d in deltas) == text
    last = deltas[-1]
    assert (last.finish, last.prompt_tokens, last.completion_tokens) == ("stop", 3, 12)


def test_an_upstream_counting_past_max_tokens_is_cut_by_its_own_count() -> None:
    """A count the upstream sends along the way is the answer's length: one word of 40
    tokens' worth, past max_tokens 4 and its slack, is cut there."""
    raw = sse(
        *(chat_chunk("a") | {"usage": {"completion_tokens": n}} for n in range(1, 41)),
        chat_chunk(finish="stop"),
    )
    with canned_worker(lambda _: raw) as w:
        w.handle(ask(max_tokens=4))
        deltas = [m for m in settle(w) if isinstance(m, Delta)]
    assert "".join(d.text for d in deltas) == "a" * (4 + 16)
    assert deltas[-1].finish == "length"


@pytest.mark.parametrize(
    "pieces",
    [["one two  three"], list("one two  three"), ["on", "e t", "wo ", " ", "thr", "ee"]],
    ids=["whole", "characters", "split"],
)
def test_the_token_floor_counts_words_however_the_text_is_cut(pieces: list[str]) -> None:
    floor = TokenFloor()
    for piece in pieces:
        floor.add(piece)
    assert (floor.words, floor.chars, floor.least) == (3, 14, 3)
    floor.add("", reported=7)
    assert floor.least == 7


def test_an_oversized_event_fails_only_its_session(restore_logging: None) -> None:
    """One session's upstream sends an event of 1 MiB and more, in lines of 3 bytes: that
    session fails with a clear error, logged with its request id; the other session on
    the same worker, at the same time, is answered whole."""
    stream = io.StringIO()
    configure_logging("worker", "debug", "json", stream=stream)
    head = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}],"pad":[\n'
    hostile = sse(chat_chunk("a"), done=False)
    hostile += head + b"data: 1,\n" * ((1 << 20) // 3 + 64) + b"data: 1]}\n\n"
    fine = sse(chat_chunk("fine"), chat_chunk(finish="stop"))
    with canned_worker(lambda said: hostile if said == "hostile" else fine) as w:
        w.handle(ask("bad", say("hostile"), request_id="r-bad"))
        w.handle(ask("good", say("hello"), request_id="r-good"))
        bad, good = settle(w, "bad"), settle(w, "good")
    error = only_error(bad)
    assert (error.code, error.request_id) == (ErrorCode.UPSTREAM_ERROR, "r-bad")
    assert "sent an event over 1 MiB" in error.message
    assert [m.text for m in bad if isinstance(m, Delta)] == ["a"]
    assert "".join(m.text for m in good if isinstance(m, Delta)) == "fine"
    assert isinstance(good[-1], Delta) and good[-1].finish == "stop"
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    (failed,) = [line for line in lines if line["event"] == "upstream stream failed"]
    assert failed["request_id"] == "r-bad" and failed["reason"] == "event_too_large"
    (ended,) = [line for line in lines if line["event"] == "upstream failed; session failed"]
    assert ended["request_id"] == "r-bad" and ended["code"] == "upstream_error"


# -- serve -------------------------------------------------------------------------------
def remote_config(url: str, **worker: Any) -> Config:
    cfg = Config()
    cfg.security.insecure = True
    cfg.worker.remote = url
    for key, value in worker.items():
        setattr(cfg.worker, key, value)
    return cfg


def test_an_upstream_id_that_is_no_model_name_is_a_config_error() -> None:
    with FakeUpstream(model_id="my model") as up, pytest.raises(ConfigError, match="served-name"):
        serve(remote_config(up.url))


def test_an_unreachable_upstream_without_a_model_id_fails_at_start() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = remote_config(f"http://127.0.0.1:{port}/v1", remote_retries=0)
    assert serve(cfg) == 1


def test_a_bad_key_file_fails_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("two\nlines")
    cfg = remote_config(
        "http://127.0.0.1:9/v1", remote_model="m", api_key_file=str(tmp_path / "key")
    )
    with pytest.raises(ConfigError, match="one key on one line"):
        serve(cfg)


def test_the_url_may_come_from_a_file(tmp_path: Path) -> None:
    from zmqllm.remote.main import read_remote_url

    assert read_remote_url("http://u.test/v1") == "http://u.test/v1"
    path = tmp_path / "url"
    path.write_text("https://u.test/v1?key=k\n")
    assert read_remote_url(f"@{path}") == "https://u.test/v1?key=k"
    for bad in ("", "two\nlines"):
        path.write_text(bad)
        with pytest.raises(ConfigError, match="must hold one URL on one line") as err:
            read_remote_url(f"@{path}")
        assert "u.test" not in str(err.value)
    with pytest.raises(ConfigError, match="cannot read it"):
        read_remote_url(f"@{tmp_path / 'missing'}")
