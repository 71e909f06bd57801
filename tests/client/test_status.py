"""`zmqllm status`: fetching the broker's status over a DEALER and printing it as tables.

No torch here: the CLI's status command runs without the ML stack.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from zmqllm.bus.messages import (
    Error,
    ErrorCode,
    Heartbeat,
    Message,
    SessionError,
    Status,
    StatusReply,
)
from zmqllm.bus.protocol import MAX_FRAMES, decode, encode
from zmqllm.bus.wire_types import Payload
from zmqllm.cli import main
from zmqllm.client.status import fetch_status, format_status

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
            "peer": "tcp://127.0.0.1:40001",
            # --layers auto: what it measured of itself before loading
            "measured": {"ms_1": 0.95, "ms_16": 19.9, "memory_bytes": 4 << 30, "rtt_ms": 0.31},
            "stats": {"mean_batch": 2.5, "prefix_query_tokens": 300, "prefix_hit_tokens": 256},
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
        "prefix",
        "hit",
        "speculation",
        "heartbeat",
        "state",
        "peer",
        "link",
        "measured",
    ]
    assert line_with(out, "w-host-0-15 ").split() == [
        "w-host-0-15",
        "0:15",
        "3/64",
        "900/65536",
        "0.05",
        "2.5",
        "256/300",  # prompt tokens found in the prefix cache / looked up
        "-",  # no speculation
        "0.4s",
        "serving",
        "tcp://127.0.0.1:40001",
        # ms per layer at 1/16 rows, the memory it may use, its round trip to the broker
        "0.95/19.9",
        "ms,",
        "4.0",
        "GiB,",
        "rtt",
        "0.31",
        "ms",
    ]
    busy = line_with(out, "w-host-15-30 ")
    assert busy.split() == [
        "w-host-15-30",
        "15:30",
        "0/8",
        "0/4096",
        "0.00",
        "-",
        "-",  # no prefix cache (or an older worker)
        "-",  # no speculation
        "1.0s",
        "draining",
        "-",  # no peer link (or an older worker)
        "-",  # measured nothing: started with a range
    ]
    # Columns line up: each cell starts where its header does.
    assert busy.index("15:30") == header.index("layers")
    assert busy.index("draining") == header.index("state")


def test_format_status_groups_the_workers_of_several_models() -> None:
    remote = dict(SAMPLE["workers"][1], id="w-remote", layers=[0, 1], model="chat-api")
    workers = [dict(w, model="big") for w in SAMPLE["workers"]] + [remote]
    models = [
        {
            "name": "big",
            "text_model": False,
            "num_layers": 30,
            "complete_route": True,
            "routes": [["0:15", "15:30"]],
        },
        {
            "name": "chat-api",
            "text_model": True,
            "num_layers": 1,
            "complete_route": False,
            "uncovered": "0:1",
            "routes": [],
        },
    ]
    out = format_status(dict(SAMPLE, workers=workers, models=models))
    lines = out.splitlines()
    assert "models 2" in lines[0]
    big = lines.index("model big  30 layers  complete route: yes")
    api = lines.index("model chat-api  remote (text)  complete route: NO (missing 0:1)")
    assert big < api
    assert any(line.startswith("w-host-0-15") for line in lines[big:api])
    assert not any(line.startswith("w-remote") for line in lines[big:api])
    assert any(line.startswith("w-remote") for line in lines[api:])
    assert "routes: 0:15 -> 15:30" in lines[big:api]


def test_format_status_prints_pools_and_counters() -> None:
    out = format_status(SAMPLE)
    assert line_with(out, "15:30 ").split() == ["15:30", "w-host-15-30,", "w-other-15-30"]
    assert "sessions_opened 7" in out
    assert "dropped_messages 1" in out


def test_format_status_of_an_empty_broker() -> None:
    out = format_status({"complete_route": False})
    assert "complete route: NO" in out
    assert out.count("(none)") == 3  # no workers, no pools, no routes


def test_format_status_shows_entries_of_another_shape_as_unknown() -> None:
    odd = {
        "workers": [SAMPLE["workers"][0], {"id": "w-new"}, "w-str"],
        "pools": [{"layers": 3}],
        "routes": "not a list",
        "counters": ["not", "a", "map"],
    }
    out = format_status(odd)
    assert line_with(out, "w-host-0-15 ").split()[1] == "0:15"
    assert out.count("?  ") >= 2  # the two odd workers, cell by cell
    assert "routes (chains of pools covering every layer)\n  (none)" in out


@pytest.fixture
def router() -> Iterator[zmq.Socket]:
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    yield sock
    sock.close(linger=0)


Reply = Callable[[str], Message]


def serve_once(sock: zmq.Socket, reply: Reply) -> threading.Thread:
    """Answer one STATUS with ``reply(request_id)``, after noise the client must skip."""

    def answer() -> None:
        if not sock.poll(10_000):
            return
        identity, *frames = sock.recv_multipart()
        asked = decode(frames)
        assert isinstance(asked, Status)
        noise: list[list[Any]] = [
            [b"\xc1"],  # not msgpack
            [b"\x00"] * (MAX_FRAMES + 5),  # more frames than any message has
            encode(Heartbeat(boot="x")),
            encode(StatusReply.of({}, request_id="stale")),
            encode(Error.of(ErrorCode.INTERNAL, "for another request", request_id="other")),
        ]
        for frames_out in noise:
            sock.send_multipart([identity, *frames_out])
        sock.send_multipart([identity, *encode(reply(asked.request_id))])

    # The socket is used by this thread only until join: no two threads touch it at once.
    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


def fetch_answered(router: zmq.Socket, reply: Reply) -> dict[str, Any]:
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)
    thread = serve_once(router, reply)
    try:
        return fetch_status(address, timeout=10.0)
    finally:
        thread.join(timeout=15.0)
        assert not thread.is_alive()


def test_fetch_status_returns_the_reply(router: zmq.Socket) -> None:
    got = fetch_answered(router, lambda key: StatusReply.of(SAMPLE, request_id=key))
    assert got == SAMPLE


def test_fetch_status_times_out(router: zmq.Socket) -> None:
    # Bound but never read: the request goes out, no answer comes back.
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)
    with pytest.raises(TimeoutError, match="no answer"):
        fetch_status(address, timeout=0.2)


def test_a_status_reply_that_is_not_msgpack_is_a_clear_error(router: zmq.Socket) -> None:
    def bad(key: str) -> Message:
        body = np.frombuffer(b"\xc1\xc1", np.uint8)
        return StatusReply(request_id=key, body=Payload(body, "uint8"))

    with pytest.raises(SessionError, match="unreadable status") as info:
        fetch_answered(router, bad)
    assert info.value.code is ErrorCode.INTERNAL


def test_an_error_answer_raises_its_code(router: zmq.Socket) -> None:
    def refuse(key: str) -> Message:
        return Error.of(ErrorCode.BUSY, "too many status requests", request_id=key)

    with pytest.raises(SessionError, match="too many status requests") as info:
        fetch_answered(router, refuse)
    assert info.value.code is ErrorCode.BUSY


# A worker's build with a screen-clearing sequence in it, and a C1 CSI in a worker's name.
HOSTILE_DRIFT = [
    {
        "model": "m\x1b]0;title\x07",
        "layers": [0, 4],
        "field": "torch",
        "values": {"2.13.0\x1b[2J": ["w0"], "2.12.1": ["w1\x9b2J"], "(not sent)": ["w2"]},
    }
]


@pytest.mark.parametrize("only_drift", [True, False])
def test_status_prints_what_workers_sent_escaped(
    router: zmq.Socket,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    only_drift: bool,
) -> None:
    """`zmqllm status --drift` (and the full status) never hands the terminal an escape."""
    monkeypatch.setenv("ZMQLLM_HOME", str(tmp_path))  # no keys, no `zmqllm up` state
    hostile = {**SAMPLE, "drift": HOSTILE_DRIFT}
    hostile["workers"] = [{**SAMPLE["workers"][0], "id": "w\x1b[2J", "peer": "\x1bc"}]
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)
    thread = serve_once(router, lambda key: StatusReply.of(hostile, request_id=key))
    argv = ["status", "--broker", address, "--insecure", "--timeout", "10"]
    code = main([*argv, "--drift"] if only_drift else argv)
    thread.join(timeout=15.0)
    out = capsys.readouterr().out
    assert code == (1 if only_drift else 0)
    assert not any(c in out for c in "\x1b\x07\x9b")
    assert (
        "  model m\\x1b]0;title\\x07 layers 0:4  torch differs: 2.13.0\\x1b[2J: w0; "
        "2.12.1: w1\\x9b2J; (not sent): w2"
    ) in out.splitlines()
    if not only_drift:
        assert "w\\x1b[2J" in out and "\\x1bc" in out  # the worker table's cells too


def test_a_last_stage_that_speculates_shows_its_acceptance() -> None:
    stats = {"spec_proposed": 40, "spec_accepted": 30, "spec_tokens_per_pass": 2.5}
    worker = dict(SAMPLE["workers"][0], stats={**SAMPLE["workers"][0]["stats"], **stats})
    out = format_status({**SAMPLE, "workers": [worker]})
    assert "30/40, 2.50 tok/pass" in line_with(out, "w-host-0-15 ")
