"""Joining a broker with a ticket: ``--join TICKET`` of `zmqllm worker` and `zmqllm gateway`.

``join`` reads the ticket (the flag's value, ``@FILE`` or ``-`` for stdin: the last two keep
the secret out of `ps` and shell history), checks it, asks the broker whether it takes the
ticket's key, and only then stores the keys (ticket_keys.store_ticket). Each refusal is a
``TicketError`` whose ``kind`` and message say which check failed; nothing is stored
before all pass, and no message holds the ticket or its secret.

1. Its form (tickets.decode_ticket): truncated, altered (checksum, key pair), another
   format version.
2. The broker (``probe``): one message over a CURVE connection made with the ticket's keys
   to the endpoint it names, and the first thing that comes back:

   - the handshake denied (the broker's ZAP handler answers 400): the broker does not
     know the key, so it did not issue this ticket: forged (or the key was deleted there);
   - the handshake failing without detail: whoever listens there holds another secret key
     than the ticket's broker key: a ticket for another broker, or altered;
   - a REFUSED: the key was revoked, or the ticket expired unused, in the broker's words;
   - anything else (a worker's heartbeat is answered "register again", a client's STATUS
     with the status): the broker takes the key, and has recorded the ticket as used;
   - nothing within the timeout: the broker is down or out of reach.

The probe's connection ends before the role starts its own. Torch-free.
"""

from __future__ import annotations

import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import zmq
import zmq.utils.monitor

from zmqllm.bus.keys import PeerKeys, as_client
from zmqllm.bus.messages import MAX_STATUS_BYTES, Heartbeat, Refused, Status
from zmqllm.bus.protocol import MAX_FRAMES, decode, encode
from zmqllm.bus.sockets import recv_bounded
from zmqllm.bus.ticket_keys import store_ticket
from zmqllm.bus.tickets import MAX_TICKET_CHARS, Ticket, TicketError, decode_ticket
from zmqllm.bus.wire_types import ProtocolError
from zmqllm.config.loading import with_overrides
from zmqllm.config.settings import Config

__all__ = ["PROBE_TIMEOUT_S", "Joined", "join", "joined_config", "probe", "read_ticket"]

PROBE_TIMEOUT_S = 10.0
_HANDSHAKE_FAILED: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "denied",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no_detail",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",
}


@dataclass(frozen=True)
class Joined:
    """What a ticket that was taken gives its role (no secret in here)."""

    role: str
    name: str
    endpoint: str
    model: str
    layers: str
    expires: int
    keys: Path  # the key folder stored for it

    def overrides(self) -> dict[str, dict[str, Any]]:
        """The settings the ticket gives, by section (flags given still win over them)."""
        section = "worker" if self.role == "worker" else "gateway"
        out: dict[str, dict[str, Any]] = {
            section: {"broker": self.endpoint, "join": ""},
            "security": {"keys": str(self.keys), "insecure": False},
        }
        if self.model:
            out["model"] = {"path": self.model}
        if self.role == "worker":
            out[section]["layers"] = self.layers
        return out

    def describe(self) -> str:
        what = f"model {self.model}" + (f", layers {self.layers}" if self.layers else "")
        return (
            f"joined the broker at {self.endpoint} with ticket {self.name!r} ({self.role}; "
            f"{what}); its keys are in {self.keys}"
        )


def read_ticket(value: str, stdin: TextIO | None = None) -> str:
    """The ticket ``value`` gives: itself, the contents of @FILE, or stdin for "-"."""
    if value == "-":
        source = stdin or sys.stdin
        if source.isatty():
            print("paste the ticket, then Enter:", file=sys.stderr, flush=True)
            return source.readline(2 * MAX_TICKET_CHARS)
        return source.read(2 * MAX_TICKET_CHARS)
    if value.startswith("@"):
        path = Path(value[1:]).expanduser()
        try:
            with path.open(encoding="utf-8", errors="replace") as f:
                return f.read(2 * MAX_TICKET_CHARS)
        except OSError as exc:
            raise TicketError("unreadable", f"cannot read {path}: {exc.strerror}") from None
    return value


def _refusal(reason: str) -> TicketError:
    kind = "revoked" if "revoked" in reason else "expired" if "expired" in reason else "refused"
    return TicketError(kind, f"the broker refused this ticket: {reason[:300]}")


def _handshake(kind: str, endpoint: str) -> TicketError:
    if kind == "denied":
        return TicketError(
            "forged",
            f"the broker at {endpoint} does not know this ticket's key: the ticket was not "
            "made by that broker (forged), or its key was deleted there",
        )
    if kind == "protocol":
        return TicketError("refused", f"the broker at {endpoint} does not take CURVE keys")
    return TicketError(
        "forged",
        f"whoever listens at {endpoint} is not the broker this ticket names (its key "
        "differs): a ticket for another broker, or one altered",
    )


def probe(ticket: Ticket, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Ask the ticket's broker whether it takes the ticket's key; TicketError if not."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    monitor = sock.get_monitor_socket(sum(_HANDSHAKE_FAILED))
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_STATUS_BYTES)
        as_client(sock, PeerKeys(public=ticket.public, secret=ticket.secret, server=ticket.server))
        sock.connect(ticket.endpoint)
        request = uuid.uuid4().hex
        first = Heartbeat() if ticket.role == "worker" else Status(request_id=request)
        # Queued on the connection's pipe: sent once the handshake is done.
        sock.send_multipart(encode(first), flags=zmq.NOBLOCK)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left * 1000) + 1))
            if monitor in ready:
                event = zmq.utils.monitor.recv_monitor_message(monitor)
                kind = _HANDSHAKE_FAILED.get(int(event["event"]))
                if kind is not None:
                    raise _handshake(kind, ticket.endpoint)
            if sock in ready:
                frames = recv_bounded(sock, MAX_FRAMES)
                try:
                    msg = decode(frames, max_payload_bytes=MAX_STATUS_BYTES) if frames else None
                except ProtocolError:
                    continue
                if isinstance(msg, Refused):
                    raise _refusal(msg.reason)
                if msg is not None:
                    return  # the broker's usual answer: the key is taken
        raise TicketError(
            "unreachable",
            f"no answer from the broker at {ticket.endpoint} within {timeout:g}s: is it "
            "running, and does this machine reach it?",
        )
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()


def join(
    value: str,
    role: str,
    timeout: float = PROBE_TIMEOUT_S,
    home: Path | None = None,
    stdin: TextIO | None = None,
) -> Joined:
    """Read, check and probe the ticket ``value`` for ``role`` ("worker" or "client"),
    store its keys under ``home`` (``$ZMQLLM_HOME``) and say what it gives."""
    ticket = decode_ticket(read_ticket(value, stdin))
    if ticket.role != role:
        raise TicketError(
            "role",
            f"this ticket is for a {ticket.role}, not a {role}: make one with "
            + ("`zmqllm ticket --client`" if role == "client" else "`zmqllm ticket`"),
        )
    probe(ticket, timeout)
    folder = store_ticket(ticket, home)
    return Joined(
        role=ticket.role,
        name=ticket.name,
        endpoint=ticket.endpoint,
        model=ticket.model,
        layers=ticket.layers,
        expires=ticket.expires,
        keys=folder,
    )


def joined_config(cfg: Config, value: str, role: str) -> Config:
    """``cfg`` with what the ticket ``value`` gives once ``join`` took it (the role's
    flags go on top). The ticket itself is kept nowhere in it, so nothing that shows
    settings can show it."""
    joined = join(value, role)
    for section, values in joined.overrides().items():
        cfg = with_overrides(cfg, section, values)
    print(f"[zmqllm] {joined.describe()}", file=sys.stderr, flush=True)
    return cfg
