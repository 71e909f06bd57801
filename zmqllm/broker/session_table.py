"""The broker's session lifecycle, without sockets: open, route, requeue, fail, end.

:class:`SessionTable` is a state machine in the manner of vLLM's scheduler: each method
takes what arrived (and the time) and returns the messages to send as :class:`Out`
values; the broker does the sending and reports back what could not be sent
(``worker_lost`` / ``client_lost``). Tested without sockets.

Sessions are keyed by (client routing id, the client's session id), so no client can
name, cancel or collide with another client's session. Workers know a session by a wire
id the broker assigns, plus the attempt number: messages of an earlier attempt still in
flight match nothing.

Requests name their model (``Open.model`` / ``Ask.model``; unnamed: the only one): each
model has its own routes, and a model without room holds back only its own queued
requests. A text model's session (ASK) is one worker that drives its own steps and
answers with DELTAs.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zmqllm.broker.registry import ModelPools, Registry, WorkerEntry
from zmqllm.broker.route_build import RouteBuild, route_build
from zmqllm.broker.session_records import Key, Out, Pending, Session, SessionStats
from zmqllm.bus.messages import (
    Activation,
    Ask,
    Cached,
    Close,
    Delta,
    Error,
    ErrorCode,
    Open,
    Step,
    Token,
)
from zmqllm.bus.prefix import PrefixIndex
from zmqllm.log import bind_request, get_logger

__all__ = ["MAX_ATTEMPTS", "SessionTable"]

log = get_logger("zmqllm.broker")

# Routes one request may be tried on (a full worker, a worker lost before the first
# token): past this it fails instead of bouncing around a sick cluster forever.
MAX_ATTEMPTS = 8
# Of the queue, the share that requests for models no worker serves may fill: they may be
# starting, or be names a peer made up.
UNSERVED_SHARE = 4


@dataclass
class SessionTable:
    registry: Registry
    boot: str
    queue_size: int = 256
    queue_timeout: float = 30.0
    session_timeout: float = 120.0
    full_backoff: float = 1.0  # how long a worker that said "full" is skipped
    sessions: dict[Key, Session] = field(default_factory=dict)
    by_wire: dict[str, Session] = field(default_factory=dict)
    queue: deque[Pending] = field(default_factory=deque)
    stats: SessionStats = field(default_factory=SessionStats)
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)
    _ids: Any = field(default_factory=lambda: itertools.count(1))

    # -- clients ---------------------------------------------------------------
    def open(self, client: bytes, msg: Open | Ask, now: float) -> list[Out]:
        """A new request: an OPEN (token ids) for a model of layers, an ASK (the request
        as JSON) for a text model; queued, then routed as soon as a route has room."""

        def refuse(code: ErrorCode, text: str) -> list[Out]:
            return [self._to_client(client, msg.session, msg.request_id, code, text)]

        key = (client, msg.session)
        if key in self.sessions or any(p.key == key for p in self.queue):
            return refuse(ErrorCode.BAD_REQUEST, f"session {msg.session} is already open")
        model = self.registry.resolve(msg.model)
        if model is None and not msg.model and len(self.registry.models) > 1:
            names = ", ".join(sorted(self.registry.models)[:8])
            return refuse(ErrorCode.BAD_REQUEST, f"several models are served ({names}): name one")
        if isinstance(msg, Open) and msg.tokens is None:
            return refuse(ErrorCode.BAD_REQUEST, "OPEN needs the prompt's int32 token ids")
        build = None
        if isinstance(msg, Open) and msg.build:
            try:
                build = RouteBuild.parse(msg.build)
            except ValueError as exc:
                return refuse(ErrorCode.BAD_REQUEST, f"field 'build': {exc}")
        why = self._unfit(msg, model, build) if model is not None else ""
        if why:
            return refuse(ErrorCode.BAD_REQUEST, why)
        if len(self.queue) >= self.queue_size:
            return refuse(
                ErrorCode.BUSY, f"the broker queue is full ({self.queue_size}); retry shortly"
            )
        if model is None and self._unserved() >= max(1, self.queue_size // UNSERVED_SHARE):
            # Names nobody serves (yet) must not fill the queue the served models share.
            return refuse(
                ErrorCode.BUSY,
                f"no worker serves model {msg.model!r} and the queue holds enough requests "
                "for models without workers; retry shortly",
            )
        self.queue.append(Pending(client, msg, now, build=build))
        return self.dispatch(now)

    def _unserved(self) -> int:
        """Queued requests whose model no worker serves."""
        return sum(1 for p in self.queue if self.registry.resolve(p.open.model) is None)

    def cancel(self, client: bytes, session: str, now: float) -> list[Out]:
        """Only the session's own client can name it: the key holds the client's id."""
        key = (client, session)
        s = self.sessions.get(key)
        if s is not None:
            with bind_request(s.request_id, session):
                log.info("session cancelled by client", step=s.next_step)
            return self._end(s, now, failed=False, code=ErrorCode.CANCELLED, text="cancelled")
        for p in list(self.queue):
            if p.key == key:
                self.queue.remove(p)
                return [
                    self._to_client(
                        client, session, p.open.request_id, ErrorCode.CANCELLED, "cancelled"
                    )
                ]
        return []

    def client_lost(self, client: bytes, code: ErrorCode, text: str, now: float) -> list[Out]:
        """A client we cannot send to (gone, or not reading): its sessions end."""
        # Its queued requests go first, or freeing its sessions would route them.
        self.queue = deque(p for p in self.queue if p.client != client)
        out: list[Out] = []
        for s in [s for s in self.sessions.values() if s.key[0] == client]:
            with bind_request(s.request_id, s.key[1]):
                log.warning("session failed: client lost", code=code.value)
            out += self._end(s, now, failed=True, tell_client=False)
        return out

    # -- routing ---------------------------------------------------------------
    def dispatch(self, now: float) -> list[Out]:
        """Open queued requests, oldest first per model, while a route with room exists
        (a model without room holds back only its own requests)."""
        out: list[Out] = []
        blocked: set[str] = set()
        waiting: deque[Pending] = deque()
        while self.queue:
            if len(blocked) >= len(self.registry.models):
                break  # no model has room: the rest waits as it is, in order
            p = self.queue.popleft()
            model = self.registry.resolve(p.open.model)
            if model is None or model.name in blocked:
                waiting.append(p)
                continue
            # Checked again here: the model may have come (or changed) since the request
            # was queued.
            why = self._unfit(p.open, model, p.build)
            if why:
                out.append(self._refusal(p, why))
                continue
            route = self.registry.find_route(
                p.max_len,
                held=self._held_by(p.chain),
                model=model.name,
                admit=p.build.admits if p.build is not None else None,
            )
            if route is None:
                if p.build is None:
                    blocked.add(model.name)
                else:
                    # A replay waiting for workers of its build holds back no one: the
                    # requests behind it may take routes it may not.
                    self._note_waiting_for_build(p, model.name)
                waiting.append(p)
                continue
            out += self._start(p, route, now)
        waiting.extend(self.queue)
        self.queue = waiting
        return out

    def _note_waiting_for_build(self, p: Pending, model: str) -> None:
        """Say once why a replay waits while another build's route has room."""
        if p.waiting_noted or p.build is None:
            return
        if self.registry.find_route(p.max_len, model=model) is None:
            return  # no route of any build: it waits as every request does
        p.waiting_noted = True
        with bind_request(p.open.request_id, p.open.session):
            log.warning(
                "replay waits for a route of its stream's build; routes of another build have room",
                build=p.build.describe(),
            )

    @staticmethod
    def _unfit(msg: Open | Ask, model: ModelPools, build: RouteBuild | None = None) -> str:
        """Why ``model`` cannot take this request ("" when it can)."""
        if build is not None and build.end != model.num_layers:
            return (
                f"the stream's route build ends at layer {build.end}: model {model.name!r} "
                f"has {model.num_layers} layers"
            )
        if model.text_model != isinstance(msg, Ask):
            what = "a remote (text) model: send ASK" if model.text_model else "a model of tokens"
            return f"model {model.name!r} is {what}"
        if (
            isinstance(msg, Open)
            and model.context
            and msg.prompt_len + msg.max_tokens > model.context
        ):
            return (
                f"prompt ({msg.prompt_len}) + max_tokens ({msg.max_tokens}) exceed "
                f"the model's context of {model.context} tokens"
            )
        return ""

    def _refusal(self, p: Pending, why: str) -> Out:
        with bind_request(p.open.request_id, p.open.session):
            log.info("request refused", reason=why[:200])
        return self._to_client(
            p.client, p.open.session, p.open.request_id, ErrorCode.BAD_REQUEST, why
        )

    def _held_by(self, chain: tuple[int, ...]) -> Callable[[WorkerEntry], int] | None:
        """Prefix affinity: how much of ``chain`` a worker is thought to hold."""
        if not chain:
            return None
        return lambda w: self.prefixes.held(w.worker_id, chain)

    def _start(self, p: Pending, route: list[WorkerEntry], now: float) -> list[Out]:
        p.attempts += 1
        wire = f"{self.boot}-{next(self._ids):x}"
        s = Session(p, wire, [w.worker_id for w in route], now)
        if isinstance(p.open, Open):
            s.build = route_build(route)
        self.sessions[p.key] = s
        self.by_wire[wire] = s
        self.registry.reserve(route, wire, p.max_len)
        self.stats.opened += 1
        with bind_request(s.request_id, p.open.session):
            log.info(
                "session opened",
                route=s.route,
                attempt=p.attempts,
                queue_wait_ms=round((now - p.enqueued) * 1e3, 1),
                build=" ".join(s.build),
                replay_of_build=p.build is not None,
            )
        if isinstance(p.open, Ask):
            # The client's ASK under the wire id workers know the session by.
            ask = dataclasses.replace(p.open, session=wire, attempt=p.attempts, step=0)
            return [Out.to_worker(route[0].identity, ask)]
        out: list[Out] = []
        n = len(route)
        for w in route:
            self.prefixes.note(w.worker_id, p.chain)
        # Over peer links only when every stage has one (and there is more than one).
        peered = n > 1 and all(w.peer for w in route)
        lookup = p.open.speculative and route[-1].proposes
        # Later stages first: each must hold the session before stage 0's activations
        # reach it (per-peer ordering keeps each OPEN ahead of what follows it; over peer
        # links the receiving worker holds back what comes before its OPEN).
        for i in reversed(range(n)):
            nxt, prev = route[(i + 1) % n], route[i - 1]
            # next: where stage i's results go (the last stage's STEPs go to the first).
            stage_open = Open(
                session=wire,
                attempt=p.attempts,
                request_id=s.request_id,
                max_tokens=p.open.max_tokens,
                prompt_len=p.open.prompt_len,
                sampling=p.open.sampling,
                stop_ids=p.open.stop_ids,
                stage=i,
                stages=n,
                max_len=p.max_len,
                next=nxt.worker_id,
                # A last stage that speculates proposes from the prompt: it gets it too.
                tokens=p.open.tokens if i == 0 or (i == n - 1 and lookup) else None,
                prefix=p.chain,
                generated=p.generated if i == n - 1 else (),
                model=p.open.model,
                next_peer=nxt.peer if peered else "",
                next_key=nxt.key if peered else "",
                prev=prev.worker_id if peered else "",
                prev_key=prev.key if peered else "",
                speculative=p.open.speculative,
            )
            out.append(Out.to_worker(route[i].identity, stage_open))
        return out

    # -- workers ---------------------------------------------------------------
    def _session_of(self, w: WorkerEntry, wire: str, attempt: int) -> Session | None:
        s = self.by_wire.get(wire)
        if s is None or s.attempt != attempt or w.worker_id not in s.route:
            return None  # cancelled meanwhile, an earlier attempt, or not its business
        return s

    def on_activation(self, w: WorkerEntry, msg: Activation, frames: Any, now: float) -> list[Out]:
        s = self._session_of(w, msg.session, msg.attempt)
        if s is None:
            return []
        i = s.route.index(w.worker_id)
        nxt = self.registry.workers.get(s.route[i + 1]) if i + 1 < len(s.route) else None
        if nxt is None:
            return []  # from the last stage (a worker's bug), or the next one just left
        s.last_active = now
        self.stats.relayed += 1
        return [Out.to_worker(nxt.identity, frames=frames)]

    def on_cached(self, w: WorkerEntry, msg: Cached, now: float) -> list[Out]:
        """A later stage says how much of the prompt it holds: stage 0 is told."""
        s = self._session_of(w, msg.session, msg.attempt)
        if s is None or s.route[0] == w.worker_id:
            return []
        stage0 = self.registry.workers.get(s.route[0])
        if stage0 is None:
            return []
        s.last_active = now
        told = Cached(session=s.wire, attempt=s.attempt, request_id=s.request_id, tokens=msg.tokens)
        return [Out.to_worker(stage0.identity, told)]

    def on_token(self, w: WorkerEntry, msg: Token, now: float) -> list[Out]:
        s = self._session_of(w, msg.session, msg.attempt)
        if s is None or s.route[-1] != w.worker_id or msg.step != s.next_step:
            return []
        if isinstance(s.request.open, Ask):
            return []  # a text model's session moves by DELTAs only
        first = s.next_step == 0
        token = Token(
            **self._advance(s, now),
            build=s.build if first else None,
            token=msg.token,
            finish=msg.finish,
            logprob_ids=msg.logprob_ids,
            logprobs=msg.logprobs,
        )
        to_client = Out.to_client(s.key[0], token)
        if msg.finish is not None:
            return [to_client, *self._finished(s, msg.finish.value, now)]
        if msg.more:
            return [to_client]  # a pass's tokens but its last: that one steps the session
        stage0 = self.registry.workers.get(s.route[0])
        if stage0 is None or msg.stepped:
            return [to_client]  # (stepped: the last stage sent stage 0 the step itself)
        step = Step.following(msg, s.request_id)  # (msg names s: see _session_of)
        self.stats.relayed += 1
        # The next step first: stage 0 computes while the token goes on to the client.
        return [Out.to_worker(stage0.identity, step), to_client]

    def on_delta(self, w: WorkerEntry, msg: Delta, now: float) -> list[Out]:
        """A text worker's next piece: to the client; the worker drives its own steps."""
        s = self._session_of(w, msg.session, msg.attempt)
        if s is None or not isinstance(s.request.open, Ask) or msg.step != s.next_step:
            return []
        delta = Delta(
            **self._advance(s, now),
            text=msg.text,
            finish=msg.finish,
            prompt_tokens=msg.prompt_tokens,
            completion_tokens=msg.completion_tokens,
        )
        out = [Out.to_client(s.key[0], delta)]
        return out if msg.finish is None else out + self._finished(s, msg.finish, now)

    def _advance(self, s: Session, now: float) -> dict[str, Any]:
        """The session's next step came: the fields of the client's copy of it (on the
        first one, the route and the broker's boot id)."""
        step, first = s.next_step, s.next_step == 0
        s.next_step += 1
        s.last_active = now
        self.stats.tokens += 1
        return {
            "session": s.key[1],
            "request_id": s.request_id,
            "step": step,
            "route": tuple(s.route) if first else None,
            "boot": self.boot if first else None,
        }

    def _finished(self, s: Session, finish: str, now: float) -> list[Out]:
        with bind_request(s.request_id, s.key[1]):
            log.info("session finished", finish=finish, steps=s.next_step)
        return self._end(s, now, failed=False, tell_client=False)

    def on_worker_error(self, w: WorkerEntry, msg: Error, now: float) -> list[Out]:
        s = self._session_of(w, msg.session, msg.attempt)
        if s is None:
            # Usually work that crossed a CLOSE (a cancelled stream): nothing to fail.
            log.debug("worker error for no open session", worker=w.worker_id, code=msg.code.value)
            return []
        with bind_request(s.request_id, s.key[1]):
            if msg.code is ErrorCode.FULL and not s.streamed:
                # The worker had no room after all: undo, skip it a while, retry now while
                # full_until still steers the route away from it.
                log.info("worker full; request requeued", worker=w.worker_id)
                w.full_until = now + self.full_backoff
                return self._requeue(s, now)
            log.warning("session failed on worker", worker=w.worker_id, code=msg.code.value)
            return self._end(s, now, failed=True, code=msg.code, text=msg.message)

    def worker_lost(self, worker_id: str, reason: str, now: float) -> list[Out]:
        """A worker left or stopped answering (the registry already forgot it)."""
        self.prefixes.forget(worker_id)  # one registering under its id starts empty
        out: list[Out] = []
        for s in [s for s in self.sessions.values() if worker_id in s.route]:
            with bind_request(s.request_id, s.key[1]):
                if not s.streamed:
                    # No token reached the client: it loses nothing if the request starts
                    # again on another route.
                    log.info("worker lost before the first token; request requeued")
                    out += self._requeue(s, now, dispatch=False)
                    continue
                log.warning("session failed: worker lost", worker=worker_id)
                out += self._end(s, now, failed=True, code=ErrorCode.WORKER_LOST, text=reason)
        return out + self.dispatch(now)

    # -- time ------------------------------------------------------------------
    def tick(self, now: float, no_route_reason: str | Callable[[str], str]) -> list[Out]:
        """Queue timeouts, inactivity deadlines, then whatever can now be routed.
        ``no_route_reason``: what a request that waited too long is told (per model)."""
        out: list[Out] = []
        expired = [p for p in self.queue if now - p.enqueued > self.queue_timeout]
        if expired:
            self.queue = deque(p for p in self.queue if now - p.enqueued <= self.queue_timeout)
        for p in expired:
            with bind_request(p.open.request_id, p.open.session):
                log.warning("request failed in queue", code=ErrorCode.NO_CAPACITY.value)
            code = ErrorCode.NO_CAPACITY
            if p.build is not None and self.registry.resolve(p.open.model) is not None:
                why = p.build.no_route(self.queue_timeout)
            elif isinstance(no_route_reason, str):
                why = no_route_reason
            else:
                why = no_route_reason(p.open.model)
            out.append(self._to_client(p.client, p.open.session, p.open.request_id, code, why))
        for s in [s for s in self.sessions.values() if now - s.last_active > self.session_timeout]:
            with bind_request(s.request_id, s.key[1]):
                log.warning("session timed out", idle_s=round(now - s.last_active, 1))
            out += self._end(
                s,
                now,
                failed=True,
                code=ErrorCode.TIMEOUT,
                text=f"no progress from the route for {self.session_timeout:g}s",
            )
        return out + self.dispatch(now)

    # -- endings ---------------------------------------------------------------
    def fail(self, s: Session, now: float, code: ErrorCode, text: str) -> list[Out]:
        """End a session with an error its client is told."""
        return self._end(s, now, failed=True, code=code, text=text)

    def _release(self, s: Session) -> list[Out]:
        """Forget an attempt and free its caches on every stage of its route."""
        self.sessions.pop(s.key, None)
        self.by_wire.pop(s.wire, None)
        self.registry.release(s.route, s.wire, s.request.max_len)
        close = Close(session=s.wire, attempt=s.attempt, request_id=s.request_id)
        return [
            Out.to_worker(w.identity, close)
            for wid in s.route
            if (w := self.registry.workers.get(wid)) is not None
        ]

    def _requeue(self, s: Session, now: float, dispatch: bool = True) -> list[Out]:
        out = self._release(s)
        if s.attempt >= MAX_ATTEMPTS:
            self.stats.failed += 1
            text = f"no route took the request in {MAX_ATTEMPTS} attempts"
            client, sid = s.key
            return [*out, self._to_client(client, sid, s.request_id, ErrorCode.NO_CAPACITY, text)]
        self.queue.appendleft(s.request)  # ahead of newer requests
        return out + self.dispatch(now) if dispatch else out

    def _end(
        self,
        s: Session,
        now: float,
        *,
        failed: bool,
        code: ErrorCode = ErrorCode.INTERNAL,
        text: str = "",
        tell_client: bool = True,
    ) -> list[Out]:
        out = self._release(s)
        if failed:
            self.stats.failed += 1
        else:
            self.stats.finished += 1
        if tell_client:
            client, sid = s.key
            out.append(self._to_client(client, sid, s.request_id, code, text))
        return out + self.dispatch(now)

    @staticmethod
    def _to_client(client: bytes, session: str, request_id: str, code: ErrorCode, text: str) -> Out:
        return Out.to_client(client, Error.of(code, text, session, request_id=request_id))
