"""An async client for an OpenAI-compatible streaming API (a hosted LLM API, vLLM,
llama.cpp's server, another zmqllm gateway): what a remote worker forwards requests to.

``Upstream.stream`` yields the answer as ``Delta`` pieces while the server sends them;
failures come out as ``UpstreamError`` with a short code. A request is retried only while
nothing of the answer has been passed on: after a delta, a retry would repeat text. A
consumer that stops early closes the generator (``contextlib.aclosing``) or cancels its
task: the connection is then closed at once, which is how the upstream learns to stop.
No torch here: a remote worker needs no ML stack.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from zmqllm.log import get_logger

__all__ = [
    "ERROR_CODES",
    "Delta",
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
MAX_LINE_BYTES = 1 << 20
MAX_ERROR_BODY_BYTES = 64 << 10
MAX_MODELS_BODY_BYTES = 4 << 20
MAX_MESSAGE_CHARS = 1000
MAX_DETAIL_CHARS = 600  # the upstream's own words, leaving room for the URL in a message
MAX_FINISH_CHARS = 32
BACKOFF_CAP_S = 10.0
# The request itself is wrong: sending it again, or elsewhere, cannot help.
_BAD_REQUEST_STATUSES = frozenset({400, 404, 413, 422})
# Failures with no status line: no answer had begun, so a retry repeats nothing.
_RETRIED_EXCEPTIONS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError)
_LINE_END = re.compile(rb"\r\n|\r|\n")
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
        message = " ".join(_utf8(message).split())
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 1] + "…"
        # All three in args, so the error pickles whole.
        super().__init__(code, message, status)
        self.code, self.message, self.status = code, message, status

    def __str__(self) -> str:
        return self.message


@dataclass
class Delta:
    text: str = ""
    finish: str | None = None  # "stop", "length", or the upstream's own reason
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


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


def _utf8(text: str) -> str:
    # JSON may carry a lone surrogate ("\ud800"), which no UTF-8 wire can carry: the
    # message holding it could not be sent, and its session would fail for one character.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def _detail(body: Any, raw: str) -> str:
    """The upstream's own error message: {"error": {"message": ...}} and its kin."""
    error = body.get("error", body) if isinstance(body, dict) else None
    if isinstance(error, dict):
        error = error.get("message") or error.get("detail")
    if isinstance(error, str) and error:
        return error[:MAX_DETAIL_CHARS]
    return raw[:200] or "(no message)"


def _count(usage: dict[str, Any], key: str) -> int | None:
    value = usage.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"usage.{key} is not a count")
    return value


def _to_delta(chunk: dict[str, Any], kind: str) -> Delta | None:
    """The delta one stream chunk carries (None: nothing new); ValueError names a bad shape."""
    choices = chunk.get("choices") or []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise ValueError("'choices' is not a list of objects")
    # Only the first choice is ours: the worker asks for one.
    choice: dict[str, Any] = next((c for c in choices if c.get("index", 0) == 0), {})
    holder = (choice.get("delta") or {}) if kind == "chat" else choice
    if not isinstance(holder, dict):
        raise ValueError("a choice's delta is not an object")
    text = holder.get("content" if kind == "chat" else "text")
    reason = choice.get("finish_reason")
    if not isinstance(text, str | None) or not isinstance(reason, str | None):
        raise ValueError("a choice's text or finish_reason is not a string")
    usage = chunk.get("usage") or {}
    if not isinstance(usage, dict):
        raise ValueError("'usage' is not an object")
    finish = _utf8(reason[:MAX_FINISH_CHARS]) if reason else None
    tokens = _count(usage, "prompt_tokens"), _count(usage, "completion_tokens")
    delta = Delta(_utf8(text) if text else "", finish, *tokens)
    return delta if delta != Delta() else None


async def _read_capped(response: httpx.Response, limit: int) -> bytes:
    # An error page or a model list can be any size.
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) >= limit:
            break
    return bytes(body[:limit])


def _whole_json(lines: list[bytes]) -> bool:
    """Whether the data lines so far already make one JSON document (or [DONE])."""
    value = b"\n".join(lines)
    if value.strip() == b"[DONE]":
        return True
    try:
        json.loads(value)
    except ValueError:
        return False
    return True


class _EventReader:
    """Bytes of a server-sent event stream to deltas. An event's ``data:`` lines are
    joined with newlines and the event is read at its blank line, as the SSE spec says
    (a JSON document may be split over several lines). A server that leaves out the
    blank lines still streams: a data line after a buffer that is already a whole JSON
    document starts the next event."""

    def __init__(self, upstream: Upstream, kind: str, shown: str) -> None:
        self._upstream, self._kind, self._shown = upstream, kind, shown
        self._pending = bytearray()  # the start of a line not yet ended
        self._data: list[bytes] = []  # the data lines of the event being read
        self._data_bytes = 0
        self.finished = False  # a finish reason came
        self.done = False  # "data: [DONE]" came

    def feed(self, data: bytes) -> Iterator[Delta]:
        # A generator, so the deltas before a bad line still go out ahead of its error.
        if _LINE_END.search(data) is None:
            # Only new bytes are searched: a long line arriving in many pieces stays linear.
            self._hold(data)
            return
        *lines, rest = _LINE_END.split(bytes(self._pending) + data)
        self._pending = bytearray()
        for line in lines:
            if self.done:
                return
            if len(line) > MAX_LINE_BYTES:
                raise self._error("sent a data line over 1 MiB")
            yield from self._take_line(line)
        self._hold(rest)

    def end(self) -> Iterator[Delta]:
        """At EOF: what a last line without a line end holds; raises if the answer is cut."""
        if self._pending and not self.done:
            yield from self._take_line(bytes(self._pending))
        if self._data and not self.done:
            yield from self._dispatch()
        if not self.finished:
            raise self._error("the stream ended before the answer finished")

    def _hold(self, data: bytes) -> None:
        self._pending += data
        if len(self._pending) > MAX_LINE_BYTES:
            raise self._error("sent a data line over 1 MiB")

    def _error(self, what: str) -> UpstreamError:
        return self._upstream._error("upstream_error", f"upstream {self._shown}: {what}")

    def _take_line(self, line: bytes) -> Iterator[Delta]:
        if not line:  # a blank line ends the event
            yield from self._dispatch()
            return
        name, _, value = line.partition(b":")
        # ":" starts a comment; event:, id:, retry: mean nothing here.
        if name != b"data":
            return
        if self._data and _whole_json(self._data):
            yield from self._dispatch()  # no blank line came between two events
        value = value.removeprefix(b" ")
        self._data_bytes += len(value) + 1
        if self._data_bytes > MAX_LINE_BYTES:
            raise self._error("sent an event over 1 MiB")
        self._data.append(value)

    def _dispatch(self) -> Iterator[Delta]:
        if not self._data or self.done:
            self._data, self._data_bytes = [], 0
            return
        value = b"\n".join(self._data)
        self._data, self._data_bytes = [], 0
        delta = self._event(value)
        if delta is not None:
            yield delta

    def _event(self, value: bytes) -> Delta | None:
        if value.strip() == b"[DONE]":
            self.done = True
            if self.finished:
                return None
            # An end marker without a finish reason: a lax server, not a cut answer.
            log.warning("upstream sent [DONE] without a finish reason; taken as stop")
            self.finished = True
            return Delta(finish="stop")
        try:
            chunk = json.loads(value.decode("utf-8"))
        except UnicodeDecodeError:
            raise self._error("sent a data line that is not UTF-8") from None
        except ValueError:
            # Keep-alive pings and the like; not logged whole, as it may hold answer text.
            log.debug("upstream sent an event that is not JSON; skipped")
            return None
        if not isinstance(chunk, dict):
            return None
        if chunk.get("error") is not None:
            raise self._error(f"sent an error mid-stream: {_detail(chunk, '')}")
        try:
            delta = _to_delta(chunk, self._kind)
        except ValueError as exc:
            raise self._error(f"sent malformed data ({exc})") from None
        if delta is not None and delta.finish is not None:
            self.finished = True
        return delta


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
            reader = _EventReader(self, kind, shown)
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
        message = f"upstream {shown} answered HTTP {status}: {hint}{_detail(body, text)}"
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
