"""Structured logging: JSON lines, request binding, stdlib routing, levels (no torch)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import warnings
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
import structlog

from zmqllm.log import bind_request, configure_logging, get_logger, new_request_id, printable


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """Undo what configure_logging does to process-wide state, for the other test files."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


def lines_of(stream: io.StringIO) -> list[dict[str, Any]]:
    text = stream.getvalue()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_json_lines_have_the_core_keys() -> None:
    stream = io.StringIO()
    configure_logging("broker", stream=stream)
    log = get_logger("zmqllm.broker")
    log.info("worker registered", worker="w1", layers=[0, 15])
    log.warning("queue full", size=256)
    records = lines_of(stream)
    assert len(records) == 2
    for record in records:
        assert {"timestamp", "level", "service", "event"} <= record.keys()
        assert record["service"] == "broker"
        assert record["logger"] == "zmqllm.broker"
        # Keys a reader scans first come first.
        assert list(record)[:4] == ["timestamp", "level", "service", "event"]
    first = records[0]
    assert first["event"] == "worker registered"
    assert first["level"] == "info"
    assert first["worker"] == "w1" and first["layers"] == [0, 15]
    assert records[1]["level"] == "warning"
    stamp = datetime.fromisoformat(first["timestamp"].replace("Z", "+00:00"))
    assert stamp.utcoffset() == timedelta(0)


def test_unserializable_values_do_not_break_the_line() -> None:
    stream = io.StringIO()
    configure_logging("gateway", fmt="json", stream=stream)
    get_logger().info("odd value", value=object(), raw=b"\x00")
    (record,) = lines_of(stream)
    assert "object" in record["value"]


def test_bound_request_id_only_inside_the_block() -> None:
    stream = io.StringIO()
    configure_logging("gateway", stream=stream)
    log = get_logger()
    request_id = new_request_id()
    log.info("before")
    with bind_request(request_id, session="s1", model="tiny"):
        log.info("inside")
        logging.getLogger("uvicorn.error").info("stdlib inside")
    log.info("after")
    before, inside, stdlib_inside, after = lines_of(stream)
    assert "request_id" not in before
    assert inside["request_id"] == request_id
    assert inside["session"] == "s1" and inside["model"] == "tiny"
    assert stdlib_inside["request_id"] == request_id
    assert "request_id" not in after and "session" not in after


def test_bind_request_without_session_omits_it() -> None:
    stream = io.StringIO()
    configure_logging("gateway", stream=stream)
    with bind_request("r1"):
        get_logger().info("x")
    (record,) = lines_of(stream)
    assert record["request_id"] == "r1" and "session" not in record


def test_bind_request_nests_and_restores() -> None:
    stream = io.StringIO()
    configure_logging("gateway", stream=stream)
    log = get_logger()
    with bind_request("outer"):
        with bind_request("inner"):
            log.info("a")
        log.info("b")
    assert [r["request_id"] for r in lines_of(stream)] == ["inner", "outer"]


def test_concurrent_tasks_keep_their_own_request_ids() -> None:
    stream = io.StringIO()
    configure_logging("gateway", stream=stream)
    log = get_logger()

    async def handle(request_id: str) -> None:
        with bind_request(request_id):
            await asyncio.sleep(0)
            log.info("step", expect=request_id)
            await asyncio.sleep(0)
            log.info("step", expect=request_id)

    async def main() -> None:
        await asyncio.gather(*(handle(f"r{i}") for i in range(5)))

    asyncio.run(main())
    records = lines_of(stream)
    assert len(records) == 10
    assert all(r["request_id"] == r["expect"] for r in records)


def test_new_request_id() -> None:
    ids = {new_request_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)


def test_stdlib_logging_is_json_too() -> None:
    stream = io.StringIO()
    configure_logging("gateway", stream=stream)
    logging.getLogger("uvicorn.access").info("%s %s %d", "GET", "/v1/models", 200)
    logging.getLogger().warning("plain root")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("deprecated thing", DeprecationWarning, stacklevel=1)
    access, root, warned = lines_of(stream)
    assert access["event"] == "GET /v1/models 200"
    assert access["level"] == "info"
    assert access["service"] == "gateway"
    assert access["logger"] == "uvicorn.access"
    assert "timestamp" in access
    assert root["level"] == "warning" and root["event"] == "plain root"
    assert warned["logger"] == "py.warnings" and "deprecated thing" in warned["event"]


def test_self_handling_library_loggers_are_routed_through_root() -> None:
    # uvicorn's own config gives its loggers handlers and propagate = False.
    uvicorn_logger = logging.getLogger("uvicorn.error")
    own = logging.StreamHandler(io.StringIO())
    uvicorn_logger.addHandler(own)
    uvicorn_logger.propagate = False
    stream = io.StringIO()
    try:
        configure_logging("gateway", stream=stream)
        uvicorn_logger.info("Uvicorn running")
        (record,) = lines_of(stream)
        assert record["event"] == "Uvicorn running"
    finally:
        uvicorn_logger.removeHandler(own)
        uvicorn_logger.propagate = True


def test_exceptions_are_structured() -> None:
    stream = io.StringIO()
    configure_logging("worker", stream=stream)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        get_logger().exception("step failed")
        logging.getLogger("some.lib").exception("lib failed")
    ours, theirs = lines_of(stream)
    for record in (ours, theirs):
        assert record["level"] == "error"
        assert "boom" in json.dumps(record["exception"])


def test_level_filtering() -> None:
    stream = io.StringIO()
    configure_logging("worker", level="info", stream=stream)
    log = get_logger()
    log.debug("hidden")
    logging.getLogger("lib").debug("hidden too")
    log.info("shown")
    assert [r["event"] for r in lines_of(stream)] == ["shown"]

    stream = io.StringIO()
    configure_logging("worker", level="debug", stream=stream)
    log.debug("now shown")
    logging.getLogger("lib").debug("lib shown")
    assert [r["event"] for r in lines_of(stream)] == ["now shown", "lib shown"]

    stream = io.StringIO()
    configure_logging("worker", level="ERROR", stream=stream)
    log.warning("hidden")
    log.error("shown")
    assert [r["event"] for r in lines_of(stream)] == ["shown"]


def test_reconfigure_replaces_output_and_handler() -> None:
    first, second = io.StringIO(), io.StringIO()
    log = get_logger("early")  # created before configuration, as module-level loggers are
    configure_logging("a", stream=first)
    configure_logging("b", stream=second)
    log.info("x")
    logging.getLogger("lib").info("y")
    assert first.getvalue() == ""
    assert [(r["service"], r["event"]) for r in lines_of(second)] == [("b", "x"), ("b", "y")]


def test_console_format_is_human_text() -> None:
    stream = io.StringIO()
    configure_logging("broker", fmt="console", stream=stream)
    get_logger().info("worker registered", worker="w1")
    logging.getLogger("lib").info("from stdlib")
    text = stream.getvalue()
    assert "worker registered" in text and "worker=w1" in text and "from stdlib" in text
    assert "\x1b[" not in text  # no colour codes when the stream is not a terminal
    for line in text.splitlines():
        with pytest.raises(json.JSONDecodeError):
            json.loads(line)


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_format_follows_the_stream() -> None:
    tty = FakeTty()
    configure_logging("broker", fmt="auto", stream=tty)
    get_logger().info("hello")
    with pytest.raises(json.JSONDecodeError):
        json.loads(tty.getvalue().splitlines()[0])

    pipe = io.StringIO()
    configure_logging("broker", fmt="auto", stream=pipe)
    get_logger().info("hello")
    assert lines_of(pipe)[0]["event"] == "hello"


def test_default_stream_is_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("broker", fmt="auto")
    get_logger().info("to stderr")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert json.loads(captured.err.splitlines()[-1])["event"] == "to stderr"


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="level"):
        configure_logging("x", level="loud")
    with pytest.raises(ValueError, match="format"):
        configure_logging("x", fmt="xml")


def _fail_holding_a_secret() -> None:
    prompt = "the user's secret prompt text"  # a local a traceback with locals would show
    raise RuntimeError(f"failed after {len(prompt)} characters")


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_tracebacks_carry_no_locals(fmt: str) -> None:
    stream = io.StringIO()
    configure_logging("gateway", fmt=fmt, stream=stream)
    try:
        _fail_holding_a_secret()
    except RuntimeError:
        get_logger().exception("request failed")
        logging.getLogger("some.lib").exception("lib failed")
    text = stream.getvalue()
    # The traceback is there (the failing function, its message) ...
    assert text.count("_fail_holding_a_secret") >= 2
    assert "failed after 29 characters" in text
    # ... but not the values of its variables.
    assert "secret prompt" not in text
    if fmt == "json":
        for record in lines_of(stream):
            for exc in record["exception"]:
                assert all("locals" not in frame for frame in exc["frames"])


def test_printable_escapes_every_control_character() -> None:
    # C0 (ESC, BEL, CR, newline, tab), DEL and C1 (0x9b is CSI by itself) all escaped.
    assert printable("a\x1b[2Jb\x07\r\n\t\x7f\x9b31m\x85z") == (
        "a\\x1b[2Jb\\x07\\r\\n\\t\\x7f\\x9b31m\\x85z"
    )
    assert printable("plain text, ünïcode, 中文 and \\ stay") == (
        "plain text, ünïcode, 中文 and \\ stay"
    )
    assert printable("one\x1b[Kline\ntwo\r", keep_newlines=True) == "one\\x1b[Kline\ntwo\\r"


class Raises(Exception):
    def __str__(self) -> str:
        return "peer said \x1b]0;pwned\x07"


def test_console_format_escapes_what_a_peer_or_client_sent() -> None:
    """A build string, a refused Host, a library's line, an exception's message: shown
    escaped on a terminal, never acted on."""
    stream = FakeTty()  # the console format with colours, as a terminal gets it
    configure_logging("gateway", fmt="console", stream=stream)
    log = get_logger("zmqllm.gateway")
    log.info("request refused: Host not allowed", host="evil\x1b[2J\x9b2J.example")
    log.info("worker registered \x1b[2J", build={"torch": "2.13\x1b[2J"}, said=b"\x1b[2J")
    logging.getLogger("uvicorn.access").info('"GET /\x1b[2J HTTP/1.1" 404')
    try:
        raise Raises()
    except Raises:
        log.exception("failed")
    text = stream.getvalue()
    assert "\x1b[2J" not in text and "\x9b" not in text and "\x1b]0" not in text
    assert "evil\\x1b[2J\\x9b2J.example" in text
    assert "worker registered \\x1b[2J" in text and "2.13\\x1b[2J" in text
    assert "GET /\\x1b[2J HTTP/1.1" in text
    assert "peer said \\x1b]0;pwned\\x07" in text
    assert "\x1b[" in text  # the renderer's own colours are still there
    assert "Traceback (most recent call last):\n" in text  # still lines of their own


def test_json_format_escapes_control_characters_by_itself() -> None:
    stream = io.StringIO()
    configure_logging("gateway", stream=stream)
    get_logger().info("request refused: Host not allowed", host="evil\x1b[2J\x9b.example")
    assert "\x1b" not in stream.getvalue() and "\x9b" not in stream.getvalue()
    assert lines_of(stream)[0]["host"] == "evil\x1b[2J\x9b.example"
