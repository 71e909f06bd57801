"""The gateway's uvicorn settings, and a deadline on request headers (slowloris).

uvicorn bounds an idle keep-alive connection but not one that sends its request line and
headers a byte at a time: every such connection holds a socket, and enough of them stop
the server from accepting anyone else. The protocol class below closes a connection
whose request line and headers are not complete ``header_timeout`` seconds after it
opened, or after the previous response on it ended. (The body has its own deadline,
checked where it is read: ``zmqllm.gateway.body``.)
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from zmqllm.config import GatewaySettings
from zmqllm.log import get_logger

__all__ = ["HeaderDeadlineProtocol", "header_deadline_protocol", "uvicorn_config"]

# Seconds uvicorn waits for open streams on SIGINT/SIGTERM before cancelling them (which
# cancels their sessions); long enough for a short answer to finish.
GRACEFUL_SHUTDOWN_S = 5

log = get_logger("zmqllm.gateway")


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's line and headers."""

    header_timeout = 10.0  # seconds; header_deadline_protocol makes a class with another

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The next request on this keep-alive connection gets a deadline of its own.
        if not self.transport.is_closing():
            self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_deadline)

    def _disarm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline(self) -> None:
        self._header_timer = None
        # h11 leaves IDLE only once it has the whole request line and headers.
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        log.debug("connection closed: request headers not complete in time", client=self.client)
        # Mid-way through something h11 will not close cleanly: the socket closes anyway.
        with contextlib.suppress(h11.LocalProtocolError):
            self.conn.send(h11.ConnectionClosed())
        self.transport.close()


def header_deadline_protocol(header_timeout: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class with ``header_timeout`` seconds as its deadline."""

    class Protocol(HeaderDeadlineProtocol):
        pass

    Protocol.header_timeout = header_timeout
    return Protocol


def uvicorn_config(app: Any, settings: GatewaySettings) -> uvicorn.Config:
    """How the gateway runs its app under uvicorn (``serve`` and the tests alike)."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,  # keep configure_logging's JSON lines
        access_log=False,  # the gateway logs one richer line per request itself
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        http=header_deadline_protocol(settings.header_timeout),
        # Past this many connections plus requests in progress, uvicorn answers 503 at
        # once instead of letting memory and file descriptors run out.
        limit_concurrency=settings.limit_concurrency,
        timeout_keep_alive=settings.keep_alive_timeout,
    )
