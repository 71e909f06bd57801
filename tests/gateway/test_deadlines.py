"""Generation deadlines: first token, between tokens, whole request.

A session that misses a deadline is cancelled (CANCEL through the stream's cancel()) and
the client is told: 504 ``timeout`` before anything was sent, an error line or event at
the end of a stream already under way.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from tests.fake_broker_client import FakeBrokerClient, FakeTokenEvent, Script
from tests.gateway.support import (
    ANSWER,
    CHAT_ANSWER,
    answer_script,
    make_app,
    post_raw,
    sse_json,
    tiny_tokenizer,
)
from zmqllm.gateway.streaming import GenerationError, TextStream
from zmqllm.models.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.anyio

STUCK = 3600.0  # a worker that never answers again (the fake's sleep is cancelled)
CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


def client_for(fake: FakeBrokerClient, tok: Tokenizer, **settings: Any) -> Any:
    app = make_app(fake, tok, **settings)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


def stuck_after(tok: Tokenizer, tokens: int) -> Script:
    return Script(answer_script(tok).tokens, stall_after=tokens, stall=STUCK)


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/chat", b"Hi"),
        ("/v1/chat/completions", {**CHAT, "stream": True}),
        ("/v1/completions", {"prompt": "Hi"}),
    ],
)
async def test_no_first_token_in_time_is_504_and_cancels(
    tok: Tokenizer, path: str, payload: Any
) -> None:
    fake = FakeBrokerClient(stuck_after(tok, 0))
    async with client_for(fake, tok, first_token_timeout=0.2) as client:
        kwargs = {"content": payload} if isinstance(payload, bytes) else {"json": payload}
        response = await client.post(path, **kwargs)
        assert response.status_code == 504
        error = response.json()["error"]
        assert error["code"] == "timeout" and error["type"] == "server_error"
        assert error["message"] == "no first token within the first-token timeout of 0.2 s"
        (stream,) = fake.request_streams
        assert fake.cancels == [stream.session] and stream.cancelled
        assert not fake.open_streams
        # The gateway serves normally afterwards.
        fake.default_script = answer_script(tok)
        assert (await client.post("/chat", content=b"Hi")).text == CHAT_ANSWER


async def test_a_stream_that_stalls_ends_with_an_error_line(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(stuck_after(tok, 4))
    app = make_app(fake, tok, inter_token_timeout=0.2)
    status, text, complete = await post_raw(app, "/chat", b"Hi")
    assert status == 200 and not complete
    sent = tok.decode(tok.encode(ANSWER)[:4])
    assert text == f"{sent}\n[error: no token for 0.2 s (the inter-token timeout)]\n"
    (stream,) = fake.request_streams
    assert fake.cancels == [stream.session] and len(stream.produced_at) == 4


async def test_an_sse_stream_that_stalls_ends_with_an_error_event(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(stuck_after(tok, 4))
    async with client_for(fake, tok, inter_token_timeout=0.2) as client:
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    chunks = sse_json(response.text, done=False)  # ends at the error, no [DONE]
    assert chunks[-1] == {
        "error": {
            "message": "no token for 0.2 s (the inter-token timeout)",
            "type": "server_error",
            "param": None,
            "code": "timeout",
        }
    }
    assert fake.cancels == [fake.request_streams[0].session]


async def test_a_non_streamed_answer_that_stalls_is_504(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(stuck_after(tok, 4))
    async with client_for(fake, tok, inter_token_timeout=0.2) as client:
        response = await client.post("/v1/completions", json={"prompt": "Hi"})
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "timeout"
    assert fake.cancels == [fake.request_streams[0].session]


async def test_the_whole_request_deadline_cuts_a_slow_but_steady_stream(tok: Tokenizer) -> None:
    # A token every 0.1 s never misses the inter-token deadline, but 40 of them take 4 s.
    fake = FakeBrokerClient(Script([*tok.encode(" ".join([ANSWER] * 5))], delay=0.1))
    status, text, complete = await post_raw(
        make_app(fake, tok, request_timeout=0.5), "/chat", b"Hi"
    )
    assert status == 200 and not complete
    assert text.endswith("\n[error: the request timeout of 0.5 s was reached]\n")
    (stream,) = fake.request_streams
    assert fake.cancels == [stream.session]
    assert len(stream.produced_at) < len(stream.script.tokens)


async def test_tokens_in_time_are_not_cut(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(answer_script(tok, delay=0.01))
    settings = {"first_token_timeout": 5.0, "inter_token_timeout": 5.0, "request_timeout": 30.0}
    async with client_for(fake, tok, **settings) as client:
        assert (await client.post("/chat", content=b"Hi")).text == CHAT_ANSWER
    assert fake.cancels == []


class QueuedTokens:
    """A session whose tokens all arrived already: reading the next never suspends, as
    when an HTTP client reads slower than the tokens come and they wait queued."""

    session = "s-queued"

    def __init__(self, tokens: list[int]) -> None:
        self.route: list[str] = []
        self.tokens = tokens
        self.cancelled = False

    async def __aenter__(self) -> QueuedTokens:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def __aiter__(self) -> AsyncIterator[FakeTokenEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[FakeTokenEvent]:
        for step, token in enumerate(self.tokens):
            yield FakeTokenEvent(token, step, None, None)

    async def cancel(self) -> None:
        self.cancelled = True


async def test_the_request_deadline_fires_while_tokens_wait_queued(tok: Tokenizer) -> None:
    """Issue 40, item 3: the deadline wrapped the read, and a read of a queued token
    never suspends, so a slow reader's request outlived request_timeout by as long as it
    took to read what was queued."""
    session = QueuedTokens(tok.encode(" ".join([ANSWER] * 20)))
    text = TextStream(
        session, tok.incremental_decoder(prompt_ids=[]), max_tokens=10_000, timeout=0.2
    )
    await text.open()
    read = []
    with pytest.raises(GenerationError) as failed:
        async for chunk in text.chunks():
            read.append(chunk)
            await anyio.sleep(0.3)  # the HTTP write of this chunk waited on the client
    await text.close()
    assert failed.value.code == "timeout" and "request timeout of 0.2 s" in failed.value.message
    assert session.cancelled and len(read) == 1
