"""The gateway's request logic, shared by the plain and the OpenAI routes.

Turns validated request fields into a generation (prompt ids, token budget, sampling,
stop strings), checks them against the model, and opens the broker session.
"""

from __future__ import annotations

import secrets
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.requests import Request

from zmqllm.bus.messages import AskKind
from zmqllm.bus.sampling_params import MAX_SEED, NO_LOGPROBS, SamplingParams
from zmqllm.client.failover import FailoverEvent, FailoverPolicy, ReplayStream
from zmqllm.config.settings import GatewaySettings
from zmqllm.gateway.admission import Admission, ClientGone, QueueFull, QueueTimeout
from zmqllm.gateway.backend import BrokerClientLike, TokenStreamLike, broker_error_fields
from zmqllm.gateway.errors import CLIENT_CLOSED, RETRY_AFTER_S, APIError, broker_failure
from zmqllm.gateway.key_shares import KeyShares, OverShare
from zmqllm.gateway.request_context import RequestRecord
from zmqllm.gateway.served_models import ModelDirectory, ServedModel
from zmqllm.gateway.streaming import GenerationError, TextStream
from zmqllm.models.tokenizer import ChatTemplateError, IncrementalDecoder, Tokenizer

__all__ = [
    "GatewayService",
    "GenerationPlan",
    "check_messages",
    "check_prompt",
    "client_disconnected",
    "service_of",
]

# Sampling when a request names no temperature: greedy, so the same prompt gives the same
# answer (what the e2e tests compare with HF generate). OpenAI's own default is 1.0.
DEFAULT_TEMPERATURE = 0.0
# Seconds a request gives a broker link that looks dead to show it is alive. The link's
# liveness is the time since the broker's last message was read, and while the event loop
# was busy (a burst of requests parsed and tokenized at once) the broker's messages wait
# unread: the link only looks stale until the loop gets to them.
LINK_GRACE_S = 0.5
MODEL_STATUS_TIMEOUT = 2.0  # a request naming a model not seen yet asks the broker
LINK_POLL_S = 0.01


@dataclass(frozen=True)
class GenerationPlan:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stops: tuple[str, ...] = ()
    ignore_eos: bool = False  # keep going past EOS (benchmarks, vLLM's extension)


@dataclass
class GatewayService:
    client: BrokerClientLike
    settings: GatewaySettings
    # The gateway's own model of tokens; None (and model_name "") when it serves only
    # remote (text) models.
    tokenizer: Tokenizer | None
    model_name: str
    context_length: int
    created: int = field(default_factory=lambda: int(time.time()))
    # Told of every failover (metrics); set by create_app.
    on_failover: Callable[[FailoverEvent], None] | None = None
    admission: Admission = field(init=False)
    failover: FailoverPolicy = field(init=False)
    _replays: weakref.WeakSet[ReplayStream] = field(init=False)
    models: ModelDirectory = field(init=False)
    # Bytes of text one token can stand for at most (0: no model of our own).
    max_token_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        s = self.settings
        # Worked out now (a pass over the vocabulary) rather than by the first request.
        self.max_token_bytes = self.tokenizer.max_token_bytes if self.tokenizer else 0
        self.admission = Admission(s.max_concurrent, s.max_queued, s.queue_timeout)
        self.shares = KeyShares(
            s.key_max_concurrent or max(1, s.max_concurrent // 2),
            s.key_max_kv_tokens,
            self._cluster_kv_tokens,
        )
        self.failover = FailoverPolicy(timeout=s.failover_timeout, retries=s.failover_retries)
        self._replays = weakref.WeakSet()
        local = None
        if self.tokenizer is not None:
            local = ServedModel(self.model_name, False, self.context_length, self.created)
        self.models = ModelDirectory(
            local, s.default_model, lambda: self.client.status(timeout=MODEL_STATUS_TIMEOUT)
        )

    def _cluster_kv_tokens(self) -> int | None:
        """The KV tokens the workers of the gateway's own model offer: its smallest pool's
        (replicas summed), as the last broker status read by readiness says."""
        status = self.models.last_status
        workers = status.get("workers") if status else None
        pools: dict[tuple[int, int], int] = {}
        for w in workers if isinstance(workers, list) else []:
            if not isinstance(w, dict) or w.get("text_model"):
                continue
            if w.get("model") not in (self.model_name, self.models.route_name):
                continue
            try:
                rng = (int(w["layers"][0]), int(w["layers"][1]))
                pools[rng] = pools.get(rng, 0) + int(w["max_kv_tokens"])
            except (KeyError, TypeError, ValueError, IndexError):
                continue
        return min(pools.values()) if pools else None

    def check_share(self, record: RequestRecord, plans: Sequence[GenerationPlan]) -> None:
        """429 at once if the request's key would hold more than its share (key_shares)."""
        kv = sum(len(p.prompt_ids) + p.max_tokens for p in plans)
        try:
            self.shares.check(record.tenant, len(plans), kv)
        except OverShare as over:
            record.error = "key_share_exceeded"
            raise APIError(
                429,
                over.message(),
                code="key_share_exceeded",
                type="rate_limit_error",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None

    @property
    def history_tokens(self) -> int:
        """Token ids held to replay live streams (each stream's prompt + its tokens)."""
        return sum(r.history_tokens for r in list(self._replays))

    @property
    def in_flight(self) -> int:
        """Generations holding a slot (streaming, or waiting for their first token)."""
        return self.admission.running

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return self.admission.queued

    # --- checks ---------------------------------------------------------------------

    async def model(self, name: str | None) -> ServedModel:
        """The model a request names, or the default; 404 model_not_found if unknown."""
        return await self.models.find(name)

    @property
    def own_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:  # routes call this only for the gateway's own model
            raise APIError(500, "this gateway has no model of its own", code="internal")
        return self.tokenizer

    async def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The messages through the chat template, as token ids (400 if they cannot be)."""
        check_messages(messages)
        self._check_prompt_bytes(
            sum(len(str(m.get("content") or "").encode("utf-8")) for m in messages), "messages"
        )
        try:
            return await anyio.to_thread.run_sync(self.own_tokenizer.encode_chat, messages)
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_messages") from None

    async def encode_text(self, prompt: str, param: str = "prompt") -> list[int]:
        check_prompt(prompt, param)
        self._check_prompt_bytes(len(prompt.encode("utf-8")), param)
        return await anyio.to_thread.run_sync(self._encode_plain, prompt)

    def _encode_plain(self, prompt: str) -> list[int]:
        return self.own_tokenizer.encode(prompt, add_special_tokens=True)

    def _check_prompt_bytes(self, size: int, param: str) -> None:
        """400 at once for a prompt too long for the context by its size alone: tokenizing
        a body of a megabyte would cost about a second of a core for nothing."""
        limit = self.context_length * self.max_token_bytes
        if size > limit:
            raise APIError(
                400,
                f"the prompt is {size} bytes, more than any prompt that fits the model's "
                f"context of {self.context_length} tokens can be ({limit} bytes)",
                param=param,
                code="context_length_exceeded",
            )

    def plan(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int | None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stops: Sequence[str] = (),
        prompt_param: str | None = "prompt",
        ignore_eos: bool = False,
        logprobs: int | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        grammar: str = "",
    ) -> GenerationPlan:
        """Check a request against the model's context and build its plan (400 if bad)."""
        prompt_len = len(prompt_ids)
        room = self.context_length - prompt_len
        if room < 1:
            raise APIError(
                400,
                f"the prompt is {prompt_len} tokens but the model's context is "
                f"{self.context_length} tokens, which leaves no room for an answer",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            # No explicit budget: the default, clipped to what is left of the context, so a
            # long prompt still gets an answer instead of an error it did not ask for.
            budget = min(self.settings.default_max_tokens, room)
        elif max_tokens < 1:
            raise APIError(
                400,
                f"max_tokens must be at least 1, got {max_tokens}",
                param="max_tokens",
                code="invalid_value",
            )
        elif max_tokens > room:
            raise APIError(
                400,
                f"max_tokens {max_tokens} plus the prompt's {prompt_len} tokens exceeds the "
                f"model's context of {self.context_length} tokens (at most {room} here)",
                param="max_tokens",
                code="context_length_exceeded",
            )
        else:
            budget = max_tokens
        sampling = SamplingParams(
            temperature=DEFAULT_TEMPERATURE if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=0 if top_k is None else top_k,
            # An unseeded request draws a fresh seed, so resampling gives a new answer; the
            # seed still makes a replay on another route reproduce the same tokens.
            seed=secrets.randbelow(MAX_SEED + 1) if seed is None else seed,
            logprobs=NO_LOGPROBS if logprobs is None else logprobs,
            presence_penalty=presence_penalty or 0.0,
            frequency_penalty=frequency_penalty or 0.0,
            grammar=grammar,
        )
        try:
            sampling.validate()
        except ValueError as exc:
            param = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc), param=param, code="invalid_value") from None
        return GenerationPlan(list(prompt_ids), budget, sampling, tuple(stops), ignore_eos)

    # --- generation -----------------------------------------------------------------

    async def open(
        self, plan: GenerationPlan, record: RequestRecord, request: Request | None = None
    ) -> TextStream:
        """Wait for a slot, start the session and wait for its first token; errors
        become APIError.

        ``request`` is watched for a disconnect while the request waits in the queue.
        The caller owns the returned stream and must ``close`` it.
        """
        record.prompt_tokens = len(plan.prompt_ids)
        tok = self.own_tokenizer
        eos = frozenset() if plan.ignore_eos else tok.eos_token_ids

        def make(release: Callable[[], Awaitable[None]]) -> TextStream:
            return self._text_stream(
                self._token_stream(record, plan, sorted(eos)),
                tok.incremental_decoder(prompt_ids=plan.prompt_ids),
                plan.max_tokens,
                release,
                stop_ids=eos,
                stops=plan.stops,
            )

        return await self._start(record, request, make, len(plan.prompt_ids) + plan.max_tokens)

    async def open_text(
        self,
        model: ServedModel,
        kind: AskKind,
        fields: Mapping[str, Any],
        max_tokens: int,
        record: RequestRecord,
        request: Request | None = None,
    ) -> TextStream:
        """As ``open``, for a remote (text) model: the request's fields go to its worker
        as they are (ask_body checks them there), its answer comes back as text."""

        def make(release: Callable[[], Awaitable[None]]) -> TextStream:
            stream = self.client.ask(
                request_id=record.request_id,
                model=model.name,
                kind=kind,
                fields=fields,
                max_tokens=max_tokens,
            )
            # Stop strings are the upstream's to apply: they travel in ``fields``.
            return self._text_stream(stream, None, max_tokens, release)

        return await self._start(record, request, make)

    def _text_stream(
        self,
        stream: TokenStreamLike,
        decoder: IncrementalDecoder | None,
        max_tokens: int,
        release: Callable[[], Awaitable[None]],
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
        make: Callable[[Callable[[], Awaitable[None]]], TextStream],
        kv_tokens: int = 0,
    ) -> TextStream:
        """Wait for a slot, start the stream ``make`` builds and wait for its first
        token; errors become APIError. The slot and ``kv_tokens`` count against the
        request's key (check_share) until the stream ends."""
        # Held from here (queued too), so concurrent requests of one key see each other.
        self.shares.take(record.tenant, kv_tokens)
        try:
            # Fail fast: an OPEN sent into a dead link would only time out much later.
            # Checked before queueing (no wait for a dead broker) and again once a slot
            # is free.
            await self._check_broker_link(record)
            await self._admit(record, request)
        except BaseException:
            self.shares.give(record.tenant, kv_tokens)
            raise
        try:
            await self._check_broker_link(record)
        except BaseException:
            self.admission.release()
            self.shares.give(record.tenant, kv_tokens)
            raise
        released = False

        async def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.admission.release()
                self.shares.give(record.tenant, kv_tokens)

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

    def _token_stream(
        self, record: RequestRecord, plan: GenerationPlan, stop_ids: list[int]
    ) -> TokenStreamLike:
        """The request's tokens: through a replay that outlives a lost route, unless
        failover is off."""
        if not self.failover.enabled:
            return self.client.generate(
                request_id=record.request_id,
                prompt=plan.prompt_ids,
                max_tokens=plan.max_tokens,
                sampling=plan.sampling,
                stop_ids=stop_ids,
                model=self.models.route_name,
            )
        replay = ReplayStream(
            self.client,
            request_id=record.request_id,
            prompt=plan.prompt_ids,
            max_tokens=plan.max_tokens,
            sampling=plan.sampling,
            stop_ids=stop_ids,
            policy=self.failover,
            on_failover=self.on_failover,
            model=self.models.route_name,
        )
        self._replays.add(replay)
        return replay

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

    async def _check_broker_link(self, record: RequestRecord) -> None:
        """503 unless the broker link is alive, or shows it is within LINK_GRACE_S."""
        deadline = time.monotonic() + LINK_GRACE_S
        while not self.client.connected:
            if time.monotonic() >= deadline:
                record.error = "broker_unreachable"
                raise broker_failure(
                    "broker_unreachable",
                    f"the gateway has no connection to the broker at {self.settings.broker}; "
                    "retry shortly",
                )
            await anyio.sleep(LINK_POLL_S)

    async def _admit(self, record: RequestRecord, request: Request | None) -> None:
        """Take a generation slot, waiting in the queue if all are taken."""
        s = self.settings
        disconnected = None if request is None else (lambda: client_disconnected(request))
        try:
            await self.admission.acquire(disconnected)
        except QueueFull:
            record.error = "too_many_requests"
            raise APIError(
                429,
                f"the gateway is at its limit of {s.max_concurrent} running and "
                f"{s.max_queued} queued requests; retry shortly",
                code="too_many_requests",
                type="rate_limit_error",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        except QueueTimeout:
            record.error = "queue_timeout"
            raise APIError(
                503,
                f"no generation slot became free within the queue timeout of "
                f"{s.queue_timeout:g} s; retry shortly",
                code="queue_timeout",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        except ClientGone:
            record.error = record.finish_reason = "cancelled"
            raise APIError(
                CLIENT_CLOSED, "the client closed the request while it was queued"
            ) from None


def check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if not any(str(m.get("content") or "").strip() for m in messages):
        raise APIError(400, "messages contain no text", param="messages", code="empty_prompt")


def check_prompt(prompt: str, param: str = "prompt") -> None:
    if not prompt.strip():
        raise APIError(400, "the prompt is empty", param=param, code="empty_prompt")


async def client_disconnected(request: Request) -> None:
    """Return once the client has hung up (call only after the body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def service_of(request: Request) -> GatewayService:
    """The service ``create_app`` stored on the app (no module globals)."""
    service: GatewayService = request.app.state.gateway
    return service
