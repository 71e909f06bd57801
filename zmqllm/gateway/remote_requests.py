"""A request for a remote (text) model, as its ASK carries it: the prompt or messages and
the sampling fields the client gave, untouched by any tokenizer (the gateway has none for
such a model). What the upstream cannot be asked for here is a 400 naming the field."""

from __future__ import annotations

from typing import Any

from zmqllm.gateway.errors import APIError
from zmqllm.gateway.schemas import ChatCompletionRequest, CompletionRequest
from zmqllm.gateway.service import DEFAULT_TEMPERATURE

__all__ = ["remote_fields"]

# Passed on as given when set; the upstream checks them against its own model.
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty")


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
