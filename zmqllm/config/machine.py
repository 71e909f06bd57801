"""What this process holds of its machine, read without torch (every role may ask)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

__all__ = ["is_loopback_host", "memory_available", "rss_bytes"]


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 in brackets or not) names this
    machine's loopback interface only: what no other machine can reach. A host name other
    than localhost counts as reachable, as do the wildcards (0.0.0.0, ::, *)."""
    host = host.strip().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc; the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def memory_available() -> tuple[int, str]:
    """What this process may still use: the cgroup's limit less its usage where one is
    set, else the kernel's MemAvailable; whichever is less."""
    figures: list[tuple[int, str]] = []
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            figures.append((int(limit) - used, "cgroup memory.max"))
    except (OSError, ValueError):
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                figures.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError, IndexError):
        pass
    if not figures:
        return 1 << 62, "no limit known"
    return min(figures)
