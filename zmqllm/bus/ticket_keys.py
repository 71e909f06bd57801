"""Tickets' keys on disk: issuing one, revoking a key, the broker's record of each ticket
key's expiry and first use, and the key folder a joining machine keeps.

On the broker's host, in its key folder (keys.py):

    workers/NAME.key, clients/NAME.key   a ticket's public key, allowed, its claims in its
                                         metadata: the scope (keys.py CLAIMS) and
                                         ``expires``, when it must first be used by
    used/KEY                             written by the broker when the key KEY (hex) is
                                         first used before it expired
    revoked/workers/NAME.key, ...        keys `zmqllm keys revoke NAME` ended

A ticket's expiry bounds when it may first be used, as a join token's does: a worker that
joined in time keeps serving and registers again after a restart of either side, since
``used/`` says it joined. The broker's clock decides, never the joining machine's. The
secret key of a ticket is kept nowhere on the broker's host: ``issue_ticket`` removes the
folder `zmqllm keys add` writes, so the ticket line is its only copy.

On the joining machine, ``store_ticket`` writes ``$ZMQLLM_HOME/tickets/NAME/`` (0700): the
role's ``.key`` and ``.key_secret`` (0600) and ``broker.key``, a key folder as ``--keys``
takes it. Torch-free, socket-free.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq.auth
import zmq.utils.z85

from zmqllm.bus.keys import (
    ALLOWED_FOLDERS,
    REVOKED,
    SECRET_MODE,
    KeysError,
    Role,
    add_key,
    key_claims,
    load_peer_keys,
    private_dir,
)
from zmqllm.bus.tickets import Ticket, TicketError, decode_ticket, encode_ticket
from zmqllm.config.paths import zmqllm_home

__all__ = [
    "USED",
    "TicketKey",
    "issue_ticket",
    "key_file_name",
    "record_use",
    "revoke_key",
    "revoked_keys",
    "store_ticket",
    "ticket_keys",
    "used_keys",
]

USED = "used"
TICKETS = "tickets"  # under $ZMQLLM_HOME on a joining machine


@dataclass(frozen=True)
class TicketKey:
    """A ticket's allowed key as the broker reads it."""

    name: str
    expires: int  # Unix seconds: to be first used by then


def _taken(folder: Path, name: str) -> bool:
    subs = [*ALLOWED_FOLDERS.values()]
    return any(
        (folder / where / f"{name}.key").exists()
        for where in [*subs, *(f"{REVOKED}/{s}" for s in subs)]
    )


def issue_ticket(
    folder: Path,
    role: Role,
    name: str,
    endpoint: str,
    lifetime_s: int,
    *,
    model: str = "",
    layers: str = "",
    claims: Mapping[str, str] | None = None,
    now: float | None = None,
) -> Ticket:
    """Allow a new key pair in ``folder`` for a ticket (scoped by ``claims``, to be used
    within ``lifetime_s``) and return the ticket holding it."""
    if _taken(folder, name):
        raise KeysError(f"a key named {name!r} already exists in {folder} (or was revoked)")
    expires = int(time.time() if now is None else now) + lifetime_s
    issued = add_key(folder, role, name, {**(claims or {}), "expires": str(expires)})
    allowed = folder / ALLOWED_FOLDERS[role] / f"{name}.key"
    try:
        keys = load_peer_keys(issued, role)
        ticket = Ticket(
            role=role,
            name=name,
            endpoint=endpoint,
            server=keys.server,
            public=keys.public,
            secret=keys.secret,
            expires=expires,
            model=model,
            layers=layers,
        )
        decode_ticket(encode_ticket(ticket))  # what cannot be read back is not issued
    except TicketError as exc:
        allowed.unlink(missing_ok=True)
        raise KeysError(f"cannot make this ticket: {exc}") from None
    finally:
        # The ticket is the secret key's only copy.
        shutil.rmtree(issued, ignore_errors=True)
    return ticket


def revoke_key(folder: Path, name: str) -> list[Role]:
    """Move the allowed key(s) named ``name`` to ``revoked/``: the broker refuses them from
    its next tick on and drops what registered with them. The roles revoked."""
    done: list[Role] = []
    for role, sub in ALLOWED_FOLDERS.items():
        allowed = folder / sub / f"{name}.key"
        if not allowed.is_file():
            continue
        target = folder / REVOKED / sub
        private_dir(target)
        # One rename: the key is never in neither folder, so a scan never misses it.
        os.replace(allowed, target / allowed.name)
        done.append(role)
    shutil.rmtree(folder / "issued" / name, ignore_errors=True)
    if not done:
        subs = ALLOWED_FOLDERS.values()
        if any((folder / REVOKED / sub / f"{name}.key").exists() for sub in subs):
            raise KeysError(f"the key {name!r} is revoked already")
        raise KeysError(f"no key named {name!r} in {folder} (`zmqllm keys list` shows them)")
    return done


def _public(path: Path) -> bytes | None:
    try:
        public, _ = zmq.auth.load_certificate(path)
    except Exception:  # pyzmq raises IndexError, ValueError, OSError on bad files
        return None
    return public if len(public) == 40 else None


def ticket_keys(folder: Path) -> dict[bytes, TicketKey]:
    """The tickets' keys among the allowed ``folder``'s (z85 public key -> its record)."""
    out: dict[bytes, TicketKey] = {}
    with contextlib.suppress(OSError):
        for path in sorted(folder.glob("*.key")):
            expires = key_claims(path).get("expires", "")
            public = _public(path) if expires.isdigit() else None
            if public is not None:
                out[public] = TicketKey(name=path.stem, expires=int(expires))
    return out


def revoked_keys(folder: Path) -> dict[bytes, str]:
    """The revoked keys in ``folder`` (z85 public key -> its name)."""
    out: dict[bytes, str] = {}
    with contextlib.suppress(OSError):
        for path in sorted(folder.glob("*.key")):
            public = _public(path)
            if public is not None:
                out[public] = path.stem
    return out


def key_file_name(public: bytes) -> str:
    """A public key (z85) as a file name (hex: z85 has '/')."""
    return zmq.utils.z85.decode(public).hex()


def used_keys(folder: Path) -> frozenset[bytes]:
    """The keys (z85) whose use ``folder`` (the key folder's ``used/``) records."""
    out = set()
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            with contextlib.suppress(ValueError):
                raw = bytes.fromhex(entry.name)
                if len(raw) == 32:
                    out.add(zmq.utils.z85.encode(raw))
    return frozenset(out)


def record_use(folder: Path, public: bytes, when: float) -> bool:
    """Record in ``folder`` (the key folder's ``used/``) that ``public`` was first used at
    ``when``; False when it cannot be written (a read-only folder)."""
    try:
        private_dir(folder)
        (folder / key_file_name(public)).write_text(f"{int(when)}\n")
    except OSError:
        return False
    return True


def _write_cert(path: Path, public: bytes, secret: bytes | None, banner: str) -> None:
    # pyzmq's certificate format (zmq.auth.load_certificate reads it), created 0600 so
    # the secret is never readable by others, not even for a moment.
    lines = [f"#   {banner}", "", "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, SECRET_MODE)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(path, SECRET_MODE)


def store_ticket(ticket: Ticket, home: Path | None = None) -> Path:
    """Write the ticket's keys as a key folder under ``home`` (``$ZMQLLM_HOME``) and return
    it: ``tickets/NAME/`` with the role's pair and ``broker.key``."""
    private_dir((home or zmqllm_home()) / TICKETS)
    folder = (home or zmqllm_home()) / TICKETS / ticket.name
    private_dir(folder)
    banner = f"zmqllm: the {ticket.role} key of ticket {ticket.name}"
    _write_cert(folder / "broker.key", ticket.server, None, "zmqllm: the broker's public key")
    _write_cert(folder / f"{ticket.role}.key", ticket.public, None, banner)
    _write_cert(folder / f"{ticket.role}.key_secret", ticket.public, ticket.secret, banner)
    return folder
