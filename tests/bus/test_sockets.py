"""Socket-side helpers of the bus: bounded receives over real sockets, counted drops.

Log lines are captured as structlog event dicts (capture_logs), and rendered through
the JSON configuration every process uses where the rendered traceback matters.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog
import zmq
import zmq.asyncio
from structlog.testing import capture_logs

from zmqllm.bus import sockets as bus
from zmqllm.bus.sockets import (
    LOG_PER_SECOND,
    MAX_LOGGED_TEXT,
    Drops,
    recv_bounded,
    recv_bounded_async,
)
from zmqllm.log import configure_logging

Pair = tuple[zmq.Socket, zmq.Socket]


class Clock:
    """time.monotonic for the bus module, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    # bus reads time.monotonic through the time module: patched there for the test.
    monkeypatch.setattr(bus.time, "monotonic", c)
    return c


def wait_readable(sock: zmq.Socket) -> None:
    # inproc delivers at once; the poll only keeps a broken test from hanging.
    assert sock.poll(5000), "nothing arrived"


# -- recv_bounded --------------------------------------------------------------------------


def test_recv_bounded_returns_a_whole_message_as_frames(pair: Pair) -> None:
    a, b = pair
    a.send_multipart([b"head", b"", b"payload" * 1000])
    wait_readable(b)
    frames = recv_bounded(b, 3)
    assert frames is not None
    assert all(isinstance(f, zmq.Frame) for f in frames)  # not copied into bytes
    assert [f.bytes for f in frames] == [b"head", b"", b"payload" * 1000]


def test_recv_bounded_takes_a_message_of_exactly_the_limit(pair: Pair) -> None:
    a, b = pair
    a.send_multipart([b"1", b"2", b"3"])
    wait_readable(b)
    frames = recv_bounded(b, 3)
    assert frames is not None and [f.bytes for f in frames] == [b"1", b"2", b"3"]


@pytest.mark.parametrize("extra", [1, 10_000])
def test_recv_bounded_discards_an_over_long_message_and_keeps_the_next(
    pair: Pair, extra: int
) -> None:
    a, b = pair
    a.send_multipart([b"x"] * (3 + extra))
    a.send_multipart([b"next", b"one"])
    wait_readable(b)
    assert recv_bounded(b, 3) is None
    # Nothing of the long message is left behind: the next receive is the next message.
    frames = recv_bounded(b, 3)
    assert frames is not None and [f.bytes for f in frames] == [b"next", b"one"]
    with pytest.raises(zmq.Again):
        recv_bounded(b, 3)


def test_recv_bounded_raises_again_when_nothing_waits(pair: Pair) -> None:
    _, b = pair
    with pytest.raises(zmq.Again):
        recv_bounded(b, 3)


@pytest.mark.parametrize("extra", [0, 1, 10_000])
def test_recv_bounded_async_keeps_the_same_bound(extra: int) -> None:
    """The asyncio variant: the same messages kept and let go as recv_bounded."""

    async def main() -> list[list[bytes] | None]:
        ctx = zmq.asyncio.Context()
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        try:
            a.bind(f"inproc://bounded-async-{extra}")
            b.connect(f"inproc://bounded-async-{extra}")
            await a.send_multipart([b"x"] * (3 + extra))
            await a.send_multipart([b"next", b"one"])
            got = [await asyncio.wait_for(recv_bounded_async(b, 3), 5) for _ in range(2)]
            assert not await b.poll(0)  # nothing of the long message left behind
            return got
        finally:
            a.close(linger=0)
            b.close(linger=0)
            ctx.term()

    first, second = asyncio.run(main())
    assert first == (None if extra else [b"x"] * 3)
    assert second == [b"next", b"one"]


# -- Drops --------------------------------------------------------------------------------


def test_drops_count_by_reason(clock: Clock) -> None:
    drops = Drops("test")
    with capture_logs():
        for _ in range(3):
            drops.drop("frontend:malformed")
        drops.drop("backend:frames")
        drops.error("backend:token", RuntimeError("x"))
    assert drops.counts == {
        "frontend:malformed": 3,
        "backend:frames": 1,
        "error:backend:token": 1,
    }


def test_drop_logs_a_warning_with_its_details_cut_short(clock: Clock) -> None:
    drops = Drops("test")
    with capture_logs() as logs:
        drops.drop("frontend:malformed", peer="abc", error=ValueError("y" * 10_000))
    (line,) = logs
    assert line["log_level"] == "warning"
    assert line["reason"] == "frontend:malformed"
    assert line["peer"] == "abc"
    # A peer chooses the text: what is logged of it is bounded.
    assert line["error"] == "y" * MAX_LOGGED_TEXT


def test_drop_logging_is_rate_limited_per_reason_but_counting_is_not(clock: Clock) -> None:
    drops = Drops("test")
    with capture_logs() as logs:
        for _ in range(1000):
            drops.drop("flood")
        drops.drop("other")  # a flood of one reason does not hide another
    assert drops.counts["flood"] == 1000
    assert [x["reason"] for x in logs] == ["flood"] * LOG_PER_SECOND + ["other"]

    clock.now += 1.0  # the next second: a few more lines
    with capture_logs() as logs:
        for _ in range(1000):
            drops.drop("flood")
    assert len(logs) == LOG_PER_SECOND
    assert drops.counts["flood"] == 2000


def test_error_logs_the_exception_for_its_traceback(clock: Clock) -> None:
    drops = Drops("test")
    exc = RuntimeError("z" * 10_000)
    with capture_logs() as logs:
        drops.error("backend:token", exc)
    (line,) = logs
    assert line["log_level"] == "error"
    assert line["where"] == "backend:token"
    assert line["error"] == "RuntimeError"
    assert line["detail"] == "z" * MAX_LOGGED_TEXT
    assert line["exc_info"] is exc


def test_error_logging_is_rate_limited_too(clock: Clock) -> None:
    drops = Drops("test")
    with capture_logs() as logs:
        for _ in range(100):
            drops.error("backend:token", RuntimeError("again"))
    assert len(logs) == LOG_PER_SECOND
    assert drops.counts["error:backend:token"] == 100


@pytest.fixture
def json_logs() -> Iterator[io.StringIO]:
    """The JSON log configuration of every process, writing here; undone afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    out = io.StringIO()
    configure_logging("test", fmt="json", stream=out)
    yield out
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


def test_an_error_renders_a_traceback_without_locals_in_json_logs(
    json_logs: io.StringIO,
) -> None:
    # A handler's locals hold prompts and peer input: never in a log file.
    def handler(prompt: str) -> None:
        raise RuntimeError("a bug in a handler")

    try:
        handler("secret prompt text")
    except RuntimeError as exc:
        Drops("test").error("backend:token", exc)
    (line,) = [json.loads(x) for x in json_logs.getvalue().splitlines()]
    assert line["event"] == "error handling a message"
    assert line["level"] == "error"
    (trace,) = line["exception"]
    assert trace["exc_type"] == "RuntimeError"
    assert [f["name"] for f in trace["frames"]][-1] == "handler"
    assert all(not f.get("locals") for f in trace["frames"])
    assert "secret prompt text" not in json_logs.getvalue()
