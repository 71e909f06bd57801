"""The gateway's uvicorn settings (TLS included), and deadlines on slow clients.

uvicorn bounds an idle keep-alive connection but not one that sends its request line and
headers a byte at a time: every such connection holds a socket, and enough of them stop
the server from accepting anyone else. The protocol class below closes a connection
whose request line and headers are not complete ``header_timeout`` seconds after it
opened, or after the previous response on it ended. (The body has its own deadline,
checked where it is read: ``zmqllm.gateway.body``.)

A TLS handshake that never completes is bounded the same (``header_timeout``).

Nor does uvicorn bound a response's writes: a client that stops reading holds the
request's generation slots and sessions for as long as the server keeps writing into its
buffers, which Linux grows to megabytes. The protocol fixes each connection's kernel send
buffer at ``max_unread_bytes``, counts what it writes, asks the kernel what is still
unread, and lets ``zmqllm.gateway.write_progress`` judge: a client that leaves more than
``max_unread_bytes`` unread must take at least that many bytes every ``write_timeout``
seconds, else its connection is reset; the application then sees the client gone
(``http.disconnect``) and cancels the generation.

TLS files are checked before uvicorn sees them: uvicorn would fail on a missing or bad
file with a traceback from deep inside its startup, and prompt on the terminal for the
passphrase of an encrypted key; here each is one clear ConfigError (exit status 2).
"""

from __future__ import annotations

import asyncio
import asyncio.constants
import contextlib
import logging
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from zmqllm.config.settings import ConfigError, GatewaySettings
from zmqllm.gateway.request_context import record_in
from zmqllm.gateway.responses import INCOMPLETE_RESPONSE_LOG
from zmqllm.gateway.write_progress import (
    Stalled,
    WriteProgress,
    bound_send_buffer,
    reset_on_close,
    unsent_in_kernel,
)
from zmqllm.log import get_logger

__all__ = [
    "MIN_UNREAD_BYTES",
    "DeadlineProtocol",
    "base_url",
    "deadline_protocol",
    "tls_files",
    "uvicorn_config",
]

# Seconds uvicorn waits for open streams on SIGINT/SIGTERM before cancelling them (which
# cancels their sessions); long enough for a short answer to finish.
GRACEFUL_SHUTDOWN_S = 5
# Below the kernel's smallest send buffer (4608 on Linux) the bound would mean nothing.
MIN_UNREAD_BYTES = 4096

log = get_logger("zmqllm.gateway")


class _CountingTransport:
    """The connection's transport as the protocol sees it: the same, but counting the
    bytes handed to it (uvicorn writes a response only through ``write``)."""

    def __init__(self, transport: asyncio.Transport, wrote: Callable[[], None]) -> None:
        self._transport = transport
        self._wrote = wrote
        self.written = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += len(data)
        self._transport.write(data)
        self._wrote()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's line and headers, and a
    floor on how fast a client must take a response it has fallen behind on."""

    # deadline_protocol makes a class with others
    header_timeout = 10.0  # seconds
    write_timeout = 30.0  # seconds: the window write progress is judged over
    max_unread_bytes = 262_144

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._progress_timer: asyncio.TimerHandle | None = None
        self._progress = WriteProgress(self.write_timeout, self.max_unread_bytes)
        # A few samples a window, at most one a second: cheap next to the writes.
        self._sample_every = min(1.0, self.write_timeout / 4)
        self._counter: _CountingTransport | None = None
        self._socket: Any = None
        self._kernel_counts = True  # until the kernel says it cannot

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._socket = transport.get_extra_info("socket")
        if self._socket is not None:
            bound_send_buffer(self._socket, self.max_unread_bytes)
        self._counter = _CountingTransport(transport, self._arm_progress_check)
        super().connection_made(cast(asyncio.Transport, self._counter))
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The next request on this keep-alive connection gets a deadline of its own.
        if not self.transport.is_closing():
            self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        if self._progress_timer is not None:
            self._progress_timer.cancel()
            self._progress_timer = None
        super().connection_lost(exc)

    def _unread(self) -> int:
        """Bytes written and not yet taken by the client: the transport's buffer and the
        kernel's send queue. Where the kernel cannot say, the transport's alone: the
        bounded send buffer then fills and pauses the writes, which counts as behind.
        Over TLS the kernel's count is of encrypted bytes, a few percent more than those
        written: the client is taken to have read a little less than it has."""
        unread = self.transport.get_write_buffer_size()
        if self._kernel_counts and self._socket is not None:
            in_kernel = unsent_in_kernel(self._socket)
            if in_kernel is None:
                self._kernel_counts = False
            else:
                unread += in_kernel
        return unread

    def _arm_progress_check(self) -> None:
        if self._progress_timer is None and not self.transport.is_closing():
            self._progress_timer = self.loop.call_later(self._sample_every, self._check_progress)

    def _check_progress(self) -> None:
        self._progress_timer = None
        if self.transport.is_closing() or self._counter is None:
            return
        unread = self._unread()
        paused = self.flow.write_paused
        stalled = self._progress.observe(
            self.loop.time(), self._counter.written - unread, unread, paused
        )
        if stalled is not None:
            self._cut(stalled)
        elif unread or paused:
            self._arm_progress_check()
        # else all taken: the next write samples again

    def _cut(self, stalled: Stalled) -> None:
        scope: Any = self.cycle.scope if self.cycle is not None else None
        record = record_in(scope) if scope is not None else None
        request_id = None
        if record is not None:
            request_id = record.request_id
            if record.error is None:
                record.error = record.finish_reason = "write_timeout"
        log.warning(
            "client read nothing for write_timeout: connection aborted"
            if stalled.delivered == 0
            else "client read too slowly for write_timeout: connection aborted",
            request_id=request_id,
            write_timeout=self.write_timeout,
            unread_bytes=stalled.unread,
            delivered_bytes=stalled.delivered,
            required_bytes=stalled.required,
        )
        # close() would wait for the buffered bytes to be read, which they never are; and
        # a plain close of the socket would still deliver what the kernel holds, at the
        # client's pace.
        if self._socket is not None:
            reset_on_close(self._socket)
        self.transport.abort()

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


def deadline_protocol(
    header_timeout: float, write_timeout: float, max_unread_bytes: int = 262_144
) -> type[DeadlineProtocol]:
    """The protocol class with these deadlines (seconds) and this bound on unread bytes."""

    class Protocol(DeadlineProtocol):
        pass

    Protocol.header_timeout = header_timeout
    Protocol.write_timeout = write_timeout
    Protocol.max_unread_bytes = max_unread_bytes
    return Protocol


class _EncryptedKeyError(Exception):
    pass


def _no_passphrase() -> bytes:
    # Called by OpenSSL only for an encrypted key; raising here ends load_cert_chain with
    # this error instead of an interactive prompt a service would hang on.
    raise _EncryptedKeyError


def tls_files(settings: GatewaySettings) -> tuple[str, str] | None:
    """(certificate, key) when TLS is configured, after checking that they load and
    belong together; None for plain HTTP. Anything wrong is a ConfigError naming the file."""
    cert, key = settings.ssl_certfile, settings.ssl_keyfile
    if not cert and not key:
        return None
    if not cert or not key:
        given, missing = (
            ("ssl_certfile", "ssl_keyfile") if cert else ("ssl_keyfile", "ssl_certfile")
        )
        raise ConfigError(
            f"TLS needs both ssl_certfile and ssl_keyfile: {given} given, {missing} not"
        )
    paths = {"certificate": Path(cert).expanduser(), "key": Path(key).expanduser()}
    for what, path in paths.items():
        try:
            with path.open("rb"):
                pass
        except OSError as exc:
            raise ConfigError(f"TLS {what} file {path}: cannot read it ({exc.strerror})") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(paths["certificate"], paths["key"], password=_no_passphrase)
    except _EncryptedKeyError:
        raise ConfigError(
            f"TLS key file {paths['key']} is encrypted: give the key unencrypted "
            "(readable by this user only)"
        ) from None
    except ssl.SSLError as exc:
        raise ConfigError(
            f"TLS certificate {paths['certificate']} with key {paths['key']} cannot be used "
            f"({exc.reason or exc}): they must be a PEM certificate and its own private key"
        ) from None
    return str(paths["certificate"]), str(paths["key"])


def base_url(settings: GatewaySettings) -> str:
    """Where the gateway answers: http(s)://host:port (an IPv6 host in brackets)."""
    scheme = "https" if settings.ssl_certfile and settings.ssl_keyfile else "http"
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return f"{scheme}://{host}:{settings.port}"


class _DeliberateAborts(logging.Filter):
    """uvicorn reports a response left incomplete as an error; the gateway leaves one so
    on purpose (a stream that failed after its headers, see GenerationResponse) and logs
    it itself, with the request id."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != INCOMPLETE_RESPONSE_LOG


def uvicorn_config(app: Any, settings: GatewaySettings) -> uvicorn.Config:
    """How the gateway runs its app under uvicorn (``serve`` and the tests alike)."""
    uvicorn_errors = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _DeliberateAborts) for f in uvicorn_errors.filters):
        uvicorn_errors.addFilter(_DeliberateAborts())
    if settings.max_unread_bytes < MIN_UNREAD_BYTES:
        raise ConfigError(
            f"max_unread_bytes in [gateway] must be at least {MIN_UNREAD_BYTES}, "
            f"got {settings.max_unread_bytes!r}"
        )
    tls = tls_files(settings)
    if tls:
        # A TLS handshake comes before the request line, so the header deadline (armed
        # once the connection is made, i.e. after the handshake) cannot see one that
        # never ends: asyncio's own bound on it (60 s unless the server gives one, and
        # uvicorn gives none) is set to the header deadline. The asyncio loop is asked
        # for by name: uvloop's TLS would not read this.
        asyncio.constants.SSL_HANDSHAKE_TIMEOUT = settings.header_timeout
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,  # keep configure_logging's JSON lines
        access_log=False,  # the gateway logs one richer line per request itself
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        http=deadline_protocol(
            settings.header_timeout, settings.write_timeout, settings.max_unread_bytes
        ),
        # Past this many connections plus requests in progress, uvicorn answers 503 at
        # once instead of letting memory and file descriptors run out.
        limit_concurrency=settings.limit_concurrency,
        timeout_keep_alive=settings.keep_alive_timeout,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
        loop="asyncio",
    )
