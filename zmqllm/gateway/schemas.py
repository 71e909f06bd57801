"""Request and response bodies of the OpenAI-compatible API.

Requests validate strictly (``"5"`` is not an integer, ``true`` is not a number), as
OpenAI does, and ignore fields they do not know (``user``, ``metadata`` …), so clients
written for OpenAI work unchanged; a field of OpenAI's that this server does not implement
(``UNSUPPORTED``) is refused when its value asks for something. Fields that OpenAI types
as a union (``stop``, a message's ``content``, a completion ``prompt``) are normalized by
``before`` validators whose messages name the accepted forms, instead of pydantic's
one-error-per-branch output.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from zmqllm.bus.sampling_params import MAX_LOGPROBS, MAX_STOPS

__all__ = [
    "UNSUPPORTED",
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatMessage",
    "Completion",
    "CompletionChoice",
    "CompletionRequest",
    "DeltaMessage",
    "ModelCard",
    "ModelList",
    "ResponseMessage",
    "StreamOptions",
    "Usage",
    "unsupported_field",
]

# OpenAI accepts up to 5 log-probabilities per token on the completions API (20 on chat:
# MAX_LOGPROBS).
MAX_COMPLETION_LOGPROBS = 5


def _absent(value: Any) -> bool:
    # ``is``, not ``in``: 0 == False, and 0 asks for something (completions' logprobs).
    return value is None or value is False


# OpenAI fields this server does not implement, each with the values that ask for nothing
# (what a client sends when it leaves the feature off). Any other value is a 400 naming the
# field: an answer without what was asked for would be wrong without a word. Fields not
# listed and not known are ignored, as OpenAI does.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "logit_bias": lambda v: _absent(v) or v == {},
    "tools": lambda v: _absent(v) or v == [],
    "tool_choice": lambda v: _absent(v) or v == "none",
    "functions": lambda v: _absent(v) or v == [],
    "function_call": lambda v: _absent(v) or v == "none",
    "best_of": lambda v: _absent(v) or v == 1,
    "echo": _absent,
    "suffix": lambda v: _absent(v) or v == "",
    "audio": _absent,
    "modalities": lambda v: _absent(v) or v == ["text"],
    "prediction": _absent,
}


def _count_up_to(name: str, value: int | None, most: int) -> int | None:
    if value is not None and not 0 <= value <= most:
        raise ValueError(f"{name} must be in 0..{most}, got {value}")
    return value


def unsupported_field(data: Mapping[str, Any]) -> str | None:
    """The first field of a request body that asks for what this server cannot do."""
    for name, harmless in UNSUPPORTED.items():
        if name in data and not harmless(data[name]):
            return name
    return None


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool | None = None


class ChatMessage(_Request):
    # "developer" is what newer OpenAI clients send instead of "system"; it is treated as one.
    role: Literal["system", "user", "assistant", "developer"]
    content: str | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, value: Any) -> Any:
        """A list of ``{"type": "text", "text": ...}`` parts becomes one string."""
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of text parts")
        texts = []
        for index, part in enumerate(value):
            if not isinstance(part, dict):
                raise ValueError(f"content part {index} must be an object")
            if part.get("type") != "text":
                raise ValueError(
                    f"content part {index} has type {part.get('type')!r}; "
                    "only 'text' parts are supported"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"content part {index} needs a string 'text'")
            texts.append(text)
        # Like vLLM, separate parts by a newline so words of adjacent parts do not fuse.
        return "\n".join(texts)


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: the schema the answer must follow."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Request):
    """Fields shared by both generation requests."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # an extension (vLLM and TGI have it too)
    seed: int | None = None
    ignore_eos: bool = False  # an extension (vLLM has it): generate past EOS
    # An extension: false keeps this request off speculative decoding ([worker]
    # speculative), whose tokens are the same: for timing a request without it.
    speculative: bool = True
    stop: list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: ResponseFormat | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("stop must be a string or a list of strings")
        if len(stops) > MAX_STOPS:
            raise ValueError(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    # The newer name for max_tokens; it wins when both are given.
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_range(cls, value: int | None) -> int | None:
        return _count_up_to("top_logprobs", value, MAX_LOGPROBS)

    @property
    def logprobs_top(self) -> int | None:
        """How many top tokens with each token's log-probability; None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages must not be empty")
        return value

    @property
    def token_limit(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str
    # The sampled token's and this many of the most likely tokens' log-probabilities.
    logprobs: int | None = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_none(cls, value: Any) -> Any:
        # Clients that share one body between both APIs send chat's "logprobs": false.
        return None if value is False else value

    @field_validator("logprobs")
    @classmethod
    def _logprobs_range(cls, value: int | None) -> int | None:
        return _count_up_to("logprobs", value, MAX_COMPLETION_LOGPROBS)

    @property
    def logprobs_top(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _single_prompt(cls, value: Any) -> Any:
        # OpenAI also takes batches and token ids; this server answers one text per request.
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
            return value[0]
        if not isinstance(value, str):
            raise ValueError("prompt must be a string or a list holding one string")
        return value

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


# --- responses --------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class Completion(BaseModel):
    """Both the whole answer and each streamed chunk: OpenAI uses one object for both."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "zmqllm"
    # vLLM reports the context length here; unknown for a remote model.
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
