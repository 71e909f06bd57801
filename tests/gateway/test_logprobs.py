"""Log-probabilities through the gateway (``zmqllm.gateway.logprobs``): asked for on both
APIs, carried from the last stage's tokens into OpenAI's two shapes, whole and streamed.
The fake broker sends each token at -0.5 and the top ones at -0.5, -1, -1.5 ...; the real
values against HF: tests/e2e/test_cluster.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.fake_broker_client import FakeBrokerClient
from tests.gateway.support import ANSWER, answer_script, make_app, sse_json, tiny_tokenizer
from zmqllm.bus.sampling_params import NO_LOGPROBS
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
    app = make_app(fake, tok)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        yield c


def answer_ids(tok: Tokenizer) -> list[int]:
    return tok.encode(ANSWER)


async def test_chat_logprobs_whole(client: Any, fake: FakeBrokerClient, tok: Tokenizer) -> None:
    body = {"messages": HI, "logprobs": True, "top_logprobs": 2}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert fake.calls[-1].sampling.logprobs == 2
    content = response.json()["choices"][0]["logprobs"]["content"]
    ids = answer_ids(tok)
    assert [c["token"] for c in content] == [tok.decode([i]) for i in ids]  # no EOS entry
    assert "".join(c["token"] for c in content) == ANSWER
    for item, token in zip(content, ids, strict=True):
        assert item["logprob"] == -0.5
        assert item["bytes"] == list(item["token"].encode())
        tops = item["top_logprobs"]
        assert [t["token"] for t in tops] == [tok.decode([token]), tok.decode([token + 1])]
        assert [t["logprob"] for t in tops] == [-0.5, -1.0]


async def test_chat_logprobs_streamed(client: Any, tok: Tokenizer) -> None:
    body = {"messages": HI, "logprobs": True, "stream": True}
    response = await client.post("/v1/chat/completions", json=body)
    chunks = sse_json(response.text)
    entries = [
        item
        for chunk in chunks
        for choice in chunk["choices"]
        for item in (choice.get("logprobs") or {}).get("content", [])
    ]
    assert "".join(e["token"] for e in entries) == ANSWER
    assert all(e["top_logprobs"] == [] for e in entries)  # top_logprobs not asked: none
    pieces = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["delta"]]
    for piece in pieces:  # each piece carries its own tokens' entries
        text = piece["delta"].get("content") or ""
        got = "".join(e["token"] for e in (piece["logprobs"] or {}).get("content", []))
        assert got == text


async def test_completion_logprobs(client: Any, fake: FakeBrokerClient, tok: Tokenizer) -> None:
    response = await client.post("/v1/completions", json={"prompt": "Hi", "logprobs": 1})
    assert response.status_code == 200
    lp = response.json()["choices"][0]["logprobs"]
    ids = answer_ids(tok)
    assert lp["tokens"] == [tok.decode([i]) for i in ids]
    assert lp["token_logprobs"] == [-0.5] * len(ids)
    assert lp["top_logprobs"] == [{tok.decode([i]): -0.5} for i in ids]
    offsets = [sum(len(t) for t in lp["tokens"][:k]) for k in range(len(ids))]
    assert lp["text_offset"] == offsets


async def test_no_logprobs_unless_asked(client: Any, fake: FakeBrokerClient) -> None:
    for body in ({"messages": HI}, {"messages": HI, "logprobs": False, "top_logprobs": 0}):
        response = await client.post("/v1/chat/completions", json=body)
        assert response.json()["choices"][0]["logprobs"] is None
        assert fake.calls[-1].sampling.logprobs == NO_LOGPROBS


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": HI, "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ("/v1/chat/completions", {"messages": HI, "logprobs": 1}, "logprobs"),
        ("/v1/completions", {"prompt": "Hi", "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"prompt": "Hi", "logprobs": -1}, "logprobs"),
    ],
)
async def test_bad_logprobs_requests(
    client: Any, path: str, body: dict[str, Any], param: str
) -> None:
    response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
