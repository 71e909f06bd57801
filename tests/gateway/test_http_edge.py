"""The HTTP edge under hostile clients, on a real uvicorn configured as the gateway runs it.

Slowloris: connections that send their headers a byte at a time must not keep others
out, and are closed at the header deadline; a body that trickles gets 408 at the body
deadline. The deadlines here are short so the tests are quick; the waits around them
are generous.
"""

from __future__ import annotations

import contextlib
import resource
import select
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from tests.fake_broker_client import FakeBrokerClient
from tests.gateway.support import (
    CHAT_ANSWER,
    answer_script,
    make_app,
    serving,
    tiny_tokenizer,
)
from zmqllm.models.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")

SLOW_CLIENTS = 500
HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 1.0
# How long a closed-by-the-server connection may take to be seen closed here, past its
# deadline: generous, the machine is shared.
SLACK = 20.0


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture
def enough_files() -> Iterator[None]:
    """Room for the slow clients' sockets and the server's ends of them (one process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * SLOW_CLIENTS + 256
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"needs {want} open files, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    sock.setblocking(False)
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the server has closed the connection (EOF or reset); never blocks."""
    # poll, not select: in a long test run these sockets' numbers pass select's 1024.
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    if not poller.poll(0):
        return False
    try:
        data = sock.recv(65536)
    except (ConnectionResetError, BrokenPipeError):
        return True
    except BlockingIOError:
        return False
    return data == b"" or closed_by_peer(sock)


def trickle(socks: list[socket.socket], byte: bytes = b"a") -> None:
    """One more byte on every connection still open (a header that never ends)."""
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.send(byte)


def read_response(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.setblocking(True)
    sock.settimeout(timeout)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_slow_header_clients_do_not_keep_others_out(tok: Tokenizer, enough_files: None) -> None:
    fake = FakeBrokerClient(answer_script(tok))
    app = make_app(fake, tok, header_timeout=HEADER_TIMEOUT)
    with serving(app) as (url, server):
        slow = []
        for _ in range(SLOW_CLIENTS):
            sock = connect(url)
            sock.send(b"POST /chat HTTP/1.1\r\nHost: gw\r\nX-Slow: ")
            slow.append(sock)
        try:
            deadline = time.monotonic() + SLACK
            while len(server.server_state.connections) < SLOW_CLIENTS:
                assert time.monotonic() < deadline, "the slow clients were not accepted"
                trickle(slow)
                time.sleep(0.05)
            # With every slow client connected and sending, a normal request is served.
            response = httpx.post(f"{url}/chat", content=b"Hi", timeout=SLACK)
            assert response.status_code == 200 and response.text == CHAT_ANSWER
            # And every slow client is cut off at the header deadline, trickle as it may.
            open_ = list(slow)
            deadline = time.monotonic() + HEADER_TIMEOUT + SLACK
            while open_:
                assert time.monotonic() < deadline, f"{len(open_)} slow clients still open"
                trickle(open_)
                open_ = [sock for sock in open_ if not closed_by_peer(sock)]
                time.sleep(0.1)
            assert len(server.server_state.connections) == 0
            assert fake.cancels == [] and len(fake.request_streams) == 1
        finally:
            for sock in slow:
                sock.close()


def test_the_header_deadline_applies_to_each_request_of_a_connection(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(answer_script(tok))
    app = make_app(fake, tok, header_timeout=HEADER_TIMEOUT, keep_alive_timeout=600)
    with serving(app) as (url, _server):
        sock = connect(url)
        try:
            sock.setblocking(True)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            # A second request on the same keep-alive connection that never ends its
            # headers: the long keep-alive timeout does not protect it.
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\nX-Slow: ")
            sock.setblocking(False)
            deadline = time.monotonic() + HEADER_TIMEOUT + SLACK
            while not closed_by_peer(sock):
                assert time.monotonic() < deadline, "the connection was not closed"
                trickle([sock])
                time.sleep(0.1)
        finally:
            sock.close()


def test_a_body_that_trickles_gets_408(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(answer_script(tok))
    app = make_app(fake, tok, body_timeout=BODY_TIMEOUT)
    with serving(app) as (url, _server):
        sock = connect(url)
        try:
            sock.setblocking(True)
            sock.sendall(b"POST /chat HTTP/1.1\r\nHost: gw\r\nContent-Length: 1000\r\n\r\nHi ")
            # A byte now and then keeps the connection busy but never completes the body.
            sock.setblocking(False)
            deadline = time.monotonic() + BODY_TIMEOUT + SLACK
            while not select.select([sock], [], [], 0.2)[0]:
                assert time.monotonic() < deadline, "no answer to a body that never ends"
                trickle([sock])
            answer = read_response(sock, SLACK)
        finally:
            sock.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408")
        assert b"connection: close" in head.lower()
        assert b'"code":"request_timeout"' in body
        assert b"did not arrive within 1 s" in body
        assert fake.request_streams == []  # it never reached the broker
        # The server serves normally after.
        assert httpx.post(f"{url}/chat", content=b"Hi", timeout=SLACK).text == CHAT_ANSWER
