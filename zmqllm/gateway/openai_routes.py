"""The OpenAI-compatible API: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Streamed answers are server-sent events, ``data: {chunk}`` per text piece and ``data:
[DONE]`` at the end, shaped like OpenAI's ``chat.completion.chunk`` / ``text_completion``
so the official ``openai`` package parses them unchanged. A failure after the stream began
is sent as ``data: {"error": {...}}`` (which that package raises as an APIError) and the
stream ends there, without ``[DONE]``: a client can tell a whole answer from a cut one.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from zmqllm.gateway.body import read_json_object
from zmqllm.gateway.choices import Choices
from zmqllm.gateway.errors import (
    CLIENT_CLOSED,
    APIError,
    broker_failure,
    error_payload,
    validation_failure,
)
from zmqllm.gateway.logprobs import chat_logprobs, completion_logprobs
from zmqllm.gateway.request_context import RequestRecord, record_of
from zmqllm.gateway.responses import GenerationResponse, collect_unless_disconnected
from zmqllm.gateway.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    DeltaMessage,
    ModelCard,
    ModelList,
    ResponseMessage,
    Usage,
    unsupported_field,
)
from zmqllm.gateway.served_models import ServedModel
from zmqllm.gateway.service import Opened, service_of
from zmqllm.gateway.streaming import GenerationError, TextStream
from zmqllm.log import get_logger
from zmqllm.models.tokenizer import Tokenizer

__all__ = ["router"]

router = APIRouter(prefix="/v1")
log = get_logger("zmqllm.gateway")

_DONE = "data: [DONE]\n\n"


def _sse(model: BaseModel | dict[str, Any]) -> str:
    if isinstance(model, BaseModel):
        return f"data: {model.model_dump_json()}\n\n"
    return f"data: {json.dumps(model)}\n\n"


async def _parse(request: Request, schema: type[BaseModel]) -> Any:
    settings = service_of(request).settings
    data = await read_json_object(request, settings.max_body_bytes, settings.body_timeout)
    field = unsupported_field(data)
    if field is not None:
        raise APIError(
            400,
            f"{field!r} is not supported by this server; leave it out",
            param=field,
            code="unsupported_parameter",
        )
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise validation_failure(exc.errors(include_url=False)) from None


# A whole choice: its text, finish reason and log-probabilities (when asked for).
_Answer = tuple[str, str | None, dict[str, Any] | None]


class _Logprobs:
    """Formats each choice's token log-probabilities as the request's API shapes them
    (None when the request did not ask for them)."""

    def __init__(self, tok: Tokenizer | None, top: int | None, chat: bool, choices: int) -> None:
        self.tok, self.top, self.chat = tok, top, chat
        self.offsets = [0] * choices  # completions: characters of each choice so far

    def take(self, stream: TextStream, index: int) -> dict[str, Any] | None:
        if self.top is None:
            return None
        entries = stream.take_logprobs()
        assert self.tok is not None  # only the gateway's own model gives log-probabilities
        if self.chat:
            return chat_logprobs(self.tok, entries, self.top)
        shape, self.offsets[index] = completion_logprobs(
            self.tok, entries, self.top, self.offsets[index]
        )
        return shape


class _ChatShapes:
    """Builds chat.completion / chat.completion.chunk objects for one answer."""

    def __init__(self, model: str) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def _chunk(
        self,
        delta: DeltaMessage,
        finish: str | None = None,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
    ) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs)
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[choice]
        )

    def opening(self, index: int = 0) -> BaseModel | None:
        # OpenAI's first chunk announces the role with empty content.
        return self._chunk(DeltaMessage(role="assistant", content=""), index=index)

    def piece(self, text: str, index: int = 0, logprobs: dict[str, Any] | None = None) -> BaseModel:
        return self._chunk(DeltaMessage(content=text), index=index, logprobs=logprobs)

    def closing(
        self, finish: str | None, index: int = 0, logprobs: dict[str, Any] | None = None
    ) -> BaseModel:
        return self._chunk(DeltaMessage(), finish, index, logprobs)

    def usage_only(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def whole(self, answers: list[_Answer], usage: Usage) -> BaseModel:
        choices = [
            ChatChoice(
                index=i,
                message=ResponseMessage(content=text),
                finish_reason=finish,
                logprobs=logprobs,
            )
            for i, (text, finish, logprobs) in enumerate(answers)
        ]
        return ChatCompletion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )


class _CompletionShapes:
    """Builds text_completion objects (OpenAI streams the same object type)."""

    def __init__(self, model: str) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def _make(self, choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        return Completion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def opening(self, index: int = 0) -> BaseModel | None:
        return None

    def piece(self, text: str, index: int = 0, logprobs: dict[str, Any] | None = None) -> BaseModel:
        return self._make([CompletionChoice(index=index, text=text, logprobs=logprobs)])

    def closing(
        self, finish: str | None, index: int = 0, logprobs: dict[str, Any] | None = None
    ) -> BaseModel:
        choice = CompletionChoice(index=index, text="", finish_reason=finish, logprobs=logprobs)
        return self._make([choice])

    def usage_only(self, usage: Usage) -> BaseModel:
        return self._make([], usage)

    def whole(self, answers: list[_Answer], usage: Usage) -> BaseModel:
        choices = [
            CompletionChoice(index=i, text=text, finish_reason=finish, logprobs=logprobs)
            for i, (text, finish, logprobs) in enumerate(answers)
        ]
        return self._make(choices, usage)


_Shapes = _ChatShapes | _CompletionShapes


def _usage(prompt: int, choices: Choices) -> Usage:
    # OpenAI counts the prompt once however many choices share it.
    completion = choices.generated_tokens
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


async def _answer(
    request: Request,
    opened: Opened,
    body: ChatCompletionRequest | CompletionRequest,
    shapes: _Shapes,
    *,
    chat: bool,
) -> Response:
    """The answer of the opened request in the endpoint's shapes: streamed as events, or
    whole."""
    record = record_of(request)
    choices = opened.choices
    own = not opened.model.text_model  # only the gateway's own model gives log-probabilities
    logprobs = _Logprobs(
        service_of(request).tokenizer if own else None,
        body.logprobs_top if own else None,
        chat=chat,
        choices=len(choices.streams),
    )
    if body.stream:
        events = _events(
            choices, opened.prompt_tokens, shapes, logprobs, record, body.include_usage
        )
        return GenerationResponse(events, choices, record, media_type="text/event-stream")
    try:
        texts = await collect_unless_disconnected(choices, request, record)
    except GenerationError as exc:
        # Nothing was sent yet, so the failure still gets its proper status.
        record.error = exc.code
        raise broker_failure(exc.code, exc.message) from None
    if texts is None:
        return Response(status_code=CLIENT_CLOSED)
    answers = [
        (text, s.finish_reason, logprobs.take(s, i))
        for i, (text, s) in enumerate(zip(texts, choices.streams, strict=True))
    ]
    whole = shapes.whole(answers, _usage(opened.prompt_tokens(), choices))
    return JSONResponse(whole.model_dump(mode="json"))


async def _events(
    choices: Choices,
    prompt_tokens: Callable[[], int],
    shapes: _Shapes,
    logprobs: _Logprobs,
    record: RequestRecord,
    include_usage: bool,
) -> AsyncIterator[str]:
    try:
        for index in range(len(choices.streams)):
            opening = shapes.opening(index)
            if opening is not None:
                yield _sse(opening)
        async for index, text in choices.chunks():
            stream = choices.streams[index]
            lp = logprobs.take(stream, index)
            if text is None:  # this choice is done
                yield _sse(shapes.closing(stream.finish_reason, index, lp))
            else:
                yield _sse(shapes.piece(text, index, lp))
        if include_usage:
            yield _sse(shapes.usage_only(_usage(prompt_tokens(), choices)))
        yield _DONE  # only after whole answers: a stream that failed ends at its error
    except GenerationError as exc:
        record.error = exc.code
        log.warning("generation failed mid-stream", code=exc.code, error=exc.message)
        yield _sse(error_payload(exc.message, "server_error", None, exc.code))
    except Exception:
        record.error = "internal"
        log.exception("generation failed mid-stream")
        yield _sse(error_payload("internal error in the gateway", "server_error", None, "internal"))


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    body: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
    opened = await service_of(request).chat_completion(body, request)
    return await _answer(request, opened, body, _ChatShapes(opened.model.name), chat=True)


@router.post("/completions")
async def completions(request: Request) -> Response:
    body: CompletionRequest = await _parse(request, CompletionRequest)
    opened = await service_of(request).completion(body, request)
    return await _answer(request, opened, body, _CompletionShapes(opened.model.name), chat=False)


def _card(model: ServedModel) -> ModelCard:
    # A remote model's context is its upstream's, unknown here.
    context = None if model.text_model else model.context
    return ModelCard(id=model.name, created=model.created, max_model_len=context)


@router.get("/models")
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_card(m) for m in service_of(request).models.listed()])


@router.get("/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> ModelCard:
    return _card(await service_of(request).model(model_id))
