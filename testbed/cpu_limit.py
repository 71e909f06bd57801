"""A test host slower than the others: its processes in a cgroup with a CPU quota.

cgroup v2's ``cpu.max`` (``"50000 100000"``: 50 ms of CPU time per 100 ms, half a core)
where the machine mounts v2 with the cpu controller; else cgroup v1's CFS bandwidth, the
same mechanism under other names (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``). A
process joins it by writing its pid to ``cgroup.procs`` before it execs the command
(``command``), so everything it starts is limited too: wrap ``ip netns exec`` in it, not
the other way round (``ip netns exec`` mounts a sysfs of its own, without the cgroups).
``CpuLimit.close`` kills what is left in the group and removes it; it never raises.
Needs root.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CpuLimit", "cpu_limit_unusable"]

ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


def _v2_root() -> Path | None:
    for root in (ROOT, ROOT / "unified"):
        controllers = root / "cgroup.controllers"
        if controllers.is_file() and "cpu" in controllers.read_text().split():
            return root
    return None


def _v1_root() -> Path | None:
    for name in ("cpu", "cpu,cpuacct"):
        root = ROOT / name
        if (root / "cpu.cfs_quota_us").is_file():
            return root
    return None


def cpu_limit_unusable() -> str | None:
    """Why no CPU quota can be set here (None: one can)."""
    if os.geteuid() != 0:
        return "needs root: a cgroup with a CPU quota"
    if _v2_root() is None and _v1_root() is None:
        return "no cgroup cpu controller (v2 cpu.max or v1 cpu.cfs_quota_us) is mounted"
    return None


@dataclass
class CpuLimit:
    """A cgroup whose processes share ``cores`` CPUs' worth of time."""

    name: str
    cores: float = 0.5
    path: Path = field(init=False)

    def __post_init__(self) -> None:
        quota = max(1000, int(self.cores * PERIOD_US))
        v2 = _v2_root()
        if v2 is not None:
            subtree = v2 / "cgroup.subtree_control"
            if "cpu" not in subtree.read_text().split():
                subtree.write_text("+cpu")
            self.path = v2 / self.name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            return
        v1 = _v1_root()
        if v1 is None:
            raise RuntimeError(cpu_limit_unusable() or "no cgroup cpu controller")
        self.path = v1 / self.name
        self.path.mkdir(exist_ok=True)
        (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (self.path / "cpu.cfs_quota_us").write_text(str(quota))

    def command(self, *args: str) -> list[str]:
        """``args`` run inside the group (the shell joins it, then becomes the command)."""
        join = f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"'
        return ["sh", "-c", join, "sh", *args]

    def pids(self) -> list[int]:
        with contextlib.suppress(OSError):
            text = (self.path / "cgroup.procs").read_text()
            return [int(p) for p in text.split()]
        return []

    def close(self) -> None:
        """Kill what is left in the group and remove it."""
        try:
            deadline = time.monotonic() + 10.0
            while (pids := self.pids()) and time.monotonic() < deadline:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.05)
            with contextlib.suppress(OSError):
                self.path.rmdir()
        except Exception as exc:  # a clean-up must not hide the failure it follows
            print(f"cgroup {self.name}: clean-up failed: {type(exc).__name__}: {exc}")
