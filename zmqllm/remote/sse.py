"""An OpenAI-compatible stream's server-sent events to ``Delta`` pieces, in time linear in
the bytes received: what ``upstream.Upstream`` reads its answers with.

The bytes are hostile (a broken proxy, a fuzzer, a server that never ends an event): each
byte is searched for line ends once and JSON-decoded at most twice, one event holds at
most ``MAX_EVENT_BYTES`` of data, and a line at most as much. What the stream does wrong
is a ``StreamFault`` whose ``reason`` is a short slug fit for a log (the message may quote
the upstream, and is for the client). No torch here, no HTTP either.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from zmqllm.log import get_logger

__all__ = [
    "MAX_EVENT_BYTES",
    "Delta",
    "EventReader",
    "StreamFault",
    "error_detail",
    "utf8",
]

log = get_logger("zmqllm.worker")

# The most data one event (and any one line) may hold: an answer's chunk is a few hundred
# bytes; past this the stream fails, as does the session it feeds, and the worker goes on.
MAX_EVENT_BYTES = 1 << 20
MAX_DETAIL_CHARS = 600  # the upstream's own words, leaving room for the URL in a message
MAX_FINISH_CHARS = 32
_LINE_END = re.compile(rb"\r\n|\r|\n")
_SIZE = f"{MAX_EVENT_BYTES / (1 << 20):g} MiB"
# What an event's data decodes to besides a JSON value; and "not decoded yet".
_DONE = object()
_NOT_JSON = object()
_UNDECODED = object()


@dataclass
class Delta:
    text: str = ""
    finish: str | None = None  # "stop", "length", or the upstream's own reason
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class StreamFault(Exception):
    """What a stream did wrong: ``reason`` a slug for logs, the message one for clients."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def utf8(text: str) -> str:
    # JSON may carry a lone surrogate ("\ud800"), which no UTF-8 wire can carry: the
    # message holding it could not be sent, and its session would fail for one character.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def error_detail(body: Any, raw: str) -> str:
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
    finish = utf8(reason[:MAX_FINISH_CHARS]) if reason else None
    tokens = _count(usage, "prompt_tokens"), _count(usage, "completion_tokens")
    delta = Delta(utf8(text) if text else "", finish, *tokens)
    return delta if delta != Delta() else None


def _decode(value: bytes) -> Any:
    """An event's data: _DONE, a JSON value, or _NOT_JSON (a keep-alive ping, say)."""
    if value.strip() == b"[DONE]":
        return _DONE
    try:
        return json.loads(value.decode("utf-8"))
    except UnicodeDecodeError:
        raise StreamFault("not_utf8", "sent a data line that is not UTF-8") from None
    except RecursionError:
        # "[[[[..." a megabyte deep: the decoder's own recursion limit, not ours to raise.
        raise StreamFault("malformed", "sent malformed data (JSON nested too deep)") from None
    except ValueError:
        return _NOT_JSON


class EventReader:
    """Bytes of a server-sent event stream to deltas. An event's ``data:`` lines are
    joined with newlines and the event is read at its blank line, as the SSE spec says
    (a JSON document may be split over several lines). A server that leaves out the
    blank lines still streams when its events are one data line each (as such servers
    send them): a data line after an event's only line, when that line is already a whole
    JSON document (or [DONE]), starts the next event. Only an event's first line is ever
    tried alone, once: trying the whole event so far at every line was quadratic."""

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._pending = bytearray()  # the start of a line not yet ended
        self._after_cr = False  # the last bytes ended in "\r": a "\n" next is its pair
        self._data: list[bytes] = []  # the data lines of the event being read
        self._data_bytes = 0
        self.finished = False  # a finish reason came
        self.done = False  # "data: [DONE]" came

    def feed(self, data: bytes) -> Iterator[Delta]:
        # A generator, so the deltas before a bad line still go out ahead of its error.
        if not data:
            return
        if self._after_cr and data.startswith(b"\n"):
            data = data[1:]  # "\r\n" split between two reads is one line end, not two
        self._after_cr = data.endswith(b"\r")
        if _LINE_END.search(data) is None:
            # Only new bytes are searched: a long line arriving in many pieces stays linear.
            self._hold(data)
            return
        *lines, rest = _LINE_END.split(bytes(self._pending) + data)
        self._pending = bytearray()
        for line in lines:
            if self.done:
                return
            if len(line) > MAX_EVENT_BYTES:
                raise self._too_large("a line")
            yield from self._take_line(line)
        self._hold(rest)

    def end(self) -> Iterator[Delta]:
        """At EOF: what a last line without a line end holds; raises if the answer is cut."""
        if self._pending and not self.done:
            yield from self._take_line(bytes(self._pending))
        if self._data and not self.done:
            yield from self._dispatch()
        if not self.finished:
            raise StreamFault("cut", "the stream ended before the answer finished")

    def _hold(self, data: bytes) -> None:
        self._pending += data
        if len(self._pending) > MAX_EVENT_BYTES:
            raise self._too_large("a line")

    def _too_large(self, what: str) -> StreamFault:
        limit = f"over {_SIZE} (the most one event may hold)"
        return StreamFault("event_too_large", f"sent {what} {limit}")

    def _take_line(self, line: bytes) -> Iterator[Delta]:
        if not line:  # a blank line ends the event
            yield from self._dispatch()
            return
        name, _, value = line.partition(b":")
        # ":" starts a comment; event:, id:, retry: mean nothing here.
        if name != b"data":
            return
        if len(self._data) == 1:
            # No blank line came between two events? Asked once per event, of one line.
            first = _decode(self._data[0])
            if first is not _NOT_JSON:
                yield from self._dispatch(first)
        value = value.removeprefix(b" ")
        self._data_bytes += len(value) + 1
        if self._data_bytes > MAX_EVENT_BYTES:
            raise self._too_large("an event")
        self._data.append(value)

    def _dispatch(self, decoded: Any = _UNDECODED) -> Iterator[Delta]:
        """The event read so far as its delta; ``decoded``: its data, when already decoded."""
        lines, self._data, self._data_bytes = self._data, [], 0
        if not lines or self.done:
            return
        if decoded is _UNDECODED:
            decoded = _decode(lines[0] if len(lines) == 1 else b"\n".join(lines))
        delta = self._event(decoded)
        if delta is not None:
            yield delta

    def _event(self, decoded: Any) -> Delta | None:
        if decoded is _DONE:
            self.done = True
            if self.finished:
                return None
            # An end marker without a finish reason: a lax server, not a cut answer.
            log.warning("upstream sent [DONE] without a finish reason; taken as stop")
            self.finished = True
            return Delta(finish="stop")
        if decoded is _NOT_JSON:
            # Keep-alive pings and the like; not logged whole, as it may hold answer text.
            log.debug("upstream sent an event that is not JSON; skipped")
            return None
        if not isinstance(decoded, dict):
            return None
        if decoded.get("error") is not None:
            detail = error_detail(decoded, "")
            raise StreamFault("error_event", f"sent an error mid-stream: {detail}")
        try:
            delta = _to_delta(decoded, self._kind)
        except ValueError as exc:
            raise StreamFault("malformed", f"sent malformed data ({exc})") from None
        if delta is not None and delta.finish is not None:
            self.finished = True
        return delta
