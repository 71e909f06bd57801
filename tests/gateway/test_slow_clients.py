"""Clients that read their response too slowly, or not at all (issue 40, items 1 and 2).

First the rule itself (``WriteProgress``, plain numbers), then the kernel's figures it is
fed with, then a real uvicorn configured as the gateway runs it, on the fake broker: a
client that reads nothing while its whole stream fits the kernel's buffers, and one that
reads a little every so often, are both cut and their generations cancelled. Windows
here are short so the tests are quick; the waits around them are generous.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from tests.fake_broker_client import FakeBrokerClient, Script
from tests.gateway.support import make_app, tiny_tokenizer, wait_for
from zmqllm.gateway.http_server import uvicorn_config
from zmqllm.gateway.write_progress import (
    WriteProgress,
    bound_send_buffer,
    unsent_in_kernel,
)
from zmqllm.models.tokenizer import Tokenizer

W = 30.0  # the policy tests' window (write_timeout)
LIMIT = 256 * 1024  # their max_unread_bytes
KIB = 1024
WRITE_TIMEOUT = 1.0  # the served tests'
SLACK = 20.0  # how long past its deadline an effect may take to be seen: the machine is shared

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="SIOCOUTQ is Linux's")


# --- the rule ----------------------------------------------------------------------------


def run(progress: WriteProgress, samples: Iterator[tuple[float, int, int]]) -> float | None:
    """Feed (time, delivered, unread) samples; the time of the cut, or None."""
    for now, delivered, unread in samples:
        if progress.observe(now, delivered, unread) is not None:
            return now
    return None


def test_a_client_that_reads_nothing_is_cut_one_window_after_falling_behind() -> None:
    progress = WriteProgress(W, LIMIT)
    # 20 KB a second written, 4 KiB taken once (its receive buffer), then nothing.
    samples = ((float(t), 4 * KIB, 20_000 * t) for t in range(1, 200))
    first_behind = next(t for t in range(1, 200) if 20_000 * t > LIMIT)
    cut = run(progress, samples)
    assert cut == first_behind + W
    stalled = WriteProgress(W, LIMIT).observe(0, 0, LIMIT + 1)
    assert stalled is None  # behind, but not yet for a window


def test_a_trickle_that_resumes_the_writes_does_not_keep_a_connection() -> None:
    """48 KiB every 30 s (each read would resume paused writes): cut after one window."""
    progress = WriteProgress(W, LIMIT)
    delivered = 0
    for t in range(1, 400):
        if t % 30 == 0:
            delivered += 48 * KIB
        stalled = progress.observe(float(t), delivered, 300 * KIB)
        if stalled is not None:
            assert t == 31 and stalled.delivered == 48 * KIB and stalled.required == LIMIT
            assert stalled.behind_for == W and stalled.unread == 300 * KIB
            return
    pytest.fail("the trickle was never cut")


def test_a_client_that_takes_enough_each_window_is_never_cut() -> None:
    """Behind for ten minutes (a slow link under a fast stream), taking 10 KB a second."""
    progress = WriteProgress(W, LIMIT)
    assert run(progress, ((t / 2, 5_000 * t, 2 * LIMIT) for t in range(1200))) is None
    assert progress.behind


def test_what_was_taken_early_slides_out_of_the_window() -> None:
    """A big receive buffer filled at once, then nothing: cut once that fill is a window old."""
    progress = WriteProgress(W, LIMIT)
    samples = [(0.0, 0, 2 * LIMIT), (1.0, 4 * LIMIT, 2 * LIMIT)]
    samples += [(float(t), 4 * LIMIT, 2 * LIMIT) for t in range(2, 100)]
    assert run(progress, iter(samples)) == 1.0 + W


def test_catching_up_starts_the_window_afresh() -> None:
    progress = WriteProgress(W, LIMIT)
    assert progress.observe(0.0, 0, 2 * LIMIT) is None
    assert progress.observe(29.0, 0, 2 * LIMIT) is None
    assert progress.observe(29.5, 2 * LIMIT, LIMIT) is None  # all but the limit taken
    assert not progress.behind
    assert progress.observe(30.0, 2 * LIMIT, 2 * LIMIT) is None
    assert progress.observe(59.9, 2 * LIMIT, 2 * LIMIT) is None
    assert progress.observe(60.0, 2 * LIMIT, 2 * LIMIT) is not None


def test_paused_writes_count_as_behind_whatever_the_count() -> None:
    """Where the kernel cannot count, the transport's pause is the sign."""
    progress = WriteProgress(W, LIMIT)
    assert progress.observe(0.0, 0, 70 * KIB, paused=True) is None
    assert progress.observe(W, 0, 70 * KIB, paused=True) is not None


def test_the_rule_needs_a_window_and_a_limit() -> None:
    with pytest.raises(ValueError):
        WriteProgress(0.0, LIMIT)
    with pytest.raises(ValueError):
        WriteProgress(W, 0)


# --- the kernel's figures ------------------------------------------------------------------


@contextlib.contextmanager
def tcp_pair(rcvbuf: int = 0) -> Iterator[tuple[socket.socket, socket.socket]]:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.socket()
    if rcvbuf:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    client.connect(listener.getsockname())
    server, _ = listener.accept()
    try:
        yield server, client
    finally:
        for sock in (server, client, listener):
            sock.close()


@linux_only
def test_the_kernel_says_how_much_the_peer_has_not_taken() -> None:
    with tcp_pair(rcvbuf=2048) as (server, client):
        assert unsent_in_kernel(server) == 0
        bound_send_buffer(server, 64 * KIB)
        assert server.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) <= 2 * 64 * KIB
        server.setblocking(False)
        sent = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                sent += server.send(b"x" * 4096)
        # All but the client's small receive buffer is still the kernel's.
        queued = unsent_in_kernel(server)
        assert queued is not None and sent - 16 * KIB <= queued <= sent
        taken = 0
        client.settimeout(5)
        while taken < sent:
            taken += len(client.recv(65536))
        wait_for(lambda: unsent_in_kernel(server) == 0)


def test_a_closed_socket_has_no_count() -> None:
    sock = socket.socket()
    sock.close()
    assert unsent_in_kernel(sock) is None


# --- served --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


def long_script(tok: Tokenizer, tokens: int, delay: float) -> Script:
    words = tok.encode(" once upon a time there was a robot")
    return Script((words * (tokens // len(words) + 1))[:tokens], delay=delay)


@contextlib.contextmanager
def served(app: Any, listener_sndbuf: int = 0) -> Iterator[int]:
    """``app`` under uvicorn as the gateway runs it, in a thread; yields the port. A
    listener send buffer is inherited by every accepted socket."""
    sock = socket.socket()
    if listener_sndbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, listener_sndbuf)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn_config(app, app.state.gateway.settings)
    config.lifespan = "on"
    config.timeout_graceful_shutdown = 1
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])))
    thread.start()
    try:
        wait_for(lambda: server.started, timeout=SLACK)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=SLACK)
        sock.close()


def post_stream(port: int, request_id: str, body: dict[str, Any], rcvbuf: int) -> socket.socket:
    """Send a streamed chat request with a small receive buffer (set before connecting,
    so the window it offers stays small); read nothing of the answer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    data = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "stream": True, **body})
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Request-ID: {request_id}"
        f"\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data.encode())
    return sock


def events(log: io.StringIO, event: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in log.getvalue().splitlines() if line.strip()]
    return [line for line in lines if line.get("event") == event]


def cut_lines(log: io.StringIO, request_id: str) -> list[dict[str, Any]]:
    return [
        line
        for line in events(log, "client read nothing for write_timeout: connection aborted")
        + events(log, "client read too slowly for write_timeout: connection aborted")
        if line["request_id"] == request_id
    ]


@pytest.mark.parametrize("logprobs", [False, True], ids=["plain", "logprobs"])
def test_a_stream_that_fits_the_kernel_buffers_is_cut_when_nobody_reads(
    tok: Tokenizer, log_stream: io.StringIO, logprobs: bool
) -> None:
    """~400 KB streamed over several seconds (~2 MB with logprobs) to a client that reads
    nothing: without logprobs it all fits the buffers Linux gives a loopback connection,
    so the writes never paused and the stream ran to its end holding its slot."""
    fake = FakeBrokerClient(long_script(tok, 1900, delay=0.004))
    app = make_app(fake, tok, write_timeout=WRITE_TIMEOUT, max_unread_bytes=64 * KIB)
    body: dict[str, Any] = {"max_tokens": 1900, "ignore_eos": True}
    if logprobs:
        body |= {"logprobs": True, "top_logprobs": 5}
    with served(app) as port:
        sock = post_stream(port, "never-reads", body, rcvbuf=2048)
        try:
            # The generation cancelled, its slot freed.
            wait_for(lambda: fake.cancels != [], timeout=WRITE_TIMEOUT + SLACK)
            wait_for(lambda: fake.open_streams == set(), timeout=SLACK)
            wait_for(lambda: events(log_stream, "request finished"), timeout=SLACK)
        finally:
            sock.close()
    (cut,) = cut_lines(log_stream, "never-reads")
    assert cut["level"] == "warning" and cut["unread_bytes"] > 64 * KIB
    (finished,) = events(log_stream, "request finished")
    assert finished["request_id"] == "never-reads" and finished["error"] == "write_timeout"
    assert finished["generated_tokens"] < 1900


def test_a_reader_that_trickles_is_cut_by_what_it_takes_over_the_window(
    tok: Tokenizer, log_stream: io.StringIO
) -> None:
    """16 KiB every quarter second, against a floor of 256 KiB a window. The listener's
    small send buffer is what the issue saw: each read lets the paused writes resume, and a
    deadline reset on every resume never came."""
    fake = FakeBrokerClient(long_script(tok, 1900, delay=0.0))
    app = make_app(fake, tok, write_timeout=WRITE_TIMEOUT, max_unread_bytes=256 * KIB)
    # ~10 MB: far more than the reader takes before the test gives up on it.
    body = {"n": 8, "max_tokens": 1900, "ignore_eos": True, "logprobs": True, "top_logprobs": 5}
    with served(app, listener_sndbuf=16 * KIB) as port:
        sock = post_stream(port, "trickles", body, rcvbuf=2048)
        taken, outcome = 0, "alive"
        deadline = time.monotonic() + 4 * WRITE_TIMEOUT + SLACK
        sock.settimeout(SLACK)
        try:
            while time.monotonic() < deadline and outcome == "alive":
                want = 16 * KIB
                while want > 0:
                    piece = sock.recv(want)
                    if not piece:
                        outcome = "closed"
                        break
                    taken, want = taken + len(piece), want - len(piece)
                time.sleep(0.25)
        except ConnectionResetError:
            outcome = "reset"
        finally:
            sock.close()
        assert outcome == "reset", f"{outcome} after taking {taken} bytes"
        wait_for(lambda: fake.cancels != [], timeout=SLACK)
    (cut,) = cut_lines(log_stream, "trickles")
    assert cut["event"].startswith("client read too slowly")
    assert 0 < cut["delivered_bytes"] < cut["required_bytes"] == 256 * KIB


def test_readers_that_keep_up_are_left_alone(tok: Tokenizer, log_stream: io.StringIO) -> None:
    fake = FakeBrokerClient(long_script(tok, 1900, delay=0.0))
    # A longer window than the others': the reader shares this process's time with the server.
    app = make_app(fake, tok, write_timeout=3.0, max_unread_bytes=16 * KIB)
    body = {"max_tokens": 1900, "ignore_eos": True, "logprobs": True, "top_logprobs": 5}
    with served(app) as port:
        sock = post_stream(port, "keeps-up", body, rcvbuf=2048)
        data = bytearray()
        sock.settimeout(SLACK)
        try:
            while not data.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):  # chunked
                piece = sock.recv(65536)
                assert piece, "closed before the end"
                data += piece
        finally:
            sock.close()
    assert fake.cancels == [] and cut_lines(log_stream, "keeps-up") == []


def test_max_unread_bytes_below_a_kernel_buffer_is_refused(tok: Tokenizer) -> None:
    from zmqllm.config.settings import ConfigError

    app = make_app(FakeBrokerClient(), tok, max_unread_bytes=100)
    with pytest.raises(ConfigError, match="max_unread_bytes"):
        uvicorn_config(app, app.state.gateway.settings)
