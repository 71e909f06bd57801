"""The broker client's streams: one generation's tokens (``TokenStream``), the OPEN that
starts it, and the bounded table of open streams (``StreamTable``). No sockets here.

The client's receive task pushes events and errors into a stream; the caller iterates it.
A stream knows the step it expects next and its token budget, so the client can drop a
token that is out of order or past the end instead of handing it on.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from zmqllm.bus.messages import Ask, AskKind, ErrorCode, Message, Open, SessionError
from zmqllm.bus.protocol import decode, encode
from zmqllm.bus.wire_types import Payload, ProtocolError, is_valid_id
from zmqllm.client.request import GenerateRequest

__all__ = [
    "MAX_UNREAD_EVENTS",
    "DeltaEvent",
    "StreamOwner",
    "StreamTable",
    "TokenEvent",
    "TokenStream",
    "ask_frames",
    "open_frames",
]


# Events a stream may hold that its reader has not taken. A reader that falls this far
# behind (an HTTP client that stopped reading its stream) has its session failed
# (slow_consumer) and cancelled: its workers stop at once rather than generating the
# whole answer into memory that nobody reads. A text model's stream has no token budget
# to bound it otherwise.
MAX_UNREAD_EVENTS = 1024


class StreamOwner(Protocol):
    """What a stream needs of the client that made it (``BrokerClient`` is one); owned
    here, by the consumer, so that streams never import the client."""

    async def open_stream(self, stream: TokenStream) -> None: ...

    async def cancel(self, stream: TokenStream) -> None: ...

    def forget(self, stream: TokenStream) -> None: ...


@dataclass
class TokenEvent:
    token: int
    step: int
    finish: str | None  # None, "length" or "stop"
    # When asked for: (ids, log-probabilities), the sampled token's first (Token's fields).
    logprobs: tuple[tuple[int, ...], tuple[float, ...]] | None = None


@dataclass
class DeltaEvent:
    """A piece of a text model's answer; the last has ``finish`` (and the token counts
    when the upstream told them)."""

    text: str
    step: int
    finish: str | None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


@dataclass
class _Item:
    """An event, an error, or neither: the stream ended here (cancelled)."""

    event: TokenEvent | DeltaEvent | None = None
    error: SessionError | None = None


class TokenStream:
    """The tokens of one session. Use as ``async with client.generate(request) as s``;
    leaving the block before the last token cancels the session everywhere."""

    def __init__(
        self,
        client: StreamOwner,
        session: str,
        request_id: str,
        *,
        max_tokens: int,
        frames: list[Any],
        text_model: bool = False,
    ) -> None:
        self.client = client
        # A text model's stream: DELTAs (pieces of text, as many as the upstream sends)
        # instead of TOKENs (at most max_tokens).
        self.text_model = text_model
        self.session = session
        self.request_id = request_id
        self.max_tokens = max_tokens
        self.route: list[str] = []
        self.finished = False
        self.opened = False
        self.next_step = 0  # the step of the token expected next
        # The boot id of the broker that sent this stream's first token; None before it.
        self.boot: str | None = None
        # The build of its route, hop for hop, as the first token said it (None: not said).
        self.build: tuple[str, ...] | None = None
        # Set when a broker restart was seen before this stream's first token: if none
        # arrives by then, the stream was opened on the dead broker and is failed.
        self.orphan_deadline: float | None = None
        # At most MAX_UNREAD_EVENTS events and one error: the client drops anything else.
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

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._events()

    async def _events(self) -> AsyncIterator[Any]:
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

    def push_event(self, event: TokenEvent | DeltaEvent) -> bool:
        """Queue an event for the reader; False (nothing queued) when the reader has
        MAX_UNREAD_EVENTS unread: the owner fails the stream (``overrun``)."""
        if self._queue.qsize() >= MAX_UNREAD_EVENTS:
            return False
        self.next_step = event.step + 1
        self._queue.put_nowait(_Item(event=event))
        return True

    def push_error(self, error: SessionError) -> None:
        self._queue.put_nowait(_Item(error=error))

    def overrun(self) -> SessionError:
        """The reader fell MAX_UNREAD_EVENTS behind: the unread events are dropped and the
        reader's next read raises the error returned (also what the owner reports)."""
        while not self._queue.empty():
            self._queue.get_nowait()
        error = SessionError(
            ErrorCode.SLOW_CONSUMER,
            f"the reader fell {MAX_UNREAD_EVENTS} tokens behind the generation; cancelled",
        )
        self.push_error(error)
        return error


def open_frames(request: GenerateRequest) -> list[Any]:
    """The OPEN for ``request`` (its ``session`` set), encoded: the one place a request
    becomes an OPEN. SessionError(bad_request) for one the broker would drop as malformed
    (ids outside 1-64 of [A-Za-z0-9_-], an empty prompt, a value out of range): it must
    fail now, not after the first-token deadline."""

    def build() -> Open:
        tokens = np.asarray(request.prompt, dtype=np.int32)
        if tokens.size and int(tokens.min()) < 0:
            raise ValueError("token ids must be >= 0")
        return Open(
            session=request.session,
            request_id=request.request_id,
            max_tokens=int(request.max_tokens),
            prompt_len=len(tokens),
            sampling=request.sampling,
            stop_ids=tuple(int(t) for t in request.stop_ids),
            tokens=Payload(tokens, "int32"),
            model=request.model,
            build=request.route_build,
            speculative=request.speculative,
        )

    return _sendable(request.session, request.request_id, build)


def ask_frames(
    *,
    session: str,
    request_id: str,
    model: str,
    kind: AskKind,
    fields: Mapping[str, Any],
    max_tokens: int,
) -> list[Any]:
    """The ASK for a text model's request, encoded; SessionError(bad_request) for one the
    broker would drop as malformed."""

    def build() -> Ask:
        raw = json.dumps(dict(fields), ensure_ascii=False).encode()
        return Ask(
            session=session,
            request_id=request_id,
            model=model,
            kind=kind,
            max_tokens=int(max_tokens),
            body=Payload(np.frombuffer(raw, np.uint8), "uint8"),
        )

    return _sendable(session, request_id, build)


def _sendable(session: str, request_id: str, build: Callable[[], Message]) -> list[Any]:
    """The frames of the message ``build`` makes, checked as the broker will check them;
    SessionError(bad_request) naming what is wrong."""
    for what, value in (("session", session), ("request", request_id)):
        if not is_valid_id(value):
            raise SessionError(ErrorCode.BAD_REQUEST, f"{what} id must be 1 to 64 of [A-Za-z0-9_-]")
    try:
        frames = encode(build())
        decode(frames)
    except (ProtocolError, ValueError, TypeError, OverflowError) as exc:
        raise SessionError(ErrorCode.BAD_REQUEST, f"request not sendable: {exc}") from None
    return frames


class StreamTable:
    """Open streams by session id, at most ``max_streams`` of them."""

    def __init__(self, max_streams: int) -> None:
        self.max_streams = max_streams
        self._streams: dict[str, TokenStream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, session: object) -> bool:
        return session in self._streams

    def get(self, session: str) -> TokenStream | None:
        return self._streams.get(session)

    def add(self, stream: TokenStream) -> None:
        """SessionError: busy when full, bad_request for a session id in use."""
        if len(self._streams) >= self.max_streams:
            raise SessionError(ErrorCode.BUSY, f"the client holds {self.max_streams} streams")
        if stream.session in self._streams:
            raise SessionError(ErrorCode.BAD_REQUEST, "session id already in use")
        self._streams[stream.session] = stream

    def forget(self, stream: TokenStream) -> None:
        if self._streams.get(stream.session) is stream:
            del self._streams[stream.session]

    def fail(self, stream: TokenStream, error: SessionError) -> None:
        self.forget(stream)
        stream.push_error(error)

    def fail_all(self, error: SessionError) -> None:
        streams, self._streams = self._streams, {}
        for s in streams.values():
            s.push_error(error)

    def broker_restarted(self, boot: str, deadline: float) -> None:
        """A broker with a new boot id answers: streams of the old one are lost. A stream
        with no token yet may have opened on either: it has until ``deadline`` to show."""
        lost = SessionError(ErrorCode.BROKER_UNREACHABLE, "the broker restarted; sessions lost")
        for s in list(self._streams.values()):
            if s.boot is None:
                s.orphan_deadline = deadline
            elif s.boot != boot:
                self.fail(s, lost)

    def fail_orphans(self, now: float) -> None:
        lost = SessionError(ErrorCode.BROKER_UNREACHABLE, "the broker restarted; sessions lost")
        for s in list(self._streams.values()):
            if s.orphan_deadline is not None and now > s.orphan_deadline:
                self.fail(s, lost)
