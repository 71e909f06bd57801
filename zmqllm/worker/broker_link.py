"""A worker's connection to the broker (the ZeroMQ guide's mdwrkapi.py).

:class:`BrokerLink` owns the DEALER socket: it connects, registers, heartbeats both ways,
reconnects with backoff when the broker goes quiet and registers again when the broker
restarts or asks for it. Whichever thread holds ``lock`` drives the socket (ZeroMQ lets a
socket move between threads across a full memory barrier, which the lock is):

- the compute loop, between forwards: it waits on the socket itself (``pump``), takes
  what came from ``inbox`` and sends its results (``send``), so a message to or from
  the broker crosses no thread on its way;
- a keeper thread while the compute loop runs a forward (the lock is free then; torch
  releases the GIL in its ops): every ``KEEP_POLL_S`` it takes the lock if it can, reads
  what arrived into ``inbox`` and beats, so a long forward never looks like a dead
  worker.

``inbox`` holds, in arrival order, what the compute loop must act on, each message
decoded once, here, by ``inbox.take_in`` (the compute loop reads no header again):

    a Message           a session message from the broker (OPEN, STEP, ...)
    Undecodable         one whose body does not decode: the session it names fails
    Reset(reason)       the broker forgot this worker's sessions: drop them
    Refusal(reason)     the broker refused this worker

Nothing blocks on the broker: a message that cannot be queued to it fails its session
(``send`` says so; the broker's inactivity deadline does the rest), a message over
MAX_FRAMES frames is read frame by frame and dropped unbuilt, MAXMSGSIZE bounds every
frame, and past INBOX_MAX waiting messages a session message is answered "overloaded".
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from zmqllm.bus.keys import PeerKeys, as_client
from zmqllm.bus.messages import (
    Disconnect,
    Error,
    ErrorCode,
    Heartbeat,
    Message,
    Refused,
    Register,
    Registered,
)
from zmqllm.bus.protocol import MAX_FRAMES, encode
from zmqllm.bus.sockets import recv_bounded
from zmqllm.bus.wire_types import ProtocolError, SessionKey
from zmqllm.log import get_logger
from zmqllm.worker.faults import Faults
from zmqllm.worker.health import NET, process_figures
from zmqllm.worker.inbox import (
    SESSION_TYPES,
    Entry,
    Refusal,
    Reset,
    Undecodable,
    session_of,
    take_in,
)

__all__ = [
    "BrokerLink",
    "LinkLost",
    "LinkSettings",
    "WorkerRefused",
]

log = get_logger("zmqllm.worker")

RECONNECT_MAX_S = 30.0
MAX_MESSAGES_PER_PUMP = 1024
INBOX_MAX = 100_000  # messages waiting for the compute loop; past it: "overloaded"
SOCKET_HWM = 10_000
CLOSE_LINGER_MS = 500  # long enough for the goodbye DISCONNECT, short enough to exit
JOIN_TIMEOUT_S = 5.0
# How often the keeper looks for a free lock (a forward running): well inside a
# heartbeat interval, and rare enough to cost nothing.
KEEP_POLL_S = 0.05


class WorkerRefused(RuntimeError):
    """The broker refused this worker (different model or version)."""


class LinkLost(RuntimeError):
    """The broker link's thread is gone: this worker can no longer be reached."""


@dataclass(frozen=True)
class LinkSettings:
    address: str  # the broker's backend endpoint
    identity: str  # this worker's routing id, the same on every reconnect
    interval: float  # heartbeat interval, both ways
    liveness: int  # intervals without a word from the broker before it counts as gone
    max_message_bytes: int  # MAXMSGSIZE: the largest frame this worker accepts
    keys: PeerKeys | None = None  # CURVE: this worker's pair and the broker's key


class BrokerLink:
    def __init__(
        self, ctx: zmq.Context[Any], settings: LinkSettings, register: Register, faults: Faults
    ) -> None:
        self.ctx = ctx
        self.settings = settings
        self.register = register
        self.faults = faults
        # Reentrant: the compute loop sends while it holds it for a pump.
        self.lock = threading.RLock()
        self.inbox: deque[Entry] = deque()
        self._status: tuple[dict[str, Any], bool] = ({}, False)
        self._thread: threading.Thread | None = None
        self._done = threading.Event()  # set: the keeper ends
        # Driven under ``lock``, by whichever thread holds it.
        self._sock: zmq.Socket[Any] | None = None
        self._registered = False
        self._refused = False
        self._boot: str | None = None
        self._last_broker = 0.0
        self._next_beat = 0.0
        self._reconnect_at = 0.0
        self._backoff = settings.interval
        self._polled: tuple[Any, Any] = (None, None)
        self._poll = zmq.Poller()
        # What the broker itself says, by type (session messages go to ``inbox``).
        self._handlers: dict[type[Message], Callable[[Any], None]] = {
            Heartbeat: self._on_heartbeat,
            Registered: self._on_registered,
            Refused: self._on_refused,
            Disconnect: self._on_disconnect,
            Error: self._on_error,
        }

    # -- the compute loop's side ---------------------------------------------------
    def start(self) -> None:
        """Connect and register, and start the keeper."""
        with self.lock:
            try:
                self._connect()
            except zmq.ZMQError as exc:  # e.g. a malformed endpoint: nothing to retry
                log.error(
                    "cannot connect to the broker", address=self.settings.address, error=str(exc)
                )
                return  # no keeper: alive() says so
        self._thread = threading.Thread(target=self._keep, name="broker-link", daemon=True)
        self._thread.start()

    def publish(self, figures: dict[str, Any], draining: bool) -> None:
        """What the next heartbeats report (one reference swap: safe across threads)."""
        self._status = (figures, draining)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, reason: str = "worker shutting down") -> None:
        """End the keeper, say goodbye (DISCONNECT) and close the socket."""
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=JOIN_TIMEOUT_S)
        with self.lock:
            self._close_socket(goodbye=self._registered and not self._refused, why=reason)

    def pump(self, timeout: float, also: zmq.Socket[Any] | None = None) -> None:
        """(Lock held.) Wait up to ``timeout`` seconds, never past the next heartbeat,
        for the broker (or for ``also`` to have a message: the worker's peer socket);
        read what came from the broker into ``inbox``; beat, notice a silent broker and
        reconnect when due."""
        now = time.monotonic()
        due = self._next_beat if self._sock is not None else self._reconnect_at
        wait = max(0.0, min(timeout, due - now))
        ms = math.ceil(wait * 1000)
        if self._sock is not None and also is not None:
            ready = dict(self._poller(also).poll(ms))
            if ready.get(self._sock):
                self._from_broker()
        elif self._sock is not None:
            if self._sock.poll(ms, zmq.POLLIN):
                self._from_broker()
        elif also is not None:
            also.poll(ms, zmq.POLLIN)
        elif wait > 0:
            time.sleep(wait)
        now = time.monotonic()
        if self._sock is None:
            if now >= self._reconnect_at and not self._done.is_set():
                self._connect()
        elif now >= self._next_beat:
            self._beat(now)

    def send(self, frames: list[Any], key: SessionKey | None = None) -> str:
        """(Lock held.) Queue a message to the broker; "" when queued, else why not (the
        caller fails session ``key``)."""
        why = "not connected to the broker"
        if self._sock is not None:
            try:
                self._sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
                NET.sent(frames)
                return ""
            except zmq.Again:
                why = "send queue to the broker is full"
        if key is not None:
            self.faults.report("unsent", "message to the broker not sent; session failed", why=why)
        return why

    def _poller(self, also: zmq.Socket[Any]) -> zmq.Poller:
        """A poller of the broker socket and ``also``, made again when either changes."""
        if self._polled != (self._sock, also):
            self._polled = (self._sock, also)
            self._poll = zmq.Poller()
            self._poll.register(self._sock, zmq.POLLIN)
            self._poll.register(also, zmq.POLLIN)
        return self._poll

    # -- the keeper ----------------------------------------------------------------
    def _keep(self) -> None:
        while not self._done.wait(KEEP_POLL_S):
            if not self.lock.acquire(blocking=False):
                continue  # the compute loop drives the socket
            try:
                self.pump(0.0)
            except Exception as exc:  # the link must outlive any one message
                self.faults.report("internal", "broker link turn failed", exc)
            finally:
                self.lock.release()

    # -- the socket ----------------------------------------------------------------
    def _connect(self) -> None:
        s = self.settings
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt_string(zmq.IDENTITY, s.identity)
        sock.setsockopt(zmq.SNDHWM, SOCKET_HWM)
        sock.setsockopt(zmq.RCVHWM, SOCKET_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, s.max_message_bytes)
        if s.keys is not None:
            as_client(sock, s.keys)
        try:
            sock.connect(s.address)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self._sock = sock
        self._registered = False
        now = time.monotonic()
        self._last_broker = now
        self._next_beat = now + s.interval
        self._send(self.register)

    def _close_socket(self, goodbye: bool, why: str = "") -> None:
        if self._sock is None:
            return
        if goodbye:
            self._send(Disconnect(reason=why[:200] or "worker shutting down"))
        self._sock.close(linger=CLOSE_LINGER_MS if goodbye else 0)
        self._sock = None

    def _beat(self, now: float) -> None:
        s = self.settings
        self._next_beat = now + s.interval
        quiet = now - self._last_broker
        if quiet > s.interval * s.liveness:
            why = f"no word from the broker for {quiet:.1f}s"
            if not self._registered:
                # Also what a key mismatch looks like from here (CURVE fails silently), and
                # a key scoped without pins while no other worker has defined the model
                # (the broker holds such a REGISTER unanswered: docs/security.md).
                why += (
                    " (is it up, and do --keys match its CURVE keys? A worker key issued "
                    "for a model without --digest waits until another worker defines it)"
                )
            self._lost(why)
            return
        if not self._registered or self._refused:
            # Unregistered, a REGISTER is already on its way on this socket. Another
            # would make the broker see a restarted worker and fail the sessions it
            # routed here after the first; a broker that never answers is caught above.
            return
        worker_figures, draining = self._status
        figures = {**worker_figures, **self.faults.heartbeat_figures(), **process_figures()}
        self._send(Heartbeat(load=figures, draining=draining))

    def _lost(self, why: str) -> None:
        log.warning("reconnecting to the broker", reason=why, backoff_s=round(self._backoff, 2))
        self.inbox.append(Reset(why))
        self._close_socket(goodbye=False)
        self._reconnect_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, RECONNECT_MAX_S)

    def _register_again(self, why: str) -> None:
        log.warning("registering with the broker again", reason=why)
        self._registered = False
        self.inbox.append(Reset(why))
        self._send(self.register)

    # -- messages ------------------------------------------------------------------
    def _from_broker(self) -> None:
        for _ in range(MAX_MESSAGES_PER_PUMP):
            if self._sock is None:
                return
            try:
                frames = recv_bounded(self._sock, MAX_FRAMES)
            except zmq.Again:
                return
            self._last_broker = time.monotonic()
            if frames is None:
                self.faults.report("malformed", "message with too many frames dropped")
                continue
            NET.received(frames)
            try:
                self._handle(frames)
            except Exception as exc:  # one message costs at most itself
                self.faults.report("internal", "error handling a broker message", exc)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        msg = take_in(frames, self.faults, "the broker")
        if msg is None:
            return
        if isinstance(msg, Undecodable):
            if msg.kind in SESSION_TYPES and msg.key is not None:
                self._deliver(msg)  # the compute loop fails its session
            else:
                self.faults.report("malformed", "malformed message from the broker dropped")
            return
        if type(msg) in SESSION_TYPES:
            self._deliver(msg)
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.faults.report("unexpected", "unexpected message dropped", type=msg.TYPE.value)
        else:
            handler(msg)

    def _on_heartbeat(self, msg: Heartbeat) -> None:
        boot = msg.boot
        if self._registered and self._boot and boot is not None and boot != self._boot:
            self._register_again("the broker restarted (new boot id)")

    def _on_registered(self, msg: Registered) -> None:
        self._registered = True
        self._backoff = self.settings.interval
        self._boot = msg.boot or None
        log.info("registered with the broker", worker=msg.worker_id)

    def _on_refused(self, msg: Refused) -> None:
        self._refused = True
        self.inbox.append(Refusal(msg.reason))

    def _on_disconnect(self, msg: Disconnect) -> None:
        # Unregistered, it answers a message sent before our pending REGISTER (e.g. a
        # second heartbeat in flight to a restarted broker): that REGISTER suffices.
        if self._registered:
            self._register_again(f"the broker asked: {msg.reason[:200]}")

    def _on_error(self, msg: Error) -> None:
        log.debug("the broker reported an error", code=msg.code.value, session=msg.session)

    def _deliver(self, entry: Message | Undecodable) -> None:
        """A session message (decoded, or naming its session) for the compute loop."""
        if len(self.inbox) < INBOX_MAX:
            self.inbox.append(entry)
            return
        self.faults.report("overloaded", "compute loop inbox full; message refused")
        named = session_of(entry)
        if named is not None:
            (session, attempt), rid = named
            why = "worker overloaded"
            self._send(Error.of(ErrorCode.INTERNAL, why, session, attempt=attempt, request_id=rid))

    def _send(self, msg: Message) -> None:
        try:
            frames = encode(msg)
        except ProtocolError as exc:
            self.faults.report("internal", "message cannot be encoded", exc, type=msg.TYPE.value)
            return
        self.send(frames)
