"""Test hosts made of network namespaces on this machine, joined by a bridge.

Host ``i`` is a namespace with one veth interface at ``198.18.0.i/24`` (the range RFC 2544
reserves for benchmark tests) whose peer hangs on a bridge in the root namespace. The
root namespace gets no address in that range, so two testbeds can run at once without
sharing a route, and nothing a host sends can leave the bridge. The test process reaches
a host's sockets by entering its namespace for one thread (``Host.entered``).

A link can be rate limited (``tc`` tbf on both ends), given a one-way delay (netem on both
ends, where the kernel has it: ``shape_link`` says whether it could) and cut
(``link_down``: the bridge's end goes down, as if the cable were pulled).

Every name starts with ``PREFIX``, the pid of the process that made it and a letter
(``zqtb1234a-h1``, ``zqtb1234abr``): ``remove_stale`` removes what a run killed before its
clean-up left behind (its pid is gone) and leaves a live run's alone. ``Testbed.close``
kills the processes in its namespaces and removes everything it made; it never raises.
Needs root.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "PREFIX",
    "SUBNET",
    "Host",
    "Testbed",
    "parse_rate",
    "remove_stale",
    "unusable_reason",
]

PREFIX = "zqtb"
SUBNET = "198.18.0"  # RFC 2544's 198.18.0.0/15, benchmark tests only
NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
COMMAND_TIMEOUT_S = 30.0
# A testbed's tag: the prefix, its maker's pid and a letter (one process may make several).
_OWNED = re.compile(rf"^({PREFIX}(\d+)[a-z])")
_made = 0


def _new_tag() -> str:
    global _made
    _made += 1
    return f"{PREFIX}{os.getpid()}{chr(ord('a') + (_made - 1) % 26)}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _tc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tc", *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)


def unusable_reason() -> str | None:
    """Why this machine cannot make test hosts (None: it can)."""
    if os.geteuid() != 0:
        return "needs root: network namespaces, veth pairs and tc (CI runs as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (iproute2)"
    probe = f"{_new_tag()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails: {made.stderr.strip()}"
    _ip("netns", "delete", probe, check=False)
    return None


def parse_rate(rate: str) -> int:
    """Bits per second of a tc rate: "100mbit", "1gbit", "500kbit", "2000bit"."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if m is None:
        raise ValueError(f"rate {rate!r}: expected a number and kbit, mbit or gbit")
    return int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)])


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@dataclass
class Host:
    index: int  # 1, 2, 3...
    netns: str
    address: str  # 198.18.0.<index>
    inner: str  # its interface, inside the namespace
    outer: str  # the veth peer on the bridge

    def command(self, *args: str) -> list[str]:
        """``args`` as a command run on this host."""
        return ["ip", "netns", "exec", self.netns, *args]

    def run(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(*args), capture_output=True, text=True, timeout=timeout)

    def popen(
        self, args: list[str], log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """A process on this host, its output in ``log``, in a session of its own so that
        a signal to its group reaches its children too."""
        with log.open("wb") as out:
            return subprocess.Popen(
                self.command(*args),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def pids(self) -> list[int]:
        done = _ip("netns", "pids", self.netns, check=False)
        return [int(p) for p in done.stdout.split() if p.isdigit()]

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """The calling thread in this host's namespace (setns moves one thread only); a
        socket made inside stays in it after the thread leaves."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            there = os.open(NETNS_DIR / self.netns, os.O_RDONLY)
            try:
                _setns(there)
            finally:
                os.close(there)
            try:
                yield
            finally:
                _setns(own)
        finally:
            os.close(own)

    def connect(self, address: str, port: int, timeout: float = 10.0) -> socket.socket:
        """A TCP connection made from this host."""
        with self.entered():
            return socket.create_connection((address, port), timeout=timeout)


@dataclass
class Testbed:
    """``size`` hosts on one bridge. Use as a context manager, or ``up()`` then
    ``close()`` in a ``finally``."""

    __test__ = False  # not a test class, whatever pytest makes of its name

    size: int = 3
    tag: str = field(default_factory=_new_tag)
    hosts: list[Host] = field(init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.size <= 99:  # interface names have at most 15 characters
            raise ValueError("a testbed has 1 to 99 hosts")
        if not _OWNED.fullmatch(self.tag):
            raise ValueError(f"tag {self.tag!r}: expected {PREFIX}<pid><letter>")
        self.bridge = f"{self.tag}br"
        self.hosts = [
            Host(i, f"{self.tag}-h{i}", f"{SUBNET}.{i}", f"{self.tag}h{i}", f"{self.tag}p{i}")
            for i in range(1, self.size + 1)
        ]

    def __enter__(self) -> Testbed:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def host(self, index: int) -> Host:
        return self.hosts[index - 1]

    def up(self) -> None:
        """Make the bridge and the hosts (removing stale testbeds first); on any failure
        remove whatever was made and raise."""
        remove_stale()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for h in self.hosts:
                _ip("netns", "add", h.netns)
                _ip("link", "add", h.outer, "type", "veth", "peer", "name", h.inner)
                _ip("link", "set", h.inner, "netns", h.netns)
                _ip("link", "set", h.outer, "master", self.bridge, "up")
                _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", h.inner)
                _ip("-n", h.netns, "link", "set", h.inner, "up")
                _ip("-n", h.netns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    # -- links --------------------------------------------------------------------
    def shape_link(self, index: int, rate: str | None = None, delay_ms: float = 0.0) -> bool:
        """Limit host ``index``'s link to ``rate`` and delay it ``delay_ms`` each way,
        on both ends. Returns False when the delay could not be put on the link (the
        kernel has no netem): the caller must add it another way (a relay)."""
        h = self.host(index)
        delayed = True
        for dev, netns in ((h.outer, None), (h.inner, h.netns)):
            where = ["-n", netns] if netns else []
            _tc(*where, "qdisc", "del", "dev", dev, "root")  # none there is fine
            parent = ["root"]
            if delay_ms > 0:
                netem = _tc(
                    *where, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "netem",
                    "delay", f"{delay_ms}ms", "limit", "100000",
                )  # fmt: skip
                if netem.returncode == 0:
                    parent = ["parent", "1:1"]
                else:
                    delayed = False
            if rate:
                bits = parse_rate(rate)
                # A burst of ~5 ms of bytes (at least 16 KiB: a few full frames), and a
                # queue of up to 100 ms before tbf drops.
                burst = max(16 << 10, bits // 8 // 200)
                limited = _tc(
                    *where, "qdisc", "add", "dev", dev, *parent, "tbf", "rate", rate,
                    "burst", str(burst), "latency", "100ms",
                )  # fmt: skip
                if limited.returncode != 0:
                    raise RuntimeError(f"tc tbf on {dev}: {limited.stderr.strip()}")
        return delayed or delay_ms <= 0

    def has_netem(self) -> bool:
        """Whether this kernel delays links with netem (a probe on host 1's loopback)."""
        h = self.host(1)
        probe = _tc("-n", h.netns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
        if probe.returncode != 0:
            return False
        _tc("-n", h.netns, "qdisc", "del", "dev", "lo", "root")
        return True

    def link_down(self, index: int) -> None:
        """Pull host ``index``'s cable: its bridge end goes down."""
        _ip("link", "set", self.host(index).outer, "down")

    def link_up(self, index: int) -> None:
        _ip("link", "set", self.host(index).outer, "up")

    # -- removal ------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process in the hosts, remove the hosts and the bridge. Never raises:
        it runs in ``finally`` blocks, whatever failed before."""
        _remove(self.tag)


def _kill_in(netns: str) -> None:
    """SIGKILL every process in a namespace and wait (bounded) until none is left."""
    host = Host(0, netns, "", "", "")
    deadline = time.monotonic() + 10.0
    while (pids := host.pids()) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _links() -> list[str]:
    out = _ip("-o", "link", "show", check=False).stdout
    # "12: zqtb1234p1@if11: <BROADCAST,...>"
    return [line.split(":", 2)[1].strip().split("@")[0] for line in out.splitlines()]


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _remove(tag: str) -> None:
    try:
        for netns in _namespaces():
            if netns.startswith(f"{tag}-"):
                _kill_in(netns)
                _ip("netns", "delete", netns, check=False)
        # Deleting a namespace deletes its veth ends and so their peers; the bridge,
        # and a pair whose namespace end was never moved, are left.
        for link in _links():
            if link.startswith(tag):
                _ip("link", "delete", link, check=False)
    except Exception as exc:  # a clean-up must not hide the failure it follows
        print(f"testbed {tag}: clean-up failed: {type(exc).__name__}: {exc}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove the testbeds whose making process is gone; returns their tags."""
    tags = {
        m.group(1)
        for name in [*_namespaces(), *_links()]
        if (m := _OWNED.match(name)) and not _alive(int(m.group(2)))
    }
    for tag in sorted(tags):
        _remove(tag)
    return sorted(tags)
