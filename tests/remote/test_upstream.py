"""The upstream client (zmqllm/remote/upstream.py) against a live fake OpenAI-compatible server,
and against canned bytes for the stream-parsing corners (no torch)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import pickle
import socket
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest

from testbed.fake_upstream import FakeUpstream
from zmqllm.log import configure_logging
from zmqllm.remote.sse import Delta
from zmqllm.remote.upstream import Upstream, UpstreamError, UpstreamSettings, shown_url

KEY = "sk-test-SECRET-4242"
CHAT = {"messages": [{"role": "user", "content": "hello there world"}], "temperature": 0.5}


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    yield
    assert not [t for t in threading.enumerate() if t.name == "fake-upstream"]


@pytest.fixture
def up() -> Iterator[FakeUpstream]:
    with FakeUpstream() as fake:
        yield fake


def settings(url: str, **overrides: Any) -> UpstreamSettings:
    values: dict[str, Any] = {"url": url, "model": "m1", "api_key": KEY, "backoff": 0.01}
    values.update(overrides)
    return UpstreamSettings(**values)


def run(
    upstream_settings: UpstreamSettings,
    kind: str = "chat",
    body: dict[str, Any] = CHAT,
    transport: httpx.AsyncBaseTransport | None = None,
) -> tuple[list[Delta], UpstreamError | None]:
    """Every delta of one stream, and the error that ended it (None: it ended well)."""

    async def go() -> tuple[list[Delta], UpstreamError | None]:
        upstream = Upstream(upstream_settings, transport=transport)
        deltas: list[Delta] = []
        try:
            async with contextlib.aclosing(upstream.stream(kind, body)) as stream:
                async for delta in stream:
                    deltas.append(delta)
        except UpstreamError as exc:
            return deltas, exc
        finally:
            await upstream.aclose()
        return deltas, None

    return asyncio.run(go())


def text_of(deltas: list[Delta]) -> str:
    return "".join(d.text for d in deltas)


def test_chat_streams_the_reply_with_its_usage(up: FakeUpstream) -> None:
    deltas, error = run(settings(up.url))
    assert error is None
    assert text_of(deltas) == "echo: hello there world"
    assert [d.finish for d in deltas if d.finish] == ["stop"]
    assert (deltas[-1].prompt_tokens, deltas[-1].completion_tokens) == (3, 4)
    (body,) = up.requests
    assert body["model"] == "m1" and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"] == CHAT["messages"] and body["temperature"] == 0.5
    assert up.paths == ["POST /v1/chat/completions"]
    assert up.headers[0]["authorization"] == f"Bearer {KEY}"
    assert up.headers[0]["accept"] == "text/event-stream"


def test_completion_streams_and_max_tokens_cuts_with_length(up: FakeUpstream) -> None:
    deltas, error = run(settings(up.url + "/"), "completion", {"prompt": "a b c d", "seed": 7})
    assert error is None and text_of(deltas) == "echo: a b c d"
    assert up.paths == ["POST /v1/completions"] and up.requests[0]["seed"] == 7
    deltas, error = run(settings(up.url), "completion", {"prompt": "a b c d", "max_tokens": 2})
    assert error is None and text_of(deltas) == "echo: a"
    assert [d.finish for d in deltas if d.finish] == ["length"]
    assert (deltas[-1].prompt_tokens, deltas[-1].completion_tokens) == (4, 2)


def test_no_key_sends_no_authorization(up: FakeUpstream) -> None:
    assert run(settings(up.url, api_key=""))[1] is None
    assert "authorization" not in up.headers[0]


def test_model_resolved_from_the_models_list(up: FakeUpstream) -> None:
    up.model_id = "served-model-7"
    deltas, error = run(settings(up.url, model=""))
    assert error is None and text_of(deltas) == "echo: hello there world"
    assert up.paths == ["GET /v1/models", "POST /v1/chat/completions"]
    assert up.requests[0]["model"] == "served-model-7"

    async def resolve_twice() -> list[str]:
        upstream = Upstream(settings(up.url, model=""))
        try:
            return [await upstream.resolve_model(), await upstream.resolve_model()]
        finally:
            await upstream.aclose()

    assert asyncio.run(resolve_twice()) == ["served-model-7"] * 2
    assert up.paths.count("GET /v1/models") == 2  # one per Upstream: the id is kept


def test_status_400_is_a_bad_request_with_the_upstream_message(up: FakeUpstream) -> None:
    up.mode = "status_400"
    deltas, error = run(settings(up.url))
    assert deltas == [] and error is not None
    assert (error.code, error.status) == ("bad_request", 400)
    assert "max_tokens is out of range" in error.message
    assert "POST /v1/chat/completions" in error.message and "127.0.0.1" not in error.message
    assert len(up.requests) == 1  # never retried


def test_status_401_blames_the_key_without_showing_it(up: FakeUpstream) -> None:
    up.mode = "status_401"
    _, error = run(settings(up.url))
    assert error is not None and (error.code, error.status) == ("upstream_error", 401)
    assert "API key" in error.message and "Incorrect API key provided" in error.message
    assert KEY not in error.message and KEY not in str(error) and KEY not in repr(error)
    assert len(up.requests) == 1
    _, error = run(settings(up.url, api_key=""))
    assert error is not None and "none set" in error.message


@pytest.mark.parametrize("status", [429, 500, 503])
def test_refusals_are_retried_then_the_stream_goes_through(up: FakeUpstream, status: int) -> None:
    up.mode, up.refusal_status, up.refusals = "refuse_then_ok", status, 2
    deltas, error = run(settings(up.url))
    assert error is None and text_of(deltas) == "echo: hello there world"
    assert len(up.requests) == 3


def test_refusals_of_the_models_list_are_retried(up: FakeUpstream) -> None:
    up.mode, up.refusals = "refuse_then_ok", 1
    assert run(settings(up.url, model=""))[1] is None
    assert up.paths == ["GET /v1/models"] * 2 + ["POST /v1/chat/completions"]


def test_the_fake_refuses_afresh_each_time_the_mode_is_set(up: FakeUpstream) -> None:
    # A test sharing one fake with others still sees the refusals it asked for.
    for _ in range(2):
        up.mode, up.refusals = "refuse_then_ok", 1
        assert run(settings(up.url, retries=0))[1] is not None
        assert run(settings(up.url, retries=0))[1] is None
    assert len(up.requests) == 4


@pytest.mark.parametrize(
    ("mode", "code"), [("status_500", "upstream_error"), ("status_429", "busy")]
)
def test_persistent_refusals_fail_after_the_retries(up: FakeUpstream, mode: str, code: str) -> None:
    up.mode = mode
    _, error = run(settings(up.url, retries=2))
    assert error is not None and error.code == code and error.status == int(mode[-3:])
    assert len(up.requests) == 3


def test_connection_refused_is_retried_then_fails(log_stream: io.StringIO) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _, error = run(settings(f"http://127.0.0.1:{port}/v1"))
    assert error is not None and error.code == "upstream_error" and error.status is None
    assert "could not connect to upstream POST /v1/chat/completions" in error.message
    assert f"127.0.0.1:{port}" not in error.message  # clients read it: no address
    assert log_stream.getvalue().count("upstream failed; retrying") == 3


def test_an_error_event_mid_stream_ends_it_without_retry(up: FakeUpstream) -> None:
    up.mode = "error_mid_stream"
    deltas, error = run(settings(up.url))
    assert text_of(deltas) == "echo: hello"
    assert error is not None and error.code == "upstream_error" and "boom" in error.message
    assert len(up.requests) == 1


def test_a_stream_closed_early_is_an_error(up: FakeUpstream) -> None:
    up.mode = "close_early"
    deltas, error = run(settings(up.url))
    assert text_of(deltas) == "echo: hello"
    assert error is not None and error.code == "upstream_error"
    assert "stream ended before the answer finished" in error.message
    assert len(up.requests) == 1


def test_a_stalled_stream_times_out(up: FakeUpstream) -> None:
    up.mode = "stall"
    # The stall timeout fired (the fake would close the stream itself after 60 s: an
    # upstream_error, not a timeout).
    deltas, error = run(settings(up.url, stall_timeout=0.5))
    assert text_of(deltas) == "echo: hello"
    assert error is not None and error.code == "timeout"
    assert "sent nothing for 0.5 s mid-stream" in error.message
    assert up.wait_disconnect(30)  # the connection was closed, not left open


async def _two_slow_deltas(
    up: FakeUpstream, stop: Callable[[AsyncGenerator[Delta, None]], Awaitable[None]]
) -> None:
    upstream = Upstream(settings(up.url))
    try:
        stream = upstream.stream("chat", CHAT)
        assert [(await anext(stream)).text for _ in range(2)] == [" w0", " w1"]
        await stop(stream)
        assert await asyncio.to_thread(up.wait_disconnect, 2.0)
    finally:
        await upstream.aclose()


def test_closing_the_stream_closes_the_connection(up: FakeUpstream) -> None:
    up.mode = "slow"

    async def close(stream: AsyncGenerator[Delta, None]) -> None:
        await stream.aclose()

    asyncio.run(_two_slow_deltas(up, close))
    assert up.disconnects == 1


def test_cancelling_the_consumer_closes_the_connection(up: FakeUpstream) -> None:
    up.mode = "slow"

    async def cancel(stream: AsyncGenerator[Delta, None]) -> None:
        async def third() -> Delta:  # the task that runs the generator when it is cancelled
            return await anext(stream)

        task = asyncio.create_task(third())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(_two_slow_deltas(up, cancel))


def test_the_key_and_texts_never_reach_the_log(up: FakeUpstream, restore_logging: None) -> None:
    stream = io.StringIO()
    configure_logging("worker", level="debug", fmt="json", stream=stream)
    secret_words = {"messages": [{"role": "user", "content": "zebra-prompt-marker"}]}
    assert run(settings(up.url, model=""), body=secret_words)[1] is None
    for mode in ("status_401", "status_500", "error_mid_stream"):
        up.mode = mode
        assert run(settings(up.url), body=secret_words)[1] is not None
    logged = stream.getvalue()
    assert "upstream stream opened" in logged and "upstream failed; retrying" in logged
    assert KEY not in logged and "zebra-prompt-marker" not in logged and "boom" not in logged
    assert KEY not in repr(settings(up.url))


# The parsing corners, on canned bytes.


def canned(
    *pieces: bytes, status: int = 200, content_type: str = "text/event-stream"
) -> httpx.MockTransport:
    async def handler(request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            for piece in pieces:
                yield piece

        return httpx.Response(status, headers={"content-type": content_type}, content=body())

    return httpx.MockTransport(handler)


def sse(*events: str, end: bytes = b"data: [DONE]\n\n") -> bytes:
    return b"".join(f"data: {e}\n\n".encode() for e in events) + end


def test_noise_is_skipped_and_lines_may_split_anywhere() -> None:
    raw = (
        b": comment\r\nevent: message\r\nid: 1\r\nretry: 5\r\ndata: ping\r\n\r\n"
        b'data:{"choices":[{"index":0,"delta":{"content":"h\xc3\xa9"}}],"usage":null}\r\n\r\n'
        b'data: {"choices":[{"index":1,"delta":{"content":"other choice"}}]}\n\n'
        b"data: [1, 2]\n\n"
        b'data: {"choices":[{"index":0,"delta":{},'
        b'"finish_reason":"end_turn_of_a_very_long_reason_name"}]}\r'
        b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1}}\n\n'
        b"data: [DONE]\n\n"
        b'data: {"choices":[{"index":0,"delta":{"content":"after done"}}]}\n\n'
    )
    pieces = [raw[i : i + 7] for i in range(0, len(raw), 7)]
    deltas, error = run(settings("http://upstream.test/v1"), transport=canned(*pieces))
    assert error is None
    assert deltas == [
        Delta("hé"),
        Delta(finish="end_turn_of_a_very_long_reason_n"),
        Delta(prompt_tokens=5, completion_tokens=1),
    ]


def test_done_without_a_finish_is_a_stop_and_eof_after_a_finish_is_fine() -> None:
    chunk = '{"choices":[{"index":0,"text":"x"}]}'
    deltas, error = run(
        settings("http://u.test/v1"), "completion", {"prompt": "p"}, canned(sse(chunk))
    )
    assert error is None and deltas == [Delta("x"), Delta(finish="stop")]
    finished = '{"choices":[{"index":0,"text":"x","finish_reason":"length"}]}'
    transport = canned(sse(finished, end=b"data: " + finished.encode()))
    deltas, error = run(settings("http://u.test/v1"), "completion", {"prompt": "p"}, transport)
    assert error is None and [d.finish for d in deltas] == ["length", "length"]


@pytest.mark.parametrize(
    ("pieces", "words"),
    [
        ((b"data: " + b"x" * (1 << 20) + b"\n\n",), "over 1 MiB"),
        ((b"data: ", b"y" * (1 << 20), b"y\n"), "over 1 MiB"),
        ((sse('{"choices":{"0":1}}'),), "malformed"),
        ((sse('{"choices":[{"delta":{"content":5}}]}'),), "malformed"),
        ((sse('{"choices":[],"usage":{"prompt_tokens":"3"}}'),), "malformed"),
        ((b'data: {"choices":[{"delta":{"content":"\xff"}}]}\n\n',), "not UTF-8"),
        ((b"data: " + b"[" * 100_000 + b"\n\n",), "nested too deep"),
        ((sse(end=b""),), "stream ended before the answer finished"),
    ],
)
def test_bad_streams_are_upstream_errors(pieces: tuple[bytes, ...], words: str) -> None:
    _, error = run(settings("http://u.test/v1"), transport=canned(*pieces))
    assert error is not None and error.code == "upstream_error" and words in error.message


def test_a_lone_surrogate_becomes_a_character_the_wire_can_carry() -> None:
    # JSON may escape half a UTF-16 pair; left as it is, no UTF-8 message could carry it.
    chunk = '{"choices":[{"index":0,"delta":{"content":"a\\ud800b \\ud83d\\ude00"}}]}'
    finish = '{"choices":[{"index":0,"delta":{},"finish_reason":"x\\udc00"}]}'
    deltas, error = run(settings("http://u.test/v1"), transport=canned(sse(chunk, finish)))
    assert error is None
    assert deltas == [Delta("a?b \U0001f600"), Delta(finish="x?")]
    for delta in deltas:
        (delta.text + (delta.finish or "")).encode("utf-8")


def test_an_upstream_error_text_is_encodable() -> None:
    error = UpstreamError("upstream_error", "bad \udcff byte")
    assert error.message == "bad ? byte"
    error.message.encode("utf-8")


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://user:pw-hidden@h.test:8443/v1/?key=q-hidden", "http://h.test:8443/v1/"),
        ("https://api.example.com/v1", "https://api.example.com/v1"),
        ("http://[::1]:8080/v1#frag-hidden", "http://[::1]:8080/v1"),
    ],
)
def test_shown_url_drops_credentials_and_query(url: str, shown: str) -> None:
    assert shown_url(url) == shown


def test_a_json_answer_to_a_stream_request_is_an_error() -> None:
    transport = canned(b'{"choices":[]}', content_type="application/json")
    _, error = run(settings("http://u.test/v1"), transport=transport)
    assert error is not None and "not a stream" in error.message


def test_error_messages_are_short_and_hide_credentials() -> None:
    calls: list[httpx.Request] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        page = b"<html>\n<body>Bad gateway " + b"z" * 70_000 + b"</body></html>"
        return httpx.Response(502, content=page)

    url = "http://user:pw-hidden@upstream.test:8443/v1/?key=q-hidden"
    _, error = run(settings(url, retries=1), transport=httpx.MockTransport(handler))
    assert error is not None and error.code == "upstream_error" and error.status == 502
    assert len(calls) == 2 and calls[0].url.query == b"key=q-hidden"
    assert calls[0].url.path == "/v1/chat/completions"
    # Errors reach clients: the path, never where the upstream is.
    assert "POST /v1/chat/completions" in error.message and "upstream.test" not in error.message
    assert "<html> <body>Bad gateway zzz" in error.message and "\n" not in error.message
    assert "hidden" not in error.message and len(error.message) <= 1000
    again = pickle.loads(pickle.dumps(error))
    assert (again.code, again.message, again.status) == (error.code, error.message, 502)


def test_an_empty_models_list_is_an_error() -> None:
    transport = canned(b'{"object":"list","data":[]}', content_type="application/json")

    async def resolve() -> str:
        upstream = Upstream(settings("http://u.test/v1", model=""), transport=transport)
        try:
            return await upstream.resolve_model()
        finally:
            await upstream.aclose()

    with pytest.raises(UpstreamError, match="lists no models") as caught:
        asyncio.run(resolve())
    assert caught.value.code == "upstream_error"


def test_bad_arguments_fail_at_once() -> None:
    with pytest.raises(ValueError, match="http"):
        UpstreamSettings(url="127.0.0.1:8080/v1")
    with pytest.raises(ValueError, match="timeouts"):
        UpstreamSettings(url="http://u.test", stall_timeout=0)
    with pytest.raises(ValueError, match="code"):
        UpstreamError("nope", "x")
    upstream = Upstream(settings("http://u.test/v1"))
    with pytest.raises(ValueError, match="kind"):
        upstream.stream("embeddings", {})
    asyncio.run(upstream.aclose())


def test_the_fake_answers_whole_requests_too(up: FakeUpstream) -> None:
    # Not the client's concern, but other tests use the fake as a plain OpenAI server.
    with httpx.Client(base_url=up.url) as client:
        chat = client.post("/chat/completions", json={"model": "x", **CHAT}).json()
        completion = client.post("/completions", json={"prompt": "a b", "max_tokens": 2}).json()
    assert chat["object"] == "chat.completion" and chat["model"] == "x"
    assert chat["choices"][0]["message"]["content"] == "echo: hello there world"
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert chat["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert completion["object"] == "text_completion" and completion["model"] == "fake-model"
    assert completion["choices"][0]["text"] == "echo: a"
    assert completion["choices"][0]["finish_reason"] == "length"


def test_an_event_split_over_several_data_lines_is_joined() -> None:
    """As the SSE spec says: an event's data lines, joined with newlines (JSON allows the
    newline between tokens), make its data; the event ends at the blank line."""
    raw = (
        b'data: {"choices":[{"index":0,\n'
        b'data:  "delta":{"content":"two lines"}}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{},\r\n'
        b'data: "finish_reason":"stop"}]}\r\n\r\n'
        b"data: [DONE]\n\n"
    )
    deltas, error = run(settings("http://upstream.test/v1"), transport=canned(raw))
    assert error is None
    assert deltas == [Delta("two lines"), Delta(finish="stop")]


def test_a_crlf_split_between_two_reads_is_one_line_end() -> None:
    """A read that ends between "\\r" and "\\n" ends no event: the pair is one line end,
    so an event of several data lines stays whole however the bytes arrive."""
    raw = (
        b'data: {"choices":[{"index":0,\r\n'
        b'data: "delta":{"content":"crlf"}}]}\r\n\r\n'
        b'data: {"choices":[{"index":0,"delta":{},\r\n'
        b'data: "finish_reason":"stop"}]}\r\n\r\n'
        b"data: [DONE]\r\n\r\n"
    )
    pieces = [raw[i : i + 1] for i in range(len(raw))]
    deltas, error = run(settings("http://upstream.test/v1"), transport=canned(*pieces))
    assert error is None
    assert deltas == [Delta("crlf"), Delta(finish="stop")]


# One event's data may hold at most this (zmqllm.remote.sse.MAX_EVENT_BYTES; the errors
# say "1 MiB").
EVENT_LIMIT = 1 << 20
FINISH = '{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}'


class DecodeCount:
    """json.loads, counting its calls and the characters it is given; past ``budget`` it
    fails at once (a quadratic parser would otherwise run for minutes)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.calls = self.chars = 0
        self._loads = json.loads

    def __call__(self, value: str | bytes, **kwargs: Any) -> Any:
        self.calls += 1
        self.chars += len(value)
        assert self.chars <= self.budget, f"{self.calls} decodes of {self.chars} so far"
        return self._loads(value, **kwargs)


def one_event_of_lines(data_bytes: int) -> bytes:
    """One event whose data is about ``data_bytes`` long in lines of 3 bytes ("1," and
    its newline): a chunk with the text "x" and a long list beside it."""
    head = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}],"pad":[\n'
    lines = max(0, data_bytes - len(head)) // 3
    return head + b"data: 1,\n" * lines + b"data: 1]}\n\n"


def in_reads(raw: bytes, size: int = 4096) -> list[bytes]:
    return [raw[i : i + size] for i in range(0, len(raw), size)]


@pytest.mark.parametrize("data_bytes", [49_000, EVENT_LIMIT - 64], ids=["16k_lines", "1MiB"])
def test_an_event_of_many_lines_costs_work_linear_in_its_bytes(
    monkeypatch: pytest.MonkeyPatch, data_bytes: int
) -> None:
    """16,000 data lines in one event (and 1 MiB of them): each byte decoded at most twice,
    where trying the event so far at every line decoded it 16,000 times."""
    raw = one_event_of_lines(data_bytes) + sse(FINISH)
    decodes = DecodeCount(budget=2 * len(raw))
    monkeypatch.setattr(json, "loads", decodes)
    deltas, error = run(settings("http://upstream.test/v1"), transport=canned(*in_reads(raw)))
    assert error is None
    assert deltas == [Delta("x"), Delta(finish="stop")]
    assert decodes.calls <= 4  # the long event once, its first line alone once, the finish


def test_an_event_over_the_limit_fails_the_stream_after_linear_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = sse('{"choices":[{"index":0,"delta":{"content":"a"}}]}', end=b"")
    raw = before + one_event_of_lines(EVENT_LIMIT + 64) + sse(FINISH)
    decodes = DecodeCount(budget=len(raw))
    monkeypatch.setattr(json, "loads", decodes)
    deltas, error = run(settings("http://upstream.test/v1"), transport=canned(*in_reads(raw)))
    assert deltas == [Delta("a")]  # what came before it still went out
    assert error is not None and error.code == "upstream_error"
    assert "sent an event over 1 MiB" in error.message
    assert "POST /v1/chat/completions" in error.message
