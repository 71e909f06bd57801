"""``n`` choices per request (``zmqllm.gateway.choices``): one session each, opened
together, each with its own seed; answered whole and streamed, through a fake broker."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.fake_broker_client import FakeBrokerClient, FakeBrokerError, Script
from tests.gateway.support import ANSWER, answer_script, make_app, sse_json, tiny_tokenizer
from zmqllm.gateway.choices import MAX_CHOICES
from zmqllm.models.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture
def fake(tok: Tokenizer) -> FakeBrokerClient:
    return FakeBrokerClient(answer_script(tok))


@pytest.fixture
async def client(fake: FakeBrokerClient, tok: Tokenizer) -> AsyncIterator[Any]:
    app = make_app(fake, tok, max_concurrent=MAX_CHOICES)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        yield c


def generations(fake: FakeBrokerClient) -> list[Any]:
    return [call for call in fake.calls if not call.request_id.startswith("warmup-")]


async def test_n_choices_answered_whole(
    client: Any, fake: FakeBrokerClient, tok: Tokenizer
) -> None:
    body = {"messages": HI, "n": 3, "seed": 7, "temperature": 0.8, "max_tokens": 30}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == ANSWER for c in answer["choices"])
    assert all(c["finish_reason"] == "stop" for c in answer["choices"])
    tokens = len(tok.encode(ANSWER)) + 1  # and the EOS
    assert answer["usage"]["completion_tokens"] == 3 * tokens
    assert answer["usage"]["prompt_tokens"] == len(generations(fake)[0].prompt)  # once
    # One session per choice, the same prompt, seeds 7, 8 and 9.
    calls = generations(fake)
    assert len(calls) == 3 and len({s.session for s in fake.request_streams}) == 3
    assert {tuple(c.prompt) for c in calls} == {tuple(calls[0].prompt)}
    assert sorted(c.sampling.seed for c in calls) == [7, 8, 9]
    # Every choice's tokens count in the metrics.
    metrics = (await client.get("/metrics")).text
    assert f"zmqllm_generated_tokens_total {3 * tokens}.0" in metrics


async def test_unseeded_choices_draw_seeds_of_their_own(
    client: Any, fake: FakeBrokerClient
) -> None:
    body = {"prompt": "Hi", "n": 4, "temperature": 1.0, "max_tokens": 30}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert [c["text"] for c in response.json()["choices"]] == [ANSWER] * 4
    assert len({c.sampling.seed for c in generations(fake)}) == 4


async def test_n_choices_streamed(client: Any, fake: FakeBrokerClient) -> None:
    body = {
        "messages": HI,
        "n": 2,
        "stream": True,
        "max_tokens": 30,
        "stream_options": {"include_usage": True},
    }
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    chunks = sse_json(response.text)
    texts = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    roles = set()
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        index = choice["index"]
        assert index not in finishes  # nothing of a choice after its closing chunk
        if choice["delta"].get("role"):
            roles.add(index)
        texts[index] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finishes[index] = choice["finish_reason"]
    assert roles == {0, 1}
    assert texts == {0: ANSWER, 1: ANSWER}
    assert finishes == {0: "stop", 1: "stop"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert len(generations(fake)) == 2


async def test_a_choice_that_fails_fails_the_request_and_frees_the_others(
    client: Any, fake: FakeBrokerClient, tok: Tokenizer
) -> None:
    seen = []

    def second_fails(prompt: list[int]) -> Script | None:
        seen.append(prompt)
        if len(seen) == 2:
            return Script([], fail_before_first=FakeBrokerError("no_capacity", "full"))
        return answer_script(tok, delay=0.01)

    fake.script_for = second_fails
    body = {"messages": HI, "n": 3, "max_tokens": 30}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "no_capacity"
    # The choices that had opened are cancelled: nothing is left running.
    assert fake.open_streams == set()
    assert len(fake.cancels) == 2


async def test_more_choices_than_slots_is_refused(fake: FakeBrokerClient, tok: Tokenizer) -> None:
    app = make_app(fake, tok, max_concurrent=2)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        response = await c.post("/v1/chat/completions", json={"messages": HI, "n": 3})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "n" and "max_concurrent of 2" in error["message"]
    assert generations(fake) == []
