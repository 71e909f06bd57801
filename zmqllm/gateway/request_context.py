"""Per-request id, log binding, the one "request finished" log line, and the client's
hang-up.

A plain ASGI middleware rather than Starlette's BaseHTTPMiddleware: the latter runs the
endpoint in a separate task and buffers through a memory stream, which gets in the way of
streamed responses and of seeing a client disconnect.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from zmqllm.bus.wire_types import is_valid_id
from zmqllm.gateway.errors import APIError
from zmqllm.gateway.streaming import TextStream
from zmqllm.log import bind_request, get_logger, new_request_id

__all__ = [
    "REQUEST_ID_HEADER",
    "RequestContextMiddleware",
    "RequestRecord",
    "client_disconnected",
    "record_in",
    "record_of",
]

REQUEST_ID_HEADER = "X-Request-ID"
_STATE_KEY = "zmqllm_record"
# Probes and the cluster page's poll hit these every second or two; their lines would
# drown the real traffic.
_QUIET_PATHS = frozenset({"/health", "/ready", "/cluster/status"})

log = get_logger("zmqllm.gateway")


def pick_request_id(given: str | None) -> str:
    """The client's id if it is safe to log and forward, else a fresh one."""
    # Ids travel in log lines and on the bus, where only this pattern is accepted.
    if given is not None and is_valid_id(given):
        return given
    return new_request_id()


@dataclass
class RequestRecord:
    """What the "request finished" line reports; handlers fill in the generation."""

    request_id: str
    method: str
    path: str
    started_at: float = field(default_factory=time.perf_counter)
    status: int | None = None
    prompt_tokens: int | None = None
    # The first choice's stream; the others (OpenAI's n) in ``more``.
    generation: TextStream | None = None
    more: list[TextStream] = field(default_factory=list)
    # Set when the answer ends abnormally: a broker error code, "cancelled" (client left).
    error: str | None = None
    finish_reason: str | None = None
    # Which API key sent it (a digest's prefix, never the key), when shares apply.
    tenant: str | None = None

    def add_generation(self, stream: TextStream) -> None:
        if self.generation is None:
            self.generation = stream
        else:
            self.more.append(stream)

    @property
    def generated_tokens(self) -> int:
        """Tokens of every choice."""
        streams = [self.generation, *self.more] if self.generation else []
        return sum(s.generated_tokens for s in streams)

    def fields(self) -> dict[str, Any]:
        now = time.perf_counter()
        out: dict[str, Any] = {
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "duration_ms": round((now - self.started_at) * 1000, 1),
        }
        gen = self.generation
        if gen is not None or self.prompt_tokens is not None:
            out["prompt_tokens"] = self.prompt_tokens
            out["generated_tokens"] = self.generated_tokens
            if self.more:
                out["choices"] = 1 + len(self.more)
            out["route"] = gen.route if gen else []
            out["session"] = gen.session if gen else None
            first, last = (gen.first_token_at, gen.last_token_at) if gen else (None, None)
            out["ttft_ms"] = None if first is None else round((first - self.started_at) * 1000, 1)
            # Decode speed: tokens after the first over the time since the first, so the
            # prefill (already in ttft_ms) does not dilute it.
            rate = None
            if gen and first is not None and last is not None and last > first:
                rate = round((gen.generated_tokens - 1) / (last - first), 2)
            out["tokens_per_s"] = rate
            finish = self.finish_reason or (gen.finish_reason if gen else None)
            out["finish_reason"] = finish or ("error" if self.error else None)
        if self.error:
            out["error"] = self.error
        return out


def record_in(scope: Scope) -> RequestRecord | None:
    """The record of the request ``scope`` is for, once the middleware has made it."""
    record = scope.get("state", {}).get(_STATE_KEY)
    return record if isinstance(record, RequestRecord) else None


def record_of(request: Request) -> RequestRecord:
    record = request.scope.get("state", {}).get(_STATE_KEY)
    if not isinstance(record, RequestRecord):
        # Only reachable if the app was built without the middleware (direct use in tests).
        record = RequestRecord(new_request_id(), request.method, request.url.path)
        request.scope.setdefault("state", {})[_STATE_KEY] = record
    return record


async def client_disconnected(request: Request) -> None:
    """Return once the client has hung up (call only after the body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = pick_request_id(Headers(scope=scope).get(REQUEST_ID_HEADER))
        record = RequestRecord(request_id, scope["method"], scope["path"])
        scope.setdefault("state", {})[_STATE_KEY] = record

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        with bind_request(request_id):
            try:
                await self.app(scope, receive, send_with_id)
            except Exception:
                # Answered here (not by Starlette's ServerErrorMiddleware, outside us) so the
                # 500 still carries the request id, and the traceback is a structured line.
                log.exception("unhandled error")
                record.error = "internal"
                if record.status is None:
                    failure = APIError(500, "internal server error", code="internal")
                    await failure.response()(scope, receive, send_with_id)
            finally:
                level = log.debug if scope["path"] in _QUIET_PATHS else log.info
                level("request finished", **record.fields())
                app = scope.get("app")
                metrics = getattr(getattr(app, "state", None), "metrics", None)
                if metrics is not None:
                    metrics.observe(record)
