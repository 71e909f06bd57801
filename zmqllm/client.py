"""Async broker client: what the gateway, benchmarks and tests use to generate.

One DEALER socket to the broker's frontend. A receive task hands each TOKEN or
ERROR to the stream of its session; a heartbeat task proves the broker alive
(Paranoid Pirate style) and notices a restarted broker by its boot id, so no
stream ever waits forever on a broker that forgot it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from zmqllm.sampling_params import SamplingParams
from zmqllm.log import get_logger
from zmqllm.protocol import Header, MsgType, Payload, ProtocolError, decode, encode

log = get_logger("zmqllm.client")


@dataclass
class TokenEvent:
    token: int
    step: int
    finish: str | None  # None, "length" or "stop"


class BrokerError(Exception):
    """A generation failed; ``code`` is machine-readable, ``message`` for people.

    Codes: no_capacity, worker_lost, broker_unreachable, bad_request, timeout,
    internal, full.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass
class _Item:
    event: TokenEvent | None = None
    error: BrokerError | None = None


@dataclass
class TokenStream:
    """The tokens of one session. Use as ``async with client.generate(...) as s``;
    leaving the block before the last token cancels the session everywhere."""

    client: BrokerClient
    session: str
    request_id: str
    route: list[str] = field(default_factory=list)
    finished: bool = False
    _queue: asyncio.Queue[_Item] = field(default_factory=asyncio.Queue)
    _opened: bool = False
    _open_frames: list[Any] = field(default_factory=list)
    # The boot id of the broker that sent this stream's first token; None before it.
    boot: str | None = None
    # Set when a broker restart was seen before this stream's first token: if none
    # arrives by then, the stream was opened on the dead broker and is failed.
    orphan_deadline: float | None = None

    async def __aenter__(self) -> TokenStream:
        await self.client._open(self)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self.finished:
            await self.cancel()
        self.client._streams.pop(self.session, None)

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[TokenEvent]:
        if not self._opened:
            await self.client._open(self)
        while not self.finished:
            item = await self._queue.get()
            if item.error is not None:
                self.finished = True
                raise item.error
            assert item.event is not None
            if item.event.finish is not None:
                self.finished = True
            yield item.event

    async def cancel(self) -> None:
        if self.finished:
            return
        self.finished = True
        await self.client._send(Header(MsgType.CANCEL, self.session, self.request_id))

    def _push(self, item: _Item) -> None:
        self._queue.put_nowait(item)


class BrokerClient:
    def __init__(
        self,
        address: str,
        heartbeat_interval: float = 1.0,
        liveness: int = 3,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.address = address
        self.heartbeat_interval = heartbeat_interval
        self.liveness = liveness
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._streams: dict[str, TokenStream] = {}
        self._status_waiters: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._last_seen = 0.0
        self._boot: str | None = None
        self._send_lock = asyncio.Lock()
        self._closing = False

    # -- lifecycle -----------------------------------------------------------
    def _connect(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, f"c-{uuid.uuid4().hex[:12]}".encode())
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
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        self._fail_all(BrokerError("broker_unreachable", "the client is shutting down"))
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    @property
    def connected(self) -> bool:
        horizon = self.heartbeat_interval * self.liveness
        return self._last_seen > 0 and time.monotonic() - self._last_seen < horizon

    # -- requests ------------------------------------------------------------
    def generate(
        self,
        *,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop_ids: Sequence[int] = (),
        session: str | None = None,
    ) -> TokenStream:
        session = session or uuid.uuid4().hex
        tokens = np.asarray(prompt, dtype=np.int32)
        header = Header(
            MsgType.OPEN,
            session,
            request_id,
            0,
            {
                "max_tokens": int(max_tokens),
                "prompt_len": len(tokens),
                "sampling": sampling.to_dict(),
                "stop_ids": [int(t) for t in stop_ids],
            },
        )
        stream = TokenStream(self, session, request_id)
        stream._open_frames = encode(header, [Payload(tokens, "int32")])
        return stream

    async def _open(self, stream: TokenStream) -> None:
        if stream._opened:
            return
        stream._opened = True
        self._streams[stream.session] = stream
        if not self.connected and self._last_seen > 0:
            self._streams.pop(stream.session, None)
            stream.finished = True
            raise BrokerError("broker_unreachable", f"no answer from the broker at {self.address}")
        await self._send_frames(stream._open_frames)

    async def status(self, timeout: float = 2.0) -> dict[str, Any]:
        key = uuid.uuid4().hex
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._status_waiters[key] = fut
        try:
            await self._send(Header(MsgType.STATUS, request_id=key))
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise BrokerError(
                "broker_unreachable", f"no status from the broker at {self.address} in {timeout}s"
            ) from None
        finally:
            self._status_waiters.pop(key, None)

    # -- socket side ---------------------------------------------------------
    async def _send(self, header: Header) -> None:
        await self._send_frames(encode(header))

    async def _send_frames(self, frames: list[Any]) -> None:
        async with self._send_lock:
            if self._sock is None:
                raise BrokerError("broker_unreachable", "the client is not started")
            await self._sock.send_multipart(frames)

    async def _recv_loop(self) -> None:
        while True:
            sock = self._sock
            if sock is None:
                await asyncio.sleep(0.05)
                continue
            try:
                frames = await sock.recv_multipart()
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
            self._last_seen = time.monotonic()
            try:
                header, _ = decode(frames)
            except ProtocolError as exc:
                log.warning("malformed message from broker dropped", error=str(exc))
                continue
            self._dispatch(header)

    def _dispatch(self, h: Header) -> None:
        if h.type is MsgType.HEARTBEAT:
            boot = h.fields.get("boot")
            if isinstance(boot, str):
                if self._boot is not None and boot != self._boot:
                    self._on_broker_restart(boot)
                self._boot = boot
            return
        if h.type is MsgType.STATUS_REPLY:
            fut = self._status_waiters.get(h.request_id)
            if fut is not None and not fut.done():
                fut.set_result(h.fields["status"])
            return
        stream = self._streams.get(h.session)
        if stream is None:
            return  # a late token of a cancelled session
        if h.type is MsgType.TOKEN:
            if not stream.route and "route" in h.fields:
                stream.route = [str(w) for w in h.fields["route"]]
            if stream.boot is None and isinstance(h.fields.get("boot"), str):
                stream.boot = h.fields["boot"]
                stream.orphan_deadline = None
            stream._push(_Item(event=TokenEvent(h.fields["token"], h.step, h.fields["finish"])))
            if h.fields["finish"] is not None:
                self._streams.pop(h.session, None)
        elif h.type is MsgType.ERROR:
            stream._push(_Item(error=BrokerError(h.fields["code"], h.fields["message"])))
            self._streams.pop(h.session, None)

    def _on_broker_restart(self, boot: str) -> None:
        """A new broker answers: streams of the old one are lost. A stream that has no
        token yet may have opened on either, so it gets liveness intervals to show it."""
        lost = BrokerError("broker_unreachable", "the broker restarted; sessions lost")
        deadline = time.monotonic() + self.heartbeat_interval * self.liveness
        for sid, s in list(self._streams.items()):
            if s.boot is None:
                s.orphan_deadline = deadline
            elif s.boot != boot:
                self._streams.pop(sid, None)
                s._push(_Item(error=lost))

    def _fail_orphans(self) -> None:
        now = time.monotonic()
        for sid, s in list(self._streams.items()):
            if s.orphan_deadline is not None and now > s.orphan_deadline:
                self._streams.pop(sid, None)
                s._push(
                    _Item(
                        error=BrokerError(
                            "broker_unreachable", "the broker restarted; sessions lost"
                        )
                    )
                )

    def _fail_all(self, error: BrokerError) -> None:
        streams, self._streams = self._streams, {}
        for s in streams.values():
            s._push(_Item(error=error))

    async def _heartbeat_loop(self) -> None:
        horizon = self.heartbeat_interval * self.liveness
        started = time.monotonic()
        while True:
            with contextlib.suppress(zmq.ZMQError, BrokerError):
                await self._send(Header(MsgType.HEARTBEAT))
            await asyncio.sleep(self.heartbeat_interval)
            self._fail_orphans()
            silent_since = self._last_seen or started
            if time.monotonic() - silent_since > horizon:
                if self._streams:
                    self._fail_all(
                        BrokerError(
                            "broker_unreachable",
                            f"the broker at {self.address} stopped answering",
                        )
                    )
                # A fresh socket: pending messages of the dead peer are dropped.
                if self._sock is not None:
                    self._sock.close(linger=0)
                self._connect()
                started = time.monotonic()
                self._last_seen = 0.0
