"""Finding a broker on the local network: mDNS/DNS-SD with python-zeroconf.

``zmqllm broker --announce`` advertises a ``_zmqllm._tcp`` service (broker/announce.py):
the backend's addresses and port, and in its TXT record the format's version, the
broker's public key and the models it serves. ``zmqllm worker --discover`` browses for
it (``discover_broker``) and connects to the one it chooses.

An announcement is hostile input like any frame: anyone on the link can send one, with
any address and any key. So it only ever says *where* to connect. What the worker
connects *to* is decided by the broker key it already holds (its ``--keys`` folder's
``broker.key``, or its ticket's): an announcement whose key differs is skipped and named
in the error when nothing else is found, and the CURVE handshake uses the held key, never
the announced one, so an announcement with a copied key but another address reaches
nothing it can talk to. Among announcements with the right key, one already serving the
worker's model comes first (a model no broker serves yet goes to any of them).

Torch-free; the only module that imports zeroconf besides broker/announce.py.
"""

from __future__ import annotations

import ipaddress
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from zmqllm.bus.keys import KeysError, keys_dir, load_peer_keys
from zmqllm.config.loading import with_overrides
from zmqllm.config.settings import Config, ConfigError
from zmqllm.log import get_logger

__all__ = [
    "SERVICE_TYPE",
    "Announcement",
    "DiscoveryError",
    "choose",
    "discover_broker",
    "discovered_config",
    "parse_properties",
    "txt_properties",
]

log = get_logger("zmqllm.discovery")

SERVICE_TYPE = "_zmqllm._tcp.local."
TXT_VERSION = "1"
# After the first announcement with the right key, how long to wait for one that already
# serves the worker's model (brokers answer a query within a second or so).
PREFER_WAIT_S = 2.0
MAX_TXT_VALUE = 240  # a TXT string is at most 255 bytes, "models=" included
MAX_SEEN = 64  # announcements kept while browsing: a flood of them costs only this
_Z85_KEY = re.compile(r"[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
_MODEL = re.compile(r"[A-Za-z0-9_.:/@+~-]{1,128}")


class DiscoveryError(ConfigError):
    """No broker found that this worker may use; the message says what was seen."""


@dataclass(frozen=True)
class Announcement:
    """One broker as announced: where it says it is, and what it says it holds."""

    name: str
    addresses: tuple[str, ...]  # IPv4, as announced
    port: int  # the backend's
    key: bytes  # z85, as announced: compared, never used for the handshake
    models: tuple[str, ...] = ()

    def endpoint(self, local: Iterable[ipaddress.IPv4Network] = ()) -> str:
        """tcp://ADDRESS:PORT, the first address on a network this machine is on (else
        the first announced)."""
        nets = list(local)
        on_link = [a for a in self.addresses if any(ipaddress.ip_address(a) in n for n in nets)]
        return f"tcp://{(on_link or list(self.addresses))[0]}:{self.port}"


def txt_properties(key: bytes, models: Iterable[str]) -> dict[str, str]:
    """The TXT record a broker announces (models cut to what one TXT string holds)."""
    shown = ""
    for model in sorted(set(models)):
        joined = f"{shown},{model}" if shown else model
        if len(joined) > MAX_TXT_VALUE:
            break
        shown = joined
    return {"v": TXT_VERSION, "key": key.decode("ascii"), "models": shown}


def parse_properties(
    name: str, addresses: Iterable[str], port: int, props: Mapping[bytes, bytes | None]
) -> Announcement | None:
    """An announcement checked field by field (None: not one this version can use)."""
    try:
        text = {k.decode("ascii"): (v or b"").decode("ascii") for k, v in props.items()}
    except (UnicodeDecodeError, AttributeError):
        return None
    key = text.get("key", "")
    if text.get("v") != TXT_VERSION or not _Z85_KEY.fullmatch(key) or not 0 < port < 65536:
        return None
    ips = []
    for a in addresses:
        try:
            ip = ipaddress.ip_address(a)
        except ValueError:
            continue
        if ip.version == 4 and not ip.is_multicast and not ip.is_unspecified:
            ips.append(str(ip))
    if not ips:
        return None
    models = tuple(m for m in text.get("models", "").split(",") if _MODEL.fullmatch(m))
    return Announcement(name, tuple(ips), port, key.encode("ascii"), models)


def choose(
    found: Iterable[Announcement], trusted: bytes, model: str = ""
) -> tuple[Announcement | None, list[Announcement]]:
    """The announcement to use (one with the ``trusted`` key, serving ``model`` first,
    then by name) and those skipped for another key."""
    ok: list[Announcement] = []
    other: list[Announcement] = []
    for a in sorted(found, key=lambda a: a.name):
        (ok if a.key == trusted else other).append(a)
    serving = [a for a in ok if model and model in a.models]
    pick = serving or ok
    return (pick[0] if pick else None, other)


def _local_networks() -> list[ipaddress.IPv4Network]:
    import ifaddr

    nets = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str):  # IPv4 (IPv6 ones are tuples)
                nets.append(ipaddress.IPv4Network(f"{ip.ip}/{ip.network_prefix}", strict=False))
    return nets


def _browse(until: Callable[[list[Announcement]], bool], timeout: float) -> list[Announcement]:
    """Announcements seen until ``until(seen)`` holds or ``timeout`` passes."""
    from zeroconf import IPVersion, ServiceBrowser, ServiceStateChange, Zeroconf

    seen: dict[str, Announcement] = {}
    names: list[str] = []
    lock = threading.Lock()

    def on_change(
        zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        if state_change is not ServiceStateChange.Removed:
            with lock:
                if name not in names and len(names) < MAX_SEEN:
                    names.append(name)

    zc = Zeroconf(ip_version=IPVersion.V4Only)
    browser = ServiceBrowser(zc, SERVICE_TYPE, handlers=[on_change])
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with lock:
                pending = [n for n in names if n not in seen]
            for name in pending:
                info = zc.get_service_info(SERVICE_TYPE, name, timeout=1000)
                if info is None or info.port is None:
                    continue
                ips = info.parsed_addresses(version=IPVersion.V4Only)
                found = parse_properties(name, ips, info.port, info.properties or {})
                if found is not None:
                    seen[name] = found
            if until(list(seen.values())):
                break
            time.sleep(0.1)
        return list(seen.values())
    finally:
        browser.cancel()
        zc.close()


def discover_broker(trusted: bytes, model: str, timeout: float) -> str:
    """The backend endpoint of a broker announcing the ``trusted`` key on the local
    network; DiscoveryError naming what was seen when there is none."""
    first_ok: list[float] = []

    def done(seen: list[Announcement]) -> bool:
        chosen, _ = choose(seen, trusted, model)
        if chosen is None:
            return False
        if not model or model in chosen.models:
            return True
        if not first_ok:
            first_ok.append(time.monotonic())
        return time.monotonic() - first_ok[0] >= PREFER_WAIT_S

    seen = _browse(done, timeout)
    chosen, other = choose(seen, trusted, model)
    for a in other:
        log.warning(
            "announced broker ignored: its key is not the one this worker trusts",
            broker=a.name,
            addresses=list(a.addresses),
        )
    if chosen is None:
        said = f"; {len(other)} announced another public key, ignored" if other else ""
        raise DiscoveryError(
            f"--discover: no broker with this worker's broker key announced itself on the "
            f"local network within {timeout:g}s ({len(seen)} seen{said}). Start the broker "
            "with --announce, check that mDNS (link-local multicast, UDP 5353: "
            "docs/add-a-machine.md) passes between the machines, or give --broker ADDR"
        )
    endpoint = chosen.endpoint(_local_networks())
    log.info("broker discovered", broker=chosen.name, endpoint=endpoint, models=chosen.models)
    return endpoint


def discovered_config(cfg: Config, model: str = "") -> Config:
    """``cfg`` with ``[worker] broker`` found by discovery, checked against the broker key
    of its key folder (a ticket's, after --join)."""
    folder = keys_dir(cfg.security)
    if folder is None:
        raise DiscoveryError(
            "--discover needs the broker's public key to check what it finds: give --keys "
            "DIR (a folder from `zmqllm keys add worker`) or --join TICKET"
        )
    try:
        trusted = load_peer_keys(folder, "worker").server
    except KeysError as exc:
        raise DiscoveryError(f"--discover: {exc}") from exc
    endpoint = discover_broker(trusted, model, cfg.worker.discover_timeout)
    return with_overrides(cfg, "worker", {"broker": endpoint})
