"""Mid-stream failover by replay: one generation that outlives the route it started on.

A ``ReplayStream`` keeps its ``GenerateRequest`` and every token it has handed on. When
the route fails (a worker lost, the broker restarted or unreachable, the broker's
inactivity deadline), it opens a new session for the same request (``dataclasses.replace``)
whose prompt is prompt + tokens so far and whose sampling starts at the step reached
(``SamplingParams.first_step``): the new route prefills the history and goes on with the
very tokens the lost one would have made, greedy or seeded. The caller sees one stream
with steps 0, 1, 2 ... and no seam.

A replay keeps to the build the stream started on: the first token says its route's
build (each hop's layers and its worker's build key, zmqllm/broker/route_build.py), and
every replay's OPEN names it, so the broker routes it only onto workers of that build. A
replica of another build (a torch release, a wire dtype, another kernel) would continue
the text with other numbers: the stream rather waits for one of its own build, and fails
saying so when none comes.

Recovery is bounded: each failure has ``FailoverPolicy.timeout`` seconds to produce the
next token, and a stream reopens at most ``retries`` times in its life; then the last
error is raised, saying so. Nothing here knows sockets: the client it is given only has
to ``generate`` token streams (``zmqllm.client.broker_client.BrokerClient`` does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from zmqllm.bus.messages import ErrorCode, SessionError
from zmqllm.client.request import GenerateRequest
from zmqllm.client.streams import TokenEvent
from zmqllm.log import get_logger

__all__ = ["FailoverEvent", "FailoverPolicy", "ReplayStream", "StreamSource"]

log = get_logger("zmqllm.client.failover")

# A route that failed: worth a replay on another one.
ROUTE_FAILURES = frozenset({ErrorCode.WORKER_LOST, ErrorCode.BROKER_UNREACHABLE, ErrorCode.TIMEOUT})
# While a replay is being opened, no route may be ready yet (a worker restarting, a broker
# whose workers have not re-registered): those refusals are retried too, within the bound.
WHILE_RECOVERING = ROUTE_FAILURES | {ErrorCode.NO_CAPACITY, ErrorCode.BUSY}


@dataclass(frozen=True)
class FailoverPolicy:
    """How hard a stream tries to continue after its route failed."""

    timeout: float = 30.0  # seconds from a failure to the next token, at most
    retries: int = 5  # reopens in a stream's whole life; 0 turns failover off
    backoff: float = 0.25  # the wait before the second reopen of one failure, doubling
    max_backoff: float = 2.0

    @property
    def enabled(self) -> bool:
        return self.retries > 0 and self.timeout > 0

    def delay(self, attempt: int) -> float:
        """Seconds to wait before reopen number ``attempt`` (1-based) of one failure: the
        first goes at once, a failed one waits backoff, doubling up to max_backoff."""
        if attempt <= 1:
            return 0.0
        return min(self.max_backoff, self.backoff * 2 ** (attempt - 2))


@dataclass(frozen=True)
class FailoverEvent:
    """One failure of a stream's route, once it was healed or given up on."""

    cause: str  # the ErrorCode value that ended the route
    recovered: bool
    pause: float  # seconds from the last token before the failure to the first after it
    attempts: int  # sessions opened for this failure
    replayed: int  # generated tokens sent again as part of the new prompt


class TokenSource(Protocol):
    """One session's token stream, as ``zmqllm.client.streams.TokenStream`` is."""

    @property
    def session(self) -> str: ...

    @property
    def route(self) -> list[str]: ...

    @property
    def build(self) -> tuple[str, ...] | None: ...

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, *exc: object) -> Any: ...

    def __aiter__(self) -> AsyncIterator[Any]: ...

    async def cancel(self) -> None: ...


class StreamSource(Protocol):
    """What a replay needs of the broker client."""

    def generate(self, request: GenerateRequest) -> Any: ...


@dataclass
class _Failure:
    cause: str  # the code that ended the route
    error: SessionError  # the latest: a replay refused says why it was
    started: float  # when the stream's last token (or its open) was seen
    deadline: float
    attempts: int = 0


class ReplayStream:
    """The tokens of one generation, on as many routes as it takes.

    Use like ``TokenStream``: ``async with`` it (the first session is opened), iterate
    it, ``cancel`` it. ``tokens`` holds what was generated so far; the history lives as
    long as this object and never outgrows prompt + max_tokens.
    """

    def __init__(
        self,
        client: StreamSource,
        request: GenerateRequest,
        *,
        policy: FailoverPolicy | None = None,
        on_failover: Callable[[FailoverEvent], None] | None = None,
    ) -> None:
        self.client = client
        self.request = request  # the first attempt's; each replay is derived from it
        self.policy = policy or FailoverPolicy()
        self.on_failover = on_failover
        self.tokens: list[int] = []
        self.reopens = 0
        # The build of the route the stream's first token came from; () until that token.
        self.route_build: tuple[str, ...] = ()
        self._base = uuid.uuid4().hex  # attempt n runs as session "<base>-n"
        self._inner: TokenSource = self._new_session()  # raises bad_request at once
        self._done = False
        self._last_seen = 0.0

    # -- what a token stream offers ----------------------------------------------
    @property
    def session(self) -> str:
        return self._inner.session

    @property
    def route(self) -> list[str]:
        return list(self._inner.route)

    @property
    def history_tokens(self) -> int:
        """Token ids held for a replay (prompt + generated); 0 once the stream ended."""
        return 0 if self._done else len(self.request.prompt) + len(self.tokens)

    async def __aenter__(self) -> ReplayStream:
        self._last_seen = time.monotonic()
        try:
            await self._inner.__aenter__()
        except BaseException:
            self._end()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        inner = self._inner
        self._end()
        await inner.__aexit__(None, None, None)  # cancels the session unless it finished

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._events()

    async def cancel(self) -> None:
        self._end()
        await self._inner.cancel()

    # -- the replay ---------------------------------------------------------------
    async def _events(self) -> AsyncIterator[TokenEvent]:
        failure: _Failure | None = None
        while not self._done:
            offset = len(self.tokens)
            events = aiter(self._inner)
            try:
                while True:
                    if failure is None:
                        event = await anext(events)
                    else:
                        event = await self._first_after(failure, events)
                        await self._check_build(failure)
                        self._report(failure, recovered=True)
                        failure = None
                    if not self.route_build:
                        # What the stream's text is of: every replay asks for it.
                        self.route_build = tuple(self._inner.build or ())
                    self._last_seen = time.monotonic()
                    token_event = TokenEvent(
                        int(event.token),
                        offset + event.step,
                        event.finish,
                        event.logprobs,
                    )
                    self.tokens.append(token_event.token)
                    if token_event.finish is not None:
                        self._end()
                    yield token_event
                    if self._done:
                        return
            except StopAsyncIteration:
                return  # cancelled
            except SessionError as exc:
                failure = self._failed(exc, failure)
            await self._reopen(failure)

    def _failed(self, exc: SessionError, failure: _Failure | None) -> _Failure:
        """The route ended with ``exc``: the failure to heal, or ``exc`` raised as final."""
        if self._done:  # given up already (and reported)
            raise exc
        codes = WHILE_RECOVERING if failure is not None else ROUTE_FAILURES
        if not self.policy.enabled or exc.code not in codes:
            if failure is not None:
                self._report(failure, recovered=False)
            self._end()
            raise exc
        if failure is not None:
            failure.error = exc  # still the same failure: its deadline stands
            return failure
        now = time.monotonic()
        log.warning(
            "route failed; replaying the session on a fresh route",
            cause=exc.code.value,
            session=self.session,
            generated=len(self.tokens),
            error=exc.message,
        )
        return _Failure(exc.code.value, exc, self._last_seen, now + self.policy.timeout)

    async def _reopen(self, failure: _Failure) -> None:
        """Open the next session of the replay, waiting between tries; raises the failure
        once the retries or the time are used up."""
        while True:
            wait = self.policy.delay(failure.attempts + 1)
            if self.reopens >= self.policy.retries or failure.deadline - time.monotonic() <= wait:
                self._give_up(failure)
            await asyncio.sleep(wait)
            failure.attempts += 1
            self.reopens += 1
            # The new session is ours before its OPEN goes: a cancel from here on (the
            # client hanging up) reaches it through __aexit__, whatever is in flight.
            old, self._inner = self._inner, self._new_session()
            await old.__aexit__(None, None, None)  # it failed: only forgotten
            try:
                await self._inner.__aenter__()
            except SessionError as exc:
                self._failed(exc, failure)  # raises unless worth another try
                continue
            return

    async def _first_after(self, failure: _Failure, events: AsyncIterator[Any]) -> Any:
        """The first token of a replayed session, within the failure's deadline."""
        left = failure.deadline - time.monotonic()
        try:
            return await asyncio.wait_for(anext(events), timeout=max(left, 0.0))
        except asyncio.TimeoutError:
            await self._inner.cancel()
            self._give_up(failure)
            raise  # unreachable: _give_up raises

    async def _check_build(self, failure: _Failure) -> None:
        """A replay's first token came: its route must be of the stream's build (the
        broker routes it so). One that is not (a broker that ignored the OPEN's build)
        ends the stream rather than mix two builds' text."""
        got = self._inner.build
        if not self.route_build or got is None or tuple(got) == self.route_build:
            return
        await self._inner.cancel()
        self._report(failure, recovered=False)
        self._end()
        raise SessionError(
            ErrorCode.INTERNAL,
            f"the stream was continued on a route of another build ({_shown(tuple(got))}, "
            f"not {_shown(self.route_build)}); stopped so that its text is one build's",
        )

    def _give_up(self, failure: _Failure) -> None:
        self._report(failure, recovered=False)
        self._end()
        spent = time.monotonic() - failure.started
        only = ""
        if self.route_build:
            only = (
                "; a replay goes only onto a route of the build the stream started on: "
                + _shown(self.route_build)
            )
        raise SessionError(
            failure.error.code,
            f"{failure.error.message} (no other route continued the stream: "
            f"{failure.attempts} replay(s) in {spent:.1f} s; failover gives up after "
            f"{self.policy.timeout:g} s or {self.policy.retries} replays{only})",
        )

    def _report(self, failure: _Failure, *, recovered: bool) -> None:
        event = FailoverEvent(
            cause=failure.cause,
            recovered=recovered,
            pause=time.monotonic() - failure.started,
            attempts=failure.attempts,
            replayed=len(self.tokens),
        )
        if recovered:
            log.info(
                "stream continued on a fresh route",
                cause=event.cause,
                pause_s=round(event.pause, 3),
                attempts=event.attempts,
                replayed=event.replayed,
                session=self.session,
            )
        else:
            log.warning(
                "failover gave up", cause=event.cause, attempts=event.attempts, session=self.session
            )
        if self.on_failover is not None:
            self.on_failover(event)

    def _new_session(self) -> TokenSource:
        """The session for the next attempt: the request, with the history so far as its
        prompt, the budget left, and sampling from the step reached."""
        done = len(self.tokens)
        first = self.request
        step = first.sampling.first_step + done
        attempt = dataclasses.replace(
            first,
            prompt=(*first.prompt, *self.tokens),
            max_tokens=first.max_tokens - done,
            sampling=dataclasses.replace(first.sampling, first_step=step),
            session=self._base if self.reopens == 0 else f"{self._base}-{self.reopens}",
            route_build=self.route_build,
        )
        stream: TokenSource = self.client.generate(attempt)
        return stream

    def _end(self) -> None:
        """No more replays: the history is dropped (the gauge of held tokens reads 0)."""
        self._done = True
        self.tokens = []
        self.request = dataclasses.replace(self.request, prompt=())


def _shown(build: tuple[str, ...]) -> str:
    """A route's build as an error message shows it ("0:2:KEY 2:4:KEY", cut short)."""
    text = " ".join(build)
    return text if len(text) <= 200 else text[:197] + "..."
