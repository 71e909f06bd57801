"""`zmqllm status`: fetching the broker's status over a DEALER and printing it as tables.

No torch here: the CLI's status command runs without the ML stack.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from zmqllm.protocol import Header, MsgType, decode, encode
from zmqllm.status import fetch_status, format_status

SAMPLE: dict[str, Any] = {
    "boot": "abc123",
    "version": "0.1.0",
    "uptime_s": 12.5,
    "num_layers": 30,
    "complete_route": True,
    "queue": 2,
    "sessions": 3,
    "workers": [
        {
            "id": "w-host-0-15",
            "layers": [0, 15],
            "sessions": 3,
            "capacity": 64,
            "kv_tokens_reserved": 900,
            "max_kv_tokens": 65536,
            "load": 0.0469,
            "last_heartbeat_s": 0.42,
            "draining": False,
            "stats": {"mean_batch": 2.5},
        },
        {
            "id": "w-host-15-30",
            "layers": [15, 30],
            "sessions": 0,
            "capacity": 8,
            "kv_tokens_reserved": 0,
            "max_kv_tokens": 4096,
            "load": 0.0,
            "last_heartbeat_s": 1.0,
            "draining": True,
            "stats": {},
        },
    ],
    "pools": [
        {"layers": [0, 15], "workers": ["w-host-0-15"]},
        {"layers": [15, 30], "workers": ["w-host-15-30", "w-other-15-30"]},
    ],
    "counters": {"sessions_opened": 7, "tokens": 99, "dropped_messages": 1},
}


def line_with(text: str, needle: str) -> str:
    """The one line of ``text`` that starts with ``needle`` (a table row's first cell)."""
    (line,) = [line for line in text.splitlines() if line.startswith(needle)]
    return line


def test_format_status_prints_the_summary_line() -> None:
    out = format_status(SAMPLE)
    first = out.splitlines()[0]
    for part in ["abc123", "0.1.0", "layers 30", "complete route: yes", "sessions 3", "queue 2"]:
        assert part in first


def test_format_status_prints_the_worker_table() -> None:
    out = format_status(SAMPLE)
    header = line_with(out, "id ")
    assert header.split() == [
        "id",
        "layers",
        "sessions",
        "kv",
        "tokens",
        "load",
        "mean",
        "batch",
        "heartbeat",
        "state",
    ]
    assert line_with(out, "w-host-0-15 ").split() == [
        "w-host-0-15",
        "0:15",
        "3/64",
        "900/65536",
        "0.05",
        "2.5",
        "0.4s",
        "serving",
    ]
    busy = line_with(out, "w-host-15-30 ")
    assert busy.split() == [
        "w-host-15-30",
        "15:30",
        "0/8",
        "0/4096",
        "0.00",
        "-",
        "1.0s",
        "draining",
    ]
    # Columns line up: each cell starts where its header does.
    assert busy.index("15:30") == header.index("layers")
    assert busy.index("draining") == header.index("state")


def test_format_status_prints_pools_and_counters() -> None:
    out = format_status(SAMPLE)
    assert line_with(out, "15:30 ").split() == ["15:30", "w-host-15-30,", "w-other-15-30"]
    assert "sessions_opened 7" in out
    assert "dropped_messages 1" in out


def test_format_status_of_an_empty_broker() -> None:
    out = format_status({"complete_route": False})
    assert "complete route: NO" in out
    assert out.count("(none)") == 3  # no workers, no pools, no routes


@pytest.fixture
def router() -> Iterator[zmq.Socket]:
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    yield sock
    sock.close(linger=0)


def serve_once(sock: zmq.Socket, status: dict[str, Any]) -> threading.Thread:
    """Answer one STATUS: first with noise the client must skip, then the real reply."""

    def answer() -> None:
        if not sock.poll(10_000):
            return
        identity, *frames = sock.recv_multipart()
        asked, _ = decode(frames)
        assert asked.type is MsgType.STATUS
        noise: list[list[Any]] = [
            [b"\xc1"],  # not msgpack
            encode(Header(MsgType.HEARTBEAT, fields={"boot": "x"})),
            encode(Header(MsgType.STATUS_REPLY, request_id="stale", fields={"status": {}})),
        ]
        for frames_out in noise:
            sock.send_multipart([identity, *frames_out])
        reply = Header(MsgType.STATUS_REPLY, request_id=asked.request_id, fields={"status": status})
        sock.send_multipart([identity, *encode(reply)])

    # The socket is used by this thread only until join: no two threads touch it at once.
    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


def test_fetch_status_returns_the_reply(router: zmq.Socket) -> None:
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)
    thread = serve_once(router, SAMPLE)
    try:
        assert fetch_status(address, timeout=10.0) == SAMPLE
    finally:
        thread.join(timeout=15.0)
    assert not thread.is_alive()


def test_fetch_status_times_out(router: zmq.Socket) -> None:
    # Bound but never read: the request goes out, no answer comes back.
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)
    with pytest.raises(TimeoutError, match="no answer"):
        fetch_status(address, timeout=0.2)
