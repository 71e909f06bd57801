"""Failover through the gateway: a route lost mid-answer, healed by replay, unseen by the
client on every kind of response; every route gone, a clear error within the bound; and
what /metrics says about both.

The fake broker continues a replayed session from the history it is sent: a replay that
sends the wrong prompt gets the wrong tokens, and the text would show it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.fake_broker_client import FakeBrokerClient, Script
from tests.gateway.support import (
    ANSWER,
    CHAT_ANSWER,
    answer_script,
    make_app,
    post_raw,
    sse_json,
    tiny_tokenizer,
)
from tests.gateway.test_metrics import gauge
from zmqllm.bus.messages import ErrorCode, SessionError
from zmqllm.models.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.anyio

FAIL_AFTER = 4


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


def healing_fake(tok: Tokenizer, replays_fail: bool = False) -> FakeBrokerClient:
    """The first session of each request fails after FAIL_AFTER tokens; a replay goes on
    with the answer's tokens after the ones it was sent (or, with ``replays_fail``, is
    refused: no route left)."""
    answer = answer_script(tok).tokens
    fake = FakeBrokerClient()
    firsts: list[list[int]] = []

    def script_for(prompt: list[int]) -> Script:
        base = next((p for p in firsts if prompt[: len(p)] == p and len(prompt) > len(p)), None)
        if base is None:
            firsts.append(prompt)
            return Script(answer, fail_after=FAIL_AFTER)
        if replays_fail:
            refused = SessionError(ErrorCode.NO_CAPACITY, "no route: layers 2:4 have no worker")
            return Script(answer, fail_before_first=refused)
        done = prompt[len(base) :]
        assert done == answer[: len(done)], "the replay's prompt must be the history"
        return Script(answer[len(done) :])

    fake.script_for = script_for
    return fake


@pytest.fixture
async def failing(tok: Tokenizer) -> AsyncIterator[tuple[Any, FakeBrokerClient, Any]]:
    fake = healing_fake(tok)
    app = make_app(fake, tok, failover_retries=3, failover_timeout=5.0)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        yield http, fake, app


async def test_chat_stream_goes_on_after_its_route_failed(failing: Any, tok: Tokenizer) -> None:
    _, fake, app = failing
    status, body, complete = await post_raw(app, "/chat", b"Hi")
    assert status == 200 and complete
    assert body == CHAT_ANSWER
    first, replayed = fake.request_streams
    assert replayed.call.sampling.first_step == FAIL_AFTER
    assert replayed.call.sampling.seed == first.call.sampling.seed
    assert replayed.call.max_tokens == first.call.max_tokens - FAIL_AFTER


async def test_sse_and_non_streamed_answers_are_whole(failing: Any) -> None:
    http, _, _ = failing
    messages = [{"role": "user", "content": "Hi"}]
    sse = await http.post("/v1/chat/completions", json={"messages": messages, "stream": True})
    chunks = sse_json(sse.text)  # ends with [DONE]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == ANSWER
    whole = await http.post("/v1/completions", json={"prompt": "Hi"})
    assert whole.status_code == 200
    body = whole.json()
    assert body["choices"][0]["text"] == ANSWER and body["choices"][0]["finish_reason"] == "stop"


async def test_metrics_count_failovers_and_pauses(failing: Any) -> None:
    http, _, _ = failing
    assert (await http.post("/chat", content=b"Hi")).text == CHAT_ANSWER
    text = (await http.get("/metrics")).text
    assert 'zmqllm_failovers_total{cause="worker_lost",outcome="recovered"} 1.0' in text
    assert gauge(text, "zmqllm_failover_pause_seconds_count") == 1.0
    assert gauge(text, "zmqllm_failover_history_tokens") == 0.0  # nothing held afterwards


async def test_every_route_gone_is_a_clear_error_and_holds_nothing(tok: Tokenizer) -> None:
    fake = healing_fake(tok, replays_fail=True)
    app = make_app(fake, tok, failover_retries=3, failover_timeout=5.0)
    status, body, complete = await post_raw(app, "/chat", b"Hi")
    assert status == 200 and not complete  # the stream is cut: curl exits non-zero
    last = body.splitlines()[-1]
    assert last.startswith("[error: no route: layers 2:4 have no worker (no other route")
    service = app.state.gateway
    assert service.history_tokens == 0
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        text = (await http.get("/metrics")).text
    assert 'zmqllm_failovers_total{cause="worker_lost",outcome="failed"} 1.0' in text
    assert len(fake.request_streams) == 1 + 3  # the first session and three replays


async def test_failover_off_keeps_the_error(tok: Tokenizer) -> None:
    fake = healing_fake(tok)
    _, body, complete = await post_raw(make_app(fake, tok), "/chat", b"Hi")
    assert not complete and body.endswith("[error: worker w1 stopped answering]\n")
    assert len(fake.request_streams) == 1
