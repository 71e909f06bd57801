"""The broker: the sockets around the registry and the session table.

Two ROUTER sockets: the frontend faces gateways and clients, the backend faces
workers. Everything a peer sends is decoded in one place (``protocol.decode``) and
handled in isolation: a malformed message is counted and dropped, an exception while
handling one is counted and logged and costs at most the session it names. Sends never
block: a peer whose pipe is full is not reading, and loses its sessions. Session
lifecycle lives in :class:`~zmqllm.broker.session_table.SessionTable` (no sockets); worker
bookkeeping in :class:`~zmqllm.broker.registry.Registry`. It never imports torch.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from zmqllm.broker.admission import Admission
from zmqllm.broker.placement import Placements
from zmqllm.broker.registry import Registry, RegistryError, WorkerEntry
from zmqllm.broker.session_records import Out
from zmqllm.broker.session_table import SessionTable
from zmqllm.broker.status import broker_status, no_route_reason
from zmqllm.bus.auth import CLIENTS, WORKERS, Authenticator, ClientKeys, HandshakeMonitor, peer_key
from zmqllm.bus.keys import BrokerKeys, as_server
from zmqllm.bus.messages import (
    Activation,
    Ask,
    Cached,
    Cancel,
    Delta,
    Disconnect,
    Error,
    ErrorCode,
    Heartbeat,
    Message,
    MsgType,
    Open,
    Place,
    Refused,
    Register,
    Registered,
    Status,
    StatusReply,
    Token,
)
from zmqllm.bus.protocol import (
    MAX_FRAMES,
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    VersionMismatch,
    decode,
    encode,
)
from zmqllm.bus.sockets import Drops, recv_bounded
from zmqllm.bus.wire_types import ProtocolError
from zmqllm.config.settings import BrokerSettings
from zmqllm.log import get_logger
from zmqllm.version import __version__

log = get_logger("zmqllm.broker")

# Most messages handled per socket per loop turn, so neither side starves the other.
BATCH = 512
# Messages queued from one peer before ZeroMQ stops reading its connection.
RECV_QUEUE = 1000

# A handler of one message type: (peer, message, its frames, now). Each handler takes its
# own message type; the tables pair them.
ClientHandler = Callable[[bytes, Any, list[Any], float], None]
WorkerHandler = Callable[[WorkerEntry, Any, list[Any], float], None]


class Broker:
    def __init__(
        self,
        settings: BrokerSettings,
        context: zmq.Context | None = None,
        keys: BrokerKeys | None = None,
    ) -> None:
        self.settings = settings
        self.ctx = context or zmq.Context.instance()
        self.keys = keys
        # The ZAP handler must be bound before the sockets: libzmq looks for it when a
        # handshake starts, and without one it lets in anyone who knows our public key.
        self.auth: Authenticator | None = None
        if keys is not None:
            domains = {d: keys.folder / d for d in (CLIENTS, WORKERS)}
            self.auth = Authenticator(self.ctx, domains, keys.folder)
            self.auth.start()
        # The key each client opened sessions with, to end them on revocation.
        self.client_keys = ClientKeys()
        self.boot = uuid.uuid4().hex[:12]
        self.registry = Registry.from_settings(settings)
        self.admission = Admission(self.registry, __version__)
        self.placements = Placements(settings.place_hold, max_holds=settings.max_workers)
        self.table = SessionTable(
            self.registry,
            self.boot,
            queue_size=settings.queue_size,
            queue_timeout=settings.queue_timeout,
            session_timeout=settings.session_timeout,
            full_backoff=settings.heartbeat_interval,
        )
        self.drops = Drops("zmqllm.broker")
        self.started = time.monotonic()
        self.frontend = self._router(
            settings.frontend,
            settings.frontend_max_message_bytes,
            settings.peer_queue,
            handover=False,
            domain=CLIENTS,
        )
        # With keys, a routing id belongs to the connection that has it: a second peer
        # (another allowed key) must not take a registered worker's pipe over.
        self.backend = self._router(
            settings.backend,
            settings.max_message_bytes,
            settings.worker_queue,
            handover=keys is None,
            domain=WORKERS,
        )
        self.monitor = (
            HandshakeMonitor({"frontend": self.frontend, "backend": self.backend})
            if keys is not None
            else None
        )
        # The last STATUS reply's body, reused until anything else happens (a flood of
        # STATUS must not rebuild the status of every worker for each request).
        self._status_body: StatusReply | None = None
        self._status_at = 0.0
        self._stop = False
        self._next_beat = 0.0
        self._backend_read_at = 0.0  # when the backend was last read to empty
        # What each side may send, by message type (a REGISTER is handled before a worker
        # is known, so it is not in the workers' table).
        self._client_handlers: dict[type[Message], ClientHandler] = {
            Open: self._client_open,
            Ask: self._client_open,
            Cancel: self._client_cancel,
            Heartbeat: self._client_heartbeat,
            Status: self._client_status,
        }
        self._worker_handlers: dict[type[Message], WorkerHandler] = {
            Heartbeat: self._worker_heartbeat,
            Activation: self._worker_activation,
            Token: self._worker_token,
            Delta: self._worker_delta,
            Cached: self._worker_cached,
            Error: self._worker_error,
            Disconnect: self._worker_disconnect,
        }

    def _router(
        self, address: str, max_bytes: int, hwm: int, handover: bool, domain: str
    ) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.keys is not None:
            as_server(sock, self.keys, domain)
        if self.keys is not None and domain == WORKERS:
            # Without handover (see above) a silent connection, a host cut off, would keep its
            # routing id from the worker's next one: ZeroMQ's own heartbeats close it first.
            interval_ms = max(1, round(self.settings.heartbeat_interval * 1000))
            sock.setsockopt(zmq.HEARTBEAT_IVL, interval_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, interval_ms * self.settings.heartbeat_liveness)
        # Unknown peer -> an error we handle, not a silent drop; with NOBLOCK a full
        # pipe -> EAGAIN instead of the whole broker waiting on one peer.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A worker reconnecting keeps its routing id (the old pipe may not be gone yet).
        # Clients pick a fresh id per connection: on the frontend a second peer with a
        # live client's id would take over its pipe, so there it is refused instead.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1 if handover else 0)
        # ZeroMQ disconnects a peer that sends a larger message, before we see it.
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes + MAX_HEADER_BYTES)
        sock.setsockopt(zmq.SNDHWM, hwm)
        # Inbound, a short queue per peer: a flooding peer waits (or drops) on its own
        # side instead of the broker buffering its flood.
        sock.setsockopt(zmq.RCVHWM, RECV_QUEUE)
        sock.bind(address)
        return sock

    @property
    def endpoints(self) -> tuple[str, str]:
        """Bound addresses (useful when a port was 0, chosen by the OS)."""
        return (
            self.frontend.getsockopt_string(zmq.LAST_ENDPOINT),
            self.backend.getsockopt_string(zmq.LAST_ENDPOINT),
        )

    # -- main loop -------------------------------------------------------------
    def stop(self, *_: object) -> None:
        self._stop = True

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        monitors = self.monitor.monitors if self.monitor is not None else {}
        for monitor in monitors:
            poller.register(monitor, zmq.POLLIN)
        log.info(
            "broker started",
            frontend=self.endpoints[0],
            backend=self.endpoints[1],
            boot=self.boot,
            version=__version__,
            curve=self.keys is not None,
        )
        try:
            while not self._stop:
                timeout = max(0.0, self._next_beat - time.monotonic())
                events = dict(poller.poll(int(timeout * 1000) + 1))
                if self.backend not in events:
                    self._backend_read_at = time.monotonic()
                if self.backend in events:
                    self._drain(self.backend, self.on_worker_message, "backend")
                if self.frontend in events:
                    self._drain(self.frontend, self.on_client_message, "frontend")
                for monitor in monitors:
                    if monitor in events:
                        self.monitor.read(monitor)  # type: ignore[union-attr]
                if time.monotonic() >= self._next_beat:
                    self.tick()
        finally:
            self.close()

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close([self.frontend, self.backend])
        self.frontend.close(linger=0)
        self.backend.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        log.info("broker stopped")

    def _drain(
        self, sock: zmq.Socket, handler: Callable[[bytes, Message, list[Any]], None], side: str
    ) -> None:
        for _ in range(BATCH):
            try:
                frames = recv_bounded(sock, 1 + MAX_FRAMES)
            except zmq.Again:
                if sock is self.backend:
                    self._backend_read_at = time.monotonic()
                return
            if frames is None or len(frames) < 2:
                self._status_body = None  # the counters move
                self.drops.drop(f"{side}:frames")
                continue
            identity = frames[0].bytes
            domain = WORKERS if side == "backend" else CLIENTS
            if self.auth is not None and not self.auth.admits(domain, peer_key(frames)):
                # Connected before its key was removed, or a revoked or expired ticket's:
                # nothing it sends counts now. The last two are told why (a REFUSED makes
                # a worker exit; `--join` shows it).
                self._status_body = None
                self.drops.drop(f"{side}:revoked", peer=identity.hex()[:32])
                why = self.auth.refusal(domain, peer_key(frames))
                if why is not None:
                    to = Out.to_worker if side == "backend" else Out.to_client
                    self.send([to(identity, Refused(reason=why))])
                continue
            try:
                msg = decode(frames[1:])
            except VersionMismatch as exc:
                self._status_body = None
                self.drops.drop(f"{side}:version", peer=identity.hex()[:32], error=exc)
                if side == "backend" and exc.kind == MsgType.REGISTER.value:
                    # Told in a REFUSED, which peers of every version read.
                    why = (
                        f"protocol version {exc.version} differs from the broker's "
                        f"{PROTOCOL_VERSION}: run the same zmqllm release on both"
                    )
                    self.send([Out.to_worker(identity, Refused(reason=why))])
                continue
            except ProtocolError as exc:
                self._status_body = None
                self.drops.drop(f"{side}:malformed", peer=identity.hex()[:32], error=exc)
                continue
            if not isinstance(msg, Status):
                self._status_body = None
            try:
                handler(identity, msg, frames)
            except Exception as exc:  # a bug handling one message must not stop the broker
                self.drops.error(f"{side}:{msg.TYPE.value}", exc)
                self._fail_named_session(identity, msg, side)

    def _fail_named_session(self, identity: bytes, msg: Message, side: str) -> None:
        """After an unexpected error: fail the session the message named, if any."""
        session = getattr(msg, "session", "")
        if not session:
            return
        try:
            s = (
                self.table.sessions.get((identity, session))
                if side == "frontend"
                else self.table.by_wire.get(session)
            )
            if s is not None:
                self.send(
                    self.table.fail(s, time.monotonic(), ErrorCode.INTERNAL, "internal error")
                )
            elif side == "frontend":
                # Not open: an OPEN that failed half way may have left it queued, to be
                # routed later behind its client's back. Dequeued; its client is told.
                key = (identity, session)
                self.table.queue = deque(p for p in self.table.queue if p.key != key)
                err = Error.of(
                    ErrorCode.INTERNAL, "internal error", session, request_id=msg.request_id
                )
                self.send([Out.to_client(identity, err)])
        except Exception as exc:
            self.drops.error("fail-session", exc)

    def tick(self) -> None:
        """Heartbeats out, dead workers out, deadlines, queue in; each step isolated."""
        now = time.monotonic()
        self._status_body = None
        self._next_beat = now + self.settings.heartbeat_interval
        for step in (self._revoke, self._beat_workers, self._expire):
            try:
                step(now)
            except Exception as exc:
                self.drops.error(f"tick:{step.__name__}", exc)

    def _beat_workers(self, now: float) -> None:
        beat = encode(Heartbeat(boot=self.boot))
        horizon = self.settings.heartbeat_interval * self.settings.heartbeat_liveness
        for w in list(self.registry.workers.values()):
            # Silent up to the last time everything that had arrived was read: a broker
            # behind on its backend (a flood) must not take unread heartbeats for silence.
            silent = self._backend_read_at - w.last_seen
            if silent > horizon:
                self.remove_worker(
                    w,
                    f"worker {w.worker_id} (layers {w.start}:{w.end}) "
                    f"stopped answering for {silent:.1f}s",
                )
            else:
                self.send([Out.to_worker(w.identity, frames=beat)])

    def _revoke(self, now: float) -> None:
        """After a key file was removed: its workers are refused and removed, its
        clients lose their sessions."""
        if self.auth is None:
            return
        live = {key[0] for key in self.table.sessions} | {p.key[0] for p in self.table.queue}
        # Every tick, not only when a rescan reports a change: the ZAP thread's rescan
        # may be the one that saw it.
        self.auth.refresh()
        for client in self.client_keys.revoked(self.auth, live):
            log.warning("client key revoked; ending its sessions", peer=client.hex()[:32])
            self.send(self.table.client_lost(client, ErrorCode.CANCELLED, "key revoked", now))
        for w in list(self.registry.workers.values()):
            if not self.auth.admits(WORKERS, w.key):
                why = self.auth.refusal(WORKERS, w.key) or "this worker's key was revoked"
                self.send([Out.to_worker(w.identity, Refused(reason=why))])
                self.remove_worker(
                    w, f"worker {w.worker_id} (layers {w.start}:{w.end}): key revoked"
                )

    def _expire(self, now: float) -> None:
        self.send(self.table.tick(now, self._no_route_reason))

    # -- sending ---------------------------------------------------------------
    def send(self, outs: list[Out]) -> None:
        """Send without ever blocking; a peer we cannot reach loses its sessions."""
        todo = deque(outs)
        while todo:
            out = todo.popleft()
            frames = out.frames if out.frames is not None else encode(out.msg)  # type: ignore[arg-type]
            sock = self.backend if out.for_worker else self.frontend
            try:
                sock.send_multipart([out.identity, *frames], copy=False, flags=zmq.NOBLOCK)
                continue
            except zmq.ZMQError as exc:  # EHOSTUNREACH: gone; EAGAIN: not reading
                error = exc
            now = time.monotonic()
            slow = error.errno == zmq.EAGAIN
            if out.for_worker:
                w = self.registry.by_identity.get(out.identity)
                if w is not None:
                    why = "not reading (queue full)" if slow else "unreachable"
                    why = f"worker {w.worker_id} (layers {w.start}:{w.end}) {why}"
                    todo.extend(self._remove(w, why, now))
            elif slow:
                self.drops.drop("frontend:slow_consumer", peer=out.identity.hex()[:32])
                todo.extend(
                    self.table.client_lost(
                        out.identity, ErrorCode.SLOW_CONSUMER, "not reading its messages", now
                    )
                )
                # Its pipe is full, so no ERROR can reach it now: its own deadlines end
                # its streams (the gateway's inter-token timeout), and later messages
                # about them match nothing.
            else:
                todo.extend(
                    self.table.client_lost(out.identity, ErrorCode.CANCELLED, "client gone", now)
                )

    # -- clients ---------------------------------------------------------------
    def on_client_message(self, client: bytes, msg: Message, frames: list[Any]) -> None:
        handler = self._client_handlers.get(type(msg))
        if handler is not None:
            handler(client, msg, frames, time.monotonic())
            return
        self.drops.drop("frontend:not_allowed", type=msg.TYPE.value)
        session = getattr(msg, "session", "")
        text = f"a client cannot send {msg.TYPE.value}"
        reply = Error.of(ErrorCode.BAD_REQUEST, text, session, request_id=msg.request_id)
        self.send([Out.to_client(client, reply)])

    def _client_open(self, client: bytes, msg: Open | Ask, frames: list[Any], now: float) -> None:
        if self.auth is not None:
            self.client_keys.opened(client, frames)
        self.send(self.table.open(client, msg, now))

    def _client_cancel(self, client: bytes, msg: Cancel, frames: list[Any], now: float) -> None:
        self.send(self.table.cancel(client, msg.session, now))

    def _client_heartbeat(
        self, client: bytes, msg: Heartbeat, frames: list[Any], now: float
    ) -> None:
        self.send([Out.to_client(client, Heartbeat(boot=self.boot))])

    def _client_status(self, client: bytes, msg: Status, frames: list[Any], now: float) -> None:
        self.send([Out.to_client(client, self._status_reply(msg.request_id, now))])

    # -- workers ---------------------------------------------------------------
    def on_worker_message(self, identity: bytes, msg: Message, frames: list[Any]) -> None:
        key = peer_key(frames) if self.auth is not None else None
        w = self.registry.by_identity.get(identity)
        if key is not None and w is not None and w.key != key:
            # Another key speaking with a registered worker's routing id.
            self.drops.drop("backend:wrong_key", worker=w.worker_id, type=msg.TYPE.value)
            return
        if isinstance(msg, Register):
            self.on_register(identity, msg, key or "")
            return
        if isinstance(msg, Place):
            self.on_place(identity, msg, key or "")
            return
        if w is None:
            # A worker from before a broker restart: tell it to register again.
            self.drops.drop("backend:unknown_peer", type=msg.TYPE.value)
            if isinstance(msg, Heartbeat):
                reply = Disconnect(reason="unknown worker: register again")
                self.send([Out.to_worker(identity, reply)])
            return
        now = time.monotonic()
        w.last_seen = now
        handler = self._worker_handlers.get(type(msg))
        if handler is None:
            self.drops.drop("backend:not_allowed", type=msg.TYPE.value, worker=w.worker_id)
        else:
            handler(w, msg, frames, now)

    def _worker_heartbeat(
        self, w: WorkerEntry, msg: Heartbeat, frames: list[Any], now: float
    ) -> None:
        w.heard(msg.load or {}, time.monotonic())
        w.draining = msg.draining

    def _worker_activation(
        self, w: WorkerEntry, msg: Activation, frames: list[Any], now: float
    ) -> None:
        self.send(self.table.on_activation(w, msg, frames[1:], now))

    def _worker_token(self, w: WorkerEntry, msg: Token, frames: list[Any], now: float) -> None:
        self.send(self.table.on_token(w, msg, now))

    def _worker_delta(self, w: WorkerEntry, msg: Delta, frames: list[Any], now: float) -> None:
        self.send(self.table.on_delta(w, msg, now))

    def _worker_cached(self, w: WorkerEntry, msg: Cached, frames: list[Any], now: float) -> None:
        self.send(self.table.on_cached(w, msg, now))

    def _worker_error(self, w: WorkerEntry, msg: Error, frames: list[Any], now: float) -> None:
        self.send(self.table.on_worker_error(w, msg, now))

    def _worker_disconnect(
        self, w: WorkerEntry, msg: Disconnect, frames: list[Any], now: float
    ) -> None:
        self.remove_worker(
            w, f"worker {w.worker_id} (layers {w.start}:{w.end}) left: {msg.reason[:200]}"
        )

    def on_register(self, identity: bytes, reg: Register, key: str = "") -> None:
        # A key issued for one model, layer range and model definition registers nothing
        # else (admission.py).
        claims = self.auth.claims(WORKERS, key) if self.auth is not None and key else {}
        verdict = self.admission.check(identity, reg, key, claims)
        if verdict.waits:
            # Unanswered: the worker registers again after its backoff.
            self.drops.drop("backend:register_waits", why=verdict.waits)
            return
        if verdict.reply is not None:
            self.drops.drop("backend:refused", why=verdict.refused)
            self.send([Out.to_worker(identity, verdict.reply)])
            return
        now = time.monotonic()
        old = self.registry.by_identity.get(identity)
        if old is not None:
            self.send(self._remove(old, f"worker {old.worker_id} registered again", now))
        try:
            w = self.registry.add(identity, reg, key)
        except RegistryError as exc:  # refusal() said yes, but the state moved meanwhile
            self.send([Out.to_worker(identity, Refused(reason=str(exc)))])
            return
        self.placements.registered(identity, w.served, w.start, w.end)
        log.info(
            "worker registered",
            worker=w.worker_id,
            model=w.served,
            digest=reg.fingerprint,
            text_model=w.text_model,
            layers=f"{w.start}:{w.end}",
            capacity=w.capacity,
            max_kv_tokens=w.max_kv_tokens,
        )
        out = [Out.to_worker(identity, Registered(worker_id=w.worker_id, boot=self.boot))]
        self.send(out + self.table.dispatch(now))

    def on_place(self, identity: bytes, msg: Place, key: str = "") -> None:
        """A worker started with --layers auto asks which layers to load (placement.py)."""
        claims = self.auth.claims(WORKERS, key) if self.auth is not None and key else {}
        reply = self.placements.place(self.registry, identity, msg, claims)
        if isinstance(reply, Refused):
            self.drops.drop("backend:place_refused", why=reply.reason)
        elif msg.hold:
            log.info(
                "worker placed",
                peer=identity.hex()[:32],
                model=msg.served,
                layers=f"{reply.start}:{reply.end}",
                why=reply.why,
                figures=msg.figures,
            )
        self.send([Out.to_worker(identity, reply)])

    def remove_worker(self, w: WorkerEntry, reason: str) -> None:
        self.send(self._remove(w, reason, time.monotonic()))

    def _remove(self, w: WorkerEntry, reason: str, now: float) -> list[Out]:
        if self.registry.workers.get(w.worker_id) is not w:
            return []
        self.registry.remove(w)
        log.warning("worker removed", worker=w.worker_id, reason=reason)
        return self.table.worker_lost(w.worker_id, reason, now)

    def _no_route_reason(self, model: str = "") -> str:
        return no_route_reason(self.registry, self.settings.queue_timeout, model)

    # -- status ----------------------------------------------------------------
    def _status_reply(self, request_id: str, now: float) -> StatusReply:
        """The status, rebuilt only if anything happened since the last one (or a
        second passed: ages in it move)."""
        cached = self._status_body
        if cached is None or now - self._status_at > 1.0:
            cached = self._status_body = StatusReply.of(self.status())
            self._status_at = now
        return StatusReply(request_id=request_id, body=cached.body)

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return broker_status(
            self.registry,
            self.table,
            boot=self.boot,
            uptime_s=now - self.started,
            now=now,
            dropped=self.drops.counts,
            curve=self.keys is not None,
            auth_refused=self.auth.denied.counts if self.auth is not None else {},
            handshake_failures=self.monitor.counts if self.monitor else {},
        )
