"""The HTTP gateway against a fake broker client: routes, streaming, ids, logs, readiness."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.fake_broker_client import FakeBrokerClient, FakeBrokerError, Script
from tests.gateway.support import (
    ANSWER,
    CHAT_ANSWER,
    CONTEXT,
    MODEL,
    TEST_HOSTS,
    answer_script,
    eos_id,
    make_app,
    post_raw,
    running_server,
    sse_json,
    tiny_tokenizer,
    wait_for,
)
from zmqllm.config.settings import GatewaySettings
from zmqllm.config.up_state import STATE_ENV, write_state
from zmqllm.gateway.api_keys import ApiKeys
from zmqllm.gateway.app import create_app
from zmqllm.models.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture
def fake(tok: Tokenizer) -> FakeBrokerClient:
    return FakeBrokerClient(answer_script(tok))


@pytest.fixture
async def client(fake: FakeBrokerClient, tok: Tokenizer) -> AsyncIterator[Any]:
    app = make_app(fake, tok)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        yield http


def log_lines(stream: io.StringIO, event: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]
    return [line for line in lines if line.get("event") == event]


def user_prompt(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode_chat([{"role": "user", "content": text}])


# --- /chat ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {"Content-Type": "application/x-www-form-urlencoded"},  # what curl -d sends
        {"Content-Type": "text/plain"},
        {"Content-Type": "application/json"},
        {},
    ],
)
async def test_chat_returns_the_answer_whatever_the_content_type(
    client: Any, fake: FakeBrokerClient, tok: Tokenizer, headers: dict[str, str]
) -> None:
    # Form decoding would turn "+" into a space and "%21" into "!": the body is taken as is.
    prompt = "What is 1+1 %21 café?"
    response = await client.post("/chat", content=prompt.encode(), headers=headers)
    assert response.status_code == 200
    assert response.text == CHAT_ANSWER
    assert response.headers["content-type"].startswith("text/plain")
    assert fake.calls[0].prompt == user_prompt(tok, prompt)
    assert fake.calls[0].stop_ids == sorted(tok.eos_token_ids)
    assert fake.cancels == []


async def test_chat_query_parameters_reach_generate(client: Any, fake: FakeBrokerClient) -> None:
    params = {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 42}
    response = await client.post("/chat", content=b"Hi", params=params)
    assert response.status_code == 200
    call = fake.calls[0]
    assert call.max_tokens == 7
    assert (call.sampling.temperature, call.sampling.top_p) == (0.5, 0.9)
    assert (call.sampling.top_k, call.sampling.seed) == (5, 42)


async def test_chat_refuses_a_query_parameter_it_does_not_take(
    client: Any, fake: FakeBrokerClient
) -> None:
    response = await client.post("/chat", content=b"Hi", params={"max_tokns": 3})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("unknown_parameter", "max_tokns")
    assert "'max_tokns'" in error["message"] and "max_tokens" in error["message"]
    # Many long names: the message stays short and names a few of them, cut.
    names = {f"{'x' * 300}{i}": "1" for i in range(50)}
    response = await client.post("/chat", content=b"Hi", params=names)
    assert response.status_code == 400 and len(response.text) < 1000
    assert "and 46 more" in response.json()["error"]["message"]
    assert fake.calls == []  # nothing was generated for either


async def test_chat_defaults_are_greedy_with_256_tokens(
    client: Any, fake: FakeBrokerClient
) -> None:
    assert (await client.post("/chat", content=b"Hi")).status_code == 200
    assert fake.calls[0].max_tokens == 256
    assert fake.calls[0].sampling.greedy


async def test_default_max_tokens_is_clipped_to_the_context(
    fake: FakeBrokerClient, tok: Tokenizer
) -> None:
    app = make_app(fake, tok, context_length=40)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        response = await c.post("/chat", content=b"Hi")
    assert response.status_code == 200
    assert fake.calls[0].max_tokens == 40 - len(user_prompt(tok, "Hi"))


async def test_chat_max_tokens_gives_a_cut_answer(client: Any, tok: Tokenizer) -> None:
    response = await client.post("/chat", content=b"Hi", params={"max_tokens": 3})
    assert response.text == tok.decode(tok.encode(ANSWER)[:3]) + "\n"


def test_chat_streams_chunks_as_tokens_are_made(tok: Tokenizer) -> None:
    script = answer_script(tok, delay=0.03)
    # Half way, the model stops for 2 s: the client has its first piece meanwhile.
    script.stall_after, script.stall = len(script.tokens) // 2, 2.0
    fake = FakeBrokerClient(script)
    with running_server(make_app(fake, tok)) as url, httpx.Client(timeout=10) as http:
        arrivals: list[tuple[int, str]] = []  # tokens made by then, and the piece
        with http.stream("POST", f"{url}/chat", content=b"Hi") as response:
            assert response.status_code == 200
            for text in response.iter_text():
                arrivals.append((len(fake.request_streams[0].produced_at), text))
    assert "".join(text for _, text in arrivals) == CHAT_ANSWER
    assert len(arrivals) >= 3
    # The first piece was on the client before the model had made the last token.
    assert arrivals[0][0] < len(script.tokens), arrivals


async def test_stop_strings_for_openai_completions(client: Any, fake: FakeBrokerClient) -> None:
    response = await client.post("/v1/completions", json={"prompt": "Q", "stop": ["France", "zzz"]})
    body = response.json()
    assert body["choices"][0]["text"] == "The capital of "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert fake.cancels == ["s1"]


# --- OpenAI chat completions ----------------------------------------------------------------


async def test_chat_completion_non_streaming(
    client: Any, fake: FakeBrokerClient, tok: Tokenizer
) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Capital"},
                {"type": "text", "text": "of France?"},
            ],
        },
    ]
    response = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "user": "u1", "logit_bias": {}},
    )
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL
    assert body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": ANSWER}
    assert choice["finish_reason"] == "stop"
    expected_prompt = tok.encode_chat(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Capital\nof France?"},
        ]
    )
    assert fake.calls[0].prompt == expected_prompt
    completion = len(tok.encode(ANSWER)) + 1  # the EOS token counts
    assert body["usage"] == {
        "prompt_tokens": len(expected_prompt),
        "completion_tokens": completion,
        "total_tokens": len(expected_prompt) + completion,
    }


async def test_chat_completion_length_and_max_completion_tokens(
    client: Any, fake: FakeBrokerClient
) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    response = await client.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 9, "max_completion_tokens": 4},
    )
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4
    assert fake.calls[0].max_tokens == 4


async def test_chat_completion_streaming(client: Any, tok: Tokenizer) -> None:
    response = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_json(response.text)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c["choices"][0]["delta"].get("content") for c in chunks[1:-2]]
    assert "".join(content) == ANSWER and len(content) > 1
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == len(tok.encode(ANSWER)) + 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_chat_completion_streaming_without_usage(client: Any) -> None:
    response = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 2},
    )
    chunks = sse_json(response.text)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c.get("usage") is None for c in chunks)


async def test_developer_role_counts_as_system(
    client: Any, fake: FakeBrokerClient, tok: Tokenizer
) -> None:
    messages = [{"role": "developer", "content": "Rules"}, {"role": "user", "content": "Hi"}]
    await client.post("/v1/chat/completions", json={"messages": messages})
    expected = tok.encode_chat(
        [{"role": "system", "content": "Rules"}, {"role": "user", "content": "Hi"}]
    )
    assert fake.calls[0].prompt == expected


# --- OpenAI completions ---------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["Paris is", ["Paris is"]])
async def test_completion_non_streaming(
    client: Any, fake: FakeBrokerClient, tok: Tokenizer, prompt: Any
) -> None:
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == ANSWER
    assert body["choices"][0]["finish_reason"] == "stop"
    prompt_ids = tok.encode("Paris is", add_special_tokens=True)
    assert fake.calls[0].prompt == prompt_ids
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)


async def test_completion_streaming(client: Any) -> None:
    response = await client.post(
        "/v1/completions",
        json={"prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
    )
    chunks = sse_json(response.text)
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == ANSWER
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


async def test_models(client: Any) -> None:
    body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["max_model_len"] == CONTEXT
    assert (await client.get(f"/v1/models/{MODEL}")).json()["id"] == MODEL
    missing = await client.get("/v1/models/nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


# --- broker failures ------------------------------------------------------------------------


@pytest.mark.parametrize("code", ["no_capacity", "broker_unreachable"])
@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/chat", b"Hi"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"prompt": "Hi", "stream": True}),
    ],
)
async def test_broker_failure_before_first_token_is_503(
    client: Any, fake: FakeBrokerClient, tok: Tokenizer, code: str, path: str, payload: Any
) -> None:
    fake.default_script = Script(
        answer_script(tok).tokens, fail_before_first=FakeBrokerError(code, f"{code} here")
    )
    kwargs = {"content": payload} if isinstance(payload, bytes) else {"json": payload}
    response = await client.post(path, **kwargs)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error["code"] == code and error["message"] == f"{code} here"
    # The server keeps serving.
    fake.default_script = answer_script(tok)
    assert (await client.post("/chat", content=b"Hi")).text == CHAT_ANSWER


async def test_disconnected_client_fails_fast_with_503(client: Any, fake: FakeBrokerClient) -> None:
    fake.unreachable = True
    response = await client.post("/v1/completions", json={"prompt": "Hi"})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "broker_unreachable"
    assert "broker" in response.json()["error"]["message"]
    assert not fake.calls
    fake.unreachable = False
    assert (await client.post("/chat", content=b"Hi")).text == CHAT_ANSWER


async def test_a_link_that_only_looks_stale_is_given_a_moment(
    client: Any, fake: FakeBrokerClient
) -> None:
    """After the event loop was busy, the broker's last message is old only because it was
    not read yet: the request waits a moment for the link to show it is alive."""
    fake.unreachable = True

    async def broker_message_read() -> None:
        await asyncio.sleep(0.05)
        fake.unreachable = False

    task = asyncio.ensure_future(broker_message_read())
    response = await client.post("/chat", content=b"Hi")
    await task
    assert response.status_code == 200 and response.text == CHAT_ANSWER


async def test_chat_error_after_streaming_began_is_a_last_line(
    client: Any, fake: FakeBrokerClient, tok: Tokenizer
) -> None:
    fake.default_script = Script(answer_script(tok).tokens, fail_after=4)
    status, body, complete = await post_raw(make_app(fake, tok), "/chat", b"Hi")
    assert status == 200
    text = tok.decode(tok.encode(ANSWER)[:4])
    assert body == f"{text}\n[error: worker w1 stopped answering]\n"
    assert not complete  # no terminating chunk: curl exits non-zero


async def test_sse_error_after_streaming_began_is_an_error_event(
    client: Any, fake: FakeBrokerClient, tok: Tokenizer
) -> None:
    fake.default_script = Script(answer_script(tok).tokens, fail_after=4)
    response = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "stream": True},
    )
    chunks = sse_json(response.text, done=False)  # ends at the error, no [DONE]
    assert chunks[-1] == {
        "error": {
            "message": "worker w1 stopped answering",
            "type": "server_error",
            "param": None,
            "code": "worker_lost",
        }
    }


async def test_non_streamed_failure_mid_answer_is_503(
    client: Any, fake: FakeBrokerClient, tok: Tokenizer
) -> None:
    fake.default_script = Script(answer_script(tok).tokens, fail_after=4)
    response = await client.post("/v1/completions", json={"prompt": "Hi"})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "worker_lost"


# --- disconnects ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/chat", b"Hi"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True}),
    ],
)
def test_client_disconnect_mid_stream_cancels_the_session(
    tok: Tokenizer, path: str, payload: Any
) -> None:
    long_answer = " ".join([ANSWER] * 20)
    fake = FakeBrokerClient(answer_script(tok, long_answer, delay=0.02))
    with running_server(make_app(fake, tok)) as url, httpx.Client(timeout=10) as http:
        kwargs = {"content": payload} if isinstance(payload, bytes) else {"json": payload}
        with http.stream("POST", f"{url}{path}", **kwargs) as response:
            for _ in response.iter_raw():
                break  # one chunk, then hang up
        stream = fake.request_streams[0]
        wait_for(lambda: fake.cancels == [stream.session])
        assert len(stream.produced_at) < len(stream.script.tokens)
        wait_for(lambda: not fake.open_streams)
        # And it keeps serving.
        fake.default_script = answer_script(tok)
        assert http.post(f"{url}/chat", content=b"Hi").text == CHAT_ANSWER


def test_client_disconnect_during_a_non_streamed_answer_cancels(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(answer_script(tok, " ".join([ANSWER] * 20), delay=0.02))
    with running_server(make_app(fake, tok)) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json={"prompt": "Hi"}, timeout=0.3)
        stream = fake.request_streams[0]
        wait_for(lambda: fake.cancels == [stream.session])


# --- request ids and the log line -----------------------------------------------------------


async def test_request_id_is_echoed_and_forwarded(client: Any, fake: FakeBrokerClient) -> None:
    response = await client.post("/chat", content=b"Hi", headers={"X-Request-ID": "abc-123_xY"})
    assert response.headers["x-request-id"] == "abc-123_xY"
    assert fake.calls[0].request_id == "abc-123_xY"


# The bus takes 1-64 of [A-Za-z0-9_-]: anything else would be refused there, so the
# gateway replaces it with its own id.
@pytest.mark.parametrize("given", [None, "bad id with spaces", "x" * 65, "", "a.b"])
async def test_request_id_is_generated_when_missing_or_unsafe(
    client: Any, fake: FakeBrokerClient, given: str | None
) -> None:
    headers = {} if given is None else {"X-Request-ID": given}
    response = await client.post("/chat", content=b"Hi", headers=headers)
    request_id = response.headers["x-request-id"]
    assert request_id != given and len(request_id) == 32
    assert fake.calls[0].request_id == request_id


async def test_errors_carry_the_request_id_too(client: Any) -> None:
    response = await client.post("/chat", content=b"  ", headers={"X-Request-ID": "r-err"})
    assert response.status_code == 400
    assert response.headers["x-request-id"] == "r-err"


async def test_one_info_line_per_finished_request(
    log_stream: io.StringIO, fake: FakeBrokerClient, tok: Tokenizer
) -> None:
    fake.default_script = answer_script(tok, delay=0.002)
    app = make_app(fake, tok)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        await c.post("/chat", content=b"secret prompt", headers={"X-Request-ID": "req-42"})
    lines = log_lines(log_stream, "request finished")
    assert len(lines) == 1
    line = lines[0]
    assert line["level"] == "info" and line["service"] == "gateway"
    assert line["request_id"] == "req-42"
    assert line["path"] == "/chat" and line["status"] == 200
    assert line["route"] == ["w0", "w1"]
    assert line["prompt_tokens"] == len(user_prompt(tok, "secret prompt"))
    assert line["generated_tokens"] == len(tok.encode(ANSWER)) + 1
    assert line["finish_reason"] == "stop"
    assert line["ttft_ms"] > 0 and line["tokens_per_s"] > 0
    # Prompts and answers never reach the info log.
    assert "secret" not in log_stream.getvalue() and "Paris" not in log_stream.getvalue()


async def test_log_line_of_a_cancelled_and_a_failed_request(
    log_stream: io.StringIO, fake: FakeBrokerClient, tok: Tokenizer
) -> None:
    fake.default_script = Script(answer_script(tok).tokens, fail_after=2)
    app = make_app(fake, tok)
    await post_raw(app, "/chat", b"Hi")
    await post_raw(app, "/chat", b"")
    failed, rejected = log_lines(log_stream, "request finished")
    assert failed["finish_reason"] == "error" and failed["error"] == "worker_lost"
    assert failed["generated_tokens"] == 2
    assert rejected["status"] == 400


# --- health and readiness -------------------------------------------------------------------


async def test_health_and_readiness(fake: FakeBrokerClient, tok: Tokenizer) -> None:
    fake.complete_route = False
    fake.default_script = Script([5, eos_id(tok)])
    app = make_app(fake, tok)
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app):
        assert fake.started
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            assert (await c.get("/health")).json() == {"status": "ok"}
            await wait_async(lambda: fake.status_calls >= 1)
            not_ready = await c.get("/ready")
            assert not_ready.status_code == 503
            assert "route" in not_ready.json()["reason"]
            await asyncio.sleep(0.05)
            assert (await c.get("/ready")).status_code == 503
            assert not fake.calls  # no warm-up without a route

            fake.complete_route = True
            await wait_async(lambda: app.state.readiness.ready)
            assert (await c.get("/ready")).json() == {"status": "ready"}
            warmup = fake.calls[0]
            assert warmup.max_tokens == 1 and warmup.request_id.startswith("warmup-")

            # The route goes away: not ready; it comes back: warm up again, then ready.
            fake.complete_route = False
            await wait_async(lambda: not app.state.readiness.ready)
            assert (await c.get("/ready")).status_code == 503
            fake.complete_route = True
            await wait_async(lambda: app.state.readiness.ready)
            assert len(fake.calls) == 2

            fake.unreachable = True
            await wait_async(lambda: not app.state.readiness.ready)
            body = (await c.get("/ready")).json()
            assert body["reason"].startswith("broker unreachable")
            assert (await c.get("/health")).status_code == 200
    assert fake.closed


async def test_ready_waits_for_a_successful_warm_up(fake: FakeBrokerClient, tok: Tokenizer) -> None:
    fake.default_script = Script([5], fail_before_first=FakeBrokerError("worker_lost", "gone"))
    app = make_app(fake, tok)
    async with app.router.lifespan_context(app):
        await wait_async(lambda: len(fake.calls) >= 2)
        assert not app.state.readiness.ready
        assert "warm-up failed" in app.state.readiness.reason
        fake.default_script = Script([5, eos_id(tok)])
        await wait_async(lambda: app.state.readiness.ready)


@pytest.mark.parametrize("keyed", [False, True])
async def test_ready_shows_the_launchers_details_only_to_an_authorized_caller(
    tok: Tokenizer, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, keyed: bool
) -> None:
    """Issue 40, item 11: /ready needs no key and showed every failing child's log file
    (an absolute path) and exit status to anyone. Now only to a caller with a valid key,
    or, on a gateway without keys, one on the loopback interface."""
    log_file = str(tmp_path / "logs" / "remote-0-0.log")
    child = {"name": "remote-0-0", "role": "worker", "state": "failing", "exits": 5}
    child |= {"last_exit": "exited with code 1", "log": log_file, "next_start_at": 9.0}
    state = tmp_path / "up-state.json"
    write_state(state, [child], time.time())
    monkeypatch.setenv(STATE_ENV, str(state))
    fake = FakeBrokerClient(Script([5, eos_id(tok)]))
    keys = ApiKeys(["sk-operator-1"]) if keyed else None
    settings = GatewaySettings(allowed_hosts=TEST_HOSTS)
    app = create_app(fake, settings, tok, "tiny-test", 2048, api_keys=keys)

    async def ready(client_host: str, headers: dict[str, str]) -> dict[str, Any]:
        transport = httpx.ASGITransport(app=app, client=(client_host, 4000))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            return (await c.get("/ready", headers=headers)).json()

    async with app.router.lifespan_context(app):
        await wait_async(lambda: app.state.readiness.ready)
        outsider = await ready("198.18.0.9", {})
        local = await ready("127.0.0.1", {})
        keyed_caller = await ready("198.18.0.9", {"Authorization": "Bearer sk-operator-1"})
    assert outsider["failing"] == [{"name": "remote-0-0", "role": "worker"}]
    assert log_file not in json.dumps(outsider)
    if keyed:
        assert local == outsider  # a key decides, not the address
        (whole,) = keyed_caller["failing"]
    else:
        (whole,) = local["failing"]
    assert whole["log"] == log_file and whole["exits"] == 5
    assert whole["last_exit"] == "exited with code 1"


async def wait_async(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail("condition not reached in time")
        await asyncio.sleep(0.005)


def test_gateway_modules_do_not_import_the_ml_stack() -> None:
    code = (
        "import sys, zmqllm.gateway.app, zmqllm.gateway.main; "
        "print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
