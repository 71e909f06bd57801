"""A fake OpenAI-compatible server for tests: what a remote worker's upstream looks like.

It runs in the test's own process, on 127.0.0.1 and a free port, on an event loop in a
background thread, and speaks HTTP/1.1 by hand (one request per connection) so it needs
nothing installed. ``mode`` may be changed at any time; each request reads it once:

- ``ok``: the reply streamed a word at a time ("echo: " + the last message, or the prompt)
- ``status_400`` / ``status_401`` / ``status_429`` / ``status_500``: that status with an
  OpenAI-style error body (401's message echoes the key, as a careless server might)
- ``error_mid_stream``: two deltas, then an error event
- ``stall``: two deltas, then nothing until the client leaves (or 60 s)
- ``close_early``: two deltas, then the connection is closed mid-body
- ``refuse_then_ok``: the first ``refusals`` requests (any path) since the mode was set
  get ``refusal_status`` (503 unless set), then all is ``ok``
- ``slow``: 100 deltas, one every 0.2 s (for tests that stop reading)

The status and trouble modes apply to the completion endpoints; GET /v1/models always
answers (but for ``refuse_then_ok``). A request without ``"stream": true`` gets the whole
chat.completion / text_completion object. What came in is kept in ``requests`` (POST
bodies), ``headers`` and ``paths`` (every request); ``disconnects`` counts the clients
that left while a streamed reply was still being written.

    with FakeUpstream() as up:
        settings = UpstreamSettings(url=up.url)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
from typing import Any

__all__ = ["FakeUpstream"]

DELTAS_BEFORE_TROUBLE = 2
FLOOD_DELTAS = 2000
SLOW_DELTAS = 100
SLOW_EVERY_S = 0.2
STALL_S = 60.0
_MESSAGES = {
    400: "max_tokens is out of range (the fake was told to refuse)",
    429: "Rate limit reached; slow down",
    500: "the fake upstream failed on purpose",
    503: "the fake upstream is not ready yet",
}
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found"}


def _content_text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of parts."""
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


class FakeUpstream:
    def __init__(self, mode: str = "ok", *, model_id: str = "fake-model") -> None:
        self._refused = 0
        self._mode = mode
        self.model_id = model_id
        self.refusals = 2
        self.refusal_status = 503
        self.requests: list[dict[str, Any]] = []  # the JSON bodies of the POSTs
        self.headers: list[dict[str, str]] = []  # every request's headers, lowercase names
        self.paths: list[str] = []  # every request, as "GET /v1/models"
        self.disconnects = 0
        self.port = 0
        self._changed = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None  # the thread's, once it runs
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._run, name="fake-upstream", daemon=True)
        self._ready = threading.Event()

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        # Each switch to refuse_then_ok refuses afresh: a test sharing one fake with
        # earlier ones still sees its ``refusals``.
        self._refused = 0
        self._mode = mode

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> FakeUpstream:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> FakeUpstream:
        self._thread.start()
        if not self._ready.wait(10) or self._server is None:
            self.stop()
            raise RuntimeError("the fake upstream did not start")
        return self

    def stop(self) -> None:
        """Close every connection and the listening socket, and end the thread."""
        if self._loop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def wait_disconnect(self, timeout: float, count: int = 1) -> bool:
        """Whether ``count`` clients have left mid-reply, waiting up to ``timeout`` s."""
        with self._changed:
            return self._changed.wait_for(lambda: self.disconnects >= count, timeout)

    def _run(self) -> None:
        self._loop = loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            self._server = loop.run_until_complete(
                asyncio.start_server(self._handle, "127.0.0.1", 0)
            )
            self.port = int(self._server.sockets[0].getsockname()[1])
            self._ready.set()
            loop.run_forever()
            loop.run_until_complete(self._shutdown())
        finally:
            self._ready.set()
            loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._handlers:
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the client left before its request was whole
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        request_line, *lines = head.split("\r\n")
        method, target, _ = request_line.split(" ", 2)
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            if name:
                headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        raw = await reader.readexactly(length) if length else b""
        path = target.split("?", 1)[0]
        self.paths.append(f"{method} {path}")
        self.headers.append(headers)
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            return await self._reply(writer, 400, {"error": {"message": "body is not JSON"}})
        if method == "POST":
            self.requests.append(body)
        mode = self.mode
        if mode == "refuse_then_ok" and self._refused < self.refusals:
            self._refused += 1
            return await self._error(writer, self.refusal_status, headers)
        if method == "GET" and path == "/v1/models":
            models = [{"id": self.model_id, "object": "model", "owned_by": "fake"}]
            return await self._reply(writer, 200, {"object": "list", "data": models})
        kind = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}.get(path)
        if method != "POST" or kind is None:
            return await self._reply(writer, 404, {"error": {"message": f"no route {path}"}})
        if mode.startswith("status_"):
            return await self._error(writer, int(mode.removeprefix("status_")), headers)
        await _Reply(self, reader, writer, kind, body, mode).send()

    async def _error(
        self, writer: asyncio.StreamWriter, status: int, headers: dict[str, str]
    ) -> None:
        message = _MESSAGES.get(status, "error")
        if status == 401:
            key = headers.get("authorization", "").removeprefix("Bearer ")
            message = f"Incorrect API key provided: {key}"
        kind = "invalid_request_error" if status < 500 else "server_error"
        await self._reply(writer, status, {"error": {"message": message, "type": kind}})

    async def _reply(self, writer: asyncio.StreamWriter, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        reason = _REASONS.get(status, "Error")
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        await writer.drain()

    def _count_disconnect(self) -> None:
        with self._changed:
            self.disconnects += 1
            self._changed.notify_all()


class _Reply:
    """One answer to a chat or completion request, streamed or whole."""

    def __init__(
        self,
        fake: FakeUpstream,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        kind: str,
        body: dict[str, Any],
        mode: str,
    ) -> None:
        self.fake, self.writer, self.kind, self.body, self.mode = fake, writer, kind, body, mode
        # The client sends nothing more: this read ends only when it closes the connection.
        self.gone = asyncio.ensure_future(reader.read(1))
        self.model = body.get("model") or fake.model_id
        if kind == "chat":
            messages = body.get("messages") or [{}]
            texts = [_content_text(m.get("content")) for m in messages if isinstance(m, dict)]
            last = texts[-1] if texts else ""
        else:
            prompt = body.get("prompt", "")
            texts = [prompt if isinstance(prompt, str) else " ".join(map(str, prompt))]
            last = texts[0]
        self.prompt_tokens = sum(len(t.split()) for t in texts)
        self.pieces = re.findall(r"\s*\S+", "echo: " + last)
        self.finish = "stop"
        limit = body.get("max_tokens") or body.get("max_completion_tokens")
        if isinstance(limit, int) and limit < len(self.pieces):
            self.pieces, self.finish = self.pieces[:limit], "length"

    def _chunk(self, text: str | None, finish: str | None = None) -> dict[str, Any]:
        kind = self.kind
        if kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {} if text is None else {"content": text},
            }
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update(logprobs=None, finish_reason=finish)
        return {
            "id": "chatcmpl-fake" if kind == "chat" else "cmpl-fake",
            "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
        }

    def _usage(self, sent: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": sent,
            "total_tokens": self.prompt_tokens + sent,
        }

    async def send(self) -> None:
        try:
            if not self.body.get("stream"):
                return await self._whole()
            self.writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n"
                b"Connection: close\r\n\r\n"
            )
            if await self._events():
                # The body's last chunk: a client may well have left after [DONE], which
                # is no disconnect mid-reply.
                with contextlib.suppress(ConnectionError):
                    self.writer.write(b"0\r\n\r\n")
                    await self.writer.drain()
        finally:
            self.gone.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await self.gone

    async def _events(self) -> bool:
        """Stream the events; False when the reply ends without the body's last chunk."""
        if self.mode == "slow":
            self.pieces, self.finish = [f" w{i}" for i in range(SLOW_DELTAS)], "stop"
        if self.mode == "flood":  # a server that does not stop at max_tokens
            self.pieces, self.finish = [f" w{i}" for i in range(FLOOD_DELTAS)], "stop"
        options = self.body.get("stream_options") or {}
        usage = bool(options.get("include_usage"))
        # A comment first, as proxies send to keep connections open: clients must skip it.
        if not await self._write(b": keep-alive\n\n"):
            return False
        role = self._chunk(None) | ({"usage": None} if usage else {})
        if self.kind == "chat":
            role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        if not await self._event(role):
            return False
        troubled = self.mode in ("error_mid_stream", "stall", "close_early")
        pieces = (self.pieces * 2)[:DELTAS_BEFORE_TROUBLE] if troubled else self.pieces
        for index, piece in enumerate(pieces):
            if self.mode == "slow" and index and not await self._pause(SLOW_EVERY_S):
                return False
            if not await self._event(self._chunk(piece)):
                return False
        if troubled:
            return await self._trouble()
        if not await self._event(self._chunk(None, self.finish)):
            return False
        if usage:
            tail = {**self._chunk(None), "choices": [], "usage": self._usage(len(self.pieces))}
            if not await self._event(tail):
                return False
        return await self._write(b"data: [DONE]\n\n")

    async def _trouble(self) -> bool:
        if self.mode == "error_mid_stream":
            error = {"error": {"message": "boom", "type": "server_error"}}
            return await self._event(error)
        if self.mode == "stall":
            await self._pause(STALL_S)
        return False  # close_early: the body ends without its last chunk

    async def _event(self, obj: dict[str, Any]) -> bool:
        return await self._write(f"data: {json.dumps(obj)}\n\n".encode())

    async def _write(self, data: bytes) -> bool:
        """Write one chunk of the body; False (and a disconnect counted) if the client left."""
        if self.gone.done():
            self.fake._count_disconnect()
            return False
        try:
            self.writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await self.writer.drain()
        except ConnectionError:
            self.fake._count_disconnect()
            return False
        return True

    async def _pause(self, seconds: float) -> bool:
        """Wait; False (and a disconnect counted) as soon as the client leaves."""
        await asyncio.wait({self.gone}, timeout=seconds)
        if self.gone.done():
            self.fake._count_disconnect()
            return False
        return True

    async def _whole(self) -> None:
        text = "".join(self.pieces)
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=self.finish)
        answer = {
            "id": "chatcmpl-fake" if self.kind == "chat" else "cmpl-fake",
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": self._usage(len(self.pieces)),
        }
        await self.fake._reply(self.writer, 200, answer)
