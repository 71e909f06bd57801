"""The gateway's service: one function per generating endpoint, from its parsed body to
its opened streams.

Each function finds the model the request names, plans the request (``planning``: the
``GenerateRequest`` of each choice, or a remote model's ASK in ``remote_requests``) and
starts it (``generations``, which admits it through ``admission``). The routes only parse
the HTTP body before and shape the answer after.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.requests import Request

from zmqllm.bus.messages import AskKind
from zmqllm.client.failover import FailoverEvent
from zmqllm.client.request import GenerateRequest
from zmqllm.config.settings import GatewaySettings
from zmqllm.gateway.admission import Gate
from zmqllm.gateway.backend import BrokerClientLike
from zmqllm.gateway.choices import Choices, check_choices
from zmqllm.gateway.generations import Generations
from zmqllm.gateway.key_shares import TokenizingTurns
from zmqllm.gateway.planning import (
    PlainQuery,
    Planner,
    chat_messages,
    check_messages,
    check_prompt,
)
from zmqllm.gateway.remote_requests import RemoteAsk, openai_ask, plain_ask
from zmqllm.gateway.request_context import record_of
from zmqllm.gateway.schemas import ChatCompletionRequest, CompletionRequest
from zmqllm.gateway.served_models import ModelDirectory, ServedModel
from zmqllm.gateway.streaming import TextStream
from zmqllm.models.tokenizer import Tokenizer

__all__ = ["GatewayService", "Opened", "service_of"]

MODEL_STATUS_TIMEOUT = 2.0  # a request naming a model not seen yet asks the broker


@dataclass
class Opened:
    """An OpenAI request's answer, opened: the model that gives it and its choices."""

    model: ServedModel
    choices: Choices
    # The prompt's tokens, read at the end (a remote model tells them last).
    prompt_tokens: Callable[[], int]


@dataclass
class GatewayService:
    client: BrokerClientLike
    settings: GatewaySettings
    # The gateway's own model of tokens; None (and model_name "") when it serves only
    # remote (text) models.
    tokenizer: Tokenizer | None
    model_name: str
    context_length: int
    # Told of every failover (metrics).
    on_failover: Callable[[FailoverEvent], None] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    models: ModelDirectory = field(init=False)
    planner: Planner = field(init=False)
    gate: Gate = field(init=False)
    # Prompts of one API key tokenizing at once (key_shares.TOKENIZING_PER_KEY).
    tokenizing: TokenizingTurns = field(init=False, default_factory=TokenizingTurns)
    generations: Generations = field(init=False)

    def __post_init__(self) -> None:
        local = None
        if self.tokenizer is not None:
            local = ServedModel(self.model_name, False, self.context_length, self.created)
        self.models = ModelDirectory(
            local,
            self.settings.default_model,
            lambda: self.client.status(timeout=MODEL_STATUS_TIMEOUT),
        )
        self.planner = Planner(self.tokenizer, self.context_length, self.settings)
        self.gate = Gate(self.settings, self.client, self._cluster_kv_tokens)
        self.generations = Generations(
            self.client,
            self.settings,
            self.gate,
            self.tokenizer,
            self.on_failover,
            route_name=lambda: self.models.route_name,
        )

    # --- the endpoints ---------------------------------------------------------------

    async def chat_completion(self, body: ChatCompletionRequest, request: Request) -> Opened:
        """``POST /v1/chat/completions``: one session per choice."""
        model = await self.models.find(body.model)
        if model.text_model:
            messages = chat_messages(body)
            check_messages(messages)
            default = self.settings.default_max_tokens
            ask = openai_ask(body, AskKind.CHAT, {"messages": messages}, default)
            return await self._ask(model, ask, request)
        record = record_of(request)
        self.gate.precheck(record, check_choices(body.n, self.settings.max_concurrent))
        async with self.tokenizing.turn(record.tenant):
            planned = await self.planner.chat_requests(body, record.request_id)
        return await self._generate(model, planned, request)

    async def completion(self, body: CompletionRequest, request: Request) -> Opened:
        """``POST /v1/completions``: one session per choice."""
        model = await self.models.find(body.model)
        if model.text_model:
            check_prompt(body.prompt)
            default = self.settings.default_max_tokens
            ask = openai_ask(body, AskKind.COMPLETION, {"prompt": body.prompt}, default)
            return await self._ask(model, ask, request)
        record = record_of(request)
        self.gate.precheck(record, check_choices(body.n, self.settings.max_concurrent))
        async with self.tokenizing.turn(record.tenant):
            planned = await self.planner.completion_requests(body, record.request_id)
        return await self._generate(model, planned, request)

    async def plain_chat(self, prompt: str, query: PlainQuery, request: Request) -> TextStream:
        """``POST /chat``: the text as one user message, the answer as one stream."""
        record = record_of(request)
        model = await self.models.find(query.model)
        if model.text_model:
            ask = plain_ask(prompt, query, self.settings.default_max_tokens)
            return await self.generations.ask(model.name, ask, record, request)
        self.gate.precheck(record, 1)
        async with self.tokenizing.turn(record.tenant):
            planned = await self.planner.plain_request(prompt, query, record.request_id)
        return await self.generations.open_one(planned, record, request)

    async def _generate(
        self, model: ServedModel, planned: list[GenerateRequest], request: Request
    ) -> Opened:
        choices = await self.generations.open_choices(planned, record_of(request), request)
        prompt_tokens = len(planned[0].prompt)
        return Opened(model, choices, lambda: prompt_tokens)

    async def _ask(self, model: ServedModel, ask: RemoteAsk, request: Request) -> Opened:
        stream = await self.generations.ask(model.name, ask, record_of(request), request)
        return Opened(model, Choices([stream]), lambda: stream.prompt_tokens or 0)

    # --- models and figures ----------------------------------------------------------

    async def model(self, name: str | None) -> ServedModel:
        """The model a request names, or the default; 404 model_not_found if unknown."""
        return await self.models.find(name)

    @property
    def history_tokens(self) -> int:
        """Token ids held to replay live streams (each stream's prompt + its tokens)."""
        return self.generations.history_tokens

    @property
    def in_flight(self) -> int:
        """Generations holding a slot (streaming, or waiting for their first token)."""
        return self.gate.queue.running

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return self.gate.queue.queued

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


def service_of(request: Request) -> GatewayService:
    """The service ``create_app`` stored on the app (no module globals)."""
    service: GatewayService = request.app.state.gateway
    return service
