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
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from zmqllm.gateway.body import read_json_object
from zmqllm.gateway.errors import CLIENT_CLOSED, broker_failure, error_payload, validation_failure
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
)
from zmqllm.gateway.service import GatewayService, GenerationPlan, service_of
from zmqllm.gateway.streaming import GenerationError, TextStream
from zmqllm.log import get_logger

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
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise validation_failure(exc.errors(include_url=False)) from None


class _ChatShapes:
    """Builds chat.completion / chat.completion.chunk objects for one answer."""

    def __init__(self, model: str) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def _chunk(self, delta: DeltaMessage, finish: str | None = None) -> ChatCompletionChunk:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish)
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[choice]
        )

    def opening(self) -> BaseModel | None:
        # OpenAI's first chunk announces the role with empty content.
        return self._chunk(DeltaMessage(role="assistant", content=""))

    def piece(self, text: str) -> BaseModel:
        return self._chunk(DeltaMessage(content=text))

    def closing(self, finish: str | None) -> BaseModel:
        return self._chunk(DeltaMessage(), finish)

    def usage_only(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def whole(self, text: str, finish: str | None, usage: Usage) -> BaseModel:
        choice = ChatChoice(message=ResponseMessage(content=text), finish_reason=finish)
        return ChatCompletion(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage
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

    def opening(self) -> BaseModel | None:
        return None

    def piece(self, text: str) -> BaseModel:
        return self._make([CompletionChoice(text=text)])

    def closing(self, finish: str | None) -> BaseModel:
        return self._make([CompletionChoice(text="", finish_reason=finish)])

    def usage_only(self, usage: Usage) -> BaseModel:
        return self._make([], usage)

    def whole(self, text: str, finish: str | None, usage: Usage) -> BaseModel:
        return self._make([CompletionChoice(text=text, finish_reason=finish)], usage)


_Shapes = _ChatShapes | _CompletionShapes


def _usage(plan: GenerationPlan, generation: TextStream) -> Usage:
    prompt, completion = len(plan.prompt_ids), generation.generated_tokens
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


async def _answer(
    request: Request,
    plan: GenerationPlan,
    shapes: _Shapes,
    *,
    stream: bool,
    include_usage: bool,
) -> Response:
    service, record = service_of(request), record_of(request)
    generation = await service.open(plan, record, request)
    if stream:
        events = _events(generation, plan, shapes, record, include_usage)
        return GenerationResponse(events, generation, record, media_type="text/event-stream")
    try:
        text = await collect_unless_disconnected(generation, request, record)
    except GenerationError as exc:
        # Nothing was sent yet, so the failure still gets its proper status.
        record.error = exc.code
        raise broker_failure(exc.code, exc.message) from None
    if text is None:
        return Response(status_code=CLIENT_CLOSED)
    body = shapes.whole(text, generation.finish_reason, _usage(plan, generation))
    return JSONResponse(body.model_dump(mode="json"))


async def _events(
    generation: TextStream,
    plan: GenerationPlan,
    shapes: _Shapes,
    record: RequestRecord,
    include_usage: bool,
) -> AsyncIterator[str]:
    try:
        opening = shapes.opening()
        if opening is not None:
            yield _sse(opening)
        async for text in generation.chunks():
            yield _sse(shapes.piece(text))
        yield _sse(shapes.closing(generation.finish_reason))
        if include_usage:
            yield _sse(shapes.usage_only(_usage(plan, generation)))
        yield _DONE  # only after a whole answer: a stream that failed ends at its error
    except GenerationError as exc:
        record.error = exc.code
        log.warning("generation failed mid-stream", code=exc.code, error=exc.message)
        yield _sse(error_payload(exc.message, "server_error", None, exc.code))
    except Exception:
        record.error = "internal"
        log.exception("generation failed mid-stream")
        yield _sse(error_payload("internal error in the gateway", "server_error", None, "internal"))


def _plan(
    service: GatewayService,
    body: ChatCompletionRequest | CompletionRequest,
    prompt_ids: list[int],
    prompt_param: str,
) -> GenerationPlan:
    """The sampling fields both endpoints share, checked against the context."""
    return service.plan(
        prompt_ids,
        max_tokens=body.token_limit,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stops=body.stop or (),
        n=body.n,
        prompt_param=prompt_param,
        ignore_eos=body.ignore_eos,
    )


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    service = service_of(request)
    body: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
    service.check_model(body.model)
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.content or ""}
        for m in body.messages
    ]
    plan = _plan(service, body, service.encode_chat(messages), "messages")
    return await _answer(
        request,
        plan,
        _ChatShapes(service.model_name),
        stream=bool(body.stream),
        include_usage=body.include_usage,
    )


@router.post("/completions")
async def completions(request: Request) -> Response:
    service = service_of(request)
    body: CompletionRequest = await _parse(request, CompletionRequest)
    service.check_model(body.model)
    plan = _plan(service, body, service.encode_text(body.prompt), "prompt")
    return await _answer(
        request,
        plan,
        _CompletionShapes(service.model_name),
        stream=bool(body.stream),
        include_usage=body.include_usage,
    )


def _card(service: GatewayService) -> ModelCard:
    return ModelCard(
        id=service.model_name, created=service.created, max_model_len=service.context_length
    )


@router.get("/models")
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_card(service_of(request))])


@router.get("/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> ModelCard:
    service = service_of(request)
    service.check_model(model_id)
    return _card(service)
