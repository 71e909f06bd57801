"""Fair share between API keys (issue 29, item 7): a key past its share of slots or of
KV tokens gets 429 with Retry-After at once, others are served; with one key, or none,
nothing is shared."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.fake_broker_client import FakeBrokerClient
from tests.gateway.support import TEST_HOSTS, answer_script, tiny_tokenizer
from zmqllm.config.settings import GatewaySettings
from zmqllm.gateway.api_keys import ApiKeys
from zmqllm.gateway.app import create_app
from zmqllm.gateway.key_shares import KeyShares, OverShare
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
