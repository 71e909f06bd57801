"""Fair share between API keys (issue 29, item 7): a key past its share of slots or of
KV tokens gets 429 with Retry-After at once, others are served; with one key, or none,
nothing is shared."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Any

import pytest

from tests.fake_broker_client import FakeBrokerClient
from tests.gateway.support import TEST_HOSTS, answer_script, tiny_tokenizer
from zmqllm.config.settings import GatewaySettings
from zmqllm.gateway.api_keys import ApiKeys
from zmqllm.gateway.app import create_app
from zmqllm.gateway.key_shares import TOKENIZING_PER_KEY, KeyShares, OverShare
from zmqllm.models.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.anyio

A, B = "sk-tenant-a-1", "sk-tenant-b-2"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


def test_the_ledger_counts_slots_and_kv_per_tenant() -> None:
    shares = KeyShares(max_slots=2, max_kv_tokens=0, cluster_kv_tokens=lambda: 1000)
    assert shares.kv_limit() == 500  # half of what the cluster offers
    shares.check("a", 2, 400)
    shares.take("a", 200)
    shares.take("a", 200)
    with pytest.raises(OverShare) as over:
        shares.check("a", 1, 10)
    assert over.value.what == "generation slots" and over.value.limit == 2
    shares.check("b", 2, 500)  # another key has its own share
    with pytest.raises(OverShare) as over:
        shares.check("b", 1, 501)
    assert over.value.what == "KV tokens" and over.value.limit == 500
    shares.give("a", 200)
    shares.give("a", 200)
    assert shares.slots == {} and shares.kv_tokens == {}
    shares.check(None, 100, 10**9)  # no tenant: nothing to share
    assert KeyShares(2, 0).kv_limit() is None  # the cluster's KV not known yet


def test_a_claim_is_checked_and_taken_in_one_step() -> None:
    shares = KeyShares(max_slots=4, max_kv_tokens=100)
    held = shares.claim("a", [10, 10, 10, 10])
    with pytest.raises(OverShare):
        shares.claim("a", [1])  # the first claim's four slots count at once
    assert shares.slots["a"] == 4 and shares.kv_tokens["a"] == 40
    for part in held:
        part.give()
        part.give()  # every path that ends a generation may give: once counts
    assert shares.slots == {} and shares.kv_tokens == {}
    with pytest.raises(OverShare):
        shares.claim("a", [60, 60])  # past the KV share: nothing taken
    assert shares.slots == {}


def keyed_app(tok: Tokenizer, keys: list[str], **settings: Any) -> tuple[Any, FakeBrokerClient]:
    fake = FakeBrokerClient(answer_script(tok, delay=0.05))
    gateway = GatewaySettings(allowed_hosts=TEST_HOSTS, failover_retries=0, **settings)
    app = create_app(fake, gateway, tok, "tiny-test", 2048, api_keys=ApiKeys(keys))
    return app, fake


def chat(key: str, n: int = 1, max_tokens: int = 16) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": "Hi"}], "n": n, "max_tokens": max_tokens}
    return {"json": body, "headers": {"Authorization": f"Bearer {key}"}}


async def test_a_key_past_its_slots_gets_429_and_others_are_served(tok: Tokenizer) -> None:
    app, _fake = keyed_app(tok, [A, B], max_concurrent=8)  # a key's share: 4 slots
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        first = asyncio.create_task(c.post("/v1/chat/completions", **chat(A, n=4)))
        await asyncio.sleep(0.1)  # its four sessions are open and streaming
        over = await c.post("/v1/chat/completions", **chat(A))
        other = await c.post("/v1/chat/completions", **chat(B, n=4))
        assert (await first).status_code == 200
        after = await c.post("/v1/chat/completions", **chat(A, n=4))  # its share is back
    assert over.status_code == 429 and over.headers["retry-after"]
    error = over.json()["error"]
    assert error["code"] == "key_share_exceeded" and error["type"] == "rate_limit_error"
    assert "at most 4" in error["message"] and A not in over.text
    assert other.status_code == 200 and after.status_code == 200


async def test_a_request_larger_than_a_share_of_kv_is_refused(tok: Tokenizer) -> None:
    app, fake = keyed_app(tok, [A, B], key_max_kv_tokens=100)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        response = await c.post("/v1/chat/completions", **chat(A, n=2, max_tokens=60))
        small = await c.post(
            "/chat?max_tokens=4", content=b"Hi", headers={"Authorization": f"Bearer {B}"}
        )
    assert response.status_code == 429
    assert "KV tokens" in response.json()["error"]["message"]
    assert small.status_code == 200
    assert len(fake.calls) == 1  # the refused one never reached the broker


async def test_one_key_is_one_tenant_with_the_whole_gateway(tok: Tokenizer) -> None:
    app, _fake = keyed_app(tok, [A], max_concurrent=8, key_max_kv_tokens=10)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        response = await c.post("/v1/chat/completions", **chat(A, n=8, max_tokens=60))
    assert response.status_code == 200


async def test_concurrent_requests_of_one_key_hold_at_most_its_share(tok: Tokenizer) -> None:
    """Issue 40, item 4: 8 concurrent n=4 requests of one key with a share of 4 slots got
    5 accepted and held 20 slots (each checked before any took)."""
    app, fake = keyed_app(tok, [A, B], max_concurrent=8)  # a key's share: 4 slots
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        answers = await asyncio.gather(
            *(c.post("/v1/chat/completions", **chat(A, n=4)) for _ in range(8))
        )
    codes = sorted(r.status_code for r in answers)
    assert codes == [200] + [429] * 7
    assert fake.most_open == 4 and len(fake.request_streams) == 4


async def test_requests_to_a_remote_model_count_against_the_key(tok: Tokenizer) -> None:
    """Issue 40, item 4: a remote (text) model's requests skipped the share check."""
    app, fake = keyed_app(tok, [A, B], max_concurrent=4, key_max_concurrent=1)
    models = [{"name": "api", "text_model": True, "complete_route": True, "context": 512}]
    fake.status_extra = {"models": models}
    transport = httpx.ASGITransport(app=app)
    body = {"model": "api", "messages": [{"role": "user", "content": "Hi"}]}
    auth = {"Authorization": f"Bearer {A}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        first = asyncio.create_task(c.post("/v1/chat/completions", json=body, headers=auth))
        await asyncio.sleep(0.1)  # its answer is streaming from the upstream
        over = await c.post("/v1/chat/completions", json=body, headers=auth)
        answered = await first
        after = await c.post("/v1/chat/completions", json=body, headers=auth)
    assert answered.status_code == 200, answered.text
    assert answered.json()["choices"][0]["message"]["content"].startswith("word ")
    assert over.status_code == 429 and over.json()["error"]["code"] == "key_share_exceeded"
    assert after.status_code == 200


async def test_a_request_past_its_keys_slots_is_refused_before_tokenizing(
    tok: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40, item 10: the share was checked after the prompt was tokenized."""
    app, _fake = keyed_app(tok, [A, B], max_concurrent=8)  # a key's share: 4 slots
    encoded: list[int] = []
    real = tok.encode_chat

    def counted(messages: Any) -> list[int]:
        encoded.append(len(messages))
        return real(messages)

    monkeypatch.setattr(tok, "encode_chat", counted)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        first = asyncio.create_task(c.post("/v1/chat/completions", **chat(A, n=4)))
        await asyncio.sleep(0.1)  # its four sessions hold A's share
        over = await c.post("/v1/chat/completions", **chat(A, n=2))
        assert (await first).status_code == 200
    assert over.status_code == 429 and over.json()["error"]["code"] == "key_share_exceeded"
    assert len(encoded) == 1  # the first request's prompt only


async def test_one_keys_prompts_tokenize_a_few_at_a_time(
    tok: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40, item 10: 16 large bodies of one key took every tokenizer thread; now at
    most TOKENIZING_PER_KEY of one key's prompts tokenize at once, other keys' beside."""
    app, _fake = keyed_app(tok, [A, B], max_concurrent=64, key_max_concurrent=32)
    running: Counter[str] = Counter()
    most: Counter[str] = Counter()
    lock = threading.Lock()
    real = tok.encode_chat

    def slow(messages: Any) -> list[int]:
        who = str(messages[0]["content"])
        with lock:
            running[who] += 1
            most[who] = max(most[who], running[who])
        time.sleep(0.05)  # a large body's tokenizing
        with lock:
            running[who] -= 1
        return real(messages)

    monkeypatch.setattr(tok, "encode_chat", slow)

    def ask(key: str) -> dict[str, Any]:
        body = {"messages": [{"role": "user", "content": key}], "max_tokens": 4}
        return {"json": body, "headers": {"Authorization": f"Bearer {key}"}}

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        answers = await asyncio.gather(
            *(c.post("/v1/chat/completions", **ask(A)) for _ in range(8)),
            *(c.post("/v1/chat/completions", **ask(B)) for _ in range(2)),
        )
    assert all(r.status_code == 200 for r in answers)
    assert most[A] == TOKENIZING_PER_KEY and most[B] == TOKENIZING_PER_KEY
    assert app.state.gateway.tokenizing.keys == 0  # nothing kept per key afterwards
