"""CURVE keys for the bus: the key folder, making keys, loading them, applying them.

A key folder (``zmqllm keys init DIR``) holds pyzmq certificate files (``NAME.key``: the
public key; ``NAME.key_secret``: both keys):

    broker.key  broker.key_secret     the broker's pair; every peer needs broker.key
    client.key  client.key_secret     gateways and tools such as `zmqllm status`
    worker.key  worker.key_secret     workers
    clients/    public keys allowed on the frontend (client.key to begin with)
    workers/    public keys allowed on the backend (worker.key to begin with)
    issued/NAME/  what `zmqllm keys add` made for another host: copy the folder there
    revoked/      clients/ and workers/: the keys `zmqllm keys revoke` ended (ticket_keys.py)
    used/         the broker's record of which tickets' keys were used (ticket_keys.py)

The broker reads its pair and the two allowed folders (again while running: removing a
file from ``clients/`` or ``workers/`` revokes that key); a worker reads ``worker.*`` and
``broker.key``; a client ``client.*`` and ``broker.key``. An issued folder has the same
layout as far as its role needs, so ``--keys`` points at either. Torch-free.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import zmq
import zmq.auth

from zmqllm.bus.messages import MAX_LAYERS
from zmqllm.config.paths import zmqllm_home
from zmqllm.config.settings import ConfigError, SecuritySettings

__all__ = [
    "ALLOWED_FOLDERS",
    "CLAIMS",
    "DEFINING_CLAIMS",
    "KINDS",
    "REVOKED",
    "TICKET_CLAIMS",
    "BrokerKeys",
    "KeysError",
    "PeerKeys",
    "add_key",
    "allowed_keys",
    "as_client",
    "as_server",
    "check_claims",
    "claim_refusal",
    "folder_claims",
    "init_keys",
    "key_claims",
    "keys_dir",
    "load_broker_keys",
    "load_peer_keys",
    "private_dir",
]

Role = Literal["client", "worker"]
# Where the broker looks up the keys allowed on each socket; also their ZAP domains.
ALLOWED_FOLDERS: dict[Role, str] = {"client": "clients", "worker": "workers"}
REVOKED = "revoked"  # revoked/clients/, revoked/workers/: keys ended by `keys revoke`
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
DIR_MODE = 0o700
SECRET_MODE = 0o600


class KeysError(ConfigError):
    """A key folder or key file that cannot be used; the message says what to do."""


@dataclass(frozen=True)
class PeerKeys:
    """What a client or worker needs: its own pair and the broker's public key (z85)."""

    public: bytes
    secret: bytes
    server: bytes


@dataclass(frozen=True)
class BrokerKeys:
    public: bytes
    secret: bytes
    folder: Path  # holds clients/ and workers/, read again while the broker runs


def keys_dir(security: SecuritySettings) -> Path | None:
    """The key folder a process uses, or None for a plaintext bus: ``--insecure`` turns
    keys off; ``keys`` must exist when given; else ``$ZMQLLM_HOME/keys`` if it exists."""
    if security.insecure:
        return None
    if security.keys:
        path = Path(security.keys).expanduser()
        if not path.is_dir():
            raise KeysError(
                f"key folder {path} does not exist: make it with `zmqllm keys init {path}`"
            )
        return path
    default = zmqllm_home() / "keys"
    return default if default.is_dir() else None


def _new_pair(
    folder: Path, name: str, claims: Mapping[str, str] | None = None
) -> tuple[Path, Path]:
    public, secret = zmq.auth.create_certificates(folder, name)
    if claims:
        # Written in the public file's metadata section, quoted (ZPL), one per line.
        text = Path(public).read_text()
        lines = "".join(f'    {k} = "{v}"\n' for k, v in claims.items())
        Path(public).write_text(text.replace("metadata\n", "metadata\n" + lines, 1))
    os.chmod(secret, SECRET_MODE)
    return Path(public), Path(secret)


def private_dir(path: Path) -> None:
    """``path`` and its missing parents made; ``path`` itself readable by its owner only."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE)


def init_keys(folder: Path) -> Path:
    """Make a new key folder (broker, client and worker pairs; each of the last two
    allowed on its socket). Refuses a folder that already has a broker key."""
    if (folder / "broker.key_secret").exists():
        raise KeysError(f"{folder} already has keys (broker.key_secret); not replacing them")
    private_dir(folder)
    _new_pair(folder, "broker")
    for role, allowed in ALLOWED_FOLDERS.items():
        public, _ = _new_pair(folder, role)
        private_dir(folder / allowed)
        shutil.copyfile(public, folder / allowed / public.name)
    return folder


def add_key(folder: Path, role: Role, name: str, claims: Mapping[str, str] | None = None) -> Path:
    """Make a pair for another client or worker, allow its public key, and return the
    folder to copy to that host (``issued/NAME``: its pair under the role's file names,
    and ``broker.key``). ``claims`` (a worker's: CLAIMS) go in the public key file's
    metadata: the broker refuses a REGISTER of that key for anything else."""
    if role not in ALLOWED_FOLDERS:
        raise KeysError(f"a key is for a client or a worker, not {role!r}")
    if not _NAME_RE.fullmatch(name):
        raise KeysError(f"key name {name!r}: use 1-64 of letters, digits, '_' and '-'")
    broker_public = folder / "broker.key"
    if not broker_public.is_file():
        raise KeysError(f"{folder} has no broker.key: make the folder with `zmqllm keys init`")
    allowed = folder / ALLOWED_FOLDERS[role] / f"{name}.key"
    issued = folder / "issued" / name
    # A revoked key keeps its name: `zmqllm keys revoke NAME` must never mean two keys.
    revoked = folder / REVOKED / ALLOWED_FOLDERS[role] / f"{name}.key"
    if allowed.exists() or issued.exists() or revoked.exists():
        raise KeysError(f"a key named {name!r} already exists in {folder}")
    check_claims(claims or {})
    private_dir(issued)
    public, _ = _new_pair(issued, role, claims)
    shutil.copyfile(broker_public, issued / "broker.key")
    private_dir(allowed.parent)
    shutil.copyfile(public, allowed)
    return issued


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        hint = "" if path.parent.name == "issued" else " (see `zmqllm keys init`)"
        raise KeysError(f"key file {path} is missing{hint}")
    try:
        public, private = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeysError(f"cannot read key file {path}: {exc}") from None
    if secret and not private:
        raise KeysError(f"{path} holds no secret key")
    return public, private


def load_peer_keys(folder: Path, role: Role) -> PeerKeys:
    public, secret = _load(folder / f"{role}.key_secret", secret=True)
    server, _ = _load(folder / "broker.key", secret=False)
    assert secret is not None
    return PeerKeys(public=public, secret=secret, server=server)


def load_broker_keys(folder: Path) -> BrokerKeys:
    public, secret = _load(folder / "broker.key_secret", secret=True)
    assert secret is not None
    return BrokerKeys(public=public, secret=secret, folder=folder)


# What a worker key may be issued for (`zmqllm keys add worker NAME --model M --layers A:B
# --digest D --num-layers N --kind layers|text`): the model's name, the layers it may serve,
# and what it pins of the model (its digest, layer count and kind: a model of layers or a
# remote text model). The broker lets a key define a model only when it pins all of
# DEFINING_CLAIMS (broker/admission.py).
CLAIMS = ("model", "layers", "digest", "num_layers", "kind")
DEFINING_CLAIMS = ("model", "digest", "num_layers", "kind")
# A ticket's key (ticket_keys.py) also holds when it must first be used by (Unix
# seconds): the broker's record, not the ticket's, decides.
TICKET_CLAIMS = ("expires",)
KINDS = ("layers", "text")
_CLAIM_LINE = re.compile(
    r"^\s+(" + "|".join(CLAIMS + TICKET_CLAIMS) + r')\s*=\s*"([^"]{0,256})"\s*$'
)
_CLAIM_VALUE = re.compile(r"[A-Za-z0-9_.:/@+-]{0,256}")
_LAYERS_CLAIM = re.compile(r"(\d{0,4}):(\d{0,4})")
MAX_DIGEST = 128  # Register.fingerprint's bound on the wire


def check_claims(claims: Mapping[str, str]) -> None:
    """KeysError unless ``claims`` are ones a broker can hold a REGISTER to: known names,
    values a ZPL string holds, and pins that agree with each other."""
    bad = sorted(set(claims) - set(CLAIMS) - set(TICKET_CLAIMS))
    if bad:
        raise KeysError(f"a key claims only {', '.join(CLAIMS)}, not {', '.join(bad)}")
    for claim in TICKET_CLAIMS:
        if claim in claims and not claims[claim].isdigit():
            raise KeysError(f"a key's {claim} claim is a time in Unix seconds")
    for value in claims.values():
        if not _CLAIM_VALUE.fullmatch(value):
            raise KeysError(f"a key's claim {value!r:.80} has characters a claim cannot hold")
    layers = _LAYERS_CLAIM.fullmatch(claims.get("layers", ":"))
    if layers is None:
        raise KeysError(f"layers {claims['layers']!r}: give a range A:B (either end may be empty)")
    digest = claims.get("digest")
    if digest is not None and not 1 <= len(digest) <= MAX_DIGEST:
        raise KeysError(f"a model digest is 1 to {MAX_DIGEST} characters")
    kind = claims.get("kind")
    if kind is not None and kind not in KINDS:
        raise KeysError(f"kind {kind!r}: one of {', '.join(KINDS)}")
    n = claims.get("num_layers")
    if n is not None:
        if not n.isdigit() or not 1 <= int(n) <= MAX_LAYERS:
            raise KeysError(f"num_layers {n!r}: a whole number in [1, {MAX_LAYERS}]")
        if kind == "text" and int(n) != 1:
            raise KeysError("a remote (text) model registers as one layer: num_layers 1")
        end = layers.group(2)
        if end and int(end) > int(n):
            raise KeysError(f"layers {claims['layers']} reach past the model's {n} layers")


def key_claims(path: Path) -> dict[str, str]:
    """The claims in a public key file's metadata section ({} when it has none)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    claims: dict[str, str] = {}
    section = ""
    for line in text.splitlines()[:200]:
        if line and not line[0].isspace() and not line.startswith("#"):
            section = line.strip()
        elif section == "metadata" and (found := _CLAIM_LINE.match(line)):
            claims[found.group(1)] = found.group(2)
    return claims


def folder_claims(folder: Path) -> dict[bytes, dict[str, str]]:
    """Each allowed key's claims (z85 public key -> claims) of the keys that have any."""
    out: dict[bytes, dict[str, str]] = {}
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("*.key")):
        claims = key_claims(path)
        if not claims:
            continue
        try:
            public, _ = zmq.auth.load_certificate(path)
        except Exception:  # pyzmq raises IndexError, ValueError, OSError on bad files
            continue
        out[public] = claims
    return out


def claim_refusal(claims: Mapping[str, str], model: str, start: int, end: int) -> str | None:
    """Why a worker with these key claims may not register layers start:end of model (the
    name and range claims only; broker/admission.py holds a REGISTER to the pins too)."""
    if "model" in claims and claims["model"] != model:
        return f"this worker's key was issued for model {claims['model']!r}, not {model!r}"
    if "layers" in claims:
        a, _, b = claims["layers"].partition(":")
        try:
            lo, hi = int(a or 0), int(b) if b else None
        except ValueError:
            return f"this worker's key claims layers {claims['layers']!r}, which is no range"
        if start < lo or (hi is not None and end > hi):
            return f"this worker's key was issued for layers {claims['layers']}, not {start}:{end}"
    return None


def allowed_keys(folder: Path) -> frozenset[bytes] | None:
    """The public keys (z85) of the ``*.key`` files in ``folder``; a file that does not
    hold one (junk, half written) is left out. None when the folder cannot be listed."""
    keys = set()
    if not folder.is_dir():
        return None
    try:
        entries = sorted(folder.glob("*.key"))
    except OSError:
        return None
    for path in entries:
        try:
            public, _ = zmq.auth.load_certificate(path)
        except Exception:  # pyzmq raises IndexError, ValueError, OSError on bad files
            continue
        if len(public) == 40:
            keys.add(public)
    return frozenset(keys)


def as_server(sock: zmq.Socket[Any], keys: BrokerKeys | PeerKeys, domain: str) -> None:
    """Make a (not yet bound) socket a CURVE server with ``keys``' pair (the broker's, or
    a worker's for its peer link) whose peers ZAP checks in ``domain``."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True
    sock.zap_domain = domain.encode()
    # Without a ZAP handler answering, refuse every handshake (libzmq would admit all).
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def as_client(sock: zmq.Socket[Any], keys: PeerKeys) -> None:
    """Make a (not yet connected) socket a CURVE client of ``keys.server`` (the broker,
    or another worker's peer link)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server
