"""ReplayStream without sockets: a scripted source plays the broker and its routes.

The source's "model" makes a fixed token for each generation step, so a replay is right
exactly when it sends the history as its prompt, starts sampling at the step reached
and hands on the same tokens with the same steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from zmqllm.bus.messages import ErrorCode, SessionError
from zmqllm.bus.sampling_params import SamplingParams
from zmqllm.client.failover import FailoverEvent, FailoverPolicy, ReplayStream
from zmqllm.client.request import GenerateRequest
from zmqllm.client.streams import TokenEvent

pytestmark = pytest.mark.anyio

PROMPT = [7, 8, 9]
WHOLE = [100 + t for t in range(12)]  # the token of generation step t
FAST = FailoverPolicy(timeout=2.0, retries=5, backoff=0.01, max_backoff=0.02)
# Route builds a broker reports with a session's first token (broker/route_build.py).
BUILD = ("0:2:0123456789ab", "2:4:0123456789ab")
OTHER_BUILD = ("0:2:0123456789ab", "2:4:ba9876543210")


@dataclass
class Fault:
    """What one session does wrong: refuse its open, fail after some tokens, or hang."""

    refuse: ErrorCode | None = None
    after: int | None = None
    code: ErrorCode = ErrorCode.WORKER_LOST
    hang: bool = False
    build: tuple[str, ...] | None = BUILD  # the route's build its first token says


@dataclass
class Session:
    source: Source
    session: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    fault: Fault
    route: list[str] = field(default_factory=lambda: ["w0", "w1"])
    cancelled: bool = False
    finished: bool = False
    asked_build: tuple[str, ...] = ()  # the route build its OPEN asked for
    build: tuple[str, ...] | None = None  # set with the first token, as the client does

    async def __aenter__(self) -> Session:
        if self.fault.refuse is not None:
            raise SessionError(self.fault.refuse, "refused at open")
        self.source.open.add(self.session)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self.finished:
            await self.cancel()
        self.source.open.discard(self.session)

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[TokenEvent]:
        first = self.sampling.first_step
        # The history is the prompt: what a route would prefill.
        assert self.prompt == PROMPT + WHOLE[:first]
        assert first + self.max_tokens == len(WHOLE)
        if self.fault.hang:
            await asyncio.sleep(3600)
        for step in range(self.max_tokens):
            if self.cancelled:
                return
            if self.fault.after is not None and step >= self.fault.after:
                self.finished = True
                raise SessionError(self.fault.code, f"{self.fault.code.value} on {self.session}")
            await asyncio.sleep(0)
            finish = "length" if step + 1 == self.max_tokens else None
            self.finished = finish is not None
            self.build = self.fault.build
            yield TokenEvent(WHOLE[first + step], step, finish)

    async def cancel(self) -> None:
        if not self.finished:
            self.cancelled = self.finished = True
            self.source.cancelled.append(self.session)


@dataclass
class Source:
    faults: list[Fault] = field(default_factory=list)  # one per session, in order
    sessions: list[Session] = field(default_factory=list)
    open: set[str] = field(default_factory=set)
    cancelled: list[str] = field(default_factory=list)

    def generate(self, request: GenerateRequest) -> Session:
        assert request.session and request.request_id == "r1"
        fault = self.faults.pop(0) if self.faults else Fault()
        s = Session(
            self,
            request.session,
            list(request.prompt),
            request.max_tokens,
            request.sampling,
            fault,
            asked_build=request.route_build,
        )
        self.sessions.append(s)
        return s


def replay(source: Source, policy: FailoverPolicy = FAST, **kw: Any) -> ReplayStream:
    events: list[FailoverEvent] = kw.pop("events", [])
    request = GenerateRequest(
        request_id="r1",
        prompt=tuple(PROMPT),
        max_tokens=len(WHOLE),
        sampling=SamplingParams(temperature=0.8, seed=3),
    )
    return ReplayStream(source, request, policy=policy, on_failover=events.append)


async def run(stream: ReplayStream) -> list[TokenEvent]:
    async with stream:
        return [e async for e in stream]


def assert_whole(events: list[TokenEvent]) -> None:
    assert [e.token for e in events] == WHOLE
    assert [e.step for e in events] == list(range(len(WHOLE)))
    assert [e.finish for e in events] == [None] * (len(WHOLE) - 1) + ["length"]


async def test_an_undisturbed_stream_is_one_session() -> None:
    source = Source()
    assert_whole(await run(replay(source)))
    assert len(source.sessions) == 1 and source.cancelled == []


@pytest.mark.parametrize(
    "code", [ErrorCode.WORKER_LOST, ErrorCode.BROKER_UNREACHABLE, ErrorCode.TIMEOUT]
)
async def test_a_lost_route_continues_with_the_history_as_prompt(code: ErrorCode) -> None:
    source = Source([Fault(after=4, code=code)])
    events: list[FailoverEvent] = []
    stream = replay(source, events=events)
    assert_whole(await run(stream))
    first, second = source.sessions
    assert second.session == f"{first.session}-1"
    assert second.sampling.first_step == 4 and second.sampling.seed == 3
    assert second.prompt == PROMPT + WHOLE[:4] and second.max_tokens == len(WHOLE) - 4
    (event,) = events
    assert (event.cause, event.recovered, event.replayed, event.attempts) == (
        code.value,
        True,
        4,
        1,
    )
    assert stream.history_tokens == 0 and source.open == set()


async def test_several_failures_in_one_stream_are_each_healed() -> None:
    source = Source([Fault(after=2), Fault(after=3), Fault(refuse=ErrorCode.NO_CAPACITY)])
    events: list[FailoverEvent] = []
    stream = replay(source, events=events)
    assert_whole(await run(stream))
    assert [s.sampling.first_step for s in source.sessions] == [0, 2, 5, 5]
    assert [e.recovered for e in events] == [True, True]
    assert [e.attempts for e in events] == [1, 2]  # the refused open counts in the second
    assert stream.reopens == 3


@pytest.mark.parametrize("code", [ErrorCode.BAD_REQUEST, ErrorCode.INTERNAL, ErrorCode.CANCELLED])
async def test_errors_that_are_not_a_lost_route_end_the_stream(code: ErrorCode) -> None:
    source = Source([Fault(after=3, code=code)])
    got: list[TokenEvent] = []
    with pytest.raises(SessionError) as caught:
        async with replay(source) as stream:
            async for e in stream:
                got.append(e)
    assert caught.value.code is code and len(source.sessions) == 1
    assert [e.token for e in got] == WHOLE[:3]


async def test_failover_off_ends_the_stream_at_the_first_failure() -> None:
    source = Source([Fault(after=3)])
    with pytest.raises(SessionError) as caught:
        await run(replay(source, FailoverPolicy(retries=0)))
    assert caught.value.code is ErrorCode.WORKER_LOST and len(source.sessions) == 1


async def test_when_no_route_is_left_the_stream_ends_after_the_retries() -> None:
    source = Source([Fault(after=3)] + [Fault(refuse=ErrorCode.NO_CAPACITY)] * 10)
    events: list[FailoverEvent] = []
    stream = replay(source, events=events)
    with pytest.raises(SessionError) as caught:
        await run(stream)
    assert caught.value.code is ErrorCode.NO_CAPACITY
    assert "5 replay(s)" in caught.value.message
    assert len(source.sessions) == 1 + FAST.retries
    (event,) = events
    assert not event.recovered and event.cause == "worker_lost"
    assert stream.history_tokens == 0


async def test_a_replay_that_never_answers_is_given_up_at_the_deadline() -> None:
    policy = FailoverPolicy(timeout=0.3, retries=5, backoff=0.01)
    source = Source([Fault(after=3), Fault(hang=True)])
    events: list[FailoverEvent] = []
    # The replayed session hangs for an hour: 30 s here only guards a hang.
    with pytest.raises(SessionError) as caught:
        await asyncio.wait_for(run(replay(source, policy, events=events)), 30)
    assert caught.value.code is ErrorCode.WORKER_LOST
    # Given up by the failover deadline (after its one replay), not ended by the hang.
    assert "no other route continued the stream: 1 replay(s)" in caught.value.message
    assert source.cancelled == [source.sessions[1].session]  # the stuck session is freed
    assert [e.recovered for e in events] == [False]  # reported once


async def test_a_broker_that_cannot_take_the_open_is_tried_again() -> None:
    source = Source([Fault(after=6), Fault(refuse=ErrorCode.BROKER_UNREACHABLE)])
    assert_whole(await run(replay(source)))
    assert len(source.sessions) == 3


async def test_a_bad_request_at_reopen_is_final() -> None:
    source = Source([Fault(after=6), Fault(refuse=ErrorCode.BAD_REQUEST)])
    with pytest.raises(SessionError) as caught:
        await run(replay(source))
    assert caught.value.code is ErrorCode.BAD_REQUEST and len(source.sessions) == 2


async def test_cancel_frees_the_route_and_the_history() -> None:
    source = Source()
    stream = replay(source)
    async with stream:
        async for e in stream:
            assert stream.history_tokens == len(PROMPT) + e.step + 1
            if e.step == 2:
                await stream.cancel()
    assert source.cancelled == [source.sessions[0].session]
    assert stream.history_tokens == 0 and source.open == set()


def test_backoff_starts_at_once_then_doubles_to_its_cap() -> None:
    policy = FailoverPolicy(backoff=0.25, max_backoff=2.0)
    assert [policy.delay(n) for n in range(1, 7)] == [0.0, 0.25, 0.5, 1.0, 2.0, 2.0]
    assert FailoverPolicy(retries=0).enabled is False


async def test_a_client_gone_during_a_replay_cancels_the_replayed_session() -> None:
    source = Source([Fault(after=3), Fault(hang=True)])

    async def consume() -> None:
        await run(replay(source, FailoverPolicy(timeout=60.0)))

    task = asyncio.create_task(consume())
    while len(source.sessions) < 2:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the replay now waits for its first token
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert source.cancelled == [source.sessions[1].session] and source.open == set()


# -- issue 40, item 15: a replay keeps to the build its stream started on ---------------


async def test_a_replay_asks_for_the_build_of_the_route_the_stream_started_on() -> None:
    source = Source([Fault(after=4), Fault(after=2)])
    stream = replay(source)
    assert_whole(await run(stream))
    first, second, third = source.sessions
    assert first.asked_build == ()  # the first open may go anywhere
    assert second.asked_build == third.asked_build == BUILD


async def test_a_stream_continued_on_another_build_ends_instead() -> None:
    """The broker routes a replay only onto its build; were one to continue it on another
    (a broker that ignored the OPEN's build), the client stops rather than mix them."""
    source = Source([Fault(after=4), Fault(build=OTHER_BUILD)])
    events: list[FailoverEvent] = []
    got: list[TokenEvent] = []
    with pytest.raises(SessionError) as caught:
        async with replay(source, events=events) as stream:
            async for e in stream:
                got.append(e)
    assert caught.value.code is ErrorCode.INTERNAL
    assert "another build" in caught.value.message and OTHER_BUILD[1] in caught.value.message
    assert [e.token for e in got] == WHOLE[:4]  # nothing of the other build was handed on
    assert source.sessions[1].cancelled and source.open == set()
    assert [e.recovered for e in events] == [False]


async def test_giving_up_names_the_build_the_replays_were_held_to() -> None:
    source = Source([Fault(after=3)] + [Fault(refuse=ErrorCode.NO_CAPACITY)] * 10)
    with pytest.raises(SessionError) as caught:
        await run(replay(source))
    message = caught.value.message
    assert "no other route continued the stream" in message
    assert "only onto a route of the build the stream started on: " + " ".join(BUILD) in message
