"""Clients that stop reading their answers, as the tests of the gateway's write bounds
make them (tests/e2e/test_operations.py, tests/e2e/test_slow_clients.py): raw sockets,
so the receive buffer, and so the window the client offers, stays as small as set."""

from __future__ import annotations

import json
import socket
from typing import Any

__all__ = ["ended_by_server", "non_reader"]


def non_reader(
    port: int, body: dict[str, Any], *, rcvbuf: int = 4096, request_id: str | None = None
) -> socket.socket:
    """A client that POSTs ``body`` to /v1/chat/completions and then reads nothing, its
    receive buffer ``rcvbuf`` bytes (set before connecting, so its window stays small)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    named = f"X-Request-ID: {request_id}\r\n" if request_id else ""
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{named}"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def ended_by_server(sock: socket.socket, timeout: float) -> bool:
    """Read (at last) whatever the server sent; True once it ends in EOF or a reset."""
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 20):
            pass
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True
