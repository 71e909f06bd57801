"""Bad input gets a 4xx with an OpenAI-shaped JSON error, and the gateway keeps serving."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.fake_broker_client import FakeBrokerClient, Script
from tests.gateway.support import ANSWER, CHAT_ANSWER, answer_script, make_app, tiny_tokenizer
from zmqllm.bus.messages import ErrorCode, SessionError
from zmqllm.gateway.backend import broker_error_fields
from zmqllm.gateway.errors import broker_failure
from zmqllm.models.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.anyio

CONTEXT = 64
MAX_BODY = 2000
CHAT = "/v1/chat/completions"
JSON = {"Content-Type": "application/json"}
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture
def fake(tok: Tokenizer) -> FakeBrokerClient:
    return FakeBrokerClient(answer_script(tok))


@pytest.fixture
async def client(fake: FakeBrokerClient, tok: Tokenizer) -> AsyncIterator[Any]:
    app = make_app(fake, tok, context_length=CONTEXT, max_body_bytes=MAX_BODY)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        yield http


async def expect_error(
    client: Any,
    response: Any,
    status: int,
    *,
    param: str | None = None,
    code: str | None = None,
    says: str = "",
) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert says.lower() in error["message"].lower()
    # The server keeps serving.
    ok = await client.post("/chat", content=b"Hi")
    assert (ok.status_code, ok.text) == (200, CHAT_ANSWER)
    return error


# --- /chat ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "params", "status", "param", "says"),
    [
        (b"\xff\xfeHi", {}, 400, None, "UTF-8"),
        (b"", {}, 400, None, "empty"),
        (b"  \n\t ", {}, 400, None, "empty"),
        (b"Hi", {"max_tokens": 0}, 400, "max_tokens", "at least 1"),
        (b"Hi", {"max_tokens": -3}, 400, "max_tokens", "at least 1"),
        (b"Hi", {"max_tokens": 1000}, 400, "max_tokens", "context"),
        (b"Hi", {"max_tokens": "many"}, 400, "max_tokens", "integer"),
        (b"Hi", {"temperature": "hot"}, 400, "temperature", "number"),
        (b"Hi", {"temperature": -1}, 400, "temperature", ">= 0"),
        (b"Hi", {"temperature": "nan"}, 400, "temperature", "finite"),
        (b"Hi", {"top_p": 0}, 400, "top_p", "top_p"),
        (b"Hi", {"top_p": 1.5}, 400, "top_p", "top_p"),
        (b"Hi", {"top_k": -1}, 400, "top_k", "top_k"),
        (b"Hi", {"seed": -1}, 400, "seed", "seed"),
    ],
)
async def test_chat_bad_input(
    client: Any,
    fake: FakeBrokerClient,
    body: bytes,
    params: dict[str, Any],
    status: int,
    param: str | None,
    says: str,
) -> None:
    response = await client.post("/chat", content=body, params=params)
    await expect_error(client, response, status, param=param, says=says)
    assert len(fake.calls) == 1  # only the good request after it reached the broker


async def test_chat_prompt_longer_than_the_context(client: Any, tok: Tokenizer) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 10
    prompt_len = len(tok.encode_chat([{"role": "user", "content": prompt}]))
    assert prompt_len > CONTEXT
    response = await client.post("/chat", content=prompt.encode())
    error = await expect_error(client, response, 400, code="context_length_exceeded")
    assert str(prompt_len) in error["message"] and str(CONTEXT) in error["message"]


async def test_body_over_the_limit_by_content_length(client: Any) -> None:
    response = await client.post("/chat", content=b"x" * (MAX_BODY + 1))
    await expect_error(client, response, 413, code="request_too_large", says=str(MAX_BODY))


async def test_body_over_the_limit_when_streamed_without_length(client: Any) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(5):
            yield b"y" * 600

    response = await client.post(CHAT, content=chunks(), headers=JSON)
    await expect_error(client, response, 413, code="request_too_large")


async def test_unknown_route_and_method(client: Any) -> None:
    await expect_error(client, await client.get("/nope"), 404, code="not_found")
    await expect_error(client, await client.get("/chat"), 405, code="method_not_allowed")


# --- the OpenAI routes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "status", "code", "says"),
    [
        (b"{not json", 400, "invalid_json", "not valid JSON"),
        (b"", 400, "invalid_json", "empty"),
        (b"[1, 2]", 400, "invalid_json", "an array"),
        (b'{"messages": "\xff"}', 400, "invalid_encoding", "UTF-8"),
    ],
)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_unparsable_bodies(
    client: Any, path: str, content: bytes, status: int, code: str, says: str
) -> None:
    response = await client.post(path, content=content, headers=JSON)
    await expect_error(client, response, status, code=code, says=says)


@pytest.mark.parametrize(
    ("payload", "status", "param", "says"),
    [
        ({}, 400, "messages", "required"),
        ({"messages": []}, 400, "messages", "empty"),
        ({"messages": [{"role": "user", "content": "   "}]}, 400, "messages", "no text"),
        ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role", "user"),
        ({"messages": [{"content": "x"}]}, 400, "messages[0].role", "required"),
        ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "string"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            400,
            "messages[0].content",
            "only 'text'",
        ),
        ({"messages": "Hi"}, 400, "messages", "list"),
        ({"messages": HI, "max_tokens": "5"}, 400, "max_tokens", "integer"),
        ({"messages": HI, "max_tokens": 5.5}, 400, "max_tokens", "integer"),
        ({"messages": HI, "max_tokens": True}, 400, "max_tokens", "integer"),
        ({"messages": HI, "max_tokens": 0}, 400, "max_tokens", "at least 1"),
        ({"messages": HI, "max_completion_tokens": -1}, 400, "max_tokens", "at least 1"),
        ({"messages": HI, "max_tokens": 10_000}, 400, "max_tokens", "context"),
        ({"messages": HI, "temperature": "hot"}, 400, "temperature", "number"),
        ({"messages": HI, "temperature": -0.5}, 400, "temperature", ">= 0"),
        ({"messages": HI, "top_p": 2}, 400, "top_p", "top_p"),
        ({"messages": HI, "top_k": 1.5}, 400, "top_k", "integer"),
        ({"messages": HI, "seed": "s"}, 400, "seed", "integer"),
        ({"messages": HI, "stop": 5}, 400, "stop", "string"),
        ({"messages": HI, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
        ({"messages": HI, "stop": ""}, 400, "stop", "empty"),
        ({"messages": HI, "n": 9}, 400, "n", "1..8"),
        ({"messages": HI, "n": 0}, 400, "n", "1..8"),
        ({"messages": HI, "n": 1.5}, 400, "n", "integer"),
        ({"messages": HI, "stream": "yes"}, 400, "stream", "boolean"),
        ({"messages": HI, "stream_options": 3}, 400, "stream_options", ""),
        ({"messages": HI, "model": 7}, 400, "model", "string"),
    ],
)
async def test_chat_completion_bad_fields(
    client: Any, payload: dict[str, Any], status: int, param: str, says: str
) -> None:
    response = await client.post(CHAT, json=payload)
    await expect_error(client, response, status, param=param, says=says)


@pytest.mark.parametrize(
    ("payload", "param", "says"),
    [
        ({}, "prompt", "required"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": []}, "prompt", "one string"),
        ({"prompt": ["a", "b"]}, "prompt", "one string"),
        ({"prompt": [1, 2, 3]}, "prompt", "one string"),
        ({"prompt": "Hi", "max_tokens": -1}, "max_tokens", "at least 1"),
        ({"prompt": "Hi", "top_k": -2}, "top_k", "top_k"),
    ],
)
async def test_completion_bad_fields(
    client: Any, payload: dict[str, Any], param: str, says: str
) -> None:
    response = await client.post(COMPLETIONS, json=payload)
    await expect_error(client, response, 400, param=param, says=says)


async def test_completion_prompt_longer_than_the_context(client: Any) -> None:
    response = await client.post(COMPLETIONS, json={"prompt": "word " * 200})
    error = await expect_error(client, response, 400, param="prompt")
    assert str(CONTEXT) in error["message"]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_unknown_model_is_404(client: Any, path: str) -> None:
    payload = {"model": "gpt-4o", "messages": HI, "prompt": "Hi"}
    response = await client.post(path, json=payload)
    error = await expect_error(client, response, 404, param="model", code="model_not_found")
    assert "gpt-4o" in error["message"]


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        (CHAT, "tools", [{"type": "function", "function": {"name": "f"}}]),
        (CHAT, "tool_choice", "auto"),
        (CHAT, "logit_bias", {"50256": -100}),
        (CHAT, "modalities", ["text", "audio"]),
        (COMPLETIONS, "echo", True),
        (COMPLETIONS, "best_of", 3),
        (COMPLETIONS, "suffix", "end"),
    ],
)
async def test_a_feature_this_server_lacks_is_refused_by_name(
    client: Any, path: str, field: str, value: Any
) -> None:
    payload = {"messages": HI, "prompt": "Hi", field: value}
    response = await client.post(path, json=payload)
    error = await expect_error(client, response, 400, param=field, code="unsupported_parameter")
    assert repr(field) in error["message"]


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -3, "[-2, 2]"),
        ("response_format", {"type": "xml"}, "json_schema"),
        ("response_format", {"type": "json_schema"}, "json_schema.schema"),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"schema": {"type": "objec"}}},
            "objec",
        ),
        ("response_format", {"type": "json_schema", "json_schema": {"schema": 5}}, "schema"),
    ],
)
async def test_bad_penalties_and_formats_are_400s_naming_them(
    client: Any, field: str, value: Any, says: str
) -> None:
    for path in (CHAT, COMPLETIONS):
        response = await client.post(path, json={"messages": HI, "prompt": "Hi", field: value})
        error = await expect_error(client, response, 400)
        assert error["param"].startswith(field)  # or the path below it that is wrong
        assert says in error["message"], error


async def test_penalties_and_formats_reach_the_sampling(
    client: Any, fake: FakeBrokerClient
) -> None:
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}}
    body = {
        "messages": HI,
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    }
    assert (await client.post(CHAT, json=body)).status_code == 200
    sampling = fake.calls[-1].sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -1.0)
    (spec,) = json.loads(sampling.grammar)["grammars"]
    assert spec["json_schema"] == {**schema, "x-guidance": {"whitespace_flexible": False}}
    body["response_format"] = {"type": "json_object"}
    assert (await client.post(CHAT, json=body)).status_code == 200
    (spec,) = json.loads(fake.calls[-1].sampling.grammar)["grammars"]
    assert spec["json_schema"]["type"] == "object"
    body["response_format"] = {"type": "text"}
    assert (await client.post(CHAT, json=body)).status_code == 200
    assert fake.calls[-1].sampling.grammar == ""


@pytest.mark.parametrize(
    "off",
    [
        {"logprobs": False, "top_logprobs": 0},
        {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}},
        {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none"},
        {"echo": False, "best_of": 1, "suffix": None, "modalities": ["text"]},
    ],
)
async def test_the_same_features_left_off_are_fine(client: Any, off: dict[str, Any]) -> None:
    for path in (CHAT, COMPLETIONS):
        response = await client.post(path, json={"messages": HI, "prompt": "Hi", **off})
        assert response.status_code == 200, (path, response.text)


async def test_unknown_fields_are_ignored(client: Any) -> None:
    payload = {"messages": HI, "user": "u", "logprobs": False, "frequency_penalty": 0, "x": {}}
    response = await client.post(CHAT, content=json.dumps(payload).encode(), headers=JSON)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == ANSWER


# --- failures the broker client reports -----------------------------------------------------

# Each code's answer before any token went out: (status, Retry-After sent, error type).
BROKER_ANSWERS = {
    ErrorCode.BAD_REQUEST: (400, False, "invalid_request_error"),
    ErrorCode.BUSY: (429, True, "rate_limit_error"),
    ErrorCode.INTERNAL: (500, False, "server_error"),
    ErrorCode.TIMEOUT: (504, False, "server_error"),
    ErrorCode.SLOW_CONSUMER: (503, True, "server_error"),
    ErrorCode.CANCELLED: (503, True, "server_error"),
    ErrorCode.NO_CAPACITY: (503, True, "server_error"),
    ErrorCode.FULL: (503, True, "server_error"),
    ErrorCode.WORKER_LOST: (503, True, "server_error"),
    ErrorCode.BROKER_UNREACHABLE: (503, True, "server_error"),
    ErrorCode.UPSTREAM_ERROR: (502, False, "server_error"),
}


def test_every_error_code_has_an_answer() -> None:
    assert set(BROKER_ANSWERS) == set(ErrorCode)


@pytest.mark.parametrize("code", list(ErrorCode))
@pytest.mark.parametrize("path", ["/chat", CHAT, COMPLETIONS])
async def test_a_broker_failure_before_the_first_token(
    client: Any, fake: FakeBrokerClient, tok: Tokenizer, code: ErrorCode, path: str
) -> None:
    fake.default_script = Script(
        answer_script(tok).tokens, fail_before_first=SessionError(code, f"{code.value} here")
    )
    payload = {"messages": HI, "prompt": "Hi"}
    kwargs: dict[str, Any] = {"content": b"Hi"} if path == "/chat" else {"json": payload}
    response = await client.post(path, **kwargs)
    status, retry, kind = BROKER_ANSWERS[code]
    assert response.status_code == status, response.text
    assert (response.headers.get("retry-after") == "1") is retry
    assert response.json()["error"] == {
        "message": f"{code.value} here",
        "type": kind,
        "param": None,
        "code": code.value,
    }
    fake.default_script = answer_script(tok)
    assert (await client.post("/chat", content=b"Hi")).text == CHAT_ANSWER


def test_broker_failure_takes_the_code_or_its_word() -> None:
    by_enum = broker_failure(ErrorCode.TIMEOUT, "slow")
    by_word = broker_failure("timeout", "slow")
    assert (by_enum.status, by_enum.code) == (by_word.status, by_word.code) == (504, "timeout")
    # A code from a newer broker: a temporary lack of service, retried shortly.
    unknown = broker_failure("rebalancing", "moving sessions")
    assert (unknown.status, unknown.code, unknown.headers) == (
        503,
        "rebalancing",
        {"Retry-After": "1"},
    )


def test_only_a_session_error_is_a_broker_failure() -> None:
    assert broker_error_fields(SessionError(ErrorCode.BUSY, "queue full")) == ("busy", "queue full")

    class LookAlike(Exception):
        code = "busy"
        message = "not from the client"

    assert broker_error_fields(LookAlike()) is None
    assert broker_error_fields(ValueError("x")) is None
