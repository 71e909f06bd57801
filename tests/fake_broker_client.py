"""An in-process stand-in for zmqllm.client.broker_client.BrokerClient, for gateway tests.

It plays broker and workers at once: each session "generates" a scripted list of token
ids, one per ``delay`` seconds, stopping at a stop id or at max_tokens exactly as the last
stage would, and it records what the gateway asked for (each request's fields, cancels).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from zmqllm.bus.messages import ErrorCode, SessionError
from zmqllm.bus.sampling_params import NO_LOGPROBS, SamplingParams
from zmqllm.client.request import GenerateRequest
from zmqllm.client.streams import DeltaEvent


@dataclass
class FakeTokenEvent:
    token: int
    step: int
    finish: str | None
    logprobs: tuple[tuple[int, ...], tuple[float, ...]] | None = None


# The real client's one error class: the gateway matches on it. The old name stays for the
# tests that build one by it.
FakeBrokerError = SessionError


@dataclass
class Script:
    """What a session produces."""

    tokens: list[int]
    delay: float = 0.0
    # Raised instead of the first token (e.g. no_capacity).
    fail_before_first: SessionError | None = None
    # Raised after this many tokens were sent (e.g. worker_lost mid-stream).
    fail_after: int | None = None
    fail_with: SessionError = field(
        default_factory=lambda: SessionError(ErrorCode.WORKER_LOST, "worker w1 stopped answering")
    )
    # After this many tokens, wait ``stall`` seconds before the next (a stuck worker).
    stall_after: int | None = None
    stall: float = 0.0


@dataclass
class GenerateCall:
    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: list[int]
    session: str | None = None


def fake_logprobs(
    token: int, sampling: SamplingParams
) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
    """What a worker would send when asked: the token at -0.5, then the top ones (the token
    itself first, then ids after it) at -0.5, -1, -1.5 ..."""
    if sampling.logprobs == NO_LOGPROBS:
        return None
    top = tuple(token + i for i in range(sampling.logprobs))
    return (token, *top), (-0.5, *(-0.5 * (i + 1) for i in range(sampling.logprobs)))


class FakeTokenStream:
    def __init__(self, client: FakeBrokerClient, call: GenerateCall, script: Script) -> None:
        self.client = client
        self.call = call
        self.script = script
        self.session = f"s{len(client.calls)}"
        self.route: list[str] = []
        self.build: tuple[str, ...] | None = None  # the broker's route build: not said
        self.finished = False
        self.cancelled = False
        # perf_counter time at which each token was handed out.
        self.produced_at: list[float] = []

    async def __aenter__(self) -> FakeTokenStream:
        self.client.open_streams.add(self.session)
        self.client.most_open = max(self.client.most_open, len(self.client.open_streams))
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Like the real client: leaving before the finish event cancels the session.
        if not self.finished:
            await self.cancel()
        self.client.open_streams.discard(self.session)

    def __aiter__(self) -> AsyncIterator[FakeTokenEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[FakeTokenEvent]:
        script = self.script
        if script.fail_before_first is not None:
            self.finished = True
            raise script.fail_before_first
        stop_ids = set(self.call.stop_ids)
        for step, token in enumerate(script.tokens):
            if script.fail_after is not None and step >= script.fail_after:
                self.finished = True
                raise script.fail_with
            if script.delay:
                await asyncio.sleep(script.delay)
            if script.stall_after is not None and step == script.stall_after:
                await asyncio.sleep(script.stall)
            self.route = ["w0", "w1"]
            finish = None
            if token in stop_ids:
                finish = "stop"
            elif step + 1 >= self.call.max_tokens:
                finish = "length"
            self.produced_at.append(time.perf_counter())
            if finish is not None:
                self.finished = True
            yield FakeTokenEvent(token, step, finish, fake_logprobs(token, self.call.sampling))
            if finish is not None:
                return
        # A script that runs out behaves like a model that keeps repeating its last token.
        raise AssertionError("script exhausted without a finish; end it with an EOS id")

    async def cancel(self) -> None:
        if self.finished:
            return
        self.finished = True
        self.cancelled = True
        self.client.cancels.append(self.session)


class FakeBrokerClient:
    def __init__(self, script: Script | None = None) -> None:
        self.default_script = script or Script(tokens=[])
        # Scripts for particular prompts (by their token ids) override the default.
        self.scripts: dict[tuple[int, ...], Script] = {}
        self.script_for: Callable[[list[int]], Script | None] | None = None
        self.calls: list[GenerateCall] = []
        self.streams: list[FakeTokenStream] = []
        self.cancels: list[str] = []
        self.open_streams: set[str] = set()
        self.most_open = 0  # the most sessions open at one time
        self.complete_route = True
        self.unreachable = False
        self.drops: Counter[str] = Counter()  # what the real client counts as dropped
        self.status_calls = 0
        self.status_delay = 0.0  # seconds each status call takes
        self.status_extra: dict[str, Any] = {}  # more keys in each status answer
        self.started = False
        self.closed = False

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True

    @property
    def connected(self) -> bool:
        return not self.unreachable

    @property
    def dropped(self) -> Mapping[str, int]:
        return self.drops

    def generate(self, request: GenerateRequest) -> FakeTokenStream:
        prompt = list(request.prompt)
        call = GenerateCall(
            request.request_id,
            prompt,
            request.max_tokens,
            request.sampling,
            list(request.stop_ids),
            request.session or None,
        )
        self.calls.append(call)
        script = self.scripts.get(tuple(prompt))
        if script is None and self.script_for is not None:
            script = self.script_for(prompt)
        stream = FakeTokenStream(self, call, script or self.default_script)
        self.streams.append(stream)
        return stream

    def ask(self, *, request_id: str, model: str, max_tokens: int, **_: Any) -> FakeAskStream:
        """A remote (text) model's answer: the default script's token count in pieces of
        text, each after the script's delay."""
        call = GenerateCall(request_id, [], max_tokens, SamplingParams(), [], None)
        self.calls.append(call)
        stream = FakeAskStream(self, call, self.default_script)
        self.streams.append(stream)
        return stream

    @property
    def request_streams(self) -> list[FakeTokenStream]:
        """The streams of HTTP requests, without the readiness warm-ups."""
        return [s for s in self.streams if not s.call.request_id.startswith("warmup-")]

    async def status(self, timeout: float = 2.0) -> dict[str, Any]:
        self.status_calls += 1
        if self.status_delay:
            await asyncio.sleep(self.status_delay)
        if self.unreachable:
            raise SessionError(ErrorCode.BROKER_UNREACHABLE, "no answer from the broker")
        return {
            "complete_route": self.complete_route,
            "workers": [],
            "pools": [],
            "queue": 0,
            "sessions": len(self.open_streams),
            **self.status_extra,
        }


class FakeAskStream(FakeTokenStream):
    """A remote model's answer: DeltaEvents of one word each, "stop" on the last."""

    async def _events(self) -> AsyncIterator[Any]:
        pieces = max(1, len(self.script.tokens) - 1)
        for step in range(pieces):
            if self.script.delay:
                await asyncio.sleep(self.script.delay)
            finish = "stop" if step + 1 == pieces else None
            self.finished = finish is not None
            yield DeltaEvent("word ", step, finish)
