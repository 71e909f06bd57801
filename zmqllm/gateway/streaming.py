"""From a broker token stream to text chunks: detokenizing, stop strings, EOS, timings.

``TextStream`` owns one ``TokenStreamLike`` for the life of one HTTP request. It is opened
(and its first token awaited) before the response starts, so a broker failure at that
point can still become a 503; after that it yields text as soon as each token completes
a character, and ``close`` always leaves the session either finished or cancelled.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import AsyncExitStack
from typing import Any

import anyio

from zmqllm.gateway.backend import TokenEventLike, TokenStreamLike, broker_error_fields
from zmqllm.models.tokenizer import IncrementalDecoder

__all__ = ["GenerationError", "StopMatcher", "TextStream"]


class GenerationError(Exception):
    """The generation failed; ``code`` uses the broker's vocabulary (worker_lost, timeout …)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _as_generation_error(exc: BaseException) -> GenerationError | None:
    if isinstance(exc, GenerationError):
        return exc
    fields = broker_error_fields(exc)
    return GenerationError(*fields) if fields else None


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back what could start one.

    Text that might be the beginning of a stop string is not released until the next
    chunk shows whether it is; so no stop string can begin inside text already sent, and
    one split across tokens (or across chunks) is still found.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return ``(releasable text, stop string found)``."""
        if not self._stops:
            return text, False
        if self.matched is not None:
            return "", True
        buffer = self._pending + text
        hits = [(index, stop) for stop in self._stops if (index := buffer.find(stop)) >= 0]
        if hits:
            index, self.matched = min(hits)
            self._pending = ""
            return buffer[:index], True
        hold = max(_overlap(buffer, stop) for stop in self._stops)
        cut = len(buffer) - hold
        self._pending = buffer[cut:]
        return buffer[:cut], False

    def flush(self) -> str:
        """At the end of the stream the held-back text is plain text after all."""
        rest, self._pending = self._pending, ""
        return rest


def _overlap(text: str, stop: str) -> int:
    """Length of the longest proper prefix of ``stop`` that ``text`` ends with."""
    for size in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:size]):
            return size
    return 0


class TextStream:
    """One request's generation, as text chunks.

    Counters and timestamps (``time.perf_counter``) are public for the request log line
    and the ``usage`` block.
    """

    def __init__(
        self,
        stream: TokenStreamLike,
        decoder: IncrementalDecoder | None,
        *,
        max_tokens: int,
        stop_ids: Iterable[int] = (),
        stops: Sequence[str] = (),
        timeout: float | None = None,
        first_token_timeout: float | None = None,
        inter_token_timeout: float | None = None,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._stream = stream
        self._decoder = decoder
        self._matcher = StopMatcher(stops)
        self._stop_ids = frozenset(stop_ids)
        self._max_tokens = max_tokens
        self._timeout = timeout  # the whole generation, from open()
        self._first_token_timeout = first_token_timeout
        self._inter_token_timeout = inter_token_timeout
        self._on_close = on_close
        self._exit_stack = AsyncExitStack()
        self._events: AsyncIterator[TokenEventLike] | None = None
        self._first: TokenEventLike | None = None
        self._closed = False
        self.opened_at = 0.0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.token_gaps: list[float] = []  # seconds between tokens, for the ITL histogram
        self.generated_tokens = 0
        # A text model's count of the prompt's tokens, when its upstream told it.
        self.prompt_tokens: int | None = None
        self.finish_reason: str | None = None
        # (token, ids, log-probabilities) of shown tokens not yet taken (take_logprobs).
        self._logprobs: list[tuple[int, tuple[int, ...], tuple[float, ...]]] = []

    def take_logprobs(self) -> list[tuple[int, tuple[int, ...], tuple[float, ...]]]:
        """The log-probabilities of the tokens accepted since the last call (when the
        session asked for them): the sampled token's first in each."""
        taken, self._logprobs = self._logprobs, []
        return taken

    @property
    def session(self) -> str:
        return self._stream.session

    @property
    def route(self) -> list[str]:
        return list(self._stream.route)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    async def open(self) -> None:
        """Start the session and wait for its first token.

        Raises GenerationError (e.g. no_capacity, broker_unreachable) before anything has
        been sent to the HTTP client; the stream is closed then.
        """
        self.opened_at = time.perf_counter()
        try:
            await self._exit_stack.enter_async_context(self._stream)
            self._events = aiter(self._stream)
            self._first = await self._next_event_in_time(first=True)
        except BaseException:
            await self.close()
            raise

    async def chunks(self) -> AsyncIterator[str]:
        """Yield the answer's text, never an empty string or a partial character.

        Ends when the model finished (finish_reason "stop"/"length") or a stop string
        matched (the session is then cancelled by ``close``). Raises GenerationError if the
        broker reports a failure mid-stream.
        """
        event = self._first
        self._first = None
        while event is not None:
            text, done = self._accept(event)
            if text:
                yield text
            if done:
                return
            event = await self._next_event_in_time(first=False)

    async def text(self) -> str:
        """The whole answer (for non-streaming requests)."""
        return "".join([chunk async for chunk in self.chunks()])

    async def close(self) -> None:
        """Leave the session; the client sends CANCEL if it had not finished. Idempotent.

        Shielded: it runs while the HTTP task is being cancelled (a client disconnect),
        and a cancelled await here would leave the session's caches on the workers.
        """
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            try:
                closer = getattr(self._events, "aclose", None)
                if closer is not None:
                    await closer()
                await self._exit_stack.aclose()
            except Exception as exc:
                # The session is gone either way; a broker failure on the way out is moot.
                if _as_generation_error(exc) is None:
                    raise
            finally:
                if self._on_close is not None:
                    await self._on_close()

    async def _next_event_in_time(self, *, first: bool) -> TokenEventLike | None:
        """The next event, or GenerationError("timeout") once a deadline passes.

        The deadline is the first-token or inter-token timeout, or what is left of the
        whole request's, whichever comes first. On a timeout the session is cancelled
        at once (its workers stop), before the caller reports the error.
        """
        limit = self._first_token_timeout if first else self._inter_token_timeout
        left = (
            None if self._timeout is None else self.opened_at + self._timeout - time.perf_counter()
        )
        budget = min((t for t in (limit, left) if t is not None), default=None)
        if budget is None:
            return await self._next_event()
        # Checked before each read, not only by the scope: a read of an event already
        # queued (a client that reads slower than tokens come) never suspends, so the
        # scope's deadline would never be seen while the queue holds tokens.
        if budget > 0:
            with anyio.move_on_after(budget):
                return await self._next_event()
        with anyio.CancelScope(shield=True):
            await self._stream.cancel()
        if left is not None and (limit is None or left <= limit):
            message = f"the request timeout of {self._timeout:g} s was reached"
        elif first:
            message = f"no first token within the first-token timeout of {limit:g} s"
        else:
            message = f"no token for {limit:g} s (the inter-token timeout)"
        raise GenerationError("timeout", message)

    async def _next_event(self) -> TokenEventLike | None:
        assert self._events is not None
        try:
            return await anext(self._events)
        except StopAsyncIteration:
            # The stream ends after the event that carries a finish reason, and we stop
            # reading there: ending earlier means the client lost the session.
            raise GenerationError(
                "internal", "the token stream ended without a finish reason"
            ) from None
        except Exception as exc:
            error = _as_generation_error(exc)
            if error is None:
                raise
            raise error from exc

    def _accept(self, event: TokenEventLike) -> tuple[str, bool]:
        """Account for one token; return ``(text to send, stream is done)``."""
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        if self.last_token_at is not None:
            self.token_gaps.append(now - self.last_token_at)
        self.last_token_at = now
        if self._decoder is None:
            return self._accept_piece(event)
        self.generated_tokens += 1
        finish = event.finish
        if event.token in self._stop_ids:
            # EOS (or another stop id) ends the answer and is never shown.
            text, finish = "", "stop"
        else:
            text = self._decoder.push(event.token)
            if event.logprobs is not None:
                self._logprobs.append((event.token, *event.logprobs))
        if finish is None and self.generated_tokens >= self._max_tokens:
            # The workers enforce max_tokens; this only guards against one that did not.
            finish = "length"
        released, hit = self._matcher.push(text)
        if hit:
            self.finish_reason = "stop"
            return released, True
        if finish is None:
            return released, False
        # Bytes still pending when the model stopped (max_tokens can cut a character) are
        # left out: a client would show them as U+FFFD.
        tail = self._decoder.flush(drop_incomplete=True)
        tail_released, hit = self._matcher.push(tail)
        released += tail_released
        if not hit:
            released += self._matcher.flush()
        self.finish_reason = finish
        return released, True

    def _accept_piece(self, event: Any) -> tuple[str, bool]:
        """A text model's piece (client.streams.DeltaEvent): its text is the answer's
        next text; the last piece carries the finish and the upstream's token counts."""
        if event.finish is None:
            self.generated_tokens += 1  # pieces, until the upstream tells the tokens
            released, hit = self._matcher.push(event.text)
            if hit:
                self.finish_reason = "stop"
            return released, hit
        if event.completion_tokens is not None:
            self.generated_tokens = event.completion_tokens
        self.prompt_tokens = event.prompt_tokens
        released, hit = self._matcher.push(event.text)
        if not hit:
            released += self._matcher.flush()
        self.finish_reason = "stop" if hit else event.finish
        return released, True
