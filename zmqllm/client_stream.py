"""One generation's tokens as the broker client delivers them: ``TokenStream``.

The client's receive task pushes events and errors into a stream; the caller iterates it.
A stream knows the step it expects next and its token budget, so the client can drop a
token that is out of order or past the end instead of handing it on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zmqllm.messages import SessionError

if TYPE_CHECKING:
    from zmqllm.client import BrokerClient

__all__ = ["TokenEvent", "TokenStream"]


@dataclass
class TokenEvent:
    token: int
    step: int
    finish: str | None  # None, "length" or "stop"


@dataclass
class _Item:
    """An event, an error, or neither: the stream ended here (cancelled)."""

    event: TokenEvent | None = None
    error: SessionError | None = None


class TokenStream:
    """The tokens of one session. Use as ``async with client.generate(...) as s``;
    leaving the block before the last token cancels the session everywhere."""

    def __init__(
        self,
        client: BrokerClient,
        session: str,
        request_id: str,
        *,
        max_tokens: int,
        frames: list[Any],
    ) -> None:
        self.client = client
        self.session = session
        self.request_id = request_id
        self.max_tokens = max_tokens
        self.route: list[str] = []
        self.finished = False
        self.opened = False
        self.next_step = 0  # the step of the token expected next
        # The boot id of the broker that sent this stream's first token; None before it.
        self.boot: str | None = None
        # Set when a broker restart was seen before this stream's first token: if none
        # arrives by then, the stream was opened on the dead broker and is failed.
        self.orphan_deadline: float | None = None
        # At most max_tokens events and one error: the client drops anything else.
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._open_frames: list[Any] | None = frames

    def take_open_frames(self) -> list[Any]:
        """The OPEN message, once (its frames are not kept for the stream's life)."""
        frames, self._open_frames = self._open_frames, None
        if frames is None:
            raise RuntimeError("the stream was opened already")
        return frames

    async def __aenter__(self) -> TokenStream:
        await self.client.open_stream(self)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self.finished:
            await self.cancel()
        self.client.forget(self)

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[TokenEvent]:
        if not self.opened:
            await self.client.open_stream(self)
        while not self.finished:
            item = await self._queue.get()
            if item.error is not None:
                self.finished = True
                raise item.error
            if item.event is None:
                return
            if item.event.finish is not None:
                self.finished = True
            yield item.event

    async def cancel(self) -> None:
        """Stop the stream (a pending iteration ends) and tell the broker."""
        if self.finished:
            return
        self.finished = True
        self._queue.put_nowait(_Item())
        await self.client.cancel(self)

    def push_event(self, event: TokenEvent) -> None:
        self.next_step = event.step + 1
        self._queue.put_nowait(_Item(event=event))

    def push_error(self, error: SessionError) -> None:
        self._queue.put_nowait(_Item(error=error))
