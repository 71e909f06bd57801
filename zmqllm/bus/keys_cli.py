"""``zmqllm keys init|add|list|revoke``: make, allow and end CURVE keys for the bus (see
keys.py; tickets' keys: ticket_keys.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from zmqllm.bus.keys import (
    ALLOWED_FOLDERS,
    CLAIMS,
    KINDS,
    REVOKED,
    KeysError,
    add_key,
    allowed_keys,
    init_keys,
)
from zmqllm.bus.ticket_keys import USED, revoke_key, ticket_keys, used_keys
from zmqllm.bus.tickets import utc
from zmqllm.config.paths import zmqllm_home

__all__ = ["add_keys_command"]


def _default_dir() -> Path:
    return zmqllm_home() / "keys"


def cmd_init(ns: argparse.Namespace) -> int:
    folder = Path(ns.dir).expanduser() if ns.dir else _default_dir()
    init_keys(folder)
    print(
        f"keys written to {folder}\n"
        f"  broker: broker.key_secret (keep it on the broker's host)\n"
        f"  gateways and tools: client.key_secret + broker.key (allowed: clients/)\n"
        f"  workers: worker.key_secret + broker.key (allowed: workers/)\n"
        f"every role takes --keys {folder}; `zmqllm keys add worker NAME` makes more"
    )
    return 0


def cmd_add(ns: argparse.Namespace) -> int:
    folder = Path(ns.keys).expanduser() if ns.keys else _default_dir()
    given = {claim: getattr(ns, claim) for claim in CLAIMS}
    claims = {k: str(v) for k, v in given.items() if v is not None and v != ""}
    if claims.get("kind") == "text":
        claims.setdefault("num_layers", "1")  # a remote model registers as one layer
    if claims and ns.role != "worker":
        raise KeysError("--model, --layers, --digest, --num-layers and --kind are a worker key's")
    issued = add_key(folder, ns.role, ns.name, claims)
    allowed = folder / ALLOWED_FOLDERS[ns.role] / f"{ns.name}.key"
    print(
        f"made a {ns.role} key {ns.name!r}, allowed as {allowed}\n"
        f"copy the folder {issued} to that host and give it as --keys there;\n"
        f"`zmqllm keys revoke {ns.name}` ends it (the broker drops its workers at once)"
    )
    return 0


def _folder(ns: argparse.Namespace) -> Path:
    folder = Path(ns.keys).expanduser() if ns.keys else _default_dir()
    if not (folder / "broker.key").is_file():
        raise KeysError(f"{folder} is not a key folder (make one with `zmqllm keys init`)")
    return folder


def cmd_list(ns: argparse.Namespace) -> int:
    folder = _folder(ns)
    used = used_keys(folder / USED)
    for role, sub in ALLOWED_FOLDERS.items():
        tickets = ticket_keys(folder / sub)
        names = {p.stem: p.stem for p in (folder / sub).glob("*.key")}
        for public, ticket in tickets.items():
            state = "used" if public in used else f"to be used by {utc(ticket.expires)}"
            names[ticket.name] = f"{ticket.name} (ticket, {state})"
        count = len(allowed_keys(folder / sub) or ())
        print(f"{role}s allowed ({count}): {', '.join(sorted(names.values())) or '-'}")
        revoked = sorted(p.stem for p in (folder / REVOKED / sub).glob("*.key"))
        if revoked:
            print(f"{role}s revoked ({len(revoked)}): {', '.join(revoked)}")
    return 0


def cmd_revoke(ns: argparse.Namespace) -> int:
    folder = _folder(ns)
    roles = revoke_key(folder, ns.name)
    print(
        f"revoked the {' and '.join(roles)} key {ns.name!r} (moved to {folder / REVOKED}): "
        "the broker refuses it from now on and drops what holds it within a heartbeat"
    )
    return 0


def add_keys_command(sub: Any) -> None:
    """Add ``keys`` and its sub-commands to the ``zmqllm`` parser's sub-parsers."""
    p = sub.add_parser("keys", help="make and allow CURVE keys for the bus")
    keys_sub = p.add_subparsers(dest="keys_command", required=True, metavar="ACTION")

    q = keys_sub.add_parser("init", help="write a new key folder (broker, client, worker)")
    q.add_argument("dir", nargs="?", help="the folder (default: $ZMQLLM_HOME/keys)")
    q.set_defaults(func=cmd_init)

    q = keys_sub.add_parser("add", help="make another client or worker key and allow it")
    q.add_argument("role", choices=sorted(ALLOWED_FOLDERS))
    q.add_argument("name", help="1-64 of letters, digits, '_' and '-'")
    q.add_argument("--keys", metavar="DIR", help="the key folder (default: $ZMQLLM_HOME/keys)")
    q.add_argument("--model", metavar="M", help="a worker key: the only model it may serve")
    q.add_argument(
        "--layers", metavar="A:B", help="a worker key: the layers it may serve (within A:B)"
    )
    # Pins: what the key's REGISTER must say of the model. With all of them (and --model)
    # the key may define the model while no other worker serves it; without, it waits
    # for a worker of an unscoped key to define it.
    q.add_argument("--digest", metavar="D", help="a worker key: the model's digest (fingerprint)")
    q.add_argument(
        "--num-layers", type=int, metavar="N", help="a worker key: the model's layer count"
    )
    q.add_argument(
        "--kind", choices=KINDS, help="a worker key: a model of layers, or a remote text model"
    )
    q.set_defaults(func=cmd_add)

    q = keys_sub.add_parser("list", help="the keys allowed on each socket, and those revoked")
    q.add_argument("--keys", metavar="DIR", help="the key folder (default: $ZMQLLM_HOME/keys)")
    q.set_defaults(func=cmd_list)

    q = keys_sub.add_parser(
        "revoke", help="end a key (a ticket's, or one `keys add` made): its workers are dropped"
    )
    q.add_argument("name", help="the key's name, as `zmqllm keys list` shows it")
    q.add_argument("--keys", metavar="DIR", help="the key folder (default: $ZMQLLM_HOME/keys)")
    q.set_defaults(func=cmd_revoke)
