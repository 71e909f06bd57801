"""The worker process: one pipeline :class:`Stage` behind a link to the broker.

:class:`Worker` is the compute loop: between forwards it drives the broker link's socket
itself (``worker_link.py``; a keeper thread beats while a forward runs), validates each
session message before any tensor op sees it, runs one batched forward of what is ready,
and sends the results. Each
message is handled in isolation: one the worker cannot process answers an ERROR for its
session and closes it here; nothing fails a session it does not name. SIGTERM drains
(no new sessions, finish the running ones, then exit); SIGINT or a second SIGTERM exits
at once. A refusal by the broker exits with status 3.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time
import uuid
import zlib
from collections import Counter
from typing import Any

import torch
import zmq

from zmqllm.bus.keys import PeerKeys, keys_dir, load_peer_keys
from zmqllm.bus.protocol import (
    Activation,
    Cached,
    Cancel,
    Close,
    Error,
    ErrorCode,
    Message,
    Open,
    ProtocolError,
    SessionMessage,
    Step,
    Token,
    decode,
    decode_header,
    encode,
)
from zmqllm.config.settings import Config
from zmqllm.engine.cache import CacheFullError
from zmqllm.engine.frames import (
    activation_dtype,
    cast_for_wire,
    payload_to_tensor,
    tensor_to_payload,
)
from zmqllm.engine.stage import BadWork, BatchFailed, Output, SessionState
from zmqllm.log import bind_request, get_logger
from zmqllm.worker.broker_link import (
    DELIVER,
    REFUSED,
    RESET,
    BrokerLink,
    LinkLost,
    LinkSettings,
    WorkerRefused,
    named_session,
    session_key,
    split_key,
)
from zmqllm.worker.cpu_turns import CpuTurns
from zmqllm.worker.faults import Faults
from zmqllm.worker.loop import WorkerLoop
from zmqllm.worker.peer_link import PeerLink, PeerRoute, peer_bind
from zmqllm.worker.shard_loader import Loaded, load_stage, max_frame_bytes, register_message

__all__ = ["LinkLost", "Loaded", "Worker", "WorkerRefused", "load_stage", "serve"]

log = get_logger("zmqllm.worker")

MAX_MESSAGES_PER_TURN = 1024
IDLE_POLL_S = 0.1  # an idle loop still looks at signals and publishes its load this often


class Worker(WorkerLoop):
    def __init__(
        self,
        cfg: Config,
        loaded: Loaded,
        context: zmq.Context[Any] | None = None,
        keys: PeerKeys | None = None,
    ) -> None:
        self.cfg = cfg
        self.loaded = loaded
        self.stage = loaded.stage
        self.ctx = context or zmq.Context.instance()
        name = cfg.worker.name or f"{socket.gethostname()}-{os.getpid()}"
        self.identity = f"w-{name}-{loaded.start}-{loaded.end}-{uuid.uuid4().hex[:6]}"
        # Group ids name this worker's forwards: short, whatever the worker names are.
        self._group_tag = uuid.uuid4().hex[:12]
        self.draining = False
        self._stop = False
        self._threads = cfg.worker.threads or torch.get_num_threads()
        self._batch_threads = cfg.worker.batch_threads
        self._threads_now = torch.get_num_threads()
        self.turns = CpuTurns(cfg.worker.cpu_lock, self.stage) if cfg.worker.cpu_lock else None
        wire = cfg.worker.wire_dtype
        # None: activations leave in the model's dtype, uncast.
        self.wire_dtype = None if wire in ("auto", cfg.model.dtype) else activation_dtype(wire)
        self.faults = Faults(log)
        settings = LinkSettings(
            address=cfg.worker.broker,
            identity=self.identity,
            interval=cfg.broker.heartbeat_interval,
            liveness=cfg.broker.heartbeat_liveness,
            max_message_bytes=min(
                cfg.broker.max_message_bytes, max_frame_bytes(self.stage, loaded.context)
            ),
            keys=keys,
        )
        self.link = BrokerLink(self.ctx, settings, register_message(cfg, loaded), self.faults)
        self.peers = PeerLink(
            self.ctx, self.identity, settings.max_message_bytes, self.faults, keys=keys
        )
        self._published = 0.0

    # -- the loop --------------------------------------------------------------
    def sessions(self) -> int:
        return len(self.stage.sessions)

    def run(self) -> int:
        try:
            self.start_peers()
        except Exception:
            self.close()
            raise
        self.link.start()
        log.info(
            "worker started",
            worker=self.identity,
            broker=self.cfg.worker.broker,
            layers=f"{self.loaded.start}:{self.loaded.end}",
            curve=self.link.settings.keys is not None,
            peer=self.peers.endpoint,
        )
        return self.run_turns()

    def start_peers(self) -> None:
        """Bind the peer link and advertise it in the REGISTER."""
        secure = self.link.settings.keys is not None
        endpoint = self.peers.start(peer_bind(self.cfg.worker.peer, self.cfg.worker.broker, secure))
        self.link.register = dataclasses.replace(self.link.register, peer=endpoint)

    def _turn(self) -> None:
        if not self.link.alive():
            raise LinkLost("the broker link ended")
        now = time.monotonic()
        if now - self._published >= min(IDLE_POLL_S, self.cfg.broker.heartbeat_interval / 2):
            self.publish_load(now)
            self.peers.expire(now)
        busy = self.stage.has_work()
        wait = self.turns.wait() if busy and self.turns is not None else 0.0
        timeout = wait if busy else IDLE_POLL_S
        with self.link.lock:
            if not self.link.inbox:  # what the keeper took in during a forward comes first
                self.link.pump(timeout, self.peers.sock)
            self.drain_inbox()
        self.drain_peers()
        if self.stage.has_work() and not (self.turns is not None and self.turns.wait()):
            self.run_batch()
        elif self.turns is not None and self.turns.holding and not self.stage.has_work():
            self.turns.release()  # the sessions we waited with were closed

    def publish_load(self, now: float | None = None) -> None:
        self._published = time.monotonic() if now is None else now
        self.link.publish(self.stage.heartbeat_figures(), self.draining)

    def close(self) -> None:
        self.link.stop()  # once stopped, or never started, it does nothing
        self.peers.close()
        if self.turns is not None:
            self.turns.close()
            self.turns = None
        log.info("worker stopped")

    def drain_inbox(self) -> None:
        """(Link lock held.) Act on what the link took in, in arrival order."""
        inbox = self.link.inbox
        for _ in range(MAX_MESSAGES_PER_TURN):
            if not inbox:
                return
            kind, value = inbox.popleft()
            if kind == DELIVER:
                self.handle_frames(value)
            elif kind == RESET:
                if self.stage.sessions:
                    log.warning(
                        "the broker forgot this worker's sessions; dropping them",
                        reason=value,
                        sessions=len(self.stage.sessions),
                    )
                self.stage.reset()
            elif kind == REFUSED:
                raise WorkerRefused(value)

    def drain_peers(self) -> None:
        """Act on what the workers beside this one sent over the peer link."""
        for sender, user, frames in self.peers.receive():
            self.from_peer(sender, user, frames)

    def from_peer(self, sender: str, user: str | None, frames: list[Any]) -> None:
        """A peer's message feeds only a session whose previous stage the broker named
        as that peer; one for a session not open here yet waits for its OPEN."""
        try:
            cls, head = decode_header(frames[0])
        except ProtocolError as exc:
            self.faults.report("malformed", "malformed peer message", exc)
            return
        named = named_session(head)
        if cls not in (Activation, Step) or named is None:
            self.faults.report("peer_refused", "peer message dropped", type=cls.TYPE.value)
            return
        key = session_key(named[0], named[1])
        s = self.stage.sessions.get(key)
        if s is None:
            self.peers.hold(key, sender, user, frames)
        elif PeerLink.accepts(s.link, sender, user):
            self.handle_frames(frames)
        else:
            self.faults.report("peer_refused", "peer message not from the session's previous stage")

    # -- messages ----------------------------------------------------------------
    def handle_frames(self, frames: list[Any]) -> None:
        """One message, in isolation: whatever goes wrong costs at most its session."""
        try:
            msg = decode(frames)
        except ProtocolError as exc:
            self.faults.report("malformed", "malformed message", exc)
            self.refuse_undecodable(frames[0], str(exc))
            return
        try:
            self.handle(msg)
        except (BadWork, ProtocolError) as exc:
            self.fail(msg, ErrorCode.BAD_REQUEST, str(exc), "bad_request")
        except Exception as exc:
            self.faults.report("internal", "error handling a message", exc, type=msg.TYPE.value)
            self.fail(msg, ErrorCode.INTERNAL, f"{type(exc).__name__} handling it", None)

    def refuse_undecodable(self, header: Any, why: str) -> None:
        """A session message that does not decode still fails the session its header
        names (the link only delivers those whose header decodes)."""
        try:
            _, head = decode_header(header)
        except ProtocolError:
            return
        named = named_session(head)
        if named is None:
            return
        session, attempt, request_id = named
        key = session_key(session, attempt)
        self.stage.close(key)
        err = Error.of(ErrorCode.BAD_REQUEST, why, session, attempt=attempt, request_id=request_id)
        self.send(err, key)

    def fail(self, msg: Message, code: ErrorCode, why: str, reason: str | None) -> None:
        """Answer ERROR for the session a message names, and close it here."""
        if not isinstance(msg, SessionMessage):
            return
        key = session_key(msg.session, msg.attempt)
        if reason is not None:
            self.faults.report(reason, "message refused", session=key, why=why[:200])
        self.stage.close(key)
        err = Error.of(code, why, msg.session, attempt=msg.attempt, request_id=msg.request_id)
        self.send(err, key)

    def handle(self, msg: Message) -> None:
        key = session_key(msg.session, msg.attempt) if isinstance(msg, SessionMessage) else ""
        if isinstance(msg, Step):
            if self.turns is not None:
                self.turns.note_arrival(msg.group)
            self.stage.step(key, msg.step, msg.token)
        elif isinstance(msg, Activation):
            if self.turns is not None:
                self.turns.note_arrival(msg.group)
            hidden = payload_to_tensor(msg.hidden)
            self.stage.activation(key, msg.step, hidden, msg.final, msg.prefix)
        elif isinstance(msg, Open):
            self.on_open(msg, key)
        elif isinstance(msg, Cached):
            self.stage.cached(key, msg.tokens)
        elif isinstance(msg, Close | Cancel):
            if self.stage.close(key):
                with bind_request(msg.request_id, msg.session):
                    log.info("session closed", reason=msg.TYPE.value, attempt=msg.attempt)
        else:
            self.faults.report("unexpected", "unexpected message dropped", type=msg.TYPE.value)

    def on_open(self, msg: Open, key: str) -> None:
        with bind_request(msg.request_id, msg.session):
            if self.draining:
                self.fail(msg, ErrorCode.FULL, "worker is draining", None)
                return
            prompt = msg.tokens.array if msg.tokens is not None else None
            try:
                msg.sampling.validate()
                state = self.stage.open(
                    key,
                    msg.request_id,
                    msg.max_len,
                    msg.max_tokens,
                    msg.sampling,
                    frozenset(msg.stop_ids),
                    prompt,
                    chain=msg.prefix,
                    stages=msg.stages,
                    prompt_len=msg.prompt_len,
                    generated=msg.generated,
                )
            except CacheFullError as exc:
                self.fail(msg, ErrorCode.FULL, str(exc), None)
                return
            except ValueError as exc:  # a duplicate OPEN too: the session is confused
                self.fail(msg, ErrorCode.BAD_REQUEST, str(exc), "bad_request")
                return
            state.next_hop = msg.next
            if msg.prev or msg.next_peer:
                state.link = PeerRoute(msg.next_peer, msg.prev, msg.prev_key)
                self.peers.expect(msg.prev_key)
                if msg.next_peer:
                    self.peers.connect(msg.next_peer, msg.next_key)
            log.info(
                "session opened",
                max_len=msg.max_len,
                stage=msg.stage,
                attempt=msg.attempt,
                prefix_held=state.held,
            )
            if msg.stage > 0 and msg.prefix:
                # Stage 0 starts the prompt after what every stage holds: say what we do.
                told = Cached(
                    session=msg.session,
                    attempt=msg.attempt,
                    request_id=msg.request_id,
                    tokens=state.held,
                )
                self.send(told, key)
            for sender, user, frames in self.peers.take_held(key):
                self.from_peer(sender, user, frames)

    # -- computing ---------------------------------------------------------------
    def _tag_groups(self, outputs: list[Output]) -> list[tuple[str, int] | None]:
        """(group id, size) per output that travels on (None: a final token)."""
        hops: list[str | None] = []
        for o in outputs:
            if o.token is not None and o.finish is not None:
                hops.append(None)  # the broker ends it here: no STEP follows
                continue
            s = self.stage.sessions.get(o.session)
            hops.append(s.next_hop if s is not None else "")
        sizes = Counter(h for h in hops if h is not None)
        gid = f"{self._group_tag}-{self.stage.stats.forwards}"
        return [
            None if h is None else (f"{gid}-{zlib.crc32(h.encode()):08x}", sizes[h]) for h in hops
        ]

    def _pick_threads(self) -> None:
        """One session in flight: stages take turns, so each may use every core. Several:
        all stages compute at once, and sharing cores they need their batch_threads."""
        want = self._threads
        if self._batch_threads and len(self.stage.sessions) > 1:
            want = self._batch_threads
        if want != self._threads_now:
            torch.set_num_threads(want)
            self._threads_now = want

    def run_batch(self) -> None:
        self._pick_threads()
        if self.turns is not None:
            self.turns.take()  # our turn on the shared cores (ours already if we kept it)
        try:
            outputs = self.stage.run()
        except BatchFailed as exc:
            cause = exc.__cause__ or exc
            self.faults.report("forward_failed", "forward failed; failing its sessions", cause)
            for key in exc.keys:
                self._fail_key(key, f"forward failed: {type(cause).__name__}")
            return
        finally:
            if self.turns is not None:
                self.turns.release()
        for key, _, why in self.stage.failed:
            self.faults.report("internal", "session failed", session=key, why=why[:200])
            self._fail_key(key, why)
        self.stage.failed.clear()
        for o, group in zip(outputs, self._tag_groups(outputs), strict=True):
            try:
                result = self._routed_result(o, group)
            except Exception as exc:
                self.faults.report("internal", "result cannot be sent", exc, session=o.session)
                self._fail_key(o.session, f"result cannot be sent: {type(exc).__name__}")
                continue
            self.send(result, o.session)

    def _routed_result(self, o: Output, group: tuple[str, int] | None) -> Message | None:
        """``o``'s message, its next step already on its way where no broker is needed:
        queued here on a route of one stage (the broker names stage 0 as the last stage's
        ``next``: that is us), or sent over the peer link. What is left for the broker
        (None: nothing)."""
        s = self.stage.sessions.get(o.session)
        steps = o.token is not None and o.finish is None
        if steps and s is not None and s.next_hop == self.identity:
            return self._result(o, group, self._step_here(o))
        route = self._peer_route(s)
        # A token whose next step goes over the peer link says so from the start (one
        # message per token: the rare failure in _over_peer_link rebuilds it).
        stepped = steps and route is not None
        return self._over_peer_link(self._result(o, group, stepped), route, o.session)

    def _step_here(self, o: Output) -> bool:
        """Queue the next step of a session whose stage 0 is this worker, as the STEP from
        the broker would be (its token then says stepped, and the broker sends none);
        False if it cannot be queued, and the broker's STEP meets the same refusal."""
        assert o.token is not None
        try:
            self.stage.step(o.session, o.step + 1, o.token)
        except BadWork:
            return False
        return True

    @staticmethod
    def _peer_route(s: SessionState | None) -> PeerRoute | None:
        """The session's peer link, if its results go over one now."""
        route = s.link if s is not None else None
        if not isinstance(route, PeerRoute) or not route.next_peer or route.via_broker:
            return None
        return route

    def _over_peer_link(self, result: Message, route: PeerRoute | None, key: str) -> Message | None:
        """Send a result over the session's peer link if it has one: an activation to
        the next stage, or (last stage) the next step to stage 0 before its token goes
        to the broker. What is left for the broker (None: nothing)."""
        if route is None:
            return result
        if isinstance(result, Activation):
            if self.peers.send(route.next_peer, encode(result)):
                return None
        elif isinstance(result, Token) and result.stepped:
            step = Step.following(result, result.request_id)
            if self.peers.send(route.next_peer, encode(step)):
                return result
            result = dataclasses.replace(result, stepped=False)  # the broker steps it
        else:
            return result
        # The link cannot take it: this and the rest of the session go through the broker.
        route.via_broker = True
        log.debug("peer link not ready; session goes through the broker", session=key)
        return result

    def _result(self, o: Output, group: tuple[str, int] | None, stepped: bool = False) -> Message:
        session, attempt = split_key(o.session)
        if o.token is not None:
            return Token(
                session=session,
                attempt=attempt,
                request_id=o.request_id,
                step=o.step,
                token=o.token,
                finish=o.finish,
                group=group,
                logprob_ids=o.logprobs[0] if o.logprobs else None,
                logprobs=o.logprobs[1] if o.logprobs else None,
                stepped=stepped,
            )
        assert o.hidden is not None
        return Activation(
            session=session,
            attempt=attempt,
            request_id=o.request_id,
            step=o.step,
            final=o.final,
            group=group,
            prefix=o.prefix,
            hidden=tensor_to_payload(cast_for_wire(o.hidden, self.wire_dtype)),
        )

    def _fail_key(self, key: str, why: str) -> None:
        s = self.stage.sessions.get(key)
        if s is None:
            return
        session, attempt = split_key(key)
        self.stage.close(key)
        err = Error.of(ErrorCode.INTERNAL, why, session, attempt=attempt, request_id=s.request_id)
        self.send(err, key)

    def send(self, msg: Message | None, key: str = "") -> None:
        """Send a message to the broker; one that cannot be sent fails its session here
        (the broker's inactivity deadline does the rest)."""
        if msg is None:
            return
        try:
            frames = encode(msg)
        except ProtocolError as exc:
            self.faults.report("unsent", "message not sent; session failed", exc, session=key)
            why = "cannot be encoded"
        else:
            with self.link.lock:
                why = self.link.send(frames, key)
        if why and key:
            self.stage.close(key)


def serve(cfg: Config) -> int:
    folder = keys_dir(cfg.security)  # a key problem is told before the model loads
    keys = load_peer_keys(folder, "worker") if folder is not None else None
    loaded = load_stage(cfg)
    worker = Worker(cfg, loaded, keys=keys)
    signal.signal(signal.SIGTERM, worker.on_sigterm)
    signal.signal(signal.SIGINT, worker.on_sigint)
    return worker.run()
