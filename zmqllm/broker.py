"""The broker: worker registry, pools, sticky routes, heartbeats and the queue.

Two ROUTER sockets: the frontend faces gateways and clients, the backend faces
workers. A session's route (one worker per layer range, chained to cover
[0, L)) is chosen once and kept: its KV caches live on those workers.
Activation payloads are forwarded as the very frame objects received; the
broker reads only the small header. It never imports torch.

Verbs are methods named after the message they handle, in the manner of the
ZeroMQ guide's Majordomo broker.
"""

from __future__ import annotations

import contextlib
import signal
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from zmqllm import __version__
from zmqllm.broker_state import Pending, Registry, Session, WorkerEntry
from zmqllm.config import BrokerSettings
from zmqllm.log import bind_request, get_logger
from zmqllm.protocol import (
    Header,
    MsgType,
    Payload,
    ProtocolError,
    decode,
    encode,
    encode_header,
    error_header,
)

log = get_logger("zmqllm.broker")

# Heartbeat constants (Paranoid Pirate): a peer silent for LIVENESS intervals is dead.
DEFAULT_HEARTBEAT_INTERVAL = 1.0
DEFAULT_HEARTBEAT_LIVENESS = 3
# Most messages handled per socket per loop turn, so neither side starves the other.
BATCH = 512


@dataclass
class BrokerStats:
    started: float = field(default_factory=time.monotonic)
    sessions_opened: int = 0
    sessions_finished: int = 0
    sessions_failed: int = 0
    tokens: int = 0
    dropped: int = 0


class Broker:
    def __init__(self, settings: BrokerSettings, context: zmq.Context | None = None) -> None:
        self.s = settings
        self.ctx = context or zmq.Context.instance()
        self.boot = uuid.uuid4().hex[:12]
        self.registry = Registry()
        self.sessions: dict[str, Session] = {}  # by the client's session id
        self.by_wire: dict[str, Session] = {}  # by the id workers know (see Session.wire)
        self.queue: deque[Pending] = deque()
        self.stats = BrokerStats()
        self.frontend = self._router(settings.frontend)
        self.backend = self._router(settings.backend)
        self._stop = False
        self._next_beat = 0.0

    def _router(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # Unknown peer -> an error we handle, not a silent drop.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A restarted peer may reuse its routing id.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, self.s.max_message_bytes)
        # At the HWM a ROUTER drops; keep it high enough for every session's
        # in-flight step, yet bounded.
        sock.setsockopt(zmq.SNDHWM, 10000)
        sock.setsockopt(zmq.RCVHWM, 10000)
        sock.bind(address)
        return sock

    @property
    def endpoints(self) -> tuple[str, str]:
        """Bound addresses (useful when a port was 0, chosen by the OS)."""
        return (
            self.frontend.getsockopt_string(zmq.LAST_ENDPOINT),
            self.backend.getsockopt_string(zmq.LAST_ENDPOINT),
        )

    # -- main loop -----------------------------------------------------------
    def stop(self, *_: object) -> None:
        self._stop = True

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        log.info(
            "broker started",
            frontend=self.endpoints[0],
            backend=self.endpoints[1],
            boot=self.boot,
            version=__version__,
        )
        try:
            while not self._stop:
                timeout = max(0.0, self._next_beat - time.monotonic())
                events = dict(poller.poll(int(timeout * 1000) + 1))
                if self.backend in events:
                    self._drain(self.backend, self.on_worker_message)
                if self.frontend in events:
                    self._drain(self.frontend, self.on_client_message)
                if time.monotonic() >= self._next_beat:
                    self.tick()
        finally:
            self.close()

    def close(self) -> None:
        self.frontend.close(linger=0)
        self.backend.close(linger=0)
        log.info("broker stopped")

    def _drain(self, sock: zmq.Socket, handler: Any) -> None:
        for _ in range(BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) < 2:
                self.stats.dropped += 1
                continue
            identity = frames[0].bytes
            try:
                header, payloads = decode(frames[1:])
            except ProtocolError as exc:
                self.stats.dropped += 1
                log.warning(
                    "malformed message dropped",
                    peer=identity.decode(errors="replace"),
                    error=str(exc),
                )
                continue
            try:
                handler(identity, header, payloads, frames)
            except Exception:  # a bug handling one message must not stop the broker
                log.exception("error handling message", type=header.type.value)

    def tick(self) -> None:
        """Heartbeats out, dead workers out, stale requests out, queue in."""
        now = time.monotonic()
        self._next_beat = now + self.s.heartbeat_interval
        beat = encode(Header(MsgType.HEARTBEAT, fields={"boot": self.boot}))
        horizon = self.s.heartbeat_interval * self.s.heartbeat_liveness
        for w in list(self.registry.workers.values()):
            if now - w.last_seen > horizon:
                self.remove_worker(
                    w,
                    f"worker {w.worker_id} (layers {w.start}:{w.end}) "
                    f"stopped answering for {now - w.last_seen:.1f}s",
                )
            else:
                self._to_worker(w, beat)
        while self.queue and now - self.queue[0].enqueued > self.s.queue_timeout:
            p = self.queue.popleft()
            self._fail_pending(p, "no_capacity", self._no_route_reason(p.max_len))
        self.dispatch()

    # -- sending -------------------------------------------------------------
    def _to_worker(self, w: WorkerEntry, frames: list[Any]) -> bool:
        try:
            self.backend.send_multipart([w.identity, *frames], copy=False)
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH: gone; EAGAIN: at HWM
            self.remove_worker(
                w, f"worker {w.worker_id} (layers {w.start}:{w.end}) unreachable ({exc.strerror})"
            )
            return False

    def _to_client(self, identity: bytes, frames: list[Any]) -> bool:
        try:
            self.frontend.send_multipart([identity, *frames], copy=False)
            return True
        except zmq.ZMQError:
            return False

    def _error_to_client(
        self, identity: bytes, session: str, request_id: str, code: str, message: str
    ) -> None:
        self._to_client(identity, encode(error_header(code, message, session, request_id)))

    # -- clients -------------------------------------------------------------
    def on_client_message(
        self, client: bytes, h: Header, payloads: list[Payload], frames: list[Any]
    ) -> None:
        if h.type is MsgType.OPEN:
            self.on_open(client, h, payloads, frames)
        elif h.type in (MsgType.CANCEL, MsgType.CLOSE):
            self.on_cancel(h)
        elif h.type is MsgType.HEARTBEAT:
            self._to_client(client, encode(Header(MsgType.HEARTBEAT, fields={"boot": self.boot})))
        elif h.type is MsgType.STATUS:
            reply = Header(
                MsgType.STATUS_REPLY, request_id=h.request_id, fields={"status": self.status()}
            )
            self._to_client(client, encode(reply))
        else:
            self._error_to_client(
                client,
                h.session,
                h.request_id,
                "bad_request",
                f"a client cannot send {h.type.value}",
            )

    def on_open(self, client: bytes, h: Header, payloads: list[Payload], frames: list[Any]) -> None:
        with bind_request(h.request_id, h.session):
            f = h.fields
            problem = None
            if h.session in self.sessions or any(p.session == h.session for p in self.queue):
                problem = f"session {h.session} is already open"
            elif not h.session:
                problem = "OPEN needs a session id"
            elif (
                len(payloads) != 1
                or payloads[0].dtype != "int32"
                or payloads[0].array.shape != (f["prompt_len"],)
            ):
                problem = "OPEN needs one payload: the prompt's int32 token ids [prompt_len]"
            elif f["max_tokens"] <= 0 or f["prompt_len"] <= 0:
                problem = "max_tokens and prompt_len must be positive"
            elif (
                self.registry.num_layers
                and f["prompt_len"] + f["max_tokens"] > self.registry.context
            ):
                problem = (
                    f"prompt ({f['prompt_len']}) + max_tokens ({f['max_tokens']}) exceed "
                    f"the model's context of {self.registry.context} tokens"
                )
            if problem:
                self._error_to_client(client, h.session, h.request_id, "bad_request", problem)
                return
            if len(self.queue) >= self.s.queue_size:
                self._error_to_client(
                    client,
                    h.session,
                    h.request_id,
                    "busy",
                    f"the broker queue is full ({self.s.queue_size} requests); retry shortly",
                )
                return
            self.queue.append(Pending(client, h, frames[2], f["prompt_len"] + f["max_tokens"]))
            log.debug("request queued", queue=len(self.queue))
            self.dispatch()

    def on_cancel(self, h: Header) -> None:
        s = self.sessions.get(h.session)
        if s is not None:
            with bind_request(s.request_id, s.id):
                log.info("session cancelled by client", step=s.step)
                self.end_session(s, failed=False)
            return
        for p in list(self.queue):
            if p.session == h.session:
                self.queue.remove(p)

    # -- routing -------------------------------------------------------------
    def dispatch(self) -> None:
        """Open queued sessions, oldest first, while a route with room exists."""
        while self.queue:
            p = self.queue[0]
            route = self.registry.find_route(p.max_len)
            if route is None:
                return
            self.queue.popleft()
            self.open_session(p, route)

    def open_session(self, p: Pending, route: list[WorkerEntry]) -> None:
        h = p.header
        s = Session(
            h.session,
            p.client,
            h.request_id,
            [w.worker_id for w in route],
            p.max_len,
            h.fields["max_tokens"],
            pending=p,
        )
        p.attempts += 1
        s.wire = s.id if p.attempts == 1 else f"{s.id}.{p.attempts}"
        self.sessions[s.id] = s
        self.by_wire[s.wire] = s
        self.registry.reserve(route, s.id, p.max_len)
        self.stats.sessions_opened += 1
        with bind_request(s.request_id, s.id):
            log.info(
                "session opened",
                route=s.route,
                queue_wait_ms=round((time.monotonic() - p.enqueued) * 1e3, 1),
            )
            n = len(route)
            # Later stages first: each must hold the session before stage 0's
            # activations can reach it (per-peer ordering keeps OPEN ahead).
            for i in reversed(range(n)):
                # next: where stage i's results go (the last stage's STEPs go to the
                # first); a worker groups its results by it (see Worker._tag_groups).
                nxt = route[(i + 1) % n].worker_id
                fields = dict(h.fields, stage=i, stages=n, max_len=p.max_len, next=nxt)
                header = Header(MsgType.OPEN, s.wire, s.request_id, 0, fields)
                if i == 0:
                    # The prompt frame goes on as received (same frame object).
                    spec = [("int32", [p.header.fields["prompt_len"]])]
                    frames = [encode_header(header, spec), p.tokens]
                else:
                    frames = encode(header)
                if not self._to_worker(route[i], frames):
                    return  # remove_worker already failed this session

    def on_worker_message(
        self, identity: bytes, h: Header, payloads: list[Payload], frames: list[Any]
    ) -> None:
        w = self.registry.by_identity.get(identity)
        if h.type is MsgType.REGISTER:
            self.on_register(identity, h)
            return
        if w is None:
            # A worker from before a broker restart: tell it to register again.
            reply = Header(MsgType.DISCONNECT, fields={"reason": "unknown worker: register again"})
            with contextlib.suppress(zmq.ZMQError):
                self.backend.send_multipart([identity, *encode(reply)])
            return
        w.last_seen = time.monotonic()
        if h.type is MsgType.HEARTBEAT:
            load = h.fields.get("load")
            if isinstance(load, dict):
                w.load = load
                w.draining = bool(load.get("draining", False))
        elif h.type is MsgType.ACTIVATION:
            self.on_activation(w, h, frames)
        elif h.type is MsgType.TOKEN:
            self.on_token(w, h)
        elif h.type is MsgType.ERROR:
            self.on_worker_error(w, h)
        elif h.type is MsgType.DISCONNECT:
            self.remove_worker(
                w, f"worker {w.worker_id} (layers {w.start}:{w.end}) left: {h.fields.get('reason')}"
            )
        else:
            log.warning(
                "unexpected message from worker dropped", type=h.type.value, worker=w.worker_id
            )

    def on_register(self, identity: bytes, h: Header) -> None:
        f = h.fields
        info = f["info"]
        fp = info.get("fingerprint") if isinstance(info.get("fingerprint"), dict) else {}
        reason = self.registry.refusal(
            f["version"], __version__, f["fingerprint"], fp, f["start"], f["end"], f["num_layers"]
        )
        if reason:
            log.warning("worker refused", peer=identity.decode(errors="replace"), reason=reason)
            self.backend.send_multipart(
                [identity, *encode(Header(MsgType.REFUSED, fields={"reason": reason}))]
            )
            return
        old = self.registry.by_identity.get(identity)
        if old is not None:
            self.remove_worker(old, f"worker {old.worker_id} registered again")
        w = self.registry.add(identity, f, info)
        log.info(
            "worker registered",
            worker=w.worker_id,
            layers=f"{w.start}:{w.end}",
            capacity=w.capacity,
            max_kv_tokens=w.max_kv_tokens,
        )
        self._to_worker(
            w,
            encode(
                Header(MsgType.REGISTERED, fields={"worker_id": w.worker_id, "boot": self.boot})
            ),
        )
        self.dispatch()

    def on_activation(self, w: WorkerEntry, h: Header, frames: list[Any]) -> None:
        s = self.by_wire.get(h.session)
        if s is None:
            return  # cancelled meanwhile; the stage already freed or will free it
        try:
            i = s.route.index(w.worker_id)
        except ValueError:
            log.warning("activation from a worker off the route dropped", worker=w.worker_id)
            return
        if i + 1 >= len(s.route):
            log.warning("activation from the last stage dropped", worker=w.worker_id)
            return
        nxt = self.registry.workers.get(s.route[i + 1])
        if nxt is not None:
            # Same frame objects on: header and payload untouched.
            self._to_worker(nxt, frames[1:])

    def on_token(self, w: WorkerEntry, h: Header) -> None:
        s = self.by_wire.get(h.session)
        if s is None or s.route[-1] != w.worker_id:
            return
        finish = h.fields["finish"]
        fields: dict[str, Any] = {"token": h.fields["token"], "finish": finish}
        if h.step == 0:
            fields["route"] = s.route
            fields["boot"] = self.boot  # lets the client tell this broker's sessions apart
            s.pending = None  # from here on the request cannot start over elsewhere
        self.stats.tokens += 1
        s.step = h.step
        ok = self._to_client(
            s.client, encode(Header(MsgType.TOKEN, s.id, s.request_id, h.step, fields))
        )
        if not ok:
            with bind_request(s.request_id, s.id):
                log.info("client gone; session cancelled", step=h.step)
            self.end_session(s, failed=True)
        elif finish is not None:
            with bind_request(s.request_id, s.id):
                log.info("session finished", finish=finish, tokens=h.step + 1)
            self.end_session(s, failed=False)
        else:
            first = self.registry.workers.get(s.route[0])
            if first is not None:
                step_fields: dict[str, Any] = {"token": h.fields["token"]}
                if "group" in h.fields:
                    step_fields["group"] = h.fields["group"]  # passed on for stage 0
                step = Header(MsgType.STEP, s.wire, s.request_id, h.step + 1, step_fields)
                self._to_worker(first, encode(step))

    def on_worker_error(self, w: WorkerEntry, h: Header) -> None:
        s = self.by_wire.get(h.session)
        if s is None:
            log.warning(
                "worker error",
                worker=w.worker_id,
                code=h.fields["code"],
                message=h.fields["message"],
            )
            return
        with bind_request(s.request_id, s.id):
            code = h.fields["code"]
            if code == "full" and s.pending is not None:
                # The worker had no room after all: undo, remember, retry.
                log.info("worker full; request requeued", worker=w.worker_id)
                w.full_until = time.monotonic() + self.s.heartbeat_interval
                pending = s.pending
                self.end_session(s, failed=False, count=False)
                self.queue.appendleft(pending)
                # Retry now, while full_until still steers the route away from this
                # worker; waiting for the next tick stalls the request an interval and
                # may find full_until expired, sending it back to the same full worker.
                self.dispatch()
                return
            log.warning("session failed on worker", worker=w.worker_id, code=code)
            self._error_to_client(s.client, s.id, s.request_id, code, h.fields["message"])
            self.end_session(s, failed=True)

    def end_session(self, s: Session, failed: bool, count: bool = True) -> None:
        """Forget a session and free its caches on every stage of its route."""
        self.sessions.pop(s.id, None)
        self.by_wire.pop(s.wire, None)
        self.registry.release(s.route, s.id, s.max_len)
        close = encode(Header(MsgType.CLOSE, s.wire, s.request_id))
        for wid in s.route:
            w = self.registry.workers.get(wid)
            if w is not None:
                self._to_worker(w, close)
        if count:
            if failed:
                self.stats.sessions_failed += 1
            else:
                self.stats.sessions_finished += 1
        self.dispatch()

    def remove_worker(self, w: WorkerEntry, reason: str) -> None:
        if self.registry.workers.get(w.worker_id) is not w:
            return
        self.registry.remove(w)
        log.warning("worker removed", worker=w.worker_id, reason=reason)
        requeued: list[Pending] = []
        for s in [s for s in self.sessions.values() if w.worker_id in s.route]:
            with bind_request(s.request_id, s.id):
                if s.pending is not None:
                    # No token has reached the client: it loses nothing if the request
                    # starts again on another route (e.g. a drained worker that left
                    # while an OPEN for it was on its way).
                    log.info("worker lost before the first token; request requeued")
                    self.end_session(s, failed=False, count=False)
                    requeued.append(s.pending)
                    continue
                log.warning("session failed: worker lost", worker=w.worker_id)
                self._error_to_client(s.client, s.id, s.request_id, "worker_lost", reason)
                self.end_session(s, failed=True)
        if requeued:
            self.queue.extendleft(reversed(requeued))  # ahead of newer requests, in order
            self.dispatch()

    def _fail_pending(self, p: Pending, code: str, message: str) -> None:
        with bind_request(p.header.request_id, p.session):
            log.warning("request failed in queue", code=code)
        self._error_to_client(p.client, p.session, p.header.request_id, code, message)

    def _no_route_reason(self, max_len: int) -> str:
        if not self.registry.workers:
            return f"no capacity: no worker registered after {self.s.queue_timeout:g}s"
        missing = self.registry.uncovered()
        if missing:
            return (
                f"no capacity: no complete route (layers {missing} have no worker) "
                f"after {self.s.queue_timeout:g}s"
            )
        return (
            f"no capacity: no route with room for {max_len} tokens after {self.s.queue_timeout:g}s"
        )

    # -- status --------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        st = self.stats
        return {
            "boot": self.boot,
            "version": __version__,
            "uptime_s": round(now - st.started, 1),
            "num_layers": self.registry.num_layers,
            "complete_route": self.registry.find_route(1, ignore_room=True) is not None,
            "queue": len(self.queue),
            "sessions": len(self.sessions),
            "workers": [w.describe(now) for w in self.registry.workers.values()],
            "pools": self.registry.pools(),
            "routes": self.registry.route_shapes(),
            "counters": {
                "sessions_opened": st.sessions_opened,
                "sessions_finished": st.sessions_finished,
                "sessions_failed": st.sessions_failed,
                "tokens": st.tokens,
                "dropped_messages": st.dropped,
            },
        }


def serve(settings: BrokerSettings) -> None:
    broker = Broker(settings)
    signal.signal(signal.SIGTERM, broker.stop)
    signal.signal(signal.SIGINT, broker.stop)
    broker.run()
