"""``POST /chat``: the body is the prompt, the answer streams back as plain text.

Made for ``curl -N -d "Why is the sky blue?" localhost:8080/chat``. The prompt goes through
the chat template as one user message; sampling and the token budget come as query
parameters. A failure after the first bytes were sent can no longer change the status
code, so it is appended as a last line ``[error: ...]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from zmqllm.gateway.body import read_text
from zmqllm.gateway.errors import APIError
from zmqllm.gateway.request_context import RequestRecord, record_of
from zmqllm.gateway.responses import GenerationResponse
from zmqllm.gateway.service import service_of
from zmqllm.gateway.streaming import GenerationError, TextStream
from zmqllm.log import get_logger

__all__ = ["router"]

router = APIRouter()
log = get_logger("zmqllm.gateway")


@router.post("/chat", response_class=Response)
async def chat(
    request: Request,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
) -> Response:
    service = service_of(request)
    record = record_of(request)
    settings = service.settings
    prompt = await read_text(request, settings.max_body_bytes, settings.body_timeout)
    if not prompt.strip():
        raise APIError(400, "the prompt (request body) is empty", code="empty_prompt")
    if service.tokenizer.has_chat_template:
        prompt_ids = service.encode_chat([{"role": "user", "content": prompt}])
    else:
        # A base model without a template still answers: the text is its prompt.
        prompt_ids = service.encode_text(prompt)
    plan = service.plan(
        prompt_ids,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        prompt_param=None,
    )
    generation = await service.open(plan, record, request)
    return GenerationResponse(
        _text_chunks(generation, record),
        generation,
        record,
        media_type="text/plain; charset=utf-8",
        abort_on_error=True,  # curl exits non-zero: a script can tell
    )


async def _text_chunks(generation: TextStream, record: RequestRecord) -> AsyncIterator[str]:
    try:
        async for text in generation.chunks():
            yield text
    except GenerationError as exc:
        record.error = exc.code
        log.warning("generation failed mid-stream", code=exc.code, error=exc.message)
        yield f"\n[error: {exc.message}]\n"
    except Exception:
        record.error = "internal"
        log.exception("generation failed mid-stream")
        yield "\n[error: internal error in the gateway]\n"
