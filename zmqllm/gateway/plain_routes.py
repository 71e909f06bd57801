"""``POST /chat``: the body is the prompt, the answer streams back as plain text.

Made for ``curl -N -d "Why is the sky blue?" localhost:8080/chat``. The prompt goes through
the chat template as one user message; sampling and the token budget come as query
parameters (an unknown one is a 400 naming it; ``model=NAME`` picks a model other than
the default, a remote one included). The answer ends with a newline. A failure
after the first bytes were sent can no longer change the status code, so it is appended
as a last line ``[error: ...]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from zmqllm.gateway.body import read_text
from zmqllm.gateway.errors import APIError
from zmqllm.gateway.planning import PlainQuery
from zmqllm.gateway.request_context import RequestRecord, record_of
from zmqllm.gateway.responses import GenerationResponse
from zmqllm.gateway.service import service_of
from zmqllm.gateway.streaming import GenerationError, TextStream
from zmqllm.log import get_logger

__all__ = ["router"]

router = APIRouter()
log = get_logger("zmqllm.gateway")

# The query parameters /chat takes (its handler's arguments); a typo in one would
# otherwise be ignored without a word.
CHAT_QUERY = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed")
NAMES_SHOWN = 4  # unknown names repeated in the error, each cut to NAME_CHARS
NAME_CHARS = 40


@router.post("/chat", response_class=Response)
async def chat(
    request: Request,
    model: str | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
) -> Response:
    _check_query(request)
    service = service_of(request)
    record = record_of(request)
    settings = service.settings
    prompt = await read_text(request, settings.max_body_bytes, settings.body_timeout)
    if not prompt.strip():
        raise APIError(400, "the prompt (request body) is empty", code="empty_prompt")
    query = PlainQuery(model, max_tokens, temperature, top_p, top_k, seed)
    generation = await service.plain_chat(prompt, query, request)
    return GenerationResponse(
        _text_chunks(generation, record),
        generation,
        record,
        media_type="text/plain; charset=utf-8",
        abort_on_error=True,  # curl exits non-zero: a script can tell
    )


def _check_query(request: Request) -> None:
    unknown = sorted({name for name in request.query_params if name not in CHAT_QUERY})
    if unknown:
        named = ", ".join(repr(name[:NAME_CHARS]) for name in unknown[:NAMES_SHOWN])
        more = f" and {len(unknown) - NAMES_SHOWN} more" if len(unknown) > NAMES_SHOWN else ""
        raise APIError(
            400,
            f"unknown query parameter {named}{more}: /chat takes {', '.join(CHAT_QUERY)}",
            param=unknown[0][:NAME_CHARS],
            code="unknown_parameter",
        )


async def _text_chunks(generation: TextStream, record: RequestRecord) -> AsyncIterator[str]:
    try:
        async for text in generation.chunks():
            yield text
        yield "\n"  # so a shell's prompt starts on a line of its own after curl
    except GenerationError as exc:
        record.error = exc.code
        log.warning("generation failed mid-stream", code=exc.code, error=exc.message)
        yield f"\n[error: {exc.message}]\n"
    except Exception:
        record.error = "internal"
        log.exception("generation failed mid-stream")
        yield "\n[error: internal error in the gateway]\n"
