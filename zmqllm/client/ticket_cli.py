"""``zmqllm ticket``: on the broker's host, one line that lets another machine join.

A worker ticket (the default) holds a new worker key allowed on the broker's backend,
scoped as `zmqllm keys add worker NAME --model M --layers A:B` scopes one, and, when the
running broker already serves the model, pinned to it (--digest, --num-layers, --kind:
a worker of the ticket may then define the model after a broker restart). ``--client``
makes one for a gateway: a client key for the frontend. Either must be used within
``--expires``; the format and what each side checks: bus/tickets.py, bus/ticket_keys.py.

``--layers auto`` asks the running broker (as `zmqllm status` does, with the folder's
client key) for the model's layers no worker serves, else the range with the fewest
workers; all layers when the model has no worker yet. The endpoint in the ticket is the
broker's bind address with ``--address`` (or, for a wildcard, this host's name) as its
host. The ticket goes to stdout alone; what it is for, to stderr.
"""

from __future__ import annotations

import argparse
import re
import secrets
import socket
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from zmqllm.bus.keys import KeysError, Role, keys_dir, load_peer_keys
from zmqllm.bus.messages import SessionError
from zmqllm.bus.ticket_keys import issue_ticket
from zmqllm.bus.tickets import encode_ticket, parse_lifetime, utc
from zmqllm.client.status import fetch_status
from zmqllm.config.flags import add_setting_flags, apply_flags
from zmqllm.config.loading import load_config
from zmqllm.config.machine import is_loopback_host
from zmqllm.config.paths import checked_model_name, served_model_name
from zmqllm.config.settings import DEFAULT_MODEL, TINY_MODEL, Config
from zmqllm.log import configure_logging

__all__ = ["add_ticket_command", "choose_layers", "model_pins", "reachable"]

_TCP = re.compile(r"tcp://(?P<host>\[[^\]]*\]|[^:/]+):(?P<port>[0-9]+)")
_ANY_HOST = ("*", "0.0.0.0", "::", "[::]")
_RANGE = re.compile(r"([0-9]{0,4}):([0-9]{0,4})")


def reachable(endpoint: str, address: str = "") -> tuple[str, str]:
    """A bind endpoint as another machine connects to it (``address`` as its host, else a
    wildcard's host is this machine's name), and a note when only this machine can."""
    m = _TCP.fullmatch(endpoint)
    if m is None:
        raise KeysError(f"a ticket names a tcp://HOST:PORT endpoint, not {endpoint!r:.80}")
    host = address or m["host"]
    if not address and host in _ANY_HOST:
        host = socket.getfqdn()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    note = ""
    if is_loopback_host(host):
        note = (
            "the broker listens on loopback: only this machine can use this ticket (bind "
            "the broker to an address others reach, e.g. --backend tcp://*:5556, and give "
            "--address HOST)"
        )
    return f"tcp://{host}:{m['port']}", note


def _served(status: dict[str, Any], name: str) -> dict[str, Any] | None:
    for m in status.get("models") or []:
        if isinstance(m, dict) and m.get("name") == name and not m.get("text_model"):
            return m
    return None


def choose_layers(status: dict[str, Any], name: str) -> str:
    """The layers a new worker of model ``name`` serves best: the first range no worker
    serves, else the range with the fewest workers; all (":") for a model not served."""
    model = _served(status, name)
    if model is None:
        return ":"
    uncovered = str(model.get("uncovered") or "").split(",")[0].strip()
    if uncovered:
        return uncovered
    ranges: Counter[str] = Counter()
    for w in status.get("workers") or []:
        layers = w.get("layers") if isinstance(w, dict) else None
        if isinstance(layers, list) and len(layers) == 2 and w.get("model") == name:
            ranges[f"{layers[0]}:{layers[1]}"] += 1
    if not ranges:
        return ":"
    return min(ranges, key=lambda r: (ranges[r], r))


def model_pins(status: dict[str, Any], name: str) -> dict[str, str]:
    """What a worker key pins of model ``name`` as the broker serves it ({}: not served)."""
    model = _served(status, name)
    if model is None or not isinstance(model.get("num_layers"), int) or not model.get("digest"):
        return {}
    return {
        "digest": str(model["digest"]),
        "num_layers": str(model["num_layers"]),
        "kind": "layers",
    }


def _status(cfg: Config, folder: Path, timeout: float) -> dict[str, Any] | None:
    m = _TCP.fullmatch(cfg.broker.frontend)
    frontend = cfg.broker.frontend
    if m is not None and m["host"] in _ANY_HOST:
        frontend = f"tcp://127.0.0.1:{m['port']}"
    try:
        return fetch_status(frontend, timeout=timeout, keys=load_peer_keys(folder, "client"))
    except (TimeoutError, SessionError):
        return None


def _model_spec(path: str) -> str:
    # A directory here is named absolutely: the other machine needs it at that path.
    if path in (DEFAULT_MODEL, TINY_MODEL) or not Path(path).expanduser().is_dir():
        return path
    return str(Path(path).expanduser().resolve())


def cmd_ticket(ns: argparse.Namespace) -> int:
    cfg = apply_flags(load_config(ns.config), "ticket", ns)
    configure_logging("ticket", cfg.log.level, cfg.log.format)
    folder = keys_dir(cfg.security)
    if folder is None:
        raise KeysError(
            "this broker has no CURVE keys: a ticket holds a key it allows (make them with "
            "`zmqllm keys init`, which `zmqllm up` does on first use)"
        )
    role: Role = "client" if ns.client else "worker"
    endpoint, note = reachable(cfg.broker.frontend if ns.client else cfg.broker.backend, ns.address)
    lifetime = parse_lifetime(ns.expires)
    name = ns.name or f"ticket-{secrets.token_hex(4)}"
    model = _model_spec(cfg.model.path)
    claims: dict[str, str] = {}
    layers = ""
    if role == "worker":
        served = checked_model_name(served_model_name(cfg.model))
        status = _status(cfg, folder, ns.timeout)
        layers = ns.layers
        if layers == "auto":
            if status is None:
                raise KeysError(
                    f"--layers auto asks the running broker which layers {served} lacks, "
                    f"and none answered at {cfg.broker.frontend}: start it, or give --layers A:B"
                )
            layers = choose_layers(status, served)
        if not _RANGE.fullmatch(layers):
            raise KeysError(
                f"--layers {layers!r:.40}: auto, or a range A:B (either end may be empty)"
            )
        claims = {"model": served, **({"layers": layers} if layers != ":" else {})}
        pins = model_pins(status, served) if status is not None else {}
        claims.update(pins)
        if not pins:
            note += (
                ("\n" if note else "")
                + f"the broker serves no {served} now: a worker of this ticket waits until a "
                "worker with an unscoped key defines the model (docs/security.md)"
            )
    ticket = issue_ticket(
        folder, role, name, endpoint, lifetime, model=model, layers=layers, claims=claims
    )
    print(encode_ticket(ticket), flush=True)
    command = "worker" if role == "worker" else "gateway"
    what = f"a worker of {claims['model']}, layers {layers}" if role == "worker" else "a gateway"
    print(
        f"ticket {name!r}: {what}, for the broker at {endpoint}, to be used by "
        f"{utc(ticket.expires)}. It is a secret: on the other machine save it to a file and "
        f"run `zmqllm {command} --join @FILE` (or `--join -` and paste it). "
        f"`zmqllm keys revoke {name}` ends it.",
        file=sys.stderr,
    )
    if note:
        print(note, file=sys.stderr)
    return 0


def add_ticket_command(sub: Any) -> None:
    """Add ``ticket`` to the ``zmqllm`` parser's sub-parsers."""
    p = sub.add_parser(
        "ticket", help="on the broker's host: one line that lets a worker (or gateway) join"
    )
    p.add_argument("--config", metavar="FILE", help="TOML config file (see configs/)")
    add_setting_flags(p, "ticket")
    p.add_argument(
        "--layers",
        default="auto",
        metavar="auto|A:B",
        help="the layers the worker serves and its key may register: auto (what the "
        "running broker lacks, else its least served range) or A:B (default: auto)",
    )
    p.add_argument(
        "--expires", default="24h", metavar="T", help="use it within T: 30m, 24h, 7d (default 24h)"
    )
    p.add_argument("--name", metavar="NAME", help="the key's name (default: ticket-RANDOM)")
    p.add_argument("--client", action="store_true", help="a ticket for a gateway (a client key)")
    p.add_argument(
        "--address",
        metavar="HOST",
        default="",
        help="the broker's host name or address as the other machine reaches it",
    )
    p.add_argument("--timeout", type=float, default=3.0, metavar="S", help="wait for the broker")
    p.set_defaults(func=cmd_ticket)
