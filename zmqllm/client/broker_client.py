"""Async broker client: what the gateway, benchmarks and tests use to generate.

One DEALER socket to the broker's frontend. A receive task decodes each message in one
place and hands a TOKEN or ERROR to the stream of its session; a heartbeat task proves the
broker alive (Paranoid Pirate style) and notices a restarted broker by its boot id, so no
stream ever waits forever on a broker that forgot it.

What the broker sends is input like any other: a message that does not decode, names no
stream of ours or comes out of order is dropped and counted (``drops``), an exception
while handling one costs at most the stream it names, and neither loop ends on one. Every
send has a deadline: a message the broker does not take fails with broker_unreachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import zmq
import zmq.asyncio

from zmqllm.bus.keys import PeerKeys, as_client
from zmqllm.bus.messages import (
    MAX_STATUS_BYTES,
    AskKind,
    Cancel,
    Delta,
    Error,
    ErrorCode,
    Heartbeat,
    Message,
    SessionError,
    Status,
    StatusReply,
    Token,
)
from zmqllm.bus.protocol import MAX_FRAMES, decode, encode
from zmqllm.bus.sockets import Drops, recv_bounded_async
from zmqllm.bus.wire_types import ProtocolError
from zmqllm.client.request import GenerateRequest
from zmqllm.client.streams import (
    DeltaEvent,
    StreamTable,
    TokenEvent,
    TokenStream,
    ask_frames,
    open_frames,
)
from zmqllm.log import get_logger

__all__ = ["DEFAULT_MAX_STREAMS", "BrokerClient"]

log = get_logger("zmqllm.client")

# Streams held at once (above the gateway's own limit); past it a new one is refused: busy.
DEFAULT_MAX_STREAMS = 4096
# The largest frame a broker sends us is a status body; ZeroMQ cuts off a peer sending more.
MAX_INBOUND_FRAME = MAX_STATUS_BYTES


class BrokerClient:
    def __init__(
        self,
        address: str,
        heartbeat_interval: float = 1.0,
        liveness: int = 3,
        context: zmq.asyncio.Context | None = None,
        *,
        send_timeout: float = 1.0,
        max_streams: int = DEFAULT_MAX_STREAMS,
        send_hwm: int = 1000,
        keys: PeerKeys | None = None,
    ) -> None:
        self.address = address
        self.keys = keys  # CURVE: our pair and the broker's public key
        self.heartbeat_interval = heartbeat_interval
        self.liveness = liveness
        self.send_timeout = send_timeout
        self.send_hwm = send_hwm
        self.drops = Drops("zmqllm.client")
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._streams = StreamTable(max_streams)
        self._status_waiters: dict[str, asyncio.Future[dict[str, Any]]] = {}
        # What a broker may send us, by message type; anything else is dropped.
        self._handlers: dict[type[Message], Callable[[Any], None]] = {
            Token: self._on_token,
            Delta: self._on_delta,
            Error: self._on_error,
            Heartbeat: self._on_heartbeat,
            StatusReply: self._on_status_reply,
        }
        self._tasks: list[asyncio.Task[None]] = []
        self._cancels: set[asyncio.Task[None]] = set()
        self._last_seen = 0.0
        self._boot: str | None = None
        self._closing = False

    # -- lifecycle -----------------------------------------------------------
    def _connect(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.send_hwm)
        # Queue nothing for a broker that is not connected: a send then waits (up to its
        # deadline) instead of handing a restarted broker requests the caller gave up on.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND_FRAME)
        sock.setsockopt(zmq.SNDTIMEO, max(1, round(self.send_timeout * 1000)))
        sock.setsockopt(zmq.IDENTITY, f"c-{uuid.uuid4().hex[:12]}".encode())
        if self.keys is not None:
            as_client(sock, self.keys)
        sock.connect(self.address)
        self._sock = sock

    async def start(self) -> None:
        self._closing = False
        self._connect()
        self._tasks = [
            asyncio.create_task(self._recv_loop()),
            asyncio.create_task(self._heartbeat_loop()),
        ]

    async def close(self) -> None:
        self._closing = True
        tasks = [*self._tasks, *self._cancels]
        for t in tasks:
            t.cancel()
        if tasks:
            # The loops also end by themselves once closing is set.
            await asyncio.wait(tasks, timeout=max(1.0, 2 * self.send_timeout))
        self._tasks = []
        self._streams.fail_all(
            SessionError(ErrorCode.BROKER_UNREACHABLE, "the client is shutting down")
        )
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    @property
    def connected(self) -> bool:
        horizon = self.heartbeat_interval * self.liveness
        return self._last_seen > 0 and time.monotonic() - self._last_seen < horizon

    @property
    def dropped(self) -> Mapping[str, int]:
        return self.drops.counts

    # -- requests ------------------------------------------------------------
    def generate(self, request: GenerateRequest) -> TokenStream:
        """A stream of the tokens ``request`` asks for (nothing is sent until it is opened);
        a request naming no session gets a fresh one.

        Raises SessionError(bad_request) for a request the broker would drop as malformed.
        """
        if not request.session:
            request = dataclasses.replace(request, session=uuid.uuid4().hex)
        frames = open_frames(request)
        session, budget = request.session, int(request.max_tokens)
        return TokenStream(self, session, request.request_id, max_tokens=budget, frames=frames)

    def ask(
        self,
        *,
        request_id: str,
        model: str,
        kind: AskKind,
        fields: Mapping[str, Any],
        max_tokens: int,
        session: str | None = None,
    ) -> TokenStream:
        """A stream of a text model's answer (DeltaEvents) to the request ``fields``
        (messages or prompt, and sampling, as ask_body reads them)."""
        session = session or uuid.uuid4().hex
        frames = ask_frames(
            session=session,
            request_id=request_id,
            model=model,
            kind=kind,
            fields=fields,
            max_tokens=max_tokens,
        )
        return TokenStream(
            self, session, request_id, max_tokens=int(max_tokens), frames=frames, text_model=True
        )

    async def open_stream(self, stream: TokenStream) -> None:
        """Send a stream's OPEN; raises SessionError if it cannot be (stream finished)."""
        if stream.opened:
            return
        stream.opened = True
        try:
            if not self.connected and self._last_seen > 0:
                raise SessionError(
                    ErrorCode.BROKER_UNREACHABLE, f"no answer from the broker at {self.address}"
                )
            self._streams.add(stream)
            await self._send_frames(stream.take_open_frames())
        except BaseException:
            stream.finished = True
            self._streams.forget(stream)
            raise

    async def cancel(self, stream: TokenStream) -> None:
        """Stop a stream here and ask the broker to stop it; never raises for the link."""
        self.forget(stream)
        if stream.opened:
            msg = Cancel(session=stream.session, request_id=stream.request_id)
            with contextlib.suppress(SessionError):
                await self._send(msg)

    def forget(self, stream: TokenStream) -> None:
        self._streams.forget(stream)

    async def status(self, timeout: float = 2.0) -> dict[str, Any]:
        """The broker's status map; SessionError when it does not answer in ``timeout`` or
        answers with something unreadable."""
        key = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()
        late = f"no status from the broker at {self.address} in {timeout}s"

        # A timer instead of wait_for: the deadline cannot swallow a cancellation.
        def expire() -> None:
            if not fut.done():
                fut.set_exception(SessionError(ErrorCode.BROKER_UNREACHABLE, late))

        timer = loop.call_later(timeout, expire)
        self._status_waiters[key] = fut
        try:
            await self._send(Status(request_id=key))
            return await fut
        finally:
            timer.cancel()
            self._status_waiters.pop(key, None)

    # -- socket side ---------------------------------------------------------
    async def _send(self, msg: Message) -> None:
        await self._send_frames(encode(msg))

    async def _send_frames(self, frames: list[Any]) -> None:
        """Send within ``send_timeout`` (SNDTIMEO, which pyzmq applies to each queued send,
        in order, each message whole) or raise SessionError(broker_unreachable)."""
        sock = self._sock
        if sock is None:
            raise SessionError(ErrorCode.BROKER_UNREACHABLE, "the client is not started")
        try:
            await sock.send_multipart(frames)
        except asyncio.CancelledError:
            # Closing a socket (a reconnect, close()) cancels the sends pending on it: that
            # is a failed send, not the caller being cancelled, unless both happened.
            task = asyncio.current_task()
            cancelling = getattr(task, "cancelling", None)  # Python 3.11+
            if sock is self._sock or (cancelling is not None and cancelling()):
                raise
            raise SessionError(
                ErrorCode.BROKER_UNREACHABLE, "the connection to the broker was reset"
            ) from None
        except zmq.Again:
            raise SessionError(
                ErrorCode.BROKER_UNREACHABLE,
                f"the broker at {self.address} did not take a message in {self.send_timeout}s",
            ) from None
        except zmq.ZMQError as exc:
            raise SessionError(ErrorCode.BROKER_UNREACHABLE, f"send failed: {exc}") from None

    async def _recv_loop(self) -> None:
        while not self._closing:
            sock = self._sock
            if sock is None:
                await asyncio.sleep(0.05)
                continue
            try:
                frames = await recv_bounded_async(sock, MAX_FRAMES)
            except zmq.ZMQError:
                await asyncio.sleep(0.05)  # socket replaced by a reconnect
                continue
            except asyncio.CancelledError:
                # Closing a zmq.asyncio socket cancels its pending recv. If the heartbeat
                # loop replaced the socket, receive on the new one; letting this end the
                # task would leave the client deaf to the broker for good.
                if self._closing or sock is self._sock:
                    raise
                continue
            try:
                self._handle(frames)
            except Exception as exc:  # nothing a message holds may end this loop
                self.drops.error("receive", exc)

    def _handle(self, frames: list[bytes] | None) -> None:
        """Decode one message and act on it; an exception costs the stream it names."""
        self._last_seen = time.monotonic()
        if frames is None:
            self.drops.drop("too many frames")
            return
        try:
            msg = decode(frames, max_payload_bytes=MAX_INBOUND_FRAME)
        except ProtocolError as exc:
            self.drops.drop("malformed", error=exc)
            return
        try:
            self._dispatch(msg)
        except Exception as exc:  # a bug of ours
            self.drops.error(msg.TYPE.value, exc)
            self._fail_named(msg)

    def _dispatch(self, msg: Message) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.drops.drop("unexpected type", type=msg.TYPE.value)
        else:
            handler(msg)

    def _drop_debug(self, reason: str, msg: Token | Delta | Error) -> None:
        # Late messages of a cancelled stream are routine: counted, not shouted.
        self.drops.counts[reason] += 1
        step = msg.step if isinstance(msg, Token | Delta) else None
        log.debug("message dropped", reason=reason, session=msg.session, step=step)

    def _on_token(self, msg: Token) -> None:
        stream = self._streams.get(msg.session)
        if stream is None:
            self._drop_debug("token of no stream", msg)
            return
        if stream.text_model or msg.step != stream.next_step or msg.step >= stream.max_tokens:
            self._drop_debug("token out of order", msg)
            return
        if not stream.route and msg.route is not None:
            stream.route = list(msg.route)
        if stream.boot is None and msg.boot is not None:
            stream.boot = msg.boot
            stream.orphan_deadline = None
        if stream.build is None and msg.build is not None:
            stream.build = msg.build
        finish = msg.finish.value if msg.finish is not None else None
        logprobs = None
        if msg.logprob_ids is not None and msg.logprobs is not None:
            logprobs = (msg.logprob_ids, msg.logprobs)
        if not stream.push_event(TokenEvent(msg.token, msg.step, finish, logprobs)):
            self._overrun(stream)
        elif finish is not None:
            self._streams.forget(stream)

    def _on_delta(self, msg: Delta) -> None:
        stream = self._streams.get(msg.session)
        if stream is None:
            self._drop_debug("delta of no stream", msg)
            return
        if not stream.text_model or msg.step != stream.next_step:
            self._drop_debug("delta out of order", msg)
            return
        if not stream.route and msg.route is not None:
            stream.route = list(msg.route)
        if stream.boot is None and msg.boot is not None:
            stream.boot = msg.boot
            stream.orphan_deadline = None
        event = DeltaEvent(msg.text, msg.step, msg.finish, msg.prompt_tokens, msg.completion_tokens)
        if not stream.push_event(event):
            self._overrun(stream)
        elif msg.finish is not None:
            self._streams.forget(stream)

    def _on_error(self, msg: Error) -> None:
        if not msg.session:
            fut = self._status_waiters.get(msg.request_id) if msg.request_id else None
            if fut is not None and not fut.done():
                fut.set_exception(SessionError(msg.code, msg.message))
            else:
                self.drops.drop("error of no session", code=msg.code.value, error=msg.message)
            return
        stream = self._streams.get(msg.session)
        if stream is None:  # e.g. the broker confirming a cancel we sent
            self._drop_debug("error of no stream", msg)
            return
        self._streams.fail(stream, SessionError(msg.code, msg.message))

    def _on_heartbeat(self, msg: Heartbeat) -> None:
        if msg.boot is not None:
            if self._boot is not None and msg.boot != self._boot:
                horizon = self.heartbeat_interval * self.liveness
                self._streams.broker_restarted(msg.boot, time.monotonic() + horizon)
            self._boot = msg.boot

    def _on_status_reply(self, msg: StatusReply) -> None:
        fut = self._status_waiters.get(msg.request_id)
        if fut is None or fut.done():
            return  # an answer to a status() that gave up
        try:
            fut.set_result(msg.status())
        except ProtocolError as exc:
            fut.set_exception(
                SessionError(ErrorCode.INTERNAL, f"unreadable status from the broker: {exc}")
            )

    def _fail_named(self, msg: Message) -> None:
        """After an error handling ``msg``: fail (and cancel) the stream it names, if any."""
        session = getattr(msg, "session", "")
        stream = self._streams.get(session) if isinstance(session, str) else None
        if stream is None:
            return
        with contextlib.suppress(Exception):
            self._streams.fail(stream, SessionError(ErrorCode.INTERNAL, "the client failed"))
        self._cancel_later(stream)

    def _overrun(self, stream: TokenStream) -> None:
        """A stream's reader fell too far behind (streams.MAX_UNREAD_EVENTS): fail it for
        the reader and cancel its session with the broker."""
        self._streams.forget(stream)
        error = stream.overrun()
        log.warning("stream cancelled", request_id=stream.request_id, reason=error.code.value)
        self._cancel_later(stream)

    def _cancel_later(self, stream: TokenStream) -> None:
        """Send the stream's CANCEL from a task: the receive loop does not wait on sends."""
        task = asyncio.create_task(self.cancel(stream))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _heartbeat_loop(self) -> None:
        started = time.monotonic()
        while not self._closing:
            with contextlib.suppress(SessionError):
                await self._send(Heartbeat())
            await asyncio.sleep(self.heartbeat_interval)
            try:
                started = self._check_liveness(started)
            except Exception as exc:  # a bug of ours: log it, keep the heartbeat going
                self.drops.error("heartbeat loop", exc)

    def _check_liveness(self, started: float) -> float:
        """Fail orphans and, after a silent horizon, everything; returns when the current
        socket's silence began counting."""
        self._streams.fail_orphans(time.monotonic())
        silent_since = self._last_seen or started
        if time.monotonic() - silent_since <= self.heartbeat_interval * self.liveness:
            return started
        if self._streams:
            self._streams.fail_all(
                SessionError(
                    ErrorCode.BROKER_UNREACHABLE,
                    f"the broker at {self.address} stopped answering",
                )
            )
        # A fresh socket: pending messages of the dead peer are dropped.
        if self._sock is not None:
            self._sock.close(linger=0)
        self._connect()
        self._last_seen = 0.0
        return time.monotonic()
