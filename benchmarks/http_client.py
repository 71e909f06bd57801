"""The one HTTP client of the benchmarks: a streamed OpenAI-compatible request, timed.

A ``RequestInput`` says what to ask (``/v1/completions`` with a prompt, or
``/v1/chat/completions`` with messages) and where; ``stream`` sends it and fills a
``RequestOutput``: when it was sent, when each token event arrived, the text, and the
token counts of the closing usage event. Any server that speaks the OpenAI streaming
format will do: the gateway, vLLM, llama.cpp's server. ``run`` and ``run_all`` are the
blocking forms for the scripts.

A token event is one whose choice carries text (``text``, or ``delta.content`` in a
chat): the chat's opening event (the role), the closing one (``finish_reason``) and the
usage event are no tokens. The gateway sends one event per token.

Only the standard library: compare_revisions.py imports this into a process whose
``zmqllm`` is an older tree's.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

__all__ = ["RequestInput", "RequestOutput", "netns_socket", "run", "run_all", "stream"]


@dataclass
class RequestInput:
    url: str  # the endpoint: http://127.0.0.1:PORT/v1/completions or .../chat/completions
    prompt: str | None = None  # /v1/completions
    messages: list[dict[str, str]] | None = None  # /v1/chat/completions
    max_tokens: int = 16
    ignore_eos: bool = False  # sent only when true
    temperature: float | None = None  # None: the server's default
    model: str | None = None  # None: the server's only (or default) model
    extra: dict[str, Any] = field(default_factory=dict)  # more fields of the body
    timeout: float = 600.0  # seconds without a byte before the request fails
    # Makes the connected socket to send on instead of one to the URL's host (from
    # inside a testbed host: see netns_socket); the URL still gives path and Host.
    connect: Callable[[], socket.socket] | None = None

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"max_tokens": self.max_tokens, "stream": True}
        out["stream_options"] = {"include_usage": True}
        if self.messages is not None:
            out["messages"] = self.messages
        else:
            out["prompt"] = self.prompt
        if self.ignore_eos:
            out["ignore_eos"] = True
        if self.temperature is not None:
            out["temperature"] = self.temperature
        if self.model is not None:
            out["model"] = self.model
        return {**out, **self.extra}


@dataclass
class RequestOutput:
    """One request's times (``time.perf_counter`` seconds) and what came back. Also
    filled by the in-process baselines (the engine, HF ``generate``), which have no HTTP:
    ``start`` and ``stamps`` are all the figures need."""

    ok: bool = False
    error: str = ""
    start: float = 0.0  # when the request was sent
    stamps: list[float] = field(default_factory=list)  # arrival of each token event
    end: float = 0.0  # arrival of the stream's last event (0: none came)
    pieces: list[str] = field(default_factory=list)  # each token event's text
    prompt_tokens: int = 0  # from the usage event (0: the server sent none)
    completion_tokens: int = 0

    @property
    def ttft(self) -> float:
        """Seconds from the request to the first token (nan: no token)."""
        return self.stamps[0] - self.start if self.stamps else float("nan")

    @property
    def itl(self) -> list[float]:
        """Seconds between consecutive token events."""
        return [b - a for a, b in itertools.pairwise(self.stamps)]

    @property
    def latency(self) -> float:
        """Seconds from the request to the end of its stream (the last token where no
        end was stamped: the in-process baselines). A token without text of its own (a
        partial character) sends no event, but the stream still ends after it."""
        end = self.end or (self.stamps[-1] if self.stamps else 0.0)
        return end - self.start if end else float("nan")

    @property
    def generated_tokens(self) -> int:
        return len(self.stamps)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def netns_socket(conn: http.client.HTTPConnection) -> socket.socket:
    """The socket ``conn`` connects the way it does (testbed.hosts.NetnsHTTPConnection:
    inside a test host), taken from it for ``RequestInput.connect``."""
    conn.connect()
    sock = conn.sock
    conn.sock = None
    assert isinstance(sock, socket.socket)
    return sock


async def _open(
    inp: RequestInput,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str, str]:
    url = urlsplit(inp.url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    if inp.connect is not None:
        reader, writer = await asyncio.open_connection(sock=inp.connect())
    else:
        reader, writer = await asyncio.open_connection(host, port)
    return reader, writer, f"{host}:{port}", url.path or "/"


async def _head(reader: asyncio.StreamReader, timeout: float) -> tuple[int, dict[str, str]]:
    status_line = await asyncio.wait_for(reader.readline(), timeout)
    parts = status_line.split(None, 2)
    if len(parts) < 2:
        raise ConnectionError(f"no HTTP status line: {status_line[:200]!r}")
    headers: dict[str, str] = {}
    while (line := await asyncio.wait_for(reader.readline(), timeout)) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _pieces(
    reader: asyncio.StreamReader, headers: dict[str, str], timeout: float
) -> AsyncIterator[bytes]:
    """The body as it arrives, undoing chunked transfer encoding."""
    if headers.get("transfer-encoding", "").lower() != "chunked":
        while piece := await asyncio.wait_for(reader.read(65536), timeout):
            yield piece
        return
    while True:
        size = int((await asyncio.wait_for(reader.readline(), timeout)).split(b";")[0], 16)
        if size == 0:
            return
        piece = await asyncio.wait_for(reader.readexactly(size + 2), timeout)  # + CRLF
        yield piece[:-2]


def _event(out: RequestOutput, data: dict[str, Any], now: float) -> bool:
    """Take one event into ``out``; False when it is the stream's error."""
    if "error" in data:
        error = data["error"]
        out.error = str(error.get("message", error) if isinstance(error, dict) else error)
        return False
    if usage := data.get("usage"):
        out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        out.completion_tokens = int(usage.get("completion_tokens") or 0)
    for choice in data.get("choices") or ():
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            out.stamps.append(now)
            out.pieces.append(text)
            break  # one choice asked: one token per event
    return True


async def stream(
    inp: RequestInput, on_token: Callable[[RequestOutput], None] | None = None
) -> RequestOutput:
    """Send ``inp`` and read its stream to the end; ``on_token(out)`` after each token
    event (it may block: the next events wait in the socket). A failure (HTTP status,
    an error event, a broken connection) comes back as ``ok=False`` with its message."""
    out = RequestOutput()
    payload = json.dumps(inp.body()).encode()
    writer = None
    try:
        out.start = time.perf_counter()  # the connection is part of the request's time
        reader, writer, host, path = await _open(inp)
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
            + payload
        )
        await writer.drain()
        status, headers = await _head(reader, inp.timeout)
        if status != 200:
            out.error = f"HTTP {status}: {(await reader.read(500))!r}"
            return out
        buf = b""
        async for piece in _pieces(reader, headers, inp.timeout):
            now = time.perf_counter()
            buf = (buf + piece).replace(b"\r\n", b"\n")
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue  # comments, event names
                    out.end = now
                    data = line[5:].strip()
                    if not data.startswith(b"{"):
                        continue  # [DONE]
                    before = len(out.stamps)
                    if not _event(out, json.loads(data), now):
                        return out
                    if on_token is not None and len(out.stamps) > before:
                        on_token(out)
        out.ok = True
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        if writer is not None:
            writer.close()
    return out


def run(
    inp: RequestInput, on_token: Callable[[RequestOutput], None] | None = None
) -> RequestOutput:
    """``stream`` from blocking code; raises on a failed request."""
    out = asyncio.run(stream(inp, on_token))
    if not out.ok:
        raise RuntimeError(f"the stream failed: {out.error}")
    return out


def run_all(inputs: Sequence[RequestInput]) -> list[RequestOutput]:
    """All of ``inputs`` at once; raises on a failed request."""

    async def together() -> list[RequestOutput]:
        return list(await asyncio.gather(*(stream(i) for i in inputs)))

    outs = asyncio.run(together())
    for out in outs:
        if not out.ok:
            raise RuntimeError(f"a stream failed: {out.error}")
    return outs
