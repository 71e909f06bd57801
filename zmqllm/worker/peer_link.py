"""A worker's direct links to the workers beside it on its routes (peer links).

Through the broker, one decode token of a 2-stage route costs three forwards: stage 0's
activation to stage 1, stage 1's token to the client and its next step back to stage 0.
Over peer links the broker forwards only the token; the activation and the step go from
worker to worker:

    stage 0 ──ACTIVATION──> stage 1 ──STEP──> stage 0       (peer links)
                               └──TOKEN(stepped)──> broker ──> client

Each worker binds one ROUTER (``PeerLink.start``) and advertises its endpoint in its
REGISTER. The broker names, in each stage's OPEN, where its results go (the next
worker's endpoint and public key) and who alone may send it that session's work (the
previous worker's id and key); a route uses peer links only when all its workers have
one. The broker keeps seeing every token, so its progress deadlines, failover and
cancels work as before, and the gateway's replay heals a route whose peer died. A result
a link cannot take (its handshake not done yet, refused, the peer gone or not reading:
links queue only to completed connections) goes through the broker instead, and so
does the rest of its session, so that the session's messages stay in order.

Security: with CURVE keys the peer socket is a CURVE server with the worker's own pair,
and a ZAP handler on the worker's context admits only keys the broker has named as a
previous stage (:class:`PeerZap`); each message is then checked against its session:
the sender's routing id and CURVE key must be the ones the broker named. Without keys
the socket binds loopback addresses only (``peer_bind``) and the routing id is checked.

Hostile input: nothing is ever sent back on the peer socket; frames are bounded
(MAXMSGSIZE, ``recv_bounded``), the socket's queue by its high-water mark, the messages
held for sessions not yet open here by count and age, outgoing links by count.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import zmq
import zmq.utils.z85

from zmqllm.bus.auth import ZapHandler, peer_key
from zmqllm.bus.keys import PeerKeys, as_client, as_server
from zmqllm.bus.messages import Message
from zmqllm.bus.protocol import MAX_FRAMES
from zmqllm.bus.sockets import recv_bounded
from zmqllm.bus.wire_types import SessionKey
from zmqllm.config.machine import is_loopback_host
from zmqllm.config.settings import ConfigError
from zmqllm.log import get_logger
from zmqllm.worker.faults import Faults
from zmqllm.worker.health import NET
from zmqllm.worker.inbox import Undecodable, take_in

__all__ = [
    "EARLY_BYTES",
    "EARLY_MAX",
    "EARLY_S",
    "MAX_LINKS",
    "PEERS",
    "PeerLink",
    "PeerMessage",
    "PeerRoute",
    "PeerZap",
    "peer_bind",
]

log = get_logger("zmqllm.worker")

PEERS = "peers"  # the ZAP domain of a worker's peer socket
SOCKET_HWM = 10_000
MAX_MESSAGES_PER_READ = 1024
# Outgoing links kept open at once; past it the least recently used goes (a route
# naming it again connects again).
MAX_LINKS = 64
# Keys the ZAP handler admits: the previous stages of recent sessions.
MAX_ADMITTED = 256
# A message for a session not open here yet (its OPEN comes through the broker, on
# another connection) is held this long at most, this many in all.
EARLY_S = 5.0
EARLY_MAX = 1024
EARLY_BYTES = 64 << 20
# A handshake whose key is not named yet waits this long for the OPEN naming it; this
# many wait at once at most.
ZAP_HOLD_S = 2.0
ZAP_HOLD_MAX = 16
ZAP_POLL_MS = 20
# What a link we only send on accepts from the other end: nothing of use, so little.
LINK_RCVHWM = 1
LINK_MAXMSGSIZE = 1024


class PeerMessage(NamedTuple):
    """One message from the peer socket, decoded once (``inbox.take_in``): who sent it
    (routing id, and CURVE key when the bus has keys) and its size in bytes as received
    (what holding it for a session not open yet costs)."""

    sender: str
    user: str | None
    entry: Message | Undecodable
    size: int


@dataclass
class PeerRoute:
    """One session's peer links on this worker (from its OPEN)."""

    next_peer: str  # where this stage's results go ("": through the broker)
    prev: str  # the worker id that alone may send this session's work here
    prev_key: str  # and its CURVE key ("" without CURVE)
    # Set once a result could not go over the link (not connected yet, refused, gone):
    # the rest of the session goes through the broker, so its messages stay in order.
    via_broker: bool = False


def _curve_request(request: list[bytes]) -> bool:
    """A well-formed ZAP request for CURVE (its one credential: a 32-byte key)."""
    return (
        len(request) == 7
        and request[0] == b"1.0"
        and request[5] == b"CURVE"
        and len(request[6]) == 32
    )


class PeerZap(ZapHandler):
    """Admits, on the peer socket, the keys the broker named as previous stages.

    The previous stage may connect before this worker has read the OPEN that names its
    key (the two come over different connections), and libzmq does not retry a refused
    handshake: a key not named yet is answered once it is, or refused after
    ``ZAP_HOLD_S``. The handler holds such requests on a ROUTER (RFC 27 lets replies
    come in any order), at most ``ZAP_HOLD_MAX`` at once; past that, unknown keys are
    refused at once, so strangers cannot delay the named ones."""

    SOCKET_TYPE = zmq.ROUTER

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        super().__init__(ctx)
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def _serve(self, sock: zmq.Socket[Any]) -> None:
        held: list[tuple[list[bytes], float]] = []  # (request, refuse after)
        while not self._stop.is_set():
            if sock.poll(ZAP_POLL_MS):
                frames = sock.recv_multipart()
                if len(frames) < 2 or frames[1] != b"":
                    continue  # not a ZAP request
                envelope, request = frames[:2], frames[2:]
                if (
                    _curve_request(request)
                    and not self.allowed(PEERS, zmq.utils.z85.encode(request[6]))
                    and len(held) < ZAP_HOLD_MAX
                ):
                    held.append((frames, time.monotonic() + ZAP_HOLD_S))
                    continue
                sock.send_multipart(envelope + self._answer(request))
            now = time.monotonic()
            still = []
            for frames, until in held:
                if self.allowed(PEERS, zmq.utils.z85.encode(frames[8])) or now >= until:
                    sock.send_multipart(frames[:2] + self._answer(frames[2:]))
                else:
                    still.append((frames, until))
            held = still

    def admit(self, key: str) -> None:
        raw = key.encode()
        with self._lock:
            self._keys[raw] = None
            self._keys.move_to_end(raw)
            while len(self._keys) > MAX_ADMITTED:
                self._keys.popitem(last=False)

    def allowed(self, domain: str, key: str | bytes | None) -> bool:
        if domain != PEERS or key is None:
            return False
        raw = key.encode() if isinstance(key, str) else key
        with self._lock:
            return raw in self._keys


def _address_towards(host: str, port: int) -> str:
    """This machine's address on the way to ``host`` (a UDP connect sends nothing)."""
    for family, _, _, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM):
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(addr)
            except OSError:
                continue
            local = s.getsockname()[0]
            return f"[{local}]" if family == socket.AF_INET6 else local
    raise ConfigError(f"no local address reaches the broker's host {host!r}")


def peer_bind(setting: str, broker: str, secure: bool) -> str:
    """The endpoint a worker's peer socket binds ("" when off): ``setting`` is
    "off", "auto" (loopback when the broker is local, else the address towards the
    broker, any port) or tcp://HOST:PORT. Without CURVE, only loopback addresses."""
    if setting == "off":
        return ""
    if setting == "auto":
        url = urlsplit(broker)
        host = url.hostname or ""
        if url.scheme != "tcp" or not host or is_loopback_host(host) or host == "*":
            return "tcp://127.0.0.1:*"
        if not secure:
            log.info("peer links off: the bus has no CURVE keys and the broker is remote")
            return ""
        return f"tcp://{_address_towards(host, url.port or 0)}:*"
    url = urlsplit(setting)
    if url.scheme != "tcp" or not url.hostname:
        raise ConfigError(f"[worker] peer {setting!r}: use off, auto or tcp://HOST:PORT")
    if not secure and not is_loopback_host(url.hostname):
        raise ConfigError(
            f"[worker] peer {setting!r}: without CURVE keys a peer link listens on loopback only"
        )
    return setting


class PeerLink:
    """A worker's peer socket and its links to other workers' (used by the compute loop
    only: no lock)."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        identity: str,
        max_message_bytes: int,
        faults: Faults,
        keys: PeerKeys | None = None,
    ) -> None:
        self.ctx = ctx
        self.identity = identity
        self.max_message_bytes = max_message_bytes
        self.faults = faults
        self.keys = keys
        self.endpoint = ""  # what the worker advertises ("": no peer link)
        self.sock: zmq.Socket[Any] | None = None
        self.zap: PeerZap | None = None
        self.links: OrderedDict[str, zmq.Socket[Any]] = OrderedDict()  # endpoint -> DEALER
        # (session key, message, when) of sessions not open here yet.
        self.early: deque[tuple[SessionKey, PeerMessage, float]] = deque()
        self.early_bytes = 0

    def start(self, bind: str) -> str:
        """Bind the peer socket; the endpoint others connect to."""
        if not bind:
            return ""
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, SOCKET_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        if self.keys is not None:
            self.zap = PeerZap(self.ctx)
            self.zap.start()
            as_server(sock, self.keys, PEERS)
        try:
            sock.bind(bind)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            self.close()
            raise ConfigError(f"cannot bind the peer link on {bind}: {exc}") from None
        self.sock = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.endpoint

    def close(self) -> None:
        for link in self.links.values():
            link.close(linger=0)
        self.links.clear()
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        if self.zap is not None:
            self.zap.stop()
            self.zap = None

    # -- what the broker said --------------------------------------------------------
    def expect(self, prev_key: str) -> None:
        """The broker named ``prev_key`` as a previous stage: admit its handshakes."""
        if self.zap is not None and prev_key:
            self.zap.admit(prev_key)

    def connect(self, endpoint: str, server_key: str) -> None:
        """Open (or keep) the link to ``endpoint``, whose CURVE key is ``server_key``."""
        if endpoint in self.links:
            self.links.move_to_end(endpoint)
            return
        while len(self.links) >= MAX_LINKS:
            _, old = self.links.popitem(last=False)
            old.close(linger=0)
        link = self.ctx.socket(zmq.DEALER)
        link.setsockopt(zmq.LINGER, 0)
        link.setsockopt_string(zmq.IDENTITY, self.identity)
        link.setsockopt(zmq.SNDHWM, SOCKET_HWM)
        link.setsockopt(zmq.RCVHWM, LINK_RCVHWM)
        link.setsockopt(zmq.MAXMSGSIZE, LINK_MAXMSGSIZE)
        # Queue only to a connection whose handshake is done: until then (and once it is
        # gone) a send fails at once and the message goes through the broker.
        link.setsockopt(zmq.IMMEDIATE, 1)
        if self.keys is not None:
            as_client(link, dataclasses.replace(self.keys, server=server_key.encode()))
        try:
            link.connect(endpoint)
        except zmq.ZMQError as exc:
            link.close(linger=0)
            self.faults.report("internal", "cannot connect a peer link", exc, endpoint=endpoint)
            return
        self.links[endpoint] = link

    # -- messages --------------------------------------------------------------------
    def send(self, endpoint: str, frames: list[Any]) -> bool:
        """Queue a message on the link to ``endpoint``; False when it cannot be (then
        the caller sends it through the broker)."""
        link = self.links.get(endpoint)
        if link is None:
            return False
        try:
            link.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # Again: not connected (yet), or the peer is not reading
            return False
        NET.sent(frames)
        return True

    def receive(self) -> list[PeerMessage]:
        """What is waiting on the peer socket, each message decoded once; never blocks.
        A message whose header does not decode is counted and dropped (``take_in``)."""
        out: list[PeerMessage] = []
        if self.sock is None:
            return out
        for _ in range(MAX_MESSAGES_PER_READ):
            try:
                frames = recv_bounded(self.sock, MAX_FRAMES + 1)
            except zmq.Again:
                break
            if frames is not None:
                NET.received(frames)
            if frames is None or len(frames) < 2:
                self.faults.report("malformed", "peer message of too many or too few frames")
                continue
            entry = take_in(frames[1:], self.faults, "a peer")
            if entry is None:
                continue
            sender = bytes(frames[0].buffer).decode("ascii", errors="replace")
            user = peer_key(frames) if self.keys is not None else None
            size = sum(len(f.buffer) for f in frames[1:])
            out.append(PeerMessage(sender, user, entry, size))
        return out

    def hold(self, key: SessionKey, msg: PeerMessage) -> None:
        """Keep a message for a session not open here yet (bounded by count, bytes and
        age)."""
        now = time.monotonic()
        self.expire(now)
        if len(self.early) >= EARLY_MAX or self.early_bytes + msg.size > EARLY_BYTES:
            self.faults.report("peer_refused", "peer message for no session here dropped")
            return
        self.early.append((key, msg, now))
        self.early_bytes += msg.size

    def take_held(self, key: SessionKey) -> list[PeerMessage]:
        """The messages held for session ``key``, in arrival order."""
        if not self.early:
            return []
        mine = [msg for k, msg, _ in self.early if k == key]
        if mine:
            self.early = deque(e for e in self.early if e[0] != key)
            self.early_bytes -= sum(msg.size for msg in mine)
        return mine

    def expire(self, now: float) -> None:
        # Usually a step that crossed its session's CLOSE: nothing went wrong.
        while self.early and now - self.early[0][2] > EARLY_S:
            _, msg, _ = self.early.popleft()
            self.early_bytes -= msg.size

    @staticmethod
    def accepts(route: PeerRoute | None, sender: str, user: str | None) -> bool:
        """Whether a message from ``sender`` (CURVE key ``user``) may feed a session."""
        if route is None or not route.prev or sender != route.prev:
            return False
        return not route.prev_key or user == route.prev_key
