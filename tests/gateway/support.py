"""Helpers shared by the gateway tests (this file holds no tests of its own).

Two ways to reach the app: httpx's ASGITransport (fast, in the test's event loop, but it
buffers each response whole) and a real uvicorn on a free 127.0.0.1 port in a thread, for
what only real HTTP shows: chunks arriving while the answer is produced, a client
disconnecting, the ``openai`` package's own transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI

from tests.fake_broker_client import FakeBrokerClient, Script
from zmqllm.config.settings import GatewaySettings
from zmqllm.gateway.app import create_app
from zmqllm.gateway.http_server import uvicorn_config
from zmqllm.models.tiny_tokenizer import EOS_TOKEN, write_tiny_tokenizer
from zmqllm.models.tokenizer import Tokenizer

MODEL = "tiny-test"
CONTEXT = 2048
ANSWER = "The capital of France is Paris."
CHAT_ANSWER = ANSWER + "\n"  # what /chat sends: the answer, then a newline


def tiny_tokenizer(directory: Path) -> Tokenizer:
    write_tiny_tokenizer(directory)
    return Tokenizer.from_dir(directory)


def eos_id(tok: Tokenizer) -> int:
    token = tok.token_to_id(EOS_TOKEN)
    assert token is not None
    return token


def answer_script(tok: Tokenizer, text: str = ANSWER, delay: float = 0.0) -> Script:
    return Script([*tok.encode(text), eos_id(tok)], delay=delay)


# The tests' requests name the gateway "gw" (httpx's base_url, post_raw); served ones
# reach it at 127.0.0.1.
TEST_HOSTS = "gw, 127.0.0.1, localhost"


def make_app(
    fake: FakeBrokerClient,
    tok: Tokenizer,
    *,
    context_length: int = CONTEXT,
    **settings: Any,
) -> FastAPI:
    """The gateway app on ``fake``. Failover is off unless a test turns it on: a failure
    the fake scripts is then the stream's end, as the error tests expect (tests of the
    replay give ``failover_retries``)."""
    settings.setdefault("failover_retries", 0)
    settings.setdefault("allowed_hosts", TEST_HOSTS)
    return create_app(
        fake,
        GatewaySettings(**settings),
        tok,
        MODEL,
        context_length,
        ready_poll_interval=0.01,
        ready_recheck_interval=0.02,
    )


def sse_data(body: str) -> list[str]:
    """The ``data:`` payloads of a server-sent-events body, in order."""
    events = [block for block in body.split("\n\n") if block]
    out = []
    for event in events:
        assert event.startswith("data: "), event
        out.append(event[len("data: ") :])
    assert body.endswith("\n\n")
    return out


def sse_json(body: str, done: bool = True) -> list[dict[str, Any]]:
    """The JSON events; a whole stream ends with ``[DONE]``, a failed one (``done=False``)
    at its error event without it."""
    data = sse_data(body)
    if done:
        assert data[-1] == "[DONE]"
        data = data[:-1]
    else:
        assert "[DONE]" not in data
    return [json.loads(item) for item in data]


async def post_raw(app: Any, path: str, body: bytes) -> tuple[int, str, bool]:
    """POST ``body`` to the ASGI app directly: (status, body text, whether the response
    was completed). httpx's ASGITransport refuses a response left incomplete, which is
    how /chat ends a stream that failed after its headers went out."""
    status, chunks, complete = 0, [], False
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays; the app cancels this wait
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, complete
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            complete = complete or not message.get("more_body", False)

    route, _, query = path.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": route,
        "raw_path": route.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(b"host", b"gw"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 50000),
        "server": ("gw", 80),
        "state": {},
    }
    await app(scope, receive, send)
    return status, b"".join(chunks).decode(), complete


def wait_for(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail("condition not reached in time")
        time.sleep(0.01)


@contextlib.contextmanager
def serving(app: FastAPI) -> Iterator[tuple[str, uvicorn.Server]]:
    """Serve ``app`` on a free port in a thread, configured as ``zmqllm gateway`` runs it
    (the app's GatewaySettings); yield its base URL and the server."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn_config(app, app.state.gateway.settings)
    config.lifespan = "on"
    config.timeout_graceful_shutdown = 2
    server = uvicorn.Server(config)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(server.serve(sockets=[sock]))
        except BaseException as exc:  # surfaced in the test thread below
            errors.append(exc)

    thread = threading.Thread(target=run, name="uvicorn-test", daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or errors or not thread.is_alive())
        if errors:
            raise errors[0]
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@contextlib.contextmanager
def running_server(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free port in a thread; yield its base URL."""
    with serving(app) as (url, _server):
        yield url
