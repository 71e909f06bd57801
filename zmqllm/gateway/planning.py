"""Planning: an HTTP request's fields become its ``GenerateRequest`` (one per choice).

The prompt goes through the tokenizer (the chat template for messages), the token budget
is checked against the model's context, the sampling fields are checked as the worker
will read them and the stop ids follow from the model's EOS; a field that cannot be
served is a 400 naming it. Nothing here waits for a slot or talks to the broker.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from zmqllm.bus.sampling_params import MAX_SEED, NO_LOGPROBS, SamplingParams
from zmqllm.client.request import GenerateRequest
from zmqllm.config.settings import GatewaySettings
from zmqllm.gateway.choices import check_choices, choice_seeds
from zmqllm.gateway.errors import APIError
from zmqllm.gateway.response_format import grammar_of
from zmqllm.gateway.schemas import ChatCompletionRequest, CompletionRequest
from zmqllm.models.tokenizer import ChatTemplateError, Tokenizer

__all__ = [
    "DEFAULT_TEMPERATURE",
    "PlainQuery",
    "Planner",
    "chat_messages",
    "check_messages",
    "check_prompt",
    "own_tokenizer",
    "sampling_of",
]

# Sampling when a request names no temperature: greedy, so the same prompt gives the same
# answer (what the e2e tests compare with HF generate). OpenAI's own default is 1.0.
DEFAULT_TEMPERATURE = 0.0


@dataclass(frozen=True)
class PlainQuery:
    """The query parameters of ``POST /chat`` (each None when not given)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as the chat template takes them (a developer message is a system one)."""
    return [
        {"role": "system" if m.role == "developer" else m.role, "content": m.content or ""}
        for m in body.messages
    ]


def check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if not any(str(m.get("content") or "").strip() for m in messages):
        raise APIError(400, "messages contain no text", param="messages", code="empty_prompt")


def check_prompt(prompt: str, param: str = "prompt") -> None:
    if not prompt.strip():
        raise APIError(400, "the prompt is empty", param=param, code="empty_prompt")


def own_tokenizer(tokenizer: Tokenizer | None) -> Tokenizer:
    """The gateway's own model's tokenizer; asked for only for that model."""
    if tokenizer is None:
        raise APIError(500, "this gateway has no model of its own", code="internal")
    return tokenizer


def sampling_of(
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
    *,
    logprobs: int | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    grammar: str = "",
) -> SamplingParams:
    """The request's sampling, its defaults filled in (400 naming a value out of range)."""
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
    return sampling


class Planner:
    """Builds the requests of the gateway's own model (its tokenizer and context)."""

    def __init__(
        self, tokenizer: Tokenizer | None, context_length: int, settings: GatewaySettings
    ) -> None:
        self.tokenizer = tokenizer  # None when the gateway serves only remote models
        self.context_length = context_length
        self.settings = settings
        # Bytes of text one token can stand for at most (0: no model of our own); worked
        # out now (a pass over the vocabulary) rather than by the first request.
        self.max_token_bytes = tokenizer.max_token_bytes if tokenizer else 0

    @property
    def own_tokenizer(self) -> Tokenizer:
        return own_tokenizer(self.tokenizer)

    # --- the endpoints ---------------------------------------------------------------

    async def chat_requests(
        self, body: ChatCompletionRequest, request_id: str
    ) -> list[GenerateRequest]:
        """``/v1/chat/completions``: one request per choice."""
        prompt_ids = await self.encode_chat(chat_messages(body))
        return self._openai_requests(body, prompt_ids, "messages", request_id)

    async def completion_requests(
        self, body: CompletionRequest, request_id: str
    ) -> list[GenerateRequest]:
        """``/v1/completions``: one request per choice."""
        prompt_ids = await self.encode_text(body.prompt)
        return self._openai_requests(body, prompt_ids, "prompt", request_id)

    async def plain_request(
        self, prompt: str, query: PlainQuery, request_id: str
    ) -> GenerateRequest:
        """``POST /chat``: the text as one user message through the chat template."""
        if self.own_tokenizer.has_chat_template:
            prompt_ids = await self.encode_chat([{"role": "user", "content": prompt}])
        else:
            # A base model without a template still answers: the text is its prompt.
            prompt_ids = await self.encode_text(prompt)
        budget = self._budget(len(prompt_ids), query.max_tokens, None)
        sampling = sampling_of(query.temperature, query.top_p, query.top_k, query.seed)
        return self._request(prompt_ids, budget, sampling, request_id)

    def _openai_requests(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        prompt_ids: list[int],
        prompt_param: str,
        request_id: str,
    ) -> list[GenerateRequest]:
        """The sampling fields both endpoints share, checked against the context: one
        request per choice (``n``), choice i seeded ``seed + i``."""
        n = check_choices(body.n, self.settings.max_concurrent)
        if isinstance(body, ChatCompletionRequest) and body.top_logprobs and not body.logprobs:
            raise APIError(
                400,
                "top_logprobs needs logprobs: true",
                param="top_logprobs",
                code="invalid_value",
            )
        budget = self._budget(len(prompt_ids), body.token_limit, prompt_param)
        sampling = sampling_of(
            body.temperature,
            body.top_p,
            body.top_k,
            body.seed,
            logprobs=body.logprobs_top,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            grammar=grammar_of(body.response_format),
        )
        first = self._request(
            prompt_ids,
            budget,
            sampling,
            request_id,
            stops=tuple(body.stop or ()),
            ignore_eos=body.ignore_eos,
            speculative=body.speculative,
        )
        return [
            dataclasses.replace(first, sampling=dataclasses.replace(sampling, seed=seed))
            for seed in choice_seeds(sampling.seed, n)
        ]

    def _request(
        self,
        prompt_ids: list[int],
        budget: int,
        sampling: SamplingParams,
        request_id: str,
        *,
        stops: tuple[str, ...] = (),
        ignore_eos: bool = False,
        speculative: bool = True,
    ) -> GenerateRequest:
        """The request; the model's EOS ids end it unless it ignores them (benchmarks,
        vLLM's extension). Its model's name on the bus is set when it opens."""
        eos = () if ignore_eos else tuple(sorted(self.own_tokenizer.eos_token_ids))
        return GenerateRequest(
            request_id=request_id,
            prompt=tuple(prompt_ids),
            max_tokens=budget,
            sampling=sampling,
            stop_ids=eos,
            stops=stops,
            speculative=speculative,
        )

    # --- the prompt ------------------------------------------------------------------

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

    def _budget(self, prompt_len: int, max_tokens: int | None, prompt_param: str | None) -> int:
        """The tokens the answer may take: ``max_tokens`` if it fits the context (400 if
        not), else the default clipped to what the context leaves."""
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
            return min(self.settings.default_max_tokens, room)
        if max_tokens < 1:
            raise APIError(
                400,
                f"max_tokens must be at least 1, got {max_tokens}",
                param="max_tokens",
                code="invalid_value",
            )
        if max_tokens > room:
            raise APIError(
                400,
                f"max_tokens {max_tokens} plus the prompt's {prompt_len} tokens exceeds the "
                f"model's context of {self.context_length} tokens (at most {room} here)",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens
