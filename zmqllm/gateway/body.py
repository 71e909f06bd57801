"""Reading request bodies with a size limit, as UTF-8 text or a JSON object.

Bodies are read by hand rather than through FastAPI's body parameters: ``/chat`` must take
the raw bytes whatever the Content-Type (``curl -d`` labels them form-urlencoded, and
decoding them as a form would mangle ``+`` and ``%``), and every failure has to come back
as a precise 4xx instead of a generic validation error.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
from starlette.requests import Request

from zmqllm.gateway.errors import APIError

__all__ = ["check_json_type", "read_body", "read_json_object", "read_text"]


def _too_large(size: str, limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is {size} bytes, over the limit of {limit} bytes",
        code="request_too_large",
    )


async def read_body(request: Request, limit: int, timeout: float | None = None) -> bytes:
    """The raw body; 413 once it is known to exceed ``limit`` bytes, 408 if it has not all
    arrived within ``timeout`` seconds.

    Content-Length is checked first so a huge upload is refused before it is read, and the
    bytes are counted anyway because a chunked body has no Content-Length (and a client may
    lie about it). The deadline keeps a client that trickles its body from holding a
    request (and a connection) for ever.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise APIError(400, f"invalid Content-Length {declared!r}") from None
        if size > limit:
            raise _too_large(str(size), limit)
    body = bytearray()
    with anyio.move_on_after(timeout) as deadline:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise _too_large(f"more than {limit}", limit)
    if deadline.cancelled_caught:
        raise APIError(
            408,
            f"the request body did not arrive within {timeout:g} s",
            code="request_timeout",
            # The rest of the body may still come: this connection cannot carry another
            # request.
            headers={"Connection": "close"},
        )
    return bytes(body)


def _decode_utf8(body: bytes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(
            400,
            f"the request body is not valid UTF-8 (bad byte at offset {exc.start})",
            code="invalid_encoding",
        ) from None


async def read_text(request: Request, limit: int, timeout: float | None = None) -> str:
    return _decode_utf8(await read_body(request, limit, timeout))


JSON_TYPES = ("application/json",)


def check_json_type(request: Request) -> None:
    """415 unless the body is labelled JSON: a page elsewhere can send text/plain (or no
    type) to any origin without asking first, but not application/json."""
    given = request.headers.get("content-type")
    kind = (given or "").partition(";")[0].strip().lower()
    if kind in JSON_TYPES or (kind.startswith("application/") and kind.endswith("+json")):
        return
    shown = repr(given[:100]) if given is not None else "none"
    raise APIError(
        415,
        f"the request body must be sent as JSON (Content-Type: application/json); the "
        f"Content-Type was {shown}",
        code="unsupported_media_type",
    )


async def read_json_object(
    request: Request, limit: int, timeout: float | None = None
) -> dict[str, Any]:
    """The body as a JSON object, after its Content-Type says it is JSON (else 415)."""
    check_json_type(request)
    text = _decode_utf8(await read_body(request, limit, timeout))
    if not text.strip():
        raise APIError(
            400, "the request body is empty; expected a JSON object", code="invalid_json"
        )
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(
            400,
            f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, "
            f"column {exc.colno})",
            code="invalid_json",
        ) from None
    if not isinstance(data, dict):
        raise APIError(
            400,
            f"the request body must be a JSON object, got {_json_kind(data)}",
            code="invalid_json",
        )
    return data


def _json_kind(value: Any) -> str:
    # Named as JSON names them: the client wrote JSON, not Python.
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "a string" if isinstance(value, str) else "an array"
