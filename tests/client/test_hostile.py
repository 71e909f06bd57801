"""BrokerClient against a broker that misbehaves: garbage, messages out of order, a peer
that never reads, nobody listening. The client drops what it cannot use, fails only the
stream concerned, and never hangs or loses its loops."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from tests.client_harness import TIMEOUT, FakeBroker, collect, generate, run
from zmqllm.bus.messages import (
    Error,
    ErrorCode,
    Heartbeat,
    MsgType,
    SessionError,
    StatusReply,
    Step,
    Token,
)
from zmqllm.bus.protocol import MAX_FRAMES, PROTOCOL_VERSION, encode
from zmqllm.bus.wire_types import Payload
from zmqllm.client.broker_client import BrokerClient


def head(**fields: Any) -> bytes:
    packed: bytes = msgpack.packb({"v": PROTOCOL_VERSION, **fields})
    return packed


# Each would break a client that trusted its broker. None names a stream but "s1".
GARBAGE: list[list[bytes]] = [
    [b"\xc1"],  # not msgpack
    [b""],
    [b"\x00"] * (MAX_FRAMES + 3),  # more frames than any message has
    [head(type="token", session="s1", token=1, step=0, tensors=[["float32", [0, 2**64 - 1]]])],
    [head(type="token", session="s1", token=1, step=0, tensors=[["float32", [2**30, 8]]]), b""],
    [head(type="token", session="s1", token="one", step=0)],  # a field of the wrong type
    [head(type="token", session="s1", token=-1, step=0)],  # out of range
    [head(type="token", session="s1.2", token=1, step=0)],  # not a session id
    [head(type="token", session="s1", token=1, step=0, finish=[1])],
    [head(type="error", session="s1", code=5, message="x")],
    [head(type="status_reply", tensors=[["uint8", [3]]]), b"ab"],  # short payload
    [head(type="no_such_type")],
    [msgpack.packb({"v": PROTOCOL_VERSION + 1, "type": "token"})],
    [msgpack.packb([1, 2, 3])],
    encode(Step(session="s1", token=3)),  # a worker's message, not ours
]


def test_garbage_from_the_broker_is_dropped_and_the_stream_goes_on() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        async with generate(client, session="s1") as stream:
            opened = await fake.expect(MsgType.OPEN)
            for frames in GARBAGE:
                await fake.send_raw(opened.identity, frames)
            await fake.token(opened, 0, 3)
            await fake.token(opened, 1, 4, finish="length")
            assert [e.token for e in await collect(stream)] == [3, 4]
        # What /metrics reads, by reason.
        assert sum(client.dropped.values()) >= len(GARBAGE)
        assert client.dropped["malformed"] and client.dropped["too many frames"] == 1
        assert client.dropped["unexpected type"] == 1  # the STEP
        assert not [r for r in client.dropped if r.startswith("error:")]
        assert await client.status() == fake.status_body

    run(body)


def test_an_oversized_frame_costs_only_the_connection() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        await client.status()  # connected: the fake knows the client's identity
        asked = await fake.expect(MsgType.STATUS)
        # ZeroMQ drops the link instead of reading 5 MiB; the DEALER connects again.
        await fake.send_raw(asked.identity, [b"x" * (5 << 20)])
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                assert await client.status(timeout=0.5) == fake.status_body
                break
            except SessionError:
                assert time.monotonic() < deadline, "the client never heard the broker again"

    run(body)


def test_tokens_out_of_step_or_of_no_stream_are_dropped() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        async with generate(client, session="s1", max_tokens=3) as stream:
            opened = await fake.expect(MsgType.OPEN)
            await fake.token(opened, 1, 99)  # ahead of step 0
            await fake.token(opened, 0, 10)
            await fake.token(opened, 0, 98)  # step 0 again
            other = Token(session="nobody", request_id="req-1", step=0, token=97)
            await fake.send(opened.identity, other)
            await fake.token(opened, 1, 11)
            await fake.token(opened, 3, 96)  # past max_tokens
            await fake.token(opened, 2, 12, finish="length")
            assert [(e.step, e.token) for e in await collect(stream)] == [
                (0, 10),
                (1, 11),
                (2, 12),
            ]
        assert client.drops.counts["token out of order"] == 3
        assert client.drops.counts["token of no stream"] == 1

    run(body)


def test_an_error_in_one_handler_does_not_stop_the_next_message() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        def broken(msg: Heartbeat) -> None:
            raise RuntimeError("a bug in the heartbeat handler")

        client._handlers[Heartbeat] = broken  # the dispatch table's entry
        async with generate(client, session="s1") as stream:
            opened = await fake.expect(MsgType.OPEN)
            await fake.send(opened.identity, Heartbeat(boot="boot-a"))
            await fake.token(opened, 0, 5, finish="length")
            assert [e.token for e in await collect(stream)] == [5]
        assert client.drops.counts["error:heartbeat"] >= 1

    # Liveness from the messages, not from the heartbeat handler: a long horizon keeps a
    # slow error log (a traceback per heartbeat) from counting as a silent broker.
    run(body, liveness=100)


def test_an_error_handling_a_token_fails_only_its_stream() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        async with generate(client, session="bad") as bad, generate(client, session="ok") as ok:
            opens = {r.msg.session: r for r in [await fake.expect(MsgType.OPEN) for _ in "ab"]}

            def push_fails(event: Any) -> None:
                raise RuntimeError("cannot queue")

            bad.push_event = push_fails  # type: ignore[method-assign]
            await fake.token(opens["bad"], 0, 1)
            await fake.token(opens["ok"], 0, 2, finish="length")
            with pytest.raises(SessionError) as info:
                await collect(bad)
            assert info.value.code is ErrorCode.INTERNAL
            assert [e.token for e in await collect(ok)] == [2]
            # The broker is told to stop the failed session.
            cancel = await fake.expect(MsgType.CANCEL)
            assert cancel.msg.session == "bad"
        assert client.drops.counts["error:token"] == 1

    run(body)


def test_a_cancelled_stream_ignores_the_brokers_cancelled_error() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        async with generate(client, session="s1") as stream:
            opened = await fake.expect(MsgType.OPEN)
            await stream.cancel()
            assert await collect(stream) == []  # ends at once, no error
        await fake.expect(MsgType.CANCEL)
        told = Error.of(ErrorCode.CANCELLED, "cancelled by its client", "s1", request_id="req-1")
        await fake.send(opened.identity, told)
        assert await client.status() == fake.status_body
        assert client.drops.counts["error of no stream"] == 1

    run(body)


def test_a_status_reply_that_is_not_msgpack_fails_status_clearly() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        fake.answer_status = False
        task = asyncio.create_task(client.status(timeout=TIMEOUT))
        asked = await fake.expect(MsgType.STATUS)
        body = Payload(np.frombuffer(b"\xc1\x00", np.uint8), "uint8")
        await fake.send(asked.identity, StatusReply(request_id=asked.msg.request_id, body=body))
        with pytest.raises(SessionError, match="unreadable status") as info:
            await task
        assert info.value.code is ErrorCode.INTERNAL

    run(body)


def test_a_status_answered_with_an_error_raises_it() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        fake.answer_status = False
        task = asyncio.create_task(client.status(timeout=TIMEOUT))
        asked = await fake.expect(MsgType.STATUS)
        busy = Error.of(ErrorCode.BUSY, "try later", request_id=asked.msg.request_id)
        await fake.send(asked.identity, busy)
        with pytest.raises(SessionError, match="try later"):
            await task

    run(body)


def test_the_streams_table_is_bounded() -> None:
    async def body(client: BrokerClient, fake: FakeBroker) -> None:
        async with generate(client, session="a"), generate(client, session="b"):
            with pytest.raises(SessionError) as info:
                async with generate(client, session="c"):
                    pass
            assert info.value.code is ErrorCode.BUSY
        # Both left: room again.
        async with generate(client, session="d") as d:
            opened = await fake.skip_to(MsgType.OPEN, "d")
            await fake.token(opened, 0, 1, finish="length")
            assert [e.token for e in await collect(d)] == [1]

    run(body, max_streams=2)


# -- sends that cannot complete ----------------------------------------------------------

SEND_TIMEOUT = 0.3
# What the send timeout says when it fires (a hang is cut by the tests' asyncio.wait_for).
SEND_TIMED_OUT = f"did not take a message in {SEND_TIMEOUT}s"


def free_tcp_address() -> str:
    """An address nobody listens on (the port was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def open_fails_in_time(client: BrokerClient, session: str) -> None:
    with pytest.raises(SessionError) as info:
        async with generate(client, session=session):
            pass
    assert SEND_TIMED_OUT in info.value.message
    assert info.value.code is ErrorCode.BROKER_UNREACHABLE
    assert session not in client._streams


def test_a_send_with_no_broker_fails_within_the_timeout() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        client = BrokerClient(free_tcp_address(), context=ctx, send_timeout=SEND_TIMEOUT)
        await client.start()
        try:
            await open_fails_in_time(client, "s1")
            with pytest.raises(SessionError):
                await client.status(timeout=SEND_TIMEOUT)
        finally:
            await client.close()
            ctx.term()

    asyncio.run(asyncio.wait_for(main(), 3 * TIMEOUT))


def test_a_send_to_a_broker_that_never_reads_fails_within_the_timeout() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        peer = ctx.socket(zmq.ROUTER)
        peer.setsockopt(zmq.RCVHWM, 1)
        peer.setsockopt(zmq.LINGER, 0)
        peer.bind("inproc://never-reads")
        client = BrokerClient(
            "inproc://never-reads", context=ctx, send_timeout=SEND_TIMEOUT, send_hwm=1
        )
        await client.start()
        try:
            # The pipe holds a message or two (and heartbeats); then an OPEN cannot go.
            for i in range(8):
                try:
                    await generate(client, session=f"s{i}").__aenter__()
                except SessionError as exc:
                    assert exc.code is ErrorCode.BROKER_UNREACHABLE
                    assert SEND_TIMED_OUT in exc.message
                    assert f"s{i}" not in client._streams
                    break
            else:
                pytest.fail("every OPEN went out to a peer that never reads")
        finally:
            await client.close()
            peer.close(linger=0)
            ctx.term()

    asyncio.run(asyncio.wait_for(main(), 6 * TIMEOUT))
