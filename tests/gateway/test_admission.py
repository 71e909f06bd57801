"""Admission: past max_concurrent requests wait in a bounded FIFO queue, not refused.

The queue itself (zmqllm.gateway.admission) is tested directly; the HTTP answers (all
served, 429 past the bound, 503 past the queue timeout, a client hanging up while
queued) through the app with the fake broker client.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any
from urllib.parse import urlsplit

import anyio
import pytest

from tests.fake_broker_client import FakeBrokerClient, Script
from tests.gateway.support import (
    ANSWER,
    CHAT_ANSWER,
    answer_script,
    make_app,
    running_server,
    tiny_tokenizer,
    wait_for,
)
from zmqllm.gateway.admission import Admission, ClientGone, QueueFull, QueueTimeout
from zmqllm.gateway.service import GatewayService
from zmqllm.models.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


async def settle() -> None:
    """Let every ready task run until it blocks."""
    for _ in range(20):
        await asyncio.sleep(0)


# --- the queue ------------------------------------------------------------------------------


async def test_slots_are_handed_out_in_arrival_order() -> None:
    admission = Admission(max_concurrent=2, max_queued=10, queue_timeout=60)
    order: list[int] = []

    async def request(number: int) -> None:
        await admission.acquire()
        order.append(number)

    await admission.acquire()
    await admission.acquire()
    async with anyio.create_task_group() as tasks:
        for number in range(5):
            tasks.start_soon(request, number)
            await settle()
        assert admission.queued == 5 and order == []
        for _ in range(5):
            admission.release()
            await settle()
    assert order == [0, 1, 2, 3, 4]
    assert admission.running == 2 and admission.queued == 0


async def test_past_the_bound_the_queue_refuses_at_once() -> None:
    admission = Admission(max_concurrent=1, max_queued=2, queue_timeout=60)
    await admission.acquire()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(admission.acquire)
        tasks.start_soon(admission.acquire)
        await settle()
        with pytest.raises(QueueFull):
            await admission.acquire()
        assert admission.queued == 2
        admission.release()
        admission.release()
    admission.release()
    assert admission.running == 0


async def test_a_waiter_that_times_out_leaves_the_queue() -> None:
    admission = Admission(max_concurrent=1, max_queued=1, queue_timeout=0.05)
    await admission.acquire()
    with pytest.raises(QueueTimeout):
        await admission.acquire()
    assert admission.queued == 0
    admission.release()
    assert admission.running == 0


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    admission = Admission(max_concurrent=1, max_queued=5, queue_timeout=60)
    await admission.acquire()
    scope = anyio.CancelScope()

    async def waiter() -> None:
        with scope:
            await admission.acquire()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(waiter)
        await settle()
        assert admission.queued == 1
        scope.cancel()
        await settle()
        assert admission.queued == 0
    admission.release()
    assert admission.running == 0


async def test_a_slot_that_reaches_a_waiter_cancelled_meanwhile_goes_on() -> None:
    admission = Admission(max_concurrent=1, max_queued=5, queue_timeout=60)
    await admission.acquire()
    got: list[str] = []

    async def request(name: str) -> None:
        await admission.acquire()
        got.append(name)

    doomed = asyncio.create_task(request("doomed"))
    await settle()
    last = asyncio.create_task(request("last"))
    await settle()
    admission.release()  # the slot goes to the oldest waiter ...
    doomed.cancel()  # ... cancelled before it woke up: the slot must not be lost
    await settle()
    assert doomed.cancelled()
    await asyncio.wait_for(last, 10)
    assert got == ["last"]
    assert admission.queued == 0 and admission.running == 1


async def test_a_client_gone_while_waiting_leaves_the_queue() -> None:
    admission = Admission(max_concurrent=1, max_queued=5, queue_timeout=60)
    await admission.acquire()
    with pytest.raises(ClientGone):
        await admission.acquire(settle)  # the client hangs up a moment after queueing
    assert admission.queued == 0
    admission.release()
    assert admission.running == 0


# --- over HTTP ------------------------------------------------------------------------------


def service(app: Any) -> GatewayService:
    gateway: GatewayService = app.state.gateway
    return gateway


async def test_requests_past_max_concurrent_wait_and_all_complete(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(answer_script(tok, delay=0.005))
    app = make_app(fake, tok, max_concurrent=4)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        responses = await asyncio.gather(*(c.post("/chat", content=b"Hi") for _ in range(40)))
    assert [r.status_code for r in responses] == [200] * 40
    assert all(r.text == CHAT_ANSWER for r in responses)
    assert fake.most_open == 4  # never more sessions than slots
    assert service(app).in_flight == 0 and service(app).queued == 0


async def test_past_the_queue_bound_429_then_normal_service(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(answer_script(tok, delay=0.02))
    app = make_app(fake, tok, max_concurrent=1, max_queued=2)
    gateway = service(app)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        running = asyncio.ensure_future(c.post("/chat", content=b"Hi"))
        while not fake.calls:
            await asyncio.sleep(0.005)
        queued = [asyncio.ensure_future(c.post("/chat", content=b"Hi")) for _ in range(2)]
        while gateway.queued < 2:
            await asyncio.sleep(0.005)
        refused = await c.post("/chat", content=b"Hi")
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert refused.json() == {
            "error": {
                "message": "the gateway is at its limit of 1 running and 2 queued requests; "
                "retry shortly",
                "type": "rate_limit_error",
                "param": None,
                "code": "too_many_requests",
            }
        }
        # Everything that was let in is served, and the gateway serves normally after.
        for response in await asyncio.gather(running, *queued):
            assert response.status_code == 200 and response.text == CHAT_ANSWER
        assert len(fake.request_streams) == 3
        after = await c.post("/v1/completions", json={"prompt": "Hi"})
        assert after.status_code == 200
    assert gateway.in_flight == 0 and gateway.queued == 0


async def test_past_the_queue_timeout_503(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(answer_script(tok, delay=0.1))
    app = make_app(fake, tok, max_concurrent=1, queue_timeout=0.1)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        running = asyncio.ensure_future(c.post("/chat", content=b"Hi"))
        while not fake.calls:
            await asyncio.sleep(0.005)
        late = await c.post("/chat", content=b"Hi")
        assert late.status_code == 503 and late.headers["retry-after"] == "1"
        assert late.json()["error"]["code"] == "queue_timeout"
        assert (await running).text == CHAT_ANSWER
    assert len(fake.request_streams) == 1  # the late one never reached the broker
    assert service(app).queued == 0


def test_a_client_that_hangs_up_while_queued_frees_its_place(tok: Tokenizer) -> None:
    """Real uvicorn: the queued client closes its socket; its place is freed at once,
    it never reaches the broker, and the next request can take the place."""
    long_answer = " ".join([ANSWER] * 10)
    fake = FakeBrokerClient(answer_script(tok, long_answer, delay=0.02))
    app = make_app(fake, tok, max_concurrent=1, max_queued=1)
    gateway = service(app)
    with running_server(app) as url, httpx.Client(timeout=30) as http:
        address = urlsplit(url)
        with http.stream("POST", f"{url}/chat", content=b"Hi") as first:
            assert first.status_code == 200
            wait_for(lambda: len(fake.request_streams) == 1)
            body = b"Hi"
            request = (
                f"POST /chat HTTP/1.1\r\nHost: gw\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body
            with socket.create_connection((address.hostname, address.port)) as quitter:
                quitter.sendall(request)
                wait_for(lambda: gateway.queued == 1)
            wait_for(lambda: gateway.queued == 0)
            # Its place is free: another request queues (no 429) and is served.
            with httpx.Client(timeout=30) as other:
                assert other.post(f"{url}/chat", content=b"Hi").text == long_answer + "\n"
            assert first.read().decode() == long_answer + "\n"
        assert len(fake.request_streams) == 2  # the client that hung up never got a session
        wait_for(lambda: gateway.in_flight == 0)


def test_a_client_that_hangs_up_before_its_first_token_frees_its_slot(tok: Tokenizer) -> None:
    """A long prefill (here: a first token that never comes) does not keep the slot and
    the workers busy for a client that has gone: the session is cancelled at once."""
    fake = FakeBrokerClient(Script(answer_script(tok).tokens, stall_after=0, stall=3600.0))
    app = make_app(fake, tok, max_concurrent=1)
    gateway = service(app)
    with running_server(app) as url:
        address = urlsplit(url)
        request = b"POST /chat HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\n\r\nHi"
        with socket.create_connection((address.hostname, address.port)) as quitter:
            quitter.sendall(request)
            wait_for(lambda: len(fake.request_streams) == 1)
        (stream,) = fake.request_streams
        wait_for(lambda: fake.cancels == [stream.session])
        wait_for(lambda: gateway.in_flight == 0 and stream.session not in fake.open_streams)
        # The slot is free: the next request is served.
        fake.default_script = answer_script(tok)
        assert httpx.post(f"{url}/chat", content=b"Hi", timeout=30).text == CHAT_ANSWER
