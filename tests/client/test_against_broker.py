"""The client against the real broker (in a thread) and one scripted worker: the contract
between them, end to end over TCP, without torch.

The worker is a DEALER on the broker's backend that owns every layer (a one-stage route)
and answers each OPEN and STEP with the next scripted token.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from zmqllm.broker.loop import Broker
from zmqllm.bus.messages import (
    Close,
    ErrorCode,
    Finish,
    Heartbeat,
    Open,
    Register,
    Registered,
    SessionError,
    Step,
    Token,
)
from zmqllm.bus.protocol import decode, encode
from zmqllm.bus.sampling_params import SamplingParams
from zmqllm.client.broker_client import BrokerClient
from zmqllm.client.request import GenerateRequest
from zmqllm.config.settings import BrokerSettings
from zmqllm.version import __version__

TIMEOUT = 10.0
INTERVAL = 0.1
SCRIPT = [11, 12, 13, 14, 15, 16, 17, 18]


class ScriptedWorker:
    """Answers OPEN with token 0 and STEP n with token n (finish at max_tokens); records
    what it was sent. ``hold`` makes it sit on STEPs (a stream that stays open)."""

    def __init__(self, ctx: zmq.Context, backend: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, b"w-test")  # the broker names workers by it
        self.sock.connect(backend)
        self.hold = threading.Event()
        self.closed: list[str] = []
        self._max_tokens: dict[tuple[str, int], int] = {}
        self._stop = threading.Event()
        self.sock.send_multipart(encode(self._register()))
        assert self.sock.poll(int(TIMEOUT * 1000))
        assert isinstance(decode(self.sock.recv_multipart()), Registered)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @staticmethod
    def _register() -> Register:
        return Register(
            start=0,
            end=4,
            num_layers=4,
            capacity=8,
            max_kv_tokens=4096,
            context=1024,
            version=__version__,
            fingerprint="fp-client-test",
            model={"num_layers": 4, "hidden_size": 64},
            host="test-host",
            served="scripted",
        )

    def _serve(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            if time.monotonic() >= next_beat:
                self.sock.send_multipart(encode(Heartbeat()))
                next_beat = time.monotonic() + INTERVAL / 2
            if not self.sock.poll(20):
                continue
            msg = decode(self.sock.recv_multipart())
            if isinstance(msg, Open):
                self._max_tokens[(msg.session, msg.attempt)] = msg.max_tokens
                self._answer(msg.session, msg.attempt, msg.request_id, 0)
            elif isinstance(msg, Step) and not self.hold.is_set():
                self._answer(msg.session, msg.attempt, msg.request_id, msg.step)
            elif isinstance(msg, Close):
                self.closed.append(msg.session)

    def _answer(self, session: str, attempt: int, request_id: str, step: int) -> None:
        last = step + 1 >= self._max_tokens.get((session, attempt), 1)
        token = Token(
            session=session,
            attempt=attempt,
            request_id=request_id,
            step=step,
            token=SCRIPT[step],
            finish=Finish.LENGTH if last else None,
        )
        self.sock.send_multipart(encode(token))

    def close(self) -> None:
        self._stop.set()
        self.thread.join(TIMEOUT)
        self.sock.close(linger=0)


@pytest.fixture
def cluster() -> Iterator[tuple[Broker, ScriptedWorker]]:
    ctx = zmq.Context()
    settings = BrokerSettings(
        frontend="tcp://127.0.0.1:0",
        backend="tcp://127.0.0.1:0",
        heartbeat_interval=INTERVAL,
        heartbeat_liveness=30,
    )
    broker = Broker(settings, context=ctx)
    thread = threading.Thread(target=broker.run, daemon=True)
    thread.start()
    worker = ScriptedWorker(ctx, broker.endpoints[1])
    try:
        yield broker, worker
    finally:
        worker.close()
        broker.stop()
        thread.join(TIMEOUT)
        assert not thread.is_alive()
        ctx.term()


def with_client(broker: Broker, body: Any) -> None:
    async def main() -> None:
        actx = zmq.asyncio.Context()
        client = BrokerClient(broker.endpoints[0], INTERVAL, 30, context=actx)
        await client.start()
        try:
            await asyncio.wait_for(body(client), 3 * TIMEOUT)
        finally:
            await client.close()
            actx.term()

    asyncio.run(main())


def request(client: BrokerClient, session: str, max_tokens: int = 4) -> Any:
    return client.generate(
        GenerateRequest(
            request_id=f"req-{session}",
            prompt=(5, 6, 7),
            max_tokens=max_tokens,
            sampling=SamplingParams(),
            stop_ids=(2,),
            session=session,
        )
    )


def test_a_stream_through_the_real_broker(cluster: tuple[Broker, ScriptedWorker]) -> None:
    broker, _ = cluster

    async def body(client: BrokerClient) -> None:
        status = await client.status()
        assert status["complete_route"]
        async with request(client, "s1", max_tokens=4) as stream:
            events = [e async for e in stream]
        assert [(e.step, e.token) for e in events] == [(0, 11), (1, 12), (2, 13), (3, 14)]
        assert [e.finish for e in events] == [None, None, None, "length"]
        assert stream.route and stream.boot == status["boot"]
        assert not client.drops.counts  # nothing the broker sent was dropped

    with_client(broker, body)


def test_a_cancel_is_confirmed_quietly(cluster: tuple[Broker, ScriptedWorker]) -> None:
    broker, worker = cluster

    async def body(client: BrokerClient) -> None:
        worker.hold.set()
        async with request(client, "s2", max_tokens=8) as stream:
            async for event in stream:
                assert event.token == SCRIPT[0]
                break  # leaving early: the client cancels
        deadline = time.monotonic() + TIMEOUT
        while (await client.status())["sessions"] and time.monotonic() < deadline:
            await asyncio.sleep(INTERVAL)
        assert (await client.status())["sessions"] == 0
        # The route was told to free the session: the broker forgets it when it sends
        # CLOSE, so the worker's thread may read that message a little later.
        while not worker.closed and time.monotonic() < deadline:
            await asyncio.sleep(INTERVAL)
        assert len(worker.closed) == 1
        # The broker's CANCELLED answer (sent before the status that showed 0 sessions, on
        # the same connection) found no stream: counted, nothing raised.
        assert client.drops.counts["error of no stream"] == 1
        assert not [r for r in client.drops.counts if r.startswith("error:")]

    with_client(broker, body)


def test_a_request_the_broker_refuses_fails_with_its_code(
    cluster: tuple[Broker, ScriptedWorker],
) -> None:
    broker, _ = cluster

    async def body(client: BrokerClient) -> None:
        # Longer than the worker's context (1024): the broker says bad_request.
        stream = client.generate(
            GenerateRequest(
                request_id="req-long",
                prompt=(5,) * 1000,
                max_tokens=100,
                sampling=SamplingParams(),
                session="s3",
            )
        )
        with pytest.raises(SessionError) as info:
            async with stream:
                [e async for e in stream]
        assert info.value.code is ErrorCode.BAD_REQUEST

    with_client(broker, body)
