"""Starting a request's generations: each one admitted (``admission.Gate``), its session
opened on the broker, through a replay that outlives a lost route unless failover is off,
and its first token awaited before the HTTP answer starts, so that a failure up to then
still gets its own status code. A remote model's request goes out as an ASK instead.

``BrokerClient.generate`` takes the ``GenerateRequest`` planned for the choice as it is;
what comes back is wrapped in a ``TextStream`` (detokenizing, stop strings, deadlines)
that gives its slot back when it closes.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace

import anyio
from starlette.requests import Request

from zmqllm.client.failover import FailoverEvent, FailoverPolicy, ReplayStream
from zmqllm.client.request import GenerateRequest
from zmqllm.config.settings import GatewaySettings
from zmqllm.gateway.admission import Gate, Release
from zmqllm.gateway.backend import BrokerClientLike, TokenStreamLike, broker_error_fields
from zmqllm.gateway.choices import Choices
from zmqllm.gateway.errors import CLIENT_CLOSED, APIError, broker_failure
from zmqllm.gateway.key_shares import Held
from zmqllm.gateway.planning import own_tokenizer
from zmqllm.gateway.remote_requests import RemoteAsk
from zmqllm.gateway.request_context import RequestRecord, client_disconnected
from zmqllm.gateway.streaming import GenerationError, TextStream
from zmqllm.models.tokenizer import IncrementalDecoder, Tokenizer

__all__ = ["Generations"]


class Generations:
    """Opens generations for the gateway's requests, through ``client``."""

    def __init__(
        self,
        client: BrokerClientLike,
        settings: GatewaySettings,
        gate: Gate,
        tokenizer: Tokenizer | None,
        on_failover: Callable[[FailoverEvent], None] | None = None,
        route_name: Callable[[], str] = lambda: "",
    ) -> None:
        # The model's name on the bus, set on each request when its session opens (after
        # the wait for a slot): the broker's status may rename it meanwhile.
        self.route_name = route_name
        self.client = client
        self.settings = settings
        self.gate = gate
        self.tokenizer = tokenizer
        self.on_failover = on_failover  # told of every failover (metrics)
        self.failover = FailoverPolicy(
            timeout=settings.failover_timeout, retries=settings.failover_retries
        )
        self._replays: weakref.WeakSet[ReplayStream] = weakref.WeakSet()

    @property
    def history_tokens(self) -> int:
        """Token ids held to replay live streams (each stream's prompt + its tokens)."""
        return sum(r.history_tokens for r in list(self._replays))

    # --- what the service asks for ---------------------------------------------------

    async def open_choices(
        self, requests: Sequence[GenerateRequest], record: RequestRecord, request: Request
    ) -> Choices:
        """Open every choice's session at once (the key's share claimed first for all of
        them); if one fails, close the others and raise."""
        held = self.gate.claim_share(record, [r.kv_tokens for r in requests])
        opens = [self.open(r, record, h, request) for r, h in zip(requests, held, strict=True)]
        try:
            results: list[TextStream | BaseException] = list(
                await asyncio.gather(*opens, return_exceptions=True)
            )
        finally:
            # A choice whose generation never started still holds its part of the share
            # (a cancelled gather too); one that started gives it back when it closes.
            for part in held:
                if not part.admitted:
                    part.give()
        streams = [r for r in results if isinstance(r, TextStream)]
        failures = [r for r in results if not isinstance(r, TextStream)]
        if failures:
            await Choices(streams).close()
            raise failures[0]
        return Choices(streams)

    async def open_one(
        self, generate: GenerateRequest, record: RequestRecord, request: Request
    ) -> TextStream:
        """As ``open_choices``, for a request of one choice."""
        (held,) = self.gate.claim_share(record, [generate.kv_tokens])
        try:
            return await self.open(generate, record, held, request)
        finally:
            if not held.admitted:
                held.give()

    async def open(
        self,
        generate: GenerateRequest,
        record: RequestRecord,
        held: Held,
        request: Request | None = None,
    ) -> TextStream:
        """Wait for a slot, start the session and wait for its first token; errors
        become APIError.

        ``held`` is the generation's part of its key's share (``Gate.claim_share``).
        ``request`` is watched for a disconnect while the request waits in the queue.
        The caller owns the returned stream and must ``close`` it.
        """
        record.prompt_tokens = len(generate.prompt)
        tok = own_tokenizer(self.tokenizer)
        stop_ids = frozenset(generate.stop_ids)

        def make(release: Release) -> TextStream:
            opened = replace(generate, model=self.route_name())
            return self._text_stream(
                self._token_stream(opened),
                tok.incremental_decoder(prompt_ids=generate.prompt),
                generate.max_tokens,
                release,
                stop_ids=stop_ids,
                stops=generate.stops,
            )

        return await self._start(record, request, make, held)

    async def ask(
        self, model: str, ask: RemoteAsk, record: RequestRecord, request: Request | None = None
    ) -> TextStream:
        """As ``open``, for a remote (text) model: the request's fields go to its worker
        as they are (ask_body checks them there), its answer comes back as text. It takes
        a slot of its key's share as any generation does (no KV tokens: the upstream
        holds its own cache)."""
        (held,) = self.gate.claim_share(record, [0])

        def make(release: Release) -> TextStream:
            stream = self.client.ask(
                request_id=record.request_id,
                model=model,
                kind=ask.kind,
                fields=ask.fields,
                max_tokens=ask.max_tokens,
            )
            # Stop strings are the upstream's to apply: they travel in ``fields``.
            return self._text_stream(stream, None, ask.max_tokens, release)

        try:
            return await self._start(record, request, make, held)
        finally:
            if not held.admitted:
                held.give()

    # --- one generation --------------------------------------------------------------

    def _token_stream(self, generate: GenerateRequest) -> TokenStreamLike:
        """The request's tokens: through a replay that outlives a lost route, unless
        failover is off."""
        if not self.failover.enabled:
            return self.client.generate(generate)
        replay = ReplayStream(
            self.client, generate, policy=self.failover, on_failover=self.on_failover
        )
        self._replays.add(replay)
        return replay

    def _text_stream(
        self,
        stream: TokenStreamLike,
        decoder: IncrementalDecoder | None,
        max_tokens: int,
        release: Release,
        *,
        stop_ids: frozenset[int] = frozenset(),
        stops: Sequence[str] = (),
    ) -> TextStream:
        s = self.settings
        return TextStream(
            stream,
            decoder,
            max_tokens=max_tokens,
            stop_ids=stop_ids,
            stops=stops,
            timeout=s.request_timeout,
            first_token_timeout=s.first_token_timeout,
            inter_token_timeout=s.inter_token_timeout,
            on_close=release,
        )

    async def _start(
        self,
        record: RequestRecord,
        request: Request | None,
        make: Callable[[Release], TextStream],
        held: Held,
    ) -> TextStream:
        """Admit the generation, start the stream ``make`` builds and wait for its first
        token; errors become APIError. The stream gives the slot back when it closes."""
        release = await self.gate.admit(record, request, held)
        try:
            text_stream = make(release)
            record.add_generation(text_stream)
            await self._first_token(text_stream, record, request)
        except GenerationError as exc:
            await release()
            record.error = exc.code
            raise broker_failure(exc.code, exc.message) from None
        except BaseException as exc:
            await release()
            fields = broker_error_fields(exc)
            if fields is None:
                raise
            # generate() itself refused (e.g. not connected to the broker).
            record.error = fields[0]
            raise broker_failure(*fields) from None
        if record.error == "cancelled":
            await text_stream.close()  # already closed, unless the token came as it left
            raise APIError(CLIENT_CLOSED, "the client closed the request before the first token")
        return text_stream

    async def _first_token(
        self, text_stream: TextStream, record: RequestRecord, request: Request | None
    ) -> None:
        """Open the stream and wait for its first token, unless the client hangs up first:
        then the session is cancelled at once (the stream closes itself) instead of
        holding its slot and its workers until the first token or its deadline."""
        if request is None:
            await text_stream.open()
            return
        failure: BaseException | None = None
        async with anyio.create_task_group() as tasks:

            async def watch() -> None:
                await client_disconnected(request)
                record.error = record.finish_reason = "cancelled"
                tasks.cancel_scope.cancel()

            tasks.start_soon(watch)
            try:
                await text_stream.open()
            except Exception as exc:
                # Raised outside the task group, which would wrap it in an ExceptionGroup.
                failure = exc
            tasks.cancel_scope.cancel()
        if failure is not None:
            raise failure
