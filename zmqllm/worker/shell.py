"""The worker shell: what every kind of worker process is around its own work (the
library half of the ZeroMQ guide's Majordomo worker, ``mdwrkapi.py``; the pipeline
worker, ``worker.pipeline``, and the remote worker, ``remote.worker``, are the
applications on it, its ``mdworker.py``).

The shell owns the worker's identity (its routing id), the settings and the object of
its link to the broker (``broker_link.BrokerLink``), its fault counters, its signals and
turn loop, and the dispatch of what the links take in. The links decode each message
once (``inbox.take_in``) and queue it typed; here each entry, a session message or what
the link itself says, goes to the handler its type names in one table built once
(SGLang's ``TypeBasedDispatcher``), so an application says what it handles by listing
it. A message of a type the table lacks is dropped and counted, never raised.

Each message is handled in isolation: one a handler cannot process answers an ERROR for
its session and drops that session here; nothing fails a session it does not name.
SIGTERM drains (no new sessions; exit once the running ones finish), SIGINT or a second
SIGTERM stops at once. A refusal by the broker exits with status 3, a dead link with 1.

No torch and no engine here: the remote worker runs on this shell without them.
"""

from __future__ import annotations

import abc
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from zmqllm.bus.keys import PeerKeys, keys_dir, load_peer_keys
from zmqllm.bus.messages import Cancel, Close, Error, ErrorCode, Message, Register, SessionMessage
from zmqllm.bus.protocol import encode
from zmqllm.bus.wire_types import ProtocolError, SessionKey
from zmqllm.config.names import is_name
from zmqllm.config.settings import Config
from zmqllm.log import bind_request, get_logger
from zmqllm.worker.broker_link import (
    BrokerLink,
    LinkLost,
    LinkSettings,
    WorkerRefused,
)
from zmqllm.worker.faults import Faults
from zmqllm.worker.inbox import Entry, Refusal, Reset, Undecodable

__all__ = [
    "IDLE_POLL_S",
    "MAX_MESSAGES_PER_TURN",
    "Handler",
    "WorkerShell",
    "host_name",
    "link_settings",
    "worker_identity",
    "worker_keys",
]

log = get_logger("zmqllm.worker")

MAX_MESSAGES_PER_TURN = 1024  # inbox entries one turn acts on: the rest wait a turn
IDLE_POLL_S = 0.1  # an idle loop still looks at signals and publishes its figures this often
TURN_FAILED_PAUSE_S = 0.01  # a turn that raised is not retried in a tight loop

# A handler: takes the message (or link event) its table names it for.
Handler = Callable[[Any], None]


def worker_identity(cfg: Config, role: str) -> str:
    """This worker's routing id, the same on every reconnect: its name (the host and
    pid without one), what it serves (its layers, or "remote"), and a random tail so
    that a restarted worker is a new one to the broker."""
    name = cfg.worker.name or f"{socket.gethostname()}-{os.getpid()}"
    return f"w-{name}-{role}-{uuid.uuid4().hex[:6]}"


def worker_keys(cfg: Config) -> PeerKeys | None:
    """This worker's CURVE keys (None: the bus has none); a problem with them is told
    now, before a model loads or an upstream is asked anything."""
    folder = keys_dir(cfg.security)
    return load_peer_keys(folder, "worker") if folder is not None else None


def link_settings(
    cfg: Config, identity: str, keys: PeerKeys | None, frame_cap: int | None = None
) -> LinkSettings:
    """The broker link's settings from the config; ``frame_cap`` lowers the largest
    frame accepted below the broker's (a pipeline worker's largest activation)."""
    max_bytes = cfg.broker.max_message_bytes
    return LinkSettings(
        address=cfg.worker.broker,
        identity=identity,
        interval=cfg.broker.heartbeat_interval,
        liveness=cfg.broker.heartbeat_liveness,
        max_message_bytes=max_bytes if frame_cap is None else min(max_bytes, frame_cap),
        keys=keys,
    )


def host_name() -> str:
    """This host's name as REGISTER takes it ("unknown" when it cannot be sent)."""
    host = socket.gethostname()
    return host if is_name(host) else "unknown"


class WorkerShell(abc.ABC):
    """A worker's identity, broker link, signals, turn loop and message dispatch.

    An application defines its turn (``_turn``), its sessions (``sessions``,
    ``close_session``, ``drop_sessions``), its ``heartbeat_figures``, ``close``,
    and its ``message_handlers``; CLOSE and CANCEL are handled here for every kind."""

    # Raised by a handler for a message that is wrong, not the worker: BAD_REQUEST.
    bad_message: tuple[type[Exception], ...] = ()
    # Whether a session message that does not decode fails the session its header
    # names now (else the broker's progress deadline does), and whether a reply that
    # cannot be encoded tells the client why now: each kind keeps what it always did.
    refuses_undecodable = False
    tells_unencodable = False
    kind = "worker"  # what this worker is called in what it tells a client

    def __init__(
        self,
        cfg: Config,
        role: str,
        register: Register,
        *,
        context: zmq.Context[Any] | None = None,
        keys: PeerKeys | None = None,
        frame_cap: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.ctx = context or zmq.Context.instance()
        self.identity = worker_identity(cfg, role)
        self.draining = False
        self._stop = False
        self.faults = Faults(log)
        settings = link_settings(cfg, self.identity, keys, frame_cap)
        self.link = BrokerLink(self.ctx, settings, register, self.faults)
        self.publish_every = IDLE_POLL_S
        self._published = 0.0
        # Built once: a lookup per message instead of a chain of isinstance tests.
        self.handlers: dict[type[Message], Handler] = {
            Close: self.on_close,
            Cancel: self.on_close,
            **self.message_handlers(),
        }
        # What the links say besides messages: not about a session the worker runs.
        self.link_handlers: dict[type[Entry], Handler] = {
            Undecodable: self.on_undecodable,
            Reset: self.on_reset,
            Refusal: self.on_refused,
        }

    # -- what an application defines --------------------------------------------------
    @abc.abstractmethod
    def message_handlers(self) -> dict[type[Message], Handler]:
        """The session messages this kind of worker handles, each with its handler."""

    @abc.abstractmethod
    def sessions(self) -> int:
        """Sessions still running here (draining ends when none is left)."""

    @abc.abstractmethod
    def close_session(self, key: SessionKey) -> bool:
        """Drop session ``key`` here, if it is here (True then)."""

    @abc.abstractmethod
    def drop_sessions(self) -> None:
        """Drop every session: the broker forgot them."""

    @abc.abstractmethod
    def heartbeat_figures(self) -> dict[str, Any]:
        """What the next heartbeats report (the link adds the fault counters)."""

    @abc.abstractmethod
    def _turn(self) -> None:
        """One turn of the loop: wait a little on the link, act on what came, work."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the link and whatever else runs, once the loop ends."""

    # -- signals and the loop ---------------------------------------------------------
    def on_sigterm(self, *_: Any) -> None:
        if self.draining:
            self._stop = True
        else:
            self.draining = True
            log.info(
                "draining: no new sessions; exiting when the running ones finish",
                sessions=self.sessions(),
            )

    def on_sigint(self, *_: Any) -> None:
        self._stop = True

    def install_signals(self) -> None:
        """(Main thread.) SIGTERM drains, SIGINT stops."""
        signal.signal(signal.SIGTERM, self.on_sigterm)
        signal.signal(signal.SIGINT, self.on_sigint)

    def run_turns(self) -> int:
        """Turn until stopped or drained; the process's exit status."""
        try:
            while not self._stop:
                try:
                    self._turn()
                except (WorkerRefused, LinkLost):
                    raise
                except Exception as exc:  # the loop outlives whatever one turn meets
                    self.faults.report("internal", "worker turn failed", exc)
                    time.sleep(TURN_FAILED_PAUSE_S)
                if self.draining and not self.sessions():
                    log.info("drained; leaving")
                    self._stop = True
        except WorkerRefused as exc:
            log.error("refused by the broker", reason=str(exc))
            return 3
        except LinkLost as exc:
            log.error("leaving", reason=str(exc))
            return 1
        finally:
            self.close()
        return 0

    def tend_link(self) -> bool:
        """First thing in a turn: a link whose thread ended ends the worker; the
        heartbeat figures are published when due (True then)."""
        if not self.link.alive():
            raise LinkLost("the broker link ended")
        now = time.monotonic()
        if now - self._published < self.publish_every:
            return False
        self._published = now
        self.link.publish(self.heartbeat_figures(), self.draining)
        return True

    # -- from the broker --------------------------------------------------------------
    def drain_inbox(self) -> None:
        """(Link lock held.) Act on what the link took in, in arrival order."""
        inbox = self.link.inbox
        for _ in range(MAX_MESSAGES_PER_TURN):
            if not inbox:
                return
            self.dispatch(inbox.popleft())

    def dispatch(self, entry: Entry) -> None:
        """One entry a link took in, by its type: a message in isolation (whatever goes
        wrong costs at most its session), else what the link says."""
        if isinstance(entry, Message):
            self.handle_isolated(entry)
        else:
            self.link_handlers[type(entry)](entry)

    def handle_isolated(self, msg: Message) -> None:
        try:
            self.handle(msg)
        except self.bad_message as exc:
            self.fail(msg, ErrorCode.BAD_REQUEST, str(exc), "bad_request")
        except Exception as exc:
            self.faults.report("internal", "error handling a message", exc, type=msg.TYPE.value)
            self.fail(msg, ErrorCode.INTERNAL, f"{type(exc).__name__} handling it")

    def handle(self, msg: Message) -> None:
        handler = self.handlers.get(type(msg))
        if handler is None:
            self.unhandled(msg)
        else:
            handler(msg)

    def on_reset(self, entry: Reset) -> None:
        if self.sessions():
            log.warning(
                "the broker forgot this worker's sessions; dropping them",
                reason=entry.reason,
                sessions=self.sessions(),
            )
        self.drop_sessions()

    def on_refused(self, entry: Refusal) -> None:
        raise WorkerRefused(entry.reason)

    def on_undecodable(self, entry: Undecodable) -> None:
        """A message whose body did not decode: counted; the session its header names
        fails now if this kind of worker says so (else at the broker's deadline)."""
        self.faults.report("malformed", "malformed message", entry.error)
        if not self.refuses_undecodable or entry.key is None:
            return
        key = entry.key
        self.close_session(key)
        err = Error.of(
            ErrorCode.BAD_REQUEST,
            str(entry.error),
            key.session,
            attempt=key.attempt,
            request_id=entry.request_id,
        )
        self.send(err, key)

    def unhandled(self, msg: Message) -> None:
        """A valid message of a type this worker has no handler for: dropped."""
        self.faults.report("unexpected", "unexpected message dropped", type=msg.TYPE.value)

    def on_close(self, msg: Close | Cancel) -> None:
        if self.close_session(SessionKey.of(msg)):
            with bind_request(msg.request_id, msg.session):
                log.info("session closed", reason=msg.TYPE.value, attempt=msg.attempt)

    # -- to the broker ----------------------------------------------------------------
    def fail(self, msg: Message, code: ErrorCode, why: str, reason: str | None = None) -> None:
        """Answer ERROR for the session a message names, and drop it here; ``reason``:
        the fault it counts as (None: none, the worker is fine and so was the message)."""
        if not isinstance(msg, SessionMessage):
            return
        key = SessionKey.of(msg)
        if reason is not None:
            self.faults.report(reason, "message refused", session=str(key), why=why[:200])
        self.close_session(key)
        err = Error.of(code, why, msg.session, attempt=msg.attempt, request_id=msg.request_id)
        self.send(err, key)

    def send(self, msg: Message | None, key: SessionKey | None = None) -> None:
        """Send a message to the broker (None: nothing); one that cannot be sent drops
        session ``key`` here (the broker's inactivity deadline does the rest)."""
        if msg is None:
            return
        try:
            frames = encode(msg)
        except ProtocolError as exc:
            named = "" if key is None else str(key)
            self.faults.report("unsent", "message not sent; session failed", exc, session=named)
            if key is not None:
                self.close_session(key)
            # The link is fine: the client can hear why now, not at a deadline (an
            # ERROR that cannot be encoded ends here: its answer would be another).
            told = isinstance(msg, SessionMessage) and not isinstance(msg, Error)
            if self.tells_unencodable and told:
                self.fail(msg, ErrorCode.INTERNAL, f"the {self.kind} could not encode a reply")
            return
        with self.link.lock:
            why = self.link.send(frames, key)
        if why and key is not None:
            self.close_session(key)
