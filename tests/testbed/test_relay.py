"""The delaying TCP relay (testbed/relay.py): its delay rule apart from the sockets, and
a real relay process between a client and an echo server on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.relay import Delay, DelayLine

REPO = Path(__file__).resolve().parents[2]
DELAY_MS = 20.0


def test_each_piece_is_due_its_delay_after_it_came_not_after_the_one_before() -> None:
    line = DelayLine(10.0)
    for t, data in ((0.0, b"a"), (1.0, b"bb"), (2.0, b"ccc")):
        line.put(data, t)
    assert line.queued == 6
    assert line.next_due() == 10.0
    assert line.take_due(9.99) == b""
    assert line.take_due(10.0) == b"a"
    # Both younger pieces are due by 12, not at 20 and 30 as they would be if each
    # waited for the one before it.
    assert line.next_due() == 11.0
    assert line.take_due(12.0) == b"bbccc"
    assert line.next_due() is None and line.queued == 0


def test_a_delay_file_is_followed_as_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "delay-ms"
    path.write_text("5")
    delay = Delay(0.0, path)
    assert delay.seconds == 0.005  # read at once
    path.with_suffix(".tmp").write_text("20")
    path.with_suffix(".tmp").replace(path)
    deadline = time.monotonic() + 10
    while delay.seconds != 0.02 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert delay.seconds == 0.02
    path.write_text("not a number")  # kept: a half-written file must not zero the delay
    time.sleep(0.2)
    assert delay.seconds == 0.02


class Echo:
    """A server on 127.0.0.1 that sends back what it gets, then closes when the client
    half-closes; ``reset`` makes it drop the next connection with a reset instead."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.reset = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            if self.reset:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00" * 2)
                conn.close()
                continue
            with conn:
                while data := conn.recv(1 << 16):
                    conn.sendall(data)


@pytest.fixture
def relayed() -> Iterator[tuple[Echo, int]]:
    echo = Echo()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "testbed.relay", "--listen", "127.0.0.1:0"]
    cmd += ["--to", f"127.0.0.1:{echo.port}", "--delay-ms", str(DELAY_MS)]
    relay = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert relay.stdout is not None
        line = relay.stdout.readline()
        assert line.startswith("relay listening on 127.0.0.1:"), line
        yield echo, int(line.rsplit(":", 1)[1])
    finally:
        relay.kill()
        relay.wait(timeout=10)
        echo.server.close()


def receive(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        piece = sock.recv(1 << 20)
        assert piece, "closed early"
        out += piece
    return bytes(out)


def test_bytes_go_both_ways_whole_and_in_order(relayed: tuple[Echo, int]) -> None:
    _, port = relayed
    data = os.urandom(4 << 20)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sender = threading.Thread(target=sock.sendall, args=(data,))
        sender.start()
        assert receive(sock, len(data)) == data
        sender.join()
        # A half-close goes through: the echo server sees EOF, closes, and so do we.
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(1) == b""


def test_nothing_comes_back_before_the_delay_each_way(relayed: tuple[Echo, int]) -> None:
    _, port = relayed
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(3):
            sent = time.monotonic()
            sock.sendall(b"ping")
            assert receive(sock, 4) == b"ping"
            # The delay is what the relay is for, so here time is the behaviour under test:
            # a lower bound only (a delay line may be late on a busy machine, never early).
            assert time.monotonic() - sent >= 2 * DELAY_MS / 1000


def test_a_reset_on_one_side_closes_the_other(relayed: tuple[Echo, int]) -> None:
    echo, port = relayed
    echo.reset = True
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    with sock, contextlib.suppress(ConnectionResetError):
        assert sock.recv(1) == b""
