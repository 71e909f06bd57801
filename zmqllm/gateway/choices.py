"""Several answers to one request (OpenAI's ``n``): how many, their seeds, and their
streams read and closed as one (``zmqllm.gateway.generations`` opens one session per
choice, all together, so the workers batch their steps).

Each choice samples with a seed of its own (the request's ``seed + i`` when it gives one),
so sampled choices differ and a seeded request is reproducible; greedy ones are equal.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import anyio

from zmqllm.bus.sampling_params import MAX_SEED
from zmqllm.gateway.errors import APIError
from zmqllm.gateway.streaming import TextStream

__all__ = ["MAX_CHOICES", "Choices", "check_choices", "choice_seeds"]

MAX_CHOICES = 8


def choice_seeds(seed: int, n: int) -> list[int]:
    """The seeds of ``n`` choices: choice i samples with ``seed + i`` (wrapping at 2**63)."""
    return [(seed + i) % (MAX_SEED + 1) for i in range(n)]


def check_choices(n: int | None, max_concurrent: int) -> int:
    """The number of choices asked for, 1 when not given; a 400 beyond what can run."""
    if n is None:
        return 1
    if not 1 <= n <= MAX_CHOICES:
        raise APIError(
            400, f"n must be in 1..{MAX_CHOICES}, got {n}", param="n", code="invalid_value"
        )
    if n > max_concurrent:
        # Each choice holds a generation slot: more than all of them would wait on itself.
        raise APIError(
            400,
            f"n={n} is more than this gateway's max_concurrent of {max_concurrent}",
            param="n",
            code="invalid_value",
        )
    return n


class Choices:
    """The streams of one request's choices, index i for choice i."""

    def __init__(self, streams: list[TextStream]) -> None:
        self.streams = streams

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.streams)

    @property
    def generated_tokens(self) -> int:
        return sum(s.generated_tokens for s in self.streams)

    async def close(self) -> None:
        """Close every stream (CANCEL where unfinished), even while being cancelled."""
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*(s.close() for s in self.streams), return_exceptions=True)

    async def text(self) -> list[str]:
        return list(await asyncio.gather(*(s.text() for s in self.streams)))

    async def chunks(self) -> AsyncIterator[tuple[int, str | None]]:
        """``(index, text)`` as each choice's text arrives, and ``(index, None)`` when that
        choice is done; the first failure of any choice is raised."""
        if len(self.streams) == 1:
            # The usual request: read it in place, without a task per token.
            async for text in self.streams[0].chunks():
                yield 0, text
            yield 0, None
            return
        iterators = [s.chunks() for s in self.streams]
        pending: dict[asyncio.Future[str], int] = {
            asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)
        }
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in sorted(done, key=pending.__getitem__):
                    index = pending.pop(future)
                    try:
                        text = future.result()
                    except StopAsyncIteration:
                        yield index, None
                        continue
                    yield index, text
                    pending[asyncio.ensure_future(anext(iterators[index]))] = index
        finally:
            for future in pending:
                future.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*pending, return_exceptions=True)
