"""Tickets: one line that holds everything another machine needs to join a broker.

``zmqllm ticket`` on the broker's host prints one; ``zmqllm worker --join TICKET`` (or
``zmqllm gateway --join`` for a client ticket) on the other machine reads it. A ticket is

    zmqllm-ticket-1.BODY.CHECK

``1`` is the format's version; BODY is base64url (unpadded) of a JSON object: the role
("worker" or "client"), the key's name, the broker endpoint to connect to, the broker's
public key, the key pair issued for the ticket (z85), when it must be used by (Unix
seconds), the model (a worker's to serve, a gateway's tokenizer) and for a worker the
layer range it is issued for. CHECK is the
first CHECK_BYTES of SHA-256 over ``zmqllm-ticket-1.BODY``, base64url.

What the joining side can check, and what it cannot: CHECK catches a ticket cut short
or damaged in copying (a line wrapped, a character lost), and the key pair must be one
pair. Anyone holding a ticket can recompute CHECK, so it proves nothing about who made
it: the broker does that. Its ZAP handler admits only the public keys it issued (a
forged ticket's key is refused at the handshake), and the scope and expiry it enforces
are its own records beside that key (ticket_keys.py), never what a ticket says, so
editing a ticket's model, layers or expiry gains nothing. The endpoint and broker key are
trusted as given: a ticket is a secret and the trust anchor at once, like the key
folder `zmqllm keys add` issues, and travels only over a channel you trust.

Errors never hold the ticket or its secret key: a ``TicketError`` says which check
failed (``kind``) and what to do. Torch-free, socket-free.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import zmq

from zmqllm.bus.keys import KeysError

__all__ = [
    "PREFIX",
    "VERSION",
    "Ticket",
    "TicketError",
    "decode_ticket",
    "encode_ticket",
    "parse_lifetime",
    "utc",
]

Role = Literal["client", "worker"]
PREFIX = "zmqllm-ticket-"
VERSION = 1
CHECK_BYTES = 8
CHECK_CHARS = 11  # base64url of CHECK_BYTES, unpadded
MAX_TICKET_CHARS = 4096  # a real one is about 400
_B64 = re.compile(r"[A-Za-z0-9_-]*")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_Z85_KEY = re.compile(r"[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
_ENDPOINT = re.compile(r"tcp://[A-Za-z0-9.\-\[\]:*]{1,255}:[0-9]{1,5}")
_SPEC = re.compile(r"[A-Za-z0-9_.:/@+~-]{0,512}")
_LIFETIME = re.compile(r"([0-9]+)\s*([smhdw]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
MAX_LIFETIME_S = 366 * 86400


class TicketError(KeysError):
    """A ticket refused; ``kind`` says which check: empty, malformed, truncated, altered,
    version, forged, expired, revoked, unreachable."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Ticket:
    role: Role
    name: str  # the key's name on the broker (`zmqllm keys revoke NAME`)
    endpoint: str  # the broker's backend (worker) or frontend (client), as others reach it
    server: bytes  # the broker's public key, z85
    public: bytes  # the issued pair, z85
    secret: bytes = field(repr=False)  # never shown: a repr may reach a log line
    expires: int = 0  # Unix seconds: to be used by then (the broker's clock decides)
    model: str = ""  # --model: what a worker prepares and serves, a gateway's tokenizer
    layers: str = ""  # a worker's --layers, "A:B" (":" = all)


def utc(when: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(when))


def parse_lifetime(text: str) -> int:
    """Seconds of a lifetime as `--expires` takes it: "24h", "30m", "7d", "2w", "90s" or
    plain seconds; KeysError otherwise."""
    m = _LIFETIME.fullmatch(text.strip().lower())
    seconds = int(m.group(1)) * _UNITS[m.group(2)] if m else 0
    if not 1 <= seconds <= MAX_LIFETIME_S:
        raise KeysError(f"--expires {text!r:.40}: a lifetime like 24h, 30m or 7d (at most 366d)")
    return seconds


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _check(head: str, body: str) -> str:
    return _b64(hashlib.sha256(f"{head}.{body}".encode()).digest()[:CHECK_BYTES])


def encode_ticket(t: Ticket) -> str:
    """The ticket's one line."""
    payload: dict[str, Any] = {
        "role": t.role,
        "name": t.name,
        "endpoint": t.endpoint,
        "broker": t.server.decode(),
        "public": t.public.decode(),
        "secret": t.secret.decode(),
        "expires": t.expires,
        "model": t.model,
    }
    if t.role == "worker":
        payload["layers"] = t.layers
    body = _b64(json.dumps(payload, separators=(",", ":"), sort_keys=True).encode())
    head = f"{PREFIX}{VERSION}"
    return f"{head}.{body}.{_check(head, body)}"


def _text(payload: dict[str, Any], key: str, pattern: re.Pattern[str]) -> str:
    value = payload.get(key)
    if not isinstance(value, str) or not pattern.fullmatch(value):
        # Never the value: this may be the secret key.
        raise TicketError("malformed", f"this ticket's {key} is missing or not valid")
    return value


def decode_ticket(text: str) -> Ticket:
    """The ticket a line holds (white space anywhere in it is ignored: a ticket wrapped
    by a mail or chat program still reads); TicketError saying which check failed."""
    line = "".join(text.split())
    if not line:
        raise TicketError("empty", "no ticket given")
    if len(line) > MAX_TICKET_CHARS:
        raise TicketError(
            "malformed", f"this is not a zmqllm ticket (over {MAX_TICKET_CHARS} characters)"
        )
    if not line.startswith(PREFIX):
        raise TicketError(
            "malformed", f"this is not a zmqllm ticket (a ticket starts with {PREFIX}{VERSION}.)"
        )
    head, dot, rest = line.partition(".")
    version = head[len(PREFIX) :]
    if not dot:
        raise TicketError("truncated", "this ticket is truncated: copy the whole line again")
    if not version.isdigit():
        raise TicketError("malformed", "this is not a zmqllm ticket (no version after its prefix)")
    if int(version) != VERSION:
        raise TicketError(
            "version",
            f"this is a version {int(version)} ticket; this zmqllm reads version {VERSION}: "
            "use the same zmqllm release on both machines",
        )
    body, dot, check = rest.partition(".")
    if not dot or len(check) < CHECK_CHARS:
        raise TicketError(
            "truncated", "this ticket is truncated (it ends early): copy the whole line again"
        )
    if (
        len(check) != CHECK_CHARS
        or not _B64.fullmatch(body + check)
        or not hmac.compare_digest(check, _check(head, body))
    ):
        raise TicketError(
            "altered",
            "this ticket was altered or damaged: its checksum does not match; copy it again "
            "from what `zmqllm ticket` printed",
        )
    try:
        payload = json.loads(_unb64(body))
    except (binascii.Error, ValueError):
        payload = None
    if not isinstance(payload, dict):
        raise TicketError("malformed", "this ticket's body is not readable")
    return _ticket(payload)


def _ticket(payload: dict[str, Any]) -> Ticket:
    role = payload.get("role")
    if role not in ("worker", "client"):
        raise TicketError("malformed", "this ticket is for neither a worker nor a client")
    expires = payload.get("expires")
    if type(expires) is not int or expires < 0:
        raise TicketError("malformed", "this ticket's expiry is not valid")
    public = _text(payload, "public", _Z85_KEY).encode()
    secret = _text(payload, "secret", _Z85_KEY).encode()
    try:
        pair = zmq.curve_public(secret) == public
    except (zmq.ZMQError, ValueError):
        pair = False
    if not pair:
        raise TicketError("altered", "this ticket was altered: its key pair is not one pair")
    return Ticket(
        role=role,
        name=_text(payload, "name", _NAME),
        endpoint=_text(payload, "endpoint", _ENDPOINT),
        server=_text(payload, "broker", _Z85_KEY).encode(),
        public=public,
        secret=secret,
        expires=expires,
        model=_text(payload, "model", _SPEC),
        layers=_text(payload, "layers", _SPEC) if role == "worker" else "",
    )
