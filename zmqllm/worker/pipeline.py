"""The pipeline worker: one :class:`Stage` of layers on the worker shell (``shell.py``,
the library half: identity, broker link, signals, loop, dispatch; this is the
application half).

:class:`Worker` is the compute loop: between forwards it drives the broker link's socket
itself (``broker_link.py``; a keeper thread beats while a forward runs), validates each
session message before any tensor op sees it, runs one batched forward of what is ready,
and sends the results where ``routing.route_result`` says they go: queued here, over
the peer link (``peer_link.py``) or to the broker. A message the worker cannot process
answers an ERROR for its session and closes it here; nothing fails a session it does
not name.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

import torch
import zmq

from zmqllm.bus.keys import PeerKeys
from zmqllm.bus.messages import Activation, Cached, Error, ErrorCode, Message, Open, Step, Token
from zmqllm.bus.protocol import encode
from zmqllm.bus.wire_types import ProtocolError, SessionKey
from zmqllm.config.settings import Config
from zmqllm.engine.cache import CacheFullError
from zmqllm.engine.frames import (
    activation_dtype,
    cast_for_wire,
    payload_to_tensor,
    tensor_to_payload,
)
from zmqllm.engine.runner import BatchFailed, Output
from zmqllm.engine.stage import BadWork
from zmqllm.log import bind_request, get_logger
from zmqllm.worker.cpu_turns import CpuTurns
from zmqllm.worker.inbox import Undecodable, session_of
from zmqllm.worker.peer_link import PeerLink, PeerMessage, PeerRoute, peer_bind
from zmqllm.worker.routing import group_tags, route_result
from zmqllm.worker.shard_loader import Loaded, max_frame_bytes, register_message
from zmqllm.worker.shell import IDLE_POLL_S, Handler, WorkerShell

__all__ = ["Worker"]

log = get_logger("zmqllm.worker")


class Worker(WorkerShell):
    """The pipeline worker: a :class:`Stage` of layers on the worker shell."""

    # A message the stage refuses (bad token, shape, step) costs its session alone.
    bad_message = (BadWork, ProtocolError)
    refuses_undecodable = True

    def __init__(
        self,
        cfg: Config,
        loaded: Loaded,
        context: zmq.Context[Any] | None = None,
        keys: PeerKeys | None = None,
    ) -> None:
        self.loaded = loaded
        self.stage = loaded.stage
        super().__init__(
            cfg,
            f"{loaded.start}-{loaded.end}",
            register_message(cfg, loaded),
            context=context,
            keys=keys,
            frame_cap=max_frame_bytes(self.stage, loaded.context),
        )
        # Published at least twice a heartbeat: the broker balances on these figures.
        self.publish_every = min(IDLE_POLL_S, cfg.broker.heartbeat_interval / 2)
        # Group ids name this worker's forwards: short, whatever the worker names are.
        self._group_tag = uuid.uuid4().hex[:12]
        self._threads = cfg.worker.threads or torch.get_num_threads()
        self._batch_threads = cfg.worker.batch_threads
        self._threads_now = torch.get_num_threads()
        self.turns = CpuTurns(cfg.worker.cpu_lock, self.stage) if cfg.worker.cpu_lock else None
        wire = cfg.worker.wire_dtype
        # None: activations leave in the model's dtype, uncast.
        self.wire_dtype = None if wire in ("auto", cfg.model.dtype) else activation_dtype(wire)
        self.peers = PeerLink(
            self.ctx, self.identity, self.link.settings.max_message_bytes, self.faults, keys=keys
        )

    def message_handlers(self) -> dict[type[Message], Handler]:
        return {
            Step: self.on_step,
            Activation: self.on_activation,
            Open: self.on_open,
            Cached: self.on_cached,
        }

    # -- the loop --------------------------------------------------------------
    def sessions(self) -> int:
        return len(self.stage.sessions)

    def close_session(self, key: SessionKey) -> bool:
        return self.stage.close(key)

    def drop_sessions(self) -> None:
        self.stage.reset()

    def heartbeat_figures(self) -> dict[str, Any]:
        return self.stage.heartbeat_figures()

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
        if self.tend_link():
            self.peers.expire(self._published)
        busy = self.stage.has_work()
        timeout = self._wait() if busy else IDLE_POLL_S
        with self.link.lock:
            if not self.link.inbox:  # what the keeper took in during a forward comes first
                self.link.pump(timeout, self.peers.sock)
            self.drain_inbox()
        self.drain_peers()
        if self.stage.has_work() and not self._wait():
            self.run_batch()
        elif self.turns is not None and self.turns.holding and not self.stage.has_work():
            self.turns.release()  # the sessions we waited with were closed

    def _wait(self) -> float:
        """Seconds the ready work waits (0: forward now): for a turn on shared cores
        (cpu_lock), else for the rest of its micro-batch (engine.micro_batches)."""
        if self.turns is not None:
            return self.turns.wait()
        return self.stage.wait(time.monotonic())

    def close(self) -> None:
        self.link.stop()  # once stopped, or never started, it does nothing
        self.peers.close()
        if self.turns is not None:
            self.turns.close()
            self.turns = None
        log.info("worker stopped")

    def drain_peers(self) -> None:
        """Act on what the workers beside this one sent over the peer link."""
        for msg in self.peers.receive():
            self.from_peer(msg)

    def from_peer(self, msg: PeerMessage) -> None:
        """A peer's message feeds only a session whose previous stage the broker named
        as that peer; one for a session not open here yet waits for its OPEN."""
        entry = msg.entry
        kind = entry.kind if isinstance(entry, Undecodable) else type(entry)
        named = session_of(entry)
        if kind not in (Activation, Step) or named is None:
            self.faults.report("peer_refused", "peer message dropped", type=kind.TYPE.value)
            return
        key = named[0]
        s = self.stage.sessions.get(key)
        if s is None:
            self.peers.hold(key, msg)
        elif PeerLink.accepts(s.link, msg.sender, msg.user):
            self.dispatch(entry)
        else:
            self.faults.report("peer_refused", "peer message not from the session's previous stage")

    # -- messages ----------------------------------------------------------------
    def on_step(self, msg: Step) -> None:
        self._arrived(msg.group)
        self.stage.step(SessionKey.of(msg), msg.step, msg.token, msg.draft)

    def on_activation(self, msg: Activation) -> None:
        self._arrived(msg.group)
        hidden = payload_to_tensor(msg.hidden)
        self.stage.activation(SessionKey.of(msg), msg.step, hidden, msg.final, msg.prefix)

    def _arrived(self, group: tuple[str, int] | None) -> None:
        """Counted before the message is validated: a refused member still came."""
        self.stage.note_arrival(group)
        if self.turns is not None:
            self.turns.note_arrival(group)

    def on_cached(self, msg: Cached) -> None:
        self.stage.cached(SessionKey.of(msg), msg.tokens)

    def on_open(self, msg: Open) -> None:
        key = SessionKey.of(msg)
        with bind_request(msg.request_id, msg.session):
            if self.draining:
                self.fail(msg, ErrorCode.FULL, "worker is draining", None)
                return
            prompt = msg.tokens.array if msg.tokens is not None else None
            # A later last stage is given the prompt too, to speculate from (history).
            history = prompt if msg.stage > 0 else None
            prompt = None if msg.stage > 0 else prompt
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
                    history=history,
                    speculative=msg.speculative,
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
            for held in self.peers.take_held(key):
                self.from_peer(held)

    # -- computing ---------------------------------------------------------------
    def _tag_groups(self, outputs: list[Output]) -> list[tuple[str, int] | None]:
        """(group id, size) per output that travels on (None: a final token)."""
        hops: list[str | None] = []
        for o in outputs:
            if o.token is not None and (o.finish is not None or o.more):
                hops.append(None)  # the broker ends it here, or a later token of its pass
                # steps it: no STEP follows this one
                continue
            s = self.stage.sessions.get(o.session)
            hops.append(s.next_hop if s is not None else "")
        return group_tags(hops, f"{self._group_tag}-{self.stage.stats.forwards}")

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
            self.faults.report("internal", "session failed", session=str(key), why=why[:200])
            self._fail_key(key, why)
        self.stage.failed.clear()
        for o, group in zip(outputs, self._tag_groups(outputs), strict=True):
            try:
                left = self._send_ahead(o, group)
            except Exception as exc:
                why = "result cannot be sent"
                self.faults.report("internal", why, exc, session=str(o.session))
                self._fail_key(o.session, f"result cannot be sent: {type(exc).__name__}")
                continue
            self.send(left, o.session)

    def _send_ahead(self, o: Output, group: tuple[str, int] | None) -> Message | None:
        """Send what of ``o``'s result goes past the broker (routing.route_result says
        where); what is left for the broker (None: nothing)."""
        s = self.stage.sessions.get(o.session)
        result = self._result(o, group)
        if s is None:
            return result
        routed = route_result(result, self.identity, s.next_hop, s.link)
        if routed.ahead is None:
            return routed.to_broker
        if not routed.peer:
            # Queued here as the broker's STEP would be; one refused meets the same
            # refusal when the broker sends it instead.
            assert isinstance(routed.ahead, Step)
            try:
                ahead = routed.ahead
                self.stage.step(o.session, ahead.step, ahead.token, ahead.draft)
            except BadWork:
                return routed.instead
            return routed.to_broker
        if self.peers.send(routed.peer, encode(routed.ahead)):
            return routed.to_broker
        # The link cannot take it: this and the rest of the session go through the broker.
        s.link.via_broker = True
        log.debug("peer link not ready; session goes through the broker", session=str(o.session))
        return routed.instead

    def _result(self, o: Output, group: tuple[str, int] | None) -> Token | Activation:
        session, attempt = o.session
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
                more=o.more,
                draft=o.draft,
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

    def _fail_key(self, key: SessionKey, why: str) -> None:
        s = self.stage.sessions.get(key)
        if s is None:
            return
        self.stage.close(key)
        err = Error.of(
            ErrorCode.INTERNAL, why, key.session, attempt=key.attempt, request_id=s.request_id
        )
        self.send(err, key)
