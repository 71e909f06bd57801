"""Long prompts cost the event loop nothing (issue 29, item 8): one longer than the
context by its byte size alone is refused before it is tokenized, and the others are
tokenized in a worker thread."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tests.fake_broker_client import FakeBrokerClient
from tests.gateway.support import answer_script, make_app, tiny_tokenizer
from zmqllm.models.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.anyio

CONTEXT = 256


class Spy:
    """Wraps a tokenizer's encode: records the thread of every call."""

    def __init__(self, tok: Tokenizer) -> None:
        self.threads: list[threading.Thread] = []
        self._encode = tok.encode
        tok.encode = self  # type: ignore[method-assign]

    def __call__(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.threads.append(threading.current_thread())
        return self._encode(text, add_special_tokens)


@pytest.fixture
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


def requests_for(text: str) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("/chat", {"content": text.encode()}),
        ("/v1/completions", {"json": {"prompt": text, "max_tokens": 4}}),
        ("/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": text}]}}),
    ]


async def test_a_prompt_too_long_by_its_size_is_not_tokenized(tok: Tokenizer) -> None:
    app = make_app(FakeBrokerClient(answer_script(tok)), tok, context_length=CONTEXT)
    spy = Spy(tok)
    text = "a" * (CONTEXT * tok.max_token_bytes + 1)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        for path, kwargs in requests_for(text):
            response = await c.post(path, **kwargs)
            assert response.status_code == 400, path
            error = response.json()["error"]
            assert error["code"] == "context_length_exceeded", error
            assert f"{len(text)} bytes" in error["message"] and str(CONTEXT) in error["message"]
    assert spy.threads == []


async def test_prompts_are_tokenized_off_the_event_loop(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(answer_script(tok))
    app = make_app(fake, tok, context_length=CONTEXT)
    spy = Spy(tok)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        for path, kwargs in requests_for("Hi there"):
            assert (await c.post(path, **kwargs)).status_code == 200, path
        # Just under the size limit but over the context in tokens: refused after counting.
        many = "ab " * (CONTEXT * 2)
        assert len(many) <= CONTEXT * tok.max_token_bytes
        response = await c.post("/v1/completions", json={"prompt": many, "max_tokens": 4})
        assert response.status_code == 400
        message = response.json()["error"]["message"]
        assert "tokens" in message and "bytes" not in message
    assert len(spy.threads) == 4
    assert all(t is not threading.main_thread() for t in spy.threads)
