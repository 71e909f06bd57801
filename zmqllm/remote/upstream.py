"""An async client for an OpenAI-compatible streaming API (a hosted LLM API, vLLM,
llama.cpp's server, another zmqllm gateway): what a remote worker forwards requests to.

``Upstream.stream`` yields the answer as ``Delta`` pieces while the server sends them;
failures come out as ``UpstreamError`` with a short code. A request is retried only while
nothing of the answer has been passed on: after a delta, a retry would repeat text. A
consumer that stops early closes the generator (``contextlib.aclosing``) or cancels its
task: the connection is then closed at once, which is how the upstream learns to stop.
The stream's bytes become deltas in ``sse.py``. No torch here: a remote worker needs no ML stack.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import httpx

from zmqllm.log import get_logger
from zmqllm.remote.sse import Delta, EventReader, StreamFault, error_detail, utf8

__all__ = [
    "ERROR_CODES",
    "Upstream",
    "UpstreamError",
    "UpstreamSettings",
    "shown_url",
]

log = get_logger("zmqllm.worker")
# httpx logs every request's URL at info, with its password and query (where some APIs
# take a key): kept to its warnings in a process that talks to an upstream.
logging.getLogger("httpx").setLevel(logging.WARNING)

ERROR_CODES = ("bad_request", "busy", "upstream_error", "timeout")
MAX_ERROR_BODY_BYTES = 64 << 10
MAX_MODELS_BODY_BYTES = 4 << 20
MAX_MESSAGE_CHARS = 1000
BACKOFF_CAP_S = 10.0
# The request itself is wrong: sending it again, or elsewhere, cannot help.
_BAD_REQUEST_STATUSES = frozenset({400, 404, 413, 422})
# Failures with no status line: no answer had begun, so a retry repeats nothing.
_RETRIED_EXCEPTIONS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError)
_ENDPOINTS = {"chat": "/chat/completions", "completion": "/completions"}


@dataclass(frozen=True)
class UpstreamSettings:
    url: str  # base URL, e.g. "http://127.0.0.1:8080/v1"
    model: str = ""  # "" = the first id the upstream lists at {url}/models
    api_key: str = field(default="", repr=False)
    connect_timeout: float = 10.0
    stall_timeout: float = 60.0  # no bytes for this long -> "timeout"
    retries: int = 3  # tries after the first, only before the first delta
    backoff: float = 0.5  # seconds before the first retry, doubling (capped)

    def __post_init__(self) -> None:
        # The URL is not echoed: it may carry credentials, or a key in its query.
        if not self.url.startswith(("http://", "https://")):
            raise ValueError("the upstream URL must start with http:// or https://")
        positive = min(self.connect_timeout, self.stall_timeout) > 0
        if not positive or min(self.retries, self.backoff) < 0:
            raise ValueError("upstream timeouts must be positive, retries and backoff not negative")


class UpstreamError(Exception):
    """A failed upstream request; ``code`` is one of ERROR_CODES, ``message`` one line."""

    def __init__(self, code: str, message: str, status: int | None = None) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"unknown upstream error code {code!r}")
        # One line, and one the wire can carry (an upstream's error text may not be).
        message = " ".join(utf8(message).split())
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 1] + "…"
        # All three in args, so the error pickles whole.
        super().__init__(code, message, status)
        self.code, self.message, self.status = code, message, status

    def __str__(self) -> str:
        return self.message


def _shown(method: str, url: httpx.URL) -> str:
    """The request as its errors name it: the method and path only. Those errors reach
    clients, who have no business knowing where the upstream is (its host, a key in its
    query); the operator's log has the URL (``shown_url``)."""
    return f"{method} {url.path}"


def shown_url(url: str) -> str:
    """An upstream base URL fit for a log: scheme, host, port and path only (no
    credentials, no query: either may hold a key)."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        return "(an invalid URL)"
    host = f"[{parsed.host}]" if ":" in parsed.host else parsed.host
    port = f":{parsed.port}" if parsed.port is not None else ""
    return f"{parsed.scheme}://{host}{port}{parsed.path}"


async def _read_capped(response: httpx.Response, limit: int) -> bytes:
    # An error page or a model list can be any size.
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) >= limit:
            break
    return bytes(body[:limit])


class Upstream:
    """One upstream server; any number of concurrent streams on one event loop."""

    def __init__(
        self, settings: UpstreamSettings, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.settings = settings
        base = httpx.URL(settings.url)
        self._base = base.copy_with(path=base.path.rstrip("/"))
        self._model = settings.model
        # httpx times reads and writes per socket operation: just "no bytes for this long".
        timeout = httpx.Timeout(
            settings.stall_timeout, connect=settings.connect_timeout, pool=settings.connect_timeout
        )
        self._client = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {},
            timeout=timeout,
            transport=transport,
            # The worker's admission bounds concurrency; a cap here would only queue streams.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def resolve_model(self) -> str:
        """The model id to send: the configured one, or the first the upstream lists."""
        if self._model:
            return self._model
        url = self._url("/models")
        response = await self._open("GET", url, None, "upstream model list fetched")
        try:
            raw = await _read_capped(response, MAX_MODELS_BODY_BYTES)
        except httpx.HTTPError as exc:
            raise self._failure(exc, _shown("GET", url)) from None
        finally:
            await response.aclose()
        try:
            data = json.loads(raw).get("data")
        except (ValueError, AttributeError):
            data = None
        ids = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        model = next((i for i in ids if isinstance(i, str) and i), None)
        if model is None:
            what = "lists no models; set the worker's upstream model"
            raise self._error("upstream_error", f"upstream {_shown('GET', url)} {what}")
        log.info("upstream model resolved", model=model)
        self._model = model
        return model

    def stream(self, kind: str, body: dict[str, Any]) -> AsyncGenerator[Delta, None]:
        """Post ``body`` (OpenAI request fields) and yield the answer's deltas. Usage may come
        on any delta (most often its own, after the finish): the last seen counts."""
        if kind not in _ENDPOINTS:
            raise ValueError(f"unknown upstream request kind {kind!r}; expected chat or completion")
        return self._stream(kind, dict(body))

    async def _stream(self, kind: str, body: dict[str, Any]) -> AsyncGenerator[Delta, None]:
        model = await self.resolve_model()
        options = body.get("stream_options")
        options = {**options, "include_usage": True} if isinstance(options, dict) else None
        body.update(model=model, stream=True, stream_options=options or {"include_usage": True})
        url = self._url(_ENDPOINTS[kind])
        shown = _shown("POST", url)
        response = await self._open("POST", url, body, "upstream stream opened", model=model)
        # Nothing awaits between _open and here, so a cancellation cannot leak the response.
        try:
            if response.headers.get("content-type", "").startswith("application/json"):
                # It ignored "stream": a server this client cannot use as it is set up.
                raise self._error("upstream_error", f"upstream {shown} sent JSON, not a stream")
            reader = EventReader(kind)
            try:
                async for data in response.aiter_bytes():
                    for delta in reader.feed(data):
                        yield delta
                    if reader.done:
                        return
            except httpx.HTTPError as exc:
                if not reader.finished:
                    raise self._failure(exc, shown, cut=True) from None
                # The answer is whole; only the trailing usage or [DONE] was lost.
                log.debug("upstream connection ended after the finish", error=type(exc).__name__)
                return
            for delta in reader.end():
                yield delta
        except StreamFault as fault:
            # The reason, not the message: that may quote the upstream's answer.
            facts = {"path": url.path, "code": "upstream_error", "reason": fault.reason}
            log.warning("upstream stream failed", **facts)
            raise self._error("upstream_error", f"upstream {shown}: {fault}") from None
        except UpstreamError as exc:
            log.warning("upstream stream failed", path=url.path, code=exc.code)
            raise
        finally:
            # A half-read connection is closed, never pooled: the upstream sees it go.
            await response.aclose()

    def _url(self, endpoint: str) -> httpx.URL:
        return self._base.copy_with(path=self._base.path + endpoint)

    def _error(self, code: str, message: str, status: int | None = None) -> UpstreamError:
        # Every message passes here: an upstream may echo the key back in its error text.
        if self.settings.api_key:
            message = message.replace(self.settings.api_key, "***")
        return UpstreamError(code, message, status)

    def _failure(self, exc: httpx.HTTPError, shown: str, cut: bool = False) -> UpstreamError:
        what = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
            limit = self.settings.connect_timeout
            return self._error("timeout", f"timed out connecting to upstream {shown} ({limit:g} s)")
        if isinstance(exc, httpx.TimeoutException):
            where = "mid-stream" if cut else "before answering"
            limit = self.settings.stall_timeout
            return self._error("timeout", f"upstream {shown} sent nothing for {limit:g} s {where}")
        if isinstance(exc, httpx.ConnectError):
            return self._error("upstream_error", f"could not connect to upstream {shown}: {what}")
        if cut:
            what = f"the stream ended before the answer finished ({what})"
        return self._error("upstream_error", f"upstream {shown} failed: {what}")

    async def _status_error(self, response: httpx.Response, shown: str) -> UpstreamError:
        try:
            text = (await _read_capped(response, MAX_ERROR_BODY_BYTES)).decode("utf-8", "replace")
        except httpx.HTTPError:
            text = ""  # the status alone still says what happened
        try:
            body = json.loads(text)
        except ValueError:
            body = None  # an HTML error page from a proxy, say: its start is shown instead
        status = response.status_code
        code = "bad_request" if status in _BAD_REQUEST_STATUSES else "upstream_error"
        code, hint = ("busy" if status == 429 else code), ""
        if status in (401, 403):
            hint = "the upstream refused the worker's API key (check the worker's upstream key); "
            if not self.settings.api_key:
                hint = "the upstream wants an API key and the worker has none set; "
        message = f"upstream {shown} answered HTTP {status}: {hint}{error_detail(body, text)}"
        return self._error(code, message, status)

    async def _open(
        self, method: str, url: httpx.URL, payload: Any, event: str, **fields: Any
    ) -> httpx.Response:
        """Send the request and check its status line, retrying what a retry can fix."""
        shown = _shown(method, url)
        accept = "text/event-stream" if payload is not None else "application/json"
        attempt = 1
        while True:
            # identity: a compressing proxy may hold a stream back to fill its blocks.
            headers = {"Accept": accept, "Accept-Encoding": "identity"}
            request = self._client.build_request(method, url, json=payload, headers=headers)
            status: int | None = None
            try:
                response = await self._client.send(request, stream=True)
            except httpx.HTTPError as exc:
                failure, error = self._failure(exc, shown), type(exc).__name__
                # A connection dropped here is most often a pooled one the server closed.
                retryable = isinstance(exc, _RETRIED_EXCEPTIONS)
            else:
                status = response.status_code
                if 200 <= status < 300:
                    log.info(event, path=url.path, status=status, attempt=attempt, **fields)
                    return response
                try:
                    failure = await self._status_error(response, shown)
                finally:
                    await response.aclose()
                error, retryable = f"HTTP {status}", status == 429 or status >= 500
            facts = {"path": url.path, "status": status, "error": error}
            if not retryable or attempt > self.settings.retries:
                log.warning("upstream request failed", code=failure.code, attempts=attempt, **facts)
                raise failure
            wait = min(self.settings.backoff * 2 ** (attempt - 1), BACKOFF_CAP_S)
            log.warning("upstream failed; retrying", attempt=attempt, wait_s=wait, **facts)
            await asyncio.sleep(wait)
            attempt += 1
