"""BrokerClient against a fake broker: a ROUTER the test scripts, on zmq.asyncio.

No torch here: the gateway uses this client without the ML stack.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from tests.client_harness import INTERVAL, TIMEOUT, FakeBroker, collect, generate, run
from zmqllm.bus.messages import (
    Error,
    ErrorCode,
    Heartbeat,
    MsgType,
    Open,
    SessionError,
    StatusReply,
)
from zmqllm.bus.sampling_params import SamplingParams
from zmqllm.client.broker_client import BrokerClient
from zmqllm.client.streams import MAX_UNREAD_EVENTS, TokenEvent

# -- generating --------------------------------------------------------------------------


def test_generate_yields_tokens_in_order_and_ends_at_finish() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        async with generate(client, prompt=[5, 6, 7], session="s1") as stream:
            opened = await fake.expect(MsgType.OPEN)
            m = opened.msg
            assert isinstance(m, Open)
            assert (m.session, m.request_id, m.attempt, m.step) == ("s1", "req-1", 0, 0)
            assert (m.max_tokens, m.prompt_len, m.stop_ids) == (8, 3, (2,))
            assert m.sampling == SamplingParams(0.5, seed=3)
            assert m.tokens is not None and m.tokens.array.tolist() == [5, 6, 7]
            assert opened.frames[1] == np.array([5, 6, 7], np.int32).tobytes()

            await fake.token(opened, 0, 10, route=["w0", "w1"])
            await fake.token(opened, 1, 11)
            await fake.token(opened, 2, 2, finish="stop")
            events = await collect(stream)
        assert events == [
            TokenEvent(10, 0, None),
            TokenEvent(11, 1, None),
            TokenEvent(2, 2, "stop"),
        ]
        assert stream.route == ["w0", "w1"]
        assert stream.finished
        # A finished stream sends no CANCEL on exit: the next thing the broker hears
        # from this client (same socket, so in order) is the status request.
        await client.status()
        await fake.expect(MsgType.STATUS)

    run(body)


def test_async_for_alone_opens_the_stream() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        stream = generate(client, session="s1")
        events: list[TokenEvent] = []

        async def consume() -> None:
            events.extend(await collect(stream))

        task = asyncio.create_task(consume())
        opened = await fake.expect(MsgType.OPEN)
        await fake.token(opened, 0, 4, finish="length")
        await asyncio.wait_for(task, TIMEOUT)
        assert events == [TokenEvent(4, 0, "length")]

    run(body)


def test_concurrent_streams_get_their_own_tokens() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        async with generate(client, session="a") as a, generate(client, session="b") as b:
            first = await fake.expect(MsgType.OPEN)
            second = await fake.expect(MsgType.OPEN)
            opens = {r.msg.session: r for r in (first, second)}
            # Interleaved, b first: each stream sees only its own session's tokens.
            await fake.token(opens["b"], 0, 20)
            await fake.token(opens["a"], 0, 10)
            await fake.token(opens["b"], 1, 21, finish="length")
            await fake.token(opens["a"], 1, 11, finish="length")
            got_a, got_b = await asyncio.gather(collect(a), collect(b))
        assert [e.token for e in got_a] == [10, 11]
        assert [e.token for e in got_b] == [20, 21]

    run(body)


def test_an_error_raises_broker_error_with_code_and_message() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        async with generate(client, session="s1") as stream:
            opened = await fake.expect(MsgType.OPEN)
            await fake.token(opened, 0, 10)
            err = Error.of(ErrorCode.NO_CAPACITY, "no route after 30s", "s1", request_id="req-1")
            await fake.send(opened.identity, err)
            events: list[TokenEvent] = []
            with pytest.raises(SessionError) as info:
                async for ev in stream:
                    events.append(ev)
        assert events == [TokenEvent(10, 0, None)]
        assert info.value.code is ErrorCode.NO_CAPACITY
        assert info.value.message == "no route after 30s"
        assert "no_capacity" in str(info.value)

    run(body)


def test_leaving_the_block_early_sends_cancel() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        async with generate(client, session="s1") as stream:
            opened = await fake.expect(MsgType.OPEN)
            await fake.token(opened, 0, 10)
            async for _ in stream:
                break  # the caller loses interest after one token
        cancel = await fake.expect(MsgType.CANCEL)
        assert (cancel.msg.session, cancel.msg.request_id) == ("s1", "req-1")
        # Tokens that were already in flight are dropped quietly.
        await fake.token(opened, 1, 11)
        assert await client.status() == fake.status_body

    run(body)


def test_a_malformed_message_from_the_broker_is_dropped() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        async with generate(client, session="s1") as stream:
            opened = await fake.expect(MsgType.OPEN)
            await fake.send_raw(opened.identity, [b"\xc1"])
            await fake.token(opened, 0, 3, finish="length")
            assert await collect(stream) == [TokenEvent(3, 0, "length")]

    run(body)


# -- the broker's health -----------------------------------------------------------------


def test_a_silent_broker_fails_streams_with_broker_unreachable() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        async with generate(client, session="s1") as stream:
            await fake.expect(MsgType.OPEN)  # arrives, but nothing ever answers
            # The bound: liveness x interval plus generous slack, never a hang.
            with pytest.raises(SessionError) as info:
                await asyncio.wait_for(collect(stream), TIMEOUT)
        assert info.value.code is ErrorCode.BROKER_UNREACHABLE
        assert "stopped answering" in info.value.message
        assert not client.connected

    run(body, silent=True)


def test_the_client_recovers_when_the_broker_answers_again() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        async with generate(client, session="s1") as stream:
            await fake.expect(MsgType.OPEN)
            with pytest.raises(SessionError):
                await asyncio.wait_for(collect(stream), TIMEOUT)
        # The broker is back: the client (on a fresh socket) hears it and serves again.
        fake.silent = False
        deadline = time.monotonic() + TIMEOUT
        while not client.connected and time.monotonic() < deadline:
            await asyncio.sleep(INTERVAL / 2)
        assert client.connected
        async with generate(client, session="s2") as stream:
            opened = await fake.expect(MsgType.OPEN)
            await fake.token(opened, 0, 8, finish="length")
            assert await collect(stream) == [TokenEvent(8, 0, "length")]

    run(body, silent=True)


def test_a_restarted_broker_fails_open_streams() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        async with generate(client, session="s1") as stream:
            opened = await fake.expect(MsgType.OPEN)
            await fake.token(opened, 0, 10)
            # Boot ids in this order on one socket: the client learns "a", then sees "b".
            await fake.send(opened.identity, Heartbeat(boot="boot-a"))
            fake.boot = "boot-b"
            await fake.send(opened.identity, Heartbeat(boot="boot-b"))
            events: list[TokenEvent] = []
            with pytest.raises(SessionError) as info:
                async for ev in stream:
                    events.append(ev)
        assert events == [TokenEvent(10, 0, None)]
        assert info.value.code is ErrorCode.BROKER_UNREACHABLE
        assert "restarted" in info.value.message

    run(body)


def test_connected_follows_the_broker_heartbeats() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        deadline = time.monotonic() + TIMEOUT
        while not client.connected and time.monotonic() < deadline:
            await asyncio.sleep(INTERVAL / 2)
        assert client.connected
        assert fake.heartbeats >= 1

    run(body)


def test_closing_the_client_fails_open_streams() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        stream = generate(client, session="s1")
        await stream.__aenter__()
        await fake.expect(MsgType.OPEN)
        await client.close()
        with pytest.raises(SessionError) as info:
            await collect(stream)
        assert info.value.code is ErrorCode.BROKER_UNREACHABLE

    run(body)


# -- status ------------------------------------------------------------------------------


def test_status_returns_the_broker_dict() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        fake.status_body = {"queue": 2, "workers": [{"id": "w0"}], "complete_route": True}
        assert await client.status() == fake.status_body
        assert (await fake.expect(MsgType.STATUS)).msg.request_id  # a key to match on

    run(body)


def test_status_times_out_with_broker_error() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        fake.answer_status = False
        with pytest.raises(SessionError) as info:
            await client.status(timeout=0.3)
        assert info.value.code is ErrorCode.BROKER_UNREACHABLE
        await fake.expect(MsgType.STATUS)

    run(body)


def test_a_stale_status_reply_is_ignored() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        fake.answer_status = False
        task = asyncio.create_task(client.status(timeout=TIMEOUT))
        asked = await fake.expect(MsgType.STATUS)
        stale = StatusReply.of({"stale": 1}, request_id="old")
        await fake.send(asked.identity, stale)
        fresh = {"fresh": 1}
        reply = StatusReply.of(fresh, request_id=asked.msg.request_id)
        await fake.send(asked.identity, reply)
        assert await task == fresh

    run(body)


def test_a_stream_opened_on_the_new_broker_survives_the_restart_notice() -> None:
    """The restart is noticed only after a stream opened on the new broker: that stream
    (its first token carries the new boot id) keeps going; the old broker's one fails."""

    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        async with generate(client, session="old") as old:
            o = await fake.expect(MsgType.OPEN)
            await fake.token(o, 0, 1, boot="boot-a")
            await fake.send(o.identity, Heartbeat(boot="boot-a"))
            async with generate(client, session="new") as new:
                n = await fake.expect(MsgType.OPEN)
                await fake.token(n, 0, 5, boot="boot-b")
                fake.boot = "boot-b"
                await fake.send(n.identity, Heartbeat(boot="boot-b"))
                await fake.token(n, 1, 6, finish="length")
                assert [e.token for e in await collect(new)] == [5, 6]
            with pytest.raises(SessionError, match="restarted"):
                await collect(old)

    run(body)


def test_a_reader_too_far_behind_fails_slow_consumer_and_cancels() -> None:
    """Issue 40, item 3: a stream's queue was unbounded for its reader: a client that
    stopped reading held every token of the answer while its workers went on."""
    max_tokens = MAX_UNREAD_EVENTS + 50

    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        async with generate(client, session="s1", max_tokens=max_tokens) as stream:
            opened = await fake.expect(MsgType.OPEN)
            for step in range(MAX_UNREAD_EVENTS + 1):
                await fake.token(opened, step, 10)
            # Nobody reads: past MAX_UNREAD_EVENTS the session is cancelled at once.
            cancel = await fake.expect(MsgType.CANCEL)
            assert cancel.msg.session == "s1"
            with pytest.raises(SessionError) as failed:
                await collect(stream)
        assert failed.value.code is ErrorCode.SLOW_CONSUMER
        assert str(MAX_UNREAD_EVENTS) in failed.value.message
        assert "s1" not in client._streams  # later tokens are dropped as of no stream

    run(body)


def test_a_reader_within_the_bound_gets_every_token() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        count = MAX_UNREAD_EVENTS
        async with generate(client, session="s1", max_tokens=count) as stream:
            opened = await fake.expect(MsgType.OPEN)
            for step in range(count):
                await fake.token(opened, step, 10, finish="length" if step == count - 1 else None)
            await client.status()  # every token has been read from the socket
            events = await collect(stream)
        assert len(events) == count and events[-1].finish == "length"

    run(body)
