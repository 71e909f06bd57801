"""A Ray cluster whose nodes are testbed hosts: ``ray start --block`` in each namespace.

Every node is started with explicit CPUs and memory, a small object store, the memory
monitor off, no dashboard, and its own ``ZMQLLM_HOME`` (the host's disk: its keys, its
model cache, its logs). Nodes are stopped by their process ids only, never by
Ray's own stop command, which ends every Ray process on the machine (CI's included);
whatever a node left behind in its namespace goes when the testbed closes. Ray's files go to a
short folder of the run's own (socket paths are limited to 107 characters).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from testbed.netns import Host
from zmqllm.launch.child_process import ChildProcess, spawn

__all__ = ["HEAD_PORT", "RayNodes", "ray_command"]

HEAD_PORT = 6379
# Ray's timings for a test: a dead node is noticed within ~3 s instead of ~30 s.
RAY_ENV = {
    "RAY_memory_monitor_refresh_ms": "0",
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def ray_command() -> list[str]:
    script = Path(sys.executable).parent / "ray"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "ray.scripts.scripts"]


@dataclass
class RayNodes:
    hosts: list[Host]  # the first is the head
    home: dict[int, Path]  # host index -> its ZMQLLM_HOME
    cpus: float = 1.0
    memory: str = str(3 * 2**30)  # bytes, as `ray start --memory` takes them
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[int, ChildProcess] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.temp = Path(tempfile.mkdtemp(prefix="zr", dir="/tmp"))

    @property
    def address(self) -> str:
        return f"{self.hosts[0].address}:{HEAD_PORT}"

    def environment(self, index: int) -> dict[str, str]:
        repo = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
        return dict(
            os.environ,
            **RAY_ENV,
            **self.env,
            ZMQLLM_HOME=str(self.home[index]),
            PYTHONPATH=path,
        )

    def start(self, host: Host, head: bool = False, cpus: float | None = None) -> ChildProcess:
        args = [*ray_command(), "start", "--block", "--node-ip-address", host.address]
        if head:
            args += ["--head", "--port", str(HEAD_PORT), "--temp-dir", str(self.temp)]
            args += ["--include-dashboard=false"]
        else:
            args += ["--address", self.address]
        args += ["--num-cpus", f"{self.cpus if cpus is None else cpus:g}"]
        args += ["--memory", self.memory, "--object-store-memory", str(80 * 2**20)]
        args += ["--disable-usage-stats"]
        log = self.home[host.index] / "ray-node.log"
        proc = spawn(
            f"ray-{host.index}", host.command(*args), log, env=self.environment(host.index)
        )
        self.procs[host.index] = proc
        return proc

    def alive(self) -> int:
        """How many nodes the head counts alive (asked from inside the head's host)."""
        code = (
            f"import ray; ray.init(address={self.address!r}, logging_level='ERROR'); "
            "print(sum(1 for n in ray.nodes() if n['Alive']))"
        )
        done = subprocess.run(
            self.hosts[0].command(sys.executable, "-c", code),
            capture_output=True,
            text=True,
            timeout=120,
            env=self.environment(self.hosts[0].index),
        )
        lines = done.stdout.strip().splitlines()
        return int(lines[-1]) if done.returncode == 0 and lines and lines[-1].isdigit() else 0

    def wait_alive(self, count: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while (n := self.alive()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{n} of {count} Ray nodes alive after {timeout:g} s")
            time.sleep(1.0)

    def kill_node(self, host: Host) -> None:
        """A host dies: every process in its namespace gets SIGKILL."""
        for pid in host.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        """Every node, by its own process ids (the `ray start --block` process's group,
        then whatever is left in each host)."""
        for proc in reversed(list(self.procs.values())):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            with contextlib.suppress(Exception):
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
        for host in self.hosts:
            self.kill_node(host)
        shutil.rmtree(self.temp, ignore_errors=True)
