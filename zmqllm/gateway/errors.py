"""Errors as OpenAI-shaped JSON: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the gateway answers, on every route (plain ``/chat`` included), uses this
one shape, so clients (and the ``openai`` package, which reads ``error.message``) need
one parser. FastAPI's own 422 validation answers and Starlette's 404/405 are converted
too: a wrong type is a 400 naming the field, as OpenAI answers it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from zmqllm.bus.messages import ErrorCode

__all__ = [
    "CLIENT_CLOSED",
    "RETRY_AFTER_S",
    "APIError",
    "broker_failure",
    "error_payload",
    "install_error_handlers",
    "validation_failure",
]

# Seconds a client should wait before retrying a 429/503. Capacity comes back when a
# worker (re)registers, which takes about a heartbeat interval.
RETRY_AFTER_S = 1

# nginx's convention for "client closed the request": only ever seen in our own log line.
CLIENT_CLOSED = 499

# The HTTP answer to a failed generation that sent nothing yet, by its code. 503 and 429
# carry Retry-After: the cluster lacks capacity for now (no route, a worker lost, the
# broker unreachable or behind on our messages, its queue full), and trying again shortly
# is the right move. A deadline that passed upstream is a 504. A code this gateway does
# not know (a newer broker's) is a temporary lack of service: 503.
_BROKER_STATUS: dict[ErrorCode, int] = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.BUSY: 429,
    ErrorCode.INTERNAL: 500,
    ErrorCode.TIMEOUT: 504,
    ErrorCode.NO_CAPACITY: 503,
    ErrorCode.FULL: 503,
    ErrorCode.WORKER_LOST: 503,
    ErrorCode.BROKER_UNREACHABLE: 503,
    ErrorCode.SLOW_CONSUMER: 503,
    ErrorCode.CANCELLED: 503,
    ErrorCode.UPSTREAM_ERROR: 502,  # a remote model's API failed: a bad gateway, in HTTP's words
}


class APIError(Exception):
    """A failure to answer as JSON with ``status``; raised anywhere in request handling."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        # OpenAI calls client mistakes invalid_request_error and its own failures server_error.
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = dict(headers or {})

    def payload(self) -> dict[str, Any]:
        return error_payload(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.payload(), status_code=self.status, headers=self.headers)


def error_payload(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def broker_failure(code: ErrorCode | str, message: str) -> APIError:
    """The answer to a generation failure (``code`` an ErrorCode or its value) that
    arrived before any token was sent."""
    word = code.value if isinstance(code, ErrorCode) else str(code)
    try:
        status = _BROKER_STATUS[ErrorCode(word)]
    except (ValueError, KeyError):
        status = 503
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    kind = "rate_limit_error" if status == 429 else None
    return APIError(status, message, code=word, headers=headers, type=kind)


def _field_path(loc: Sequence[int | str]) -> str:
    """("messages", 0, "content") -> "messages[0].content"."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def validation_failure(errors: Sequence[Any], *, drop_source: bool = False) -> APIError:
    """A 400 naming the first invalid field of a pydantic/FastAPI error list.

    ``drop_source`` strips FastAPI's leading location ("query", "body", "path"), which is
    not part of the field name a client sent.
    """
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = list(first.get("loc", ()))
    if drop_source and loc and loc[0] in ("query", "body", "path", "header"):
        loc = loc[1:]
    param = _field_path(loc) or None
    # A ValueError raised by our own validators already says what is wrong, in full.
    cause = first.get("ctx", {}).get("error")
    message = str(cause) if isinstance(cause, ValueError) else str(first.get("msg", "invalid"))
    if first.get("type") == "missing":
        message = "this field is required"
    text = f"{param}: {message}" if param else message
    return APIError(400, text, param=param, code="invalid_" + ("value" if param else "request"))


async def _api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _request_validation(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_failure(exc.errors(), drop_source=True).response()


async def _pydantic_validation(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ValidationError)
    return validation_failure(exc.errors(include_url=False)).response()


async def _http_exception(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    codes = {404: "not_found", 405: "method_not_allowed"}
    return APIError(
        exc.status_code,
        str(exc.detail),
        code=codes.get(exc.status_code),
        headers=exc.headers,
    ).response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(ValidationError, _pydantic_validation)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
