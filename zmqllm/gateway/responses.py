"""Delivering a generation: streamed, or collected whole, cancelled if the client leaves.

Either way the session must end when the HTTP exchange ends. Starlette's
StreamingResponse (ASGI spec 2.3, as uvicorn reports) cancels the streaming task when the
client disconnects; the body generator may then be parked at a ``yield`` and never
resumed, so its own ``finally`` is not a reliable place to cancel the session. The
response below closes the stream itself once Starlette is done, whatever happened.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Protocol, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from zmqllm.gateway.request_context import RequestRecord

__all__ = [
    "INCOMPLETE_RESPONSE_LOG",
    "STREAM_HEADERS",
    "Generation",
    "GenerationResponse",
    "collect_unless_disconnected",
]

# no-cache: nothing in between may store a live answer; X-Accel-Buffering: nginx would
# otherwise buffer the stream and defeat token-by-token delivery.
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


T = TypeVar("T", covariant=True)


class Generation(Protocol[T]):
    """What is delivered here: a TextStream (its text) or a request's Choices (theirs)."""

    @property
    def finished(self) -> bool: ...

    async def close(self) -> None: ...

    async def text(self) -> T: ...


# What uvicorn logs when a response is left incomplete on purpose (see abort_on_error).
INCOMPLETE_RESPONSE_LOG = "ASGI callable returned without completing response."


class GenerationResponse(StreamingResponse):
    """A streamed answer that always closes its generation (CANCEL if unfinished).

    With ``abort_on_error``, a stream whose generation failed after the headers went out
    ends without its last (terminating) chunk: the server then closes the connection, and
    a client such as curl reports the transfer as failed (exit status 18) instead of
    taking the partial answer and its error line for a whole one.
    """

    def __init__(
        self,
        content: AsyncIterator[str],
        generation: Generation[object],
        record: RequestRecord,
        *,
        media_type: str,
        headers: Mapping[str, str] | None = None,
        abort_on_error: bool = False,
    ) -> None:
        super().__init__(
            content, media_type=media_type, headers={**STREAM_HEADERS, **(headers or {})}
        )
        self._content = content
        self._generation = generation
        self._record = record
        self._abort_on_error = abort_on_error

    async def stream_response(self, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            body = chunk if isinstance(chunk, bytes | memoryview) else chunk.encode(self.charset)
            await send({"type": "http.response.body", "body": body, "more_body": True})
        if self._abort_on_error and self._record.error not in (None, "cancelled"):
            return  # no terminating chunk: uvicorn closes the connection
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                if not self._generation.finished and self._record.error is None:
                    self._record.error = "cancelled"
                    self._record.finish_reason = "cancelled"
                closer = getattr(self._content, "aclose", None)
                if closer is not None:
                    # RuntimeError: still running in a task being torn down; close() suffices.
                    with contextlib.suppress(RuntimeError):
                        await closer()
                await self._generation.close()


async def collect_unless_disconnected(
    generation: Generation[T], request: Request, record: RequestRecord
) -> T | None:
    """The whole answer, or None if the client disconnected first (the session is cancelled).

    A non-streamed answer can take a long time; without watching the connection, a client
    that gave up would keep its workers busy until max_tokens.
    """
    text: T | None = None
    failure: Exception | None = None
    try:
        async with anyio.create_task_group() as tasks:

            async def watch() -> None:
                while True:
                    message = await request.receive()
                    if message["type"] == "http.disconnect":
                        record.error = record.finish_reason = "cancelled"
                        tasks.cancel_scope.cancel()
                        return

            tasks.start_soon(watch)
            try:
                text = await generation.text()
            except Exception as exc:
                # Raised outside the task group, which would wrap it in an ExceptionGroup.
                failure = exc
            tasks.cancel_scope.cancel()
    finally:
        await generation.close()
    if failure is not None:
        raise failure
    return text
