"""A request for a remote (text) model, as its ASK carries it: the prompt or messages and
the sampling fields the client gave, untouched by any tokenizer (the gateway has none for
such a model). What the upstream cannot be asked for here is a 400 naming the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zmqllm.bus.messages import AskKind
from zmqllm.gateway.errors import APIError
from zmqllm.gateway.planning import DEFAULT_TEMPERATURE, PlainQuery
from zmqllm.gateway.schemas import ChatCompletionRequest, CompletionRequest

__all__ = ["RemoteAsk", "openai_ask", "plain_ask", "remote_fields"]

# Passed on as given when set; the upstream checks them against its own model.
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class RemoteAsk:
    """What an ASK carries: the kind of request, its body's fields and the token budget."""

    kind: AskKind
    fields: dict[str, Any]
    max_tokens: int


def openai_ask(
    body: ChatCompletionRequest | CompletionRequest,
    kind: AskKind,
    prompt: dict[str, Any],
    default_max_tokens: int,
) -> RemoteAsk:
    """The ASK of an OpenAI endpoint; ``prompt`` holds its messages or prompt."""
    fields = {**prompt, **remote_fields(body)}
    max_tokens = body.token_limit or default_max_tokens
    if max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    return RemoteAsk(kind, fields, max_tokens)


def plain_ask(prompt: str, query: PlainQuery, default_max_tokens: int) -> RemoteAsk:
    """The ASK of ``POST /chat``: the text as one user message."""
    sampling = {
        "temperature": query.temperature,
        "top_p": query.top_p,
        "top_k": query.top_k,
        "seed": query.seed,
    }
    fields = {k: v for k, v in sampling.items() if v is not None}
    fields.setdefault("temperature", DEFAULT_TEMPERATURE)
    budget = default_max_tokens if query.max_tokens is None else query.max_tokens
    if budget < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {budget}", param="max_tokens")
    messages = [{"role": "user", "content": prompt}]
    return RemoteAsk(AskKind.CHAT, {"messages": messages, **fields}, budget)


def _refuse(param: str, why: str) -> APIError:
    return APIError(
        400, f"{param} {why} for a remote model", param=param, code="unsupported_parameter"
    )


def remote_fields(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The ASK body's fields for ``body`` (its messages or prompt come separately)."""
    if body.n not in (None, 1):
        raise _refuse("n", "must be 1")
    if isinstance(body, ChatCompletionRequest) and (body.logprobs or body.top_logprobs):
        raise _refuse("logprobs", "is not available")
    if isinstance(body, CompletionRequest) and body.logprobs is not None:
        raise _refuse("logprobs", "is not available")
    if body.ignore_eos:
        raise _refuse("ignore_eos", "is not available")
    # No temperature: greedy, as for the gateway's own model (the upstream's default may
    # well be 1.0).
    fields: dict[str, Any] = {"temperature": DEFAULT_TEMPERATURE}
    for name in _SAMPLING:
        value = getattr(body, name)
        if value is not None:
            fields[name] = value
    if body.stop:
        fields["stop"] = list(body.stop)
    if body.response_format is not None:
        fields["response_format"] = body.response_format.model_dump(
            mode="json", by_alias=True, exclude_none=True
        )
    return fields
