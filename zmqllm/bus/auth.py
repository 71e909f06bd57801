"""The broker's side of CURVE: who may connect (ZAP), and what failed handshakes tell.

:class:`ZapHandler` is the ZAP thread itself, whatever decides; the worker's peer link
(peer_link.py) runs one that admits the keys its broker named.

libzmq asks a ZAP handler (RFC 27) about every CURVE handshake on a socket that has a
ZAP domain; without a handler on the socket's own context it admits any client that
knows the server's public key. :class:`Authenticator` is that handler, in a thread of
the broker: the frontend's domain admits the keys in ``clients/``, the backend's those
in ``workers/``, so a worker key is not a client key. The folders are read again at
most every ``RESCAN_S`` and whenever a file is added or removed: a key file removed is
refused from then on, and
``allowed()`` lets the broker turn away the messages of peers connected before.

Tickets (ticket_keys.py) add two kinds of key the handler still lets complete a
handshake but whose messages count for nothing: a key in ``revoked/`` (`zmqllm keys
revoke`), and a ticket's key never used before its expiry. ``refusal`` says which, so
that the broker answers such a peer with a REFUSED naming it instead of silence; a
ticket key's first message in time is recorded in ``used/`` (``admits``).

The handler answers with the peer's public key (z85) as the ZAP user id; libzmq then
stamps it on every message of that connection as the ``User-Id`` property, which is how
the broker ties a worker's routing id to the key that registered it.

:class:`HandshakeMonitor` reads the broker sockets' monitor events and counts failed
handshakes by socket and kind (a peer without CURVE, with the wrong server key, or with
a key not allowed).

Without sockets: ``peer_key`` reads that user id off a message's frames, and
:class:`ClientKeys` keeps the key each client opened its sessions with and says which
clients lose them when their key is revoked.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import zmq
import zmq.utils.monitor
import zmq.utils.z85

from zmqllm.bus.keys import ALLOWED_FOLDERS, CLAIMS, REVOKED, allowed_keys, folder_claims
from zmqllm.bus.sockets import Drops
from zmqllm.bus.ticket_keys import (
    USED,
    TicketKey,
    record_use,
    revoked_keys,
    ticket_keys,
    used_keys,
)
from zmqllm.bus.tickets import utc
from zmqllm.log import get_logger

__all__ = [
    "CLIENTS",
    "WORKERS",
    "ZAP_ENDPOINT",
    "Authenticator",
    "ClientKeys",
    "HandshakeMonitor",
    "ZapHandler",
    "peer_key",
]

log = get_logger("zmqllm.bus.auth")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27
RESCAN_S = 1.0
# How long a connected peer whose key file went away keeps speaking (see admits): with a
# rescan a second and a broker tick a second, a revoked peer is cut off within ~4 s.
GRACE_S = 1.5
POLL_MS = 200  # the handler thread looks at its stop flag this often
MAX_ZAP_FRAMES = 16
CLIENTS, WORKERS = ALLOWED_FOLDERS["client"], ALLOWED_FOLDERS["worker"]  # ZAP domains

HANDSHAKE_EVENTS: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",  # e.g. a peer without CURVE
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "denied",  # the ZAP handler said no
}


class ZapHandler:
    """A ZAP handler thread for CURVE on one context: admits a handshake when
    ``allowed(domain, key)`` says so and answers with the key as the user id. Start it
    before any socket of its context binds."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.ctx = ctx
        # Handshakes refused, by domain: apart from the process's message counters,
        # since nothing of such a peer ever reaches its handlers.
        self.denied = Drops(log)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def allowed(self, domain: str, key: str | bytes | None) -> bool:
        raise NotImplementedError

    def refresh(self, force: bool = False) -> bool:
        """Bring the allowed keys up to date; True when they changed."""
        return False

    # -- the handler thread ------------------------------------------------------------
    def start(self) -> None:
        self.refresh(force=True)
        self._thread = threading.Thread(target=self._run, name="zap", daemon=True)
        self._thread.start()
        if not self._ready.wait(5.0):
            raise RuntimeError("the ZAP handler did not start within 5 s")
        if self._error is not None:
            raise RuntimeError(f"cannot start the ZAP handler: {self._error}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    # A subclass that answers out of order binds a ROUTER and overrides _serve.
    SOCKET_TYPE = zmq.REP

    def _run(self) -> None:
        sock = self.ctx.socket(self.SOCKET_TYPE)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            sock.close()
            return
        self._ready.set()
        try:
            self._serve(sock)
        finally:
            sock.close(linger=0)

    def _serve(self, sock: zmq.Socket[Any]) -> None:
        """Answer requests until stopped, in order."""
        while not self._stop.is_set():
            if not sock.poll(POLL_MS):
                continue
            frames = sock.recv_multipart()
            try:
                reply = self._answer(frames)
            except Exception as exc:  # the handler must answer, whatever it met
                self.denied.error("zap", exc)
                reply = [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"", b"", b""]
            sock.send_multipart(reply)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) < 6 or len(frames) > MAX_ZAP_FRAMES or frames[0] != b"1.0":
            request_id = frames[1] if len(frames) > 1 else b""
            return [b"1.0", request_id, b"400", b"malformed ZAP request", b"", b""]
        _, request_id, domain_b, address_b, _, mechanism = frames[:6]
        credentials = frames[6:]
        domain = domain_b.decode(errors="replace")
        self.refresh()
        if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            why = "CURVE is required"
        else:
            key = zmq.utils.z85.encode(credentials[0])
            if self.allowed(domain, key):
                return [b"1.0", request_id, b"200", b"OK", key, b""]
            why = "key not allowed"
        self.denied.report(
            domain,
            "handshake refused",
            why=why,
            peer=address_b.decode(errors="replace")[:64],
            mechanism=mechanism.decode(errors="replace")[:16],
        )
        return [b"1.0", request_id, b"400", why.encode(), b"", b""]


class Authenticator(ZapHandler):
    """The broker's ZAP handler: ``domains`` maps a ZAP domain to its folder of allowed
    public keys; ``folder`` (the key folder) holds ``revoked/`` and ``used/``."""

    def __init__(
        self, ctx: zmq.Context[Any], domains: dict[str, Path], folder: Path | None = None
    ) -> None:
        super().__init__(ctx)
        self.domains = domains
        self._lock = threading.Lock()
        self._allowed: dict[str, frozenset[bytes]] = {d: frozenset() for d in domains}
        # Per domain, what each key was issued for (its file's metadata; keys.py claims).
        self._claims: dict[str, dict[bytes, dict[str, str]]] = {d: {} for d in domains}
        # Tickets: per domain the revoked keys (-> name) and the tickets' keys; the keys
        # used in time (also kept here when used/ cannot be written).
        self._revoked_dirs = {d: folder / REVOKED / d for d in domains} if folder else {}
        self._used_dir = folder / USED if folder else None
        self._revoked: dict[str, dict[bytes, str]] = {d: {} for d in domains}
        self._tickets: dict[str, dict[bytes, TicketKey]] = {d: {} for d in domains}
        self._used: set[bytes] = set()
        self._scanned_at = -RESCAN_S
        self._seen: tuple[tuple[tuple[str, int, int, int], ...], ...] = ()
        self._removed_at: dict[tuple[str, bytes], float] = {}  # (domain, key) -> when

    # -- the allowed keys ----------------------------------------------------------
    def _stamps(self) -> tuple[tuple[tuple[str, int, int, int], ...], ...]:
        """Each file of each folder: its name, inode, size and mtime. The folder's own
        mtime is not enough: a key file is created (the folder changes) and then written
        (only the file does), and a scan between the two must not stand for a second."""
        out = []
        for folder in [*self.domains.values(), *self._revoked_dirs.values()]:
            try:
                with os.scandir(folder) as entries:
                    files = []
                    for e in entries:
                        st = e.stat(follow_symlinks=False)
                        files.append((e.name, st.st_ino, st.st_size, st.st_mtime_ns))
                out.append(tuple(sorted(files)))
            except OSError:
                out.append(())
        return tuple(out)

    def refresh(self, force: bool = False) -> bool:
        """Read the folders again when a file was added or removed (the folder's mtime
        moved) or RESCAN_S has passed; True when a set changed. A folder that cannot be
        read keeps its last set: a copy under way must not refuse every peer."""
        with self._lock:
            now = time.monotonic()
            stamps = self._stamps()
            if not force and stamps == self._seen and now - self._scanned_at < RESCAN_S:
                return False
            fresh = {}
            for d, folder in self.domains.items():
                keys = allowed_keys(folder)
                if keys is None:
                    log.error("cannot read the allowed keys; keeping the last", folder=str(folder))
                    keys = self._allowed[d]
                else:
                    self._claims[d] = folder_claims(folder)
                    self._tickets[d] = ticket_keys(folder)
                fresh[d] = keys
            # Read after the allowed folders: a key moved between the two reads is seen
            # in both (and counts as revoked), never in neither.
            for d, revoked in self._revoked_dirs.items():
                self._revoked[d] = revoked_keys(revoked)
            if self._used_dir is not None:
                self._used |= used_keys(self._used_dir)
            self._scanned_at, self._seen = now, stamps
            for d, keys in fresh.items():
                for key in self._allowed[d] - keys:
                    if key not in self._revoked[d]:  # revoked on purpose: no grace
                        self._removed_at[(d, key)] = now
                for key in keys:
                    self._removed_at.pop((d, key), None)
                gone = len(self._allowed[d] - keys)
                if gone or len(keys) != len(self._allowed[d]):
                    log.info("allowed keys read", domain=d, keys=len(keys), revoked=gone)
            changed = fresh != self._allowed
            self._allowed = fresh
            return changed

    def claims(self, domain: str, key: str | bytes | None) -> dict[str, str]:
        """What ``key`` was issued for in ``domain`` ({}: anything); a ticket's expiry
        is no scope, so it is left out."""
        if key is None:
            return {}
        raw = key.encode() if isinstance(key, str) else key
        found = self._claims.get(domain, {}).get(raw, {})
        return {k: v for k, v in found.items() if k in CLAIMS}

    def allowed(self, domain: str, key: str | bytes | None) -> bool:
        """Whether a public key (z85) may complete a handshake in ``domain`` now: allowed,
        or revoked (its holder is told so, see ``refusal``)."""
        if key is None:
            return False
        raw = key.encode() if isinstance(key, str) else key
        return raw in self._allowed.get(domain, frozenset()) or raw in self._revoked.get(domain, {})

    def refusal(self, domain: str, key: str | bytes | None) -> str | None:
        """Why a peer with this key is refused although it may connect: its key was
        revoked, or it is a ticket's, not used before it expired. None otherwise."""
        if key is None:
            return None
        raw = key.encode() if isinstance(key, str) else key
        name = self._revoked.get(domain, {}).get(raw)
        if name is not None:
            return f"the key {name!r} was revoked on the broker's host: ask for a new ticket"
        ticket = self._tickets.get(domain, {}).get(raw)
        if ticket is not None and raw not in self._used and time.time() > ticket.expires:
            return (
                f"ticket {ticket.name!r} expired at {utc(ticket.expires)} before it was used "
                "(by the broker's clock): ask for a new one (`zmqllm ticket`)"
            )
        return None

    def admits(self, domain: str, key: str | bytes | None) -> bool:
        """Whether a connected peer with this key may still speak: allowed now and not
        refused, or removed less than GRACE_S ago (a key file rewritten in place, or its
        folder copied anew, is missing for a moment; cutting a worker off for that could
        not be undone). A ticket key's first message in time records its use."""
        if key is None:
            return False
        raw = key.encode() if isinstance(key, str) else key
        if self.refusal(domain, key) is not None:
            return False
        if raw in self._allowed.get(domain, frozenset()):
            ticket = self._tickets.get(domain, {}).get(raw)
            if ticket is not None and raw not in self._used:
                self._use(ticket, raw)
            return True
        removed = self._removed_at.get((domain, raw))
        return removed is not None and time.monotonic() - removed < GRACE_S

    def _use(self, ticket: TicketKey, raw: bytes) -> None:
        """A ticket's key was used in time: from now on it is a key like any other."""
        self._used.add(raw)
        if self._used_dir is not None and record_use(self._used_dir, raw, time.time()):
            log.info("ticket used", name=ticket.name)
        else:  # a read-only key folder
            log.warning("ticket used; cannot record it: a restart forgets", name=ticket.name)


class HandshakeMonitor:
    """Failed handshakes on the broker's sockets, counted by ``socket:kind``."""

    def __init__(self, sockets: dict[str, zmq.Socket[Any]]) -> None:
        self.counts: Counter[str] = Counter()
        events = 0
        for e in HANDSHAKE_EVENTS:
            events |= e
        self.monitors: dict[zmq.Socket[Any], str] = {}
        for name, sock in sockets.items():
            address = f"inproc://zmqllm-monitor-{name}-{uuid.uuid4().hex[:8]}"
            self.monitors[sock.get_monitor_socket(events, addr=address)] = name

    def read(self, monitor: zmq.Socket[Any]) -> None:
        """Take in what one monitor socket has waiting (never blocks)."""
        name = self.monitors[monitor]
        while monitor.poll(0):
            try:
                event = zmq.utils.monitor.recv_monitor_message(monitor, zmq.NOBLOCK)
            except (zmq.Again, ValueError):
                return
            kind = HANDSHAKE_EVENTS.get(int(event["event"]))
            if kind is None:
                continue
            self.counts[f"{name}:{kind}"] += 1
            total = self.counts[f"{name}:{kind}"]
            if total <= 3 or total % 100 == 0:  # a flood must not fill the log
                log.warning("handshake failed", socket=name, kind=kind, total=total)

    def close(self, sockets: list[zmq.Socket[Any]]) -> None:
        for sock in sockets:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
        for monitor in self.monitors:
            monitor.close(linger=0)


def peer_key(frames: list[Any]) -> str | None:
    """The CURVE public key (z85) of the connection a message came on: the ZAP user id
    libzmq stamps on its frames. None without CURVE."""
    try:
        key = frames[-1].get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None
    return key or None


class ClientKeys:
    """The key each client opened its sessions with (no sockets): ``revoked`` names the
    clients to end after a key file was removed."""

    def __init__(self) -> None:
        self.keys: dict[bytes, str] = {}  # client routing id -> its key (z85)

    def opened(self, client: bytes, frames: list[Any]) -> None:
        """``client`` opened a session; ``frames`` are the OPEN's."""
        self.keys[client] = peer_key(frames) or ""

    def revoked(self, auth: Authenticator, live: set[bytes]) -> list[bytes]:
        """The clients whose key ``auth`` no longer admits, forgotten; clients with no
        session left (not in ``live``) are forgotten too."""
        out = []
        for client, key in list(self.keys.items()):
            if not auth.admits(CLIENTS, key):
                out.append(client)
                del self.keys[client]
            elif client not in live:
                del self.keys[client]  # keeps the map as small as the live clients
        return out
