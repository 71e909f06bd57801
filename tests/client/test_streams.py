"""The client's streams without sockets: the OPEN a request becomes, the bounded table,
what a broker restart does to the streams in it, and how an iteration ends."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from zmqllm.bus.messages import ErrorCode, Open, SessionError
from zmqllm.bus.protocol import decode
from zmqllm.bus.sampling_params import SamplingParams
from zmqllm.client.request import GenerateRequest
from zmqllm.client.streams import StreamTable, TokenEvent, TokenStream, open_frames

REQUEST = GenerateRequest(
    session="s1",
    request_id="r1",
    prompt=(5, 6, 7),
    max_tokens=4,
    sampling=SamplingParams(temperature=0.7, seed=9),
    stop_ids=(2,),
)


class NoClient:
    """Stands in for BrokerClient where a stream calls back into it."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def cancel(self, stream: TokenStream) -> None:
        self.cancelled.append(stream.session)


def stream(session: str, client: Any = None) -> TokenStream:
    """An opened stream, as the client's table holds them."""
    s = TokenStream(client, session, "r1", max_tokens=4, frames=[])
    s.opened = True
    return s


def test_open_frames_is_the_open_the_broker_reads() -> None:
    msg = decode(open_frames(REQUEST))
    assert isinstance(msg, Open)
    assert (msg.session, msg.request_id, msg.max_tokens, msg.prompt_len) == ("s1", "r1", 4, 3)
    assert (msg.sampling, msg.stop_ids) == (REQUEST.sampling, (2,))
    assert msg.tokens is not None and msg.tokens.array.tolist() == [5, 6, 7]
    assert msg.speculative  # unless the request turns it off:
    off = decode(open_frames(dataclasses.replace(REQUEST, speculative=False)))
    assert isinstance(off, Open) and not off.speculative


@pytest.mark.parametrize(
    "change",
    [
        {"session": "has.dot"},
        {"session": "x" * 65},
        {"request_id": "req 1"},
        {"request_id": ""},
        {"prompt": ()},
        {"prompt": (2**40,)},
        {"prompt": (-1,)},
        {"max_tokens": 0},
        {"stop_ids": (-1,)},
        {"sampling": SamplingParams(temperature=-1.0)},
    ],
)
def test_a_request_the_broker_would_drop_fails_at_once(change: dict[str, Any]) -> None:
    with pytest.raises(SessionError) as info:
        open_frames(dataclasses.replace(REQUEST, **change))
    assert info.value.code is ErrorCode.BAD_REQUEST


def test_the_table_refuses_past_its_bound_and_a_session_in_use() -> None:
    table = StreamTable(max_streams=2)
    a, b = stream("a"), stream("b")
    table.add(a)
    with pytest.raises(SessionError) as dup:
        table.add(stream("a"))
    assert dup.value.code is ErrorCode.BAD_REQUEST
    table.add(b)
    with pytest.raises(SessionError) as full:
        table.add(stream("c"))
    assert full.value.code is ErrorCode.BUSY
    table.forget(stream("a"))  # another stream of the same id: not the one in the table
    assert "a" in table
    table.forget(a)
    table.add(stream("c"))
    assert len(table) == 2


def test_a_broker_restart_fails_the_old_brokers_streams_and_waits_on_unknown_ones() -> None:
    async def main() -> None:
        table = StreamTable(max_streams=8)
        old, new, unknown = stream("old"), stream("new"), stream("unknown")
        old.boot, new.boot = "boot-a", "boot-b"
        for s in (old, new, unknown):
            table.add(s)
        table.broker_restarted("boot-b", deadline=100.0)
        assert "old" not in table and "new" in table and "unknown" in table
        with pytest.raises(SessionError, match="restarted"):
            await anext(aiter(old))
        table.fail_orphans(now=99.0)
        assert "unknown" in table
        table.fail_orphans(now=101.0)
        assert "unknown" not in table and "new" in table
        with pytest.raises(SessionError) as info:
            await anext(aiter(unknown))
        assert info.value.code is ErrorCode.BROKER_UNREACHABLE

    asyncio.run(main())


def test_cancel_ends_a_pending_iteration() -> None:
    async def main() -> None:
        client = NoClient()
        s = stream("s1", client)
        s.push_event(TokenEvent(7, 0, None))
        got: list[int] = []

        async def consume() -> None:
            got.extend([e.token async for e in s])

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)
        await s.cancel()
        await asyncio.wait_for(task, 5.0)
        assert got == [7]
        assert client.cancelled == ["s1"]
        assert s.next_step == 1

    asyncio.run(main())
