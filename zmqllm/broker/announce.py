"""``zmqllm broker --announce``: the broker advertised on the local network by mDNS/DNS-SD.

One ``_zmqllm._tcp`` service (bus/discovery.py holds the format and the worker's side):
the backend's port and addresses, and a TXT record with the broker's public key and the
models it serves, refreshed while it runs so that a worker with ``--model`` can prefer a
broker that already serves it. The key is there so that a worker can skip another
broker's announcement early and say so; it proves nothing (anyone can copy it), and the
worker's CURVE handshake uses the key it already holds.

Refused (ConfigError) without CURVE keys (a broker without them serves loopback only, and
a worker could check nothing) and for a backend bound to loopback, ipc or inproc, which
no other machine can reach. A backend bound to every interface is announced on each
IPv4 address of this machine but loopback's.
"""

from __future__ import annotations

import contextlib
import ipaddress
import secrets
import socket
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from zmqllm.bus.discovery import SERVICE_TYPE, txt_properties
from zmqllm.config.settings import ConfigError
from zmqllm.log import get_logger

if TYPE_CHECKING:
    from zeroconf import ServiceInfo

__all__ = ["Announcer", "announced_addresses"]

log = get_logger("zmqllm.broker")

REFRESH_S = 2.0  # how often the models served are compared with those announced


def _local_ipv4() -> list[str]:
    import ifaddr

    out = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and not ipaddress.ip_address(ip.ip).is_loopback:
                out.append(ip.ip)
    return sorted(set(out))


def announced_addresses(backend: str, local: Callable[[], list[str]] = _local_ipv4) -> list[str]:
    """The IPv4 addresses to announce for the bound ``backend`` endpoint (tcp://HOST:PORT);
    ConfigError when no other machine could reach it."""
    if not backend.startswith("tcp://"):
        raise ConfigError(f"--announce: the backend {backend} is not a TCP endpoint")
    host = backend[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if host in ("*", "0.0.0.0", ""):
        found = local()
        if not found:
            raise ConfigError("--announce: this machine has no IPv4 address but loopback")
        return found
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = ipaddress.ip_address(socket.gethostbyname(host))
    if ip.is_loopback or ip.version != 4:
        raise ConfigError(
            f"--announce: the backend {backend} is not reachable from other machines (bind "
            "it to this machine's address or tcp://*:PORT)"
        )
    return [str(ip)]


class Announcer:
    """The service registered with zeroconf, its TXT kept to ``models()``; ``close``
    withdraws it (a goodbye packet) and never raises."""

    def __init__(self, backend: str, public: bytes, models: Callable[[], Iterable[str]]) -> None:
        from zeroconf import IPVersion, Zeroconf

        self.addresses = announced_addresses(backend)
        self.port = int(backend.rsplit(":", 1)[1])
        self.public = public
        self.models = models
        self._shown: list[str] = []
        self._shown = self._current()
        self.host = socket.gethostname().split(".")[0][:32] or "broker"
        # Its own name for the address records: under the machine's name they would merge
        # with any other announcer's of that name (another broker, or a liar).
        self.server = f"zmqllm-{self.host}-{secrets.token_hex(4)}.local."
        self.info = self._info(f"zmqllm-{self.host}-{self.port}.{SERVICE_TYPE}")
        self.zc = Zeroconf(interfaces=self.addresses, ip_version=IPVersion.V4Only)
        self.zc.register_service(self.info, allow_name_change=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="announce", daemon=True)
        self._thread.start()
        log.info(
            "broker announced by mDNS",
            service=self.info.name,
            addresses=self.addresses,
            port=self.port,
        )

    def _info(self, name: str) -> ServiceInfo:
        from zeroconf import ServiceInfo

        return ServiceInfo(
            SERVICE_TYPE,
            name,
            port=self.port,
            properties=txt_properties(self.public, self._shown),
            server=self.server,
            parsed_addresses=self.addresses,
        )

    def _current(self) -> list[str]:
        # Read from the broker's thread's registry: a table resized meanwhile is read
        # again at the next refresh.
        with contextlib.suppress(RuntimeError):
            return sorted(self.models())
        return self._shown

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            now = self._current()
            if now == self._shown:
                continue
            self._shown = now
            try:
                self.info = self._info(self.info.name)  # the name zeroconf settled on
                self.zc.update_service(self.info)
            except Exception as exc:  # the broker serves on without an up-to-date TXT
                log.warning("mDNS update failed", error=f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        self._stop.set()
        try:
            self.zc.unregister_service(self.info)
        except Exception as exc:
            log.warning("mDNS withdraw failed", error=f"{type(exc).__name__}: {exc}")
        with contextlib.suppress(Exception):
            self.zc.close()
