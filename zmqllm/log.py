"""Structured logging shared by every zmqllm process.

Each process writes one JSON object per line on stderr with ``timestamp`` (ISO 8601, UTC),
``level``, ``service`` and ``event``, plus whatever is bound with ``bind_request``, so the
lines of one request can be followed across the gateway, the broker and the workers with
a single filter on ``request_id``. Records from the standard ``logging`` module (uvicorn,
asyncio, warnings) are rendered the same way, so nothing on stderr breaks the format.

Text from a peer or a client (a worker's build, a refused Host header) may hold terminal
escapes: ``printable`` writes control characters out as escapes, and the console format
(the one a terminal shows) passes every string value through it; JSON escapes them anyway.

This module runs in the broker and the gateway, so it must not import torch.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import uuid
from typing import Any, TextIO

import structlog
from structlog.tracebacks import ExceptionDictTransformer
from structlog.typing import (
    EventDict,
    ExcInfo,
    FilteringBoundLogger,
    Processor,
    WrappedLogger,
)

__all__ = [
    "KERNELS_BUILDING",
    "KERNELS_BUILT",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "bind_request",
    "configure_logging",
    "get_logger",
    "new_request_id",
    "printable",
]

LOG_LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
LOG_FORMATS = ("auto", "json", "console")

# Events another process looks for in a worker's log: `zmqllm up` tells its user while
# a worker compiles the kernels (engine/native.py logs them).
KERNELS_BUILDING = "building the compiled kernels"
KERNELS_BUILT = "compiled kernels built"

# Keys a reader scans first; the rest follow in the order they were bound.
_LEADING_KEYS = ("timestamp", "level", "service", "event")

# Loggers that install their own handlers and stop propagation; they are pointed back at
# the root handler so their lines come out in our format too.
_SELF_HANDLING_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


# C0 controls, DEL and C1 controls: what a terminal acts on instead of showing. ESC starts
# the sequences that clear the screen, move the cursor or retitle the window, 0x9b is CSI
# on its own, and CR or a newline can forge what looks like another line.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f]")
_NAMED_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# Values the console renderer prints as lines of their own: their newlines stay.
_LINES_KEYS = frozenset({"stack", "exception"})


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    return _NAMED_ESCAPES.get(char) or f"\\x{ord(char):02x}"


def printable(text: str, keep_newlines: bool = False) -> str:
    """``text`` with every control character (C0, DEL, C1) written out as an escape
    (``\\x1b``, ``\\n``, ``\\x9b``), so text from a peer or a client can be printed to a
    terminal as it is: no sequence in it reaches the terminal. ``keep_newlines`` keeps
    ``\\n`` for text of several lines (a log's tail, a table)."""
    if keep_newlines:
        return "\n".join(printable(line) for line in text.split("\n"))
    return _CONTROLS.sub(_escape, text)


def _escape_controls(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
    # Only str values: the console renderer shows every other value by its repr, which
    # escapes controls already.
    for key, value in event_dict.items():
        if isinstance(value, str):
            event_dict[key] = printable(value, keep_newlines=key in _LINES_KEYS)
    return event_dict


def _escaped_traceback(sio: TextIO, exc_info: ExcInfo) -> None:
    """The plain traceback, each line escaped: an exception's message may quote a peer."""
    text = io.StringIO()
    structlog.dev.plain_traceback(text, exc_info)
    sio.write(printable(text.getvalue(), keep_newlines=True))


class _ZmqllmHandler(logging.StreamHandler):
    """The root handler this module installs, marked so a reconfigure can replace it."""


def _add_service(service: str) -> Processor:
    def add_service(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
        event_dict.setdefault("service", service)
        return event_dict

    return add_service


class _NamedWriteLogger(structlog.WriteLogger):
    """A WriteLogger that remembers the name it was asked for, like a stdlib logger."""

    def __init__(self, file: TextIO, name: str | None) -> None:
        super().__init__(file)
        self.name = name


class _NamedWriteLoggerFactory:
    # structlog passes get_logger's positional arguments to the factory; keeping the name
    # on the logger (not in the context) lets a module-level logger follow reconfiguration.
    def __init__(self, file: TextIO) -> None:
        self._file = file

    def __call__(self, *args: Any) -> _NamedWriteLogger:
        return _NamedWriteLogger(self._file, args[0] if args else None)


def _add_logger_name(logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
    # A record from the logging module names the library that spoke ("uvicorn.error").
    record = event_dict.get("_record")
    name = record.name if record is not None else getattr(logger, "name", None)
    if name:
        event_dict.setdefault("logger", name)
    return event_dict


def _leading_keys_first(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
    ordered = {key: event_dict.pop(key) for key in _LEADING_KEYS if key in event_dict}
    ordered.update(event_dict)
    return ordered


def _use_console(fmt: str, stream: TextIO) -> bool:
    if fmt == "auto":
        isatty = getattr(stream, "isatty", None)
        return bool(isatty and isatty())
    return fmt == "console"


def configure_logging(
    service: str, level: str = "info", fmt: str = "auto", stream: TextIO | None = None
) -> None:
    """Set up structlog and the ``logging`` root for this process.

    Calling it again replaces the previous setup (a CLI reconfigures once flags are read).
    """
    levelno = LOG_LEVELS.get(level.lower())
    if levelno is None:
        raise ValueError(f"unknown log level {level!r}; valid levels: {', '.join(LOG_LEVELS)}")
    if fmt.lower() not in LOG_FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; valid formats: {', '.join(LOG_FORMATS)}")
    # Resolved at call time, not import time, so a swapped sys.stderr (tests) is honoured.
    out = stream if stream is not None else sys.stderr
    console = _use_console(fmt.lower(), out)

    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_service(service),
        _add_logger_name,
        structlog.processors.StackInfoRenderer(),
    ]
    render: list[Processor]
    if console:
        isatty = getattr(out, "isatty", None)
        # ConsoleRenderer formats exc_info itself, so no traceback processor goes before it.
        # Its default formatter is rich's when rich is installed, which prints every
        # frame's locals: pinned to the plain one (escaped, as every value shown here).
        render = [
            _escape_controls,
            structlog.dev.ConsoleRenderer(
                colors=bool(isatty and isatty()),
                exception_formatter=_escaped_traceback,
            ),
        ]
    else:
        render = [
            # Frames' locals hold prompts, answers and keys: never in a log line.
            structlog.processors.ExceptionRenderer(ExceptionDictTransformer(show_locals=False)),
            _leading_keys_first,
            structlog.processors.JSONRenderer(),
        ]

    structlog.configure(
        processors=[*shared, *render],
        # The filtering logger turns calls below the level into no-ops, which keeps debug
        # logging in the per-token path nearly free.
        wrapper_class=structlog.make_filtering_bound_logger(levelno),
        logger_factory=_NamedWriteLoggerFactory(out),
        # Caching would pin loggers created at import time to the first configuration,
        # and processes reconfigure once their flags are parsed.
        cache_logger_on_first_use=False,
    )

    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *render],
    )
    handler = _ZmqllmHandler(out)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _ZmqllmHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(levelno)
    for name in _SELF_HANDLING_LOGGERS:
        library_logger = logging.getLogger(name)
        library_logger.handlers.clear()
        library_logger.propagate = True
    # warnings.warn would otherwise print free text on stderr.
    logging.captureWarnings(True)


def get_logger(name: str | None = None, **initial: Any) -> FilteringBoundLogger:
    """A structlog logger; ``name`` appears as the ``logger`` key."""
    args = (name,) if name else ()
    logger: FilteringBoundLogger = structlog.get_logger(*args, **initial)
    return logger


def new_request_id() -> str:
    """A fresh request id: 32 hex characters."""
    return uuid.uuid4().hex


def bind_request(
    request_id: str, session: str = "", **extra: Any
) -> contextlib.AbstractContextManager[None]:
    """Tag every log line inside the ``with`` block with the request (and session).

    Context variables follow asyncio tasks, so concurrent requests don't see each other's ids.
    """
    values: dict[str, Any] = {"request_id": request_id, **extra}
    if session:
        values["session"] = session
    return structlog.contextvars.bound_contextvars(**values)
