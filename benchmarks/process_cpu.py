"""Where a cluster's CPU goes while it streams: CPU seconds of each process (from
/proc/PID/stat) and the seconds each worker spends inside its forwards (the busy_s
and forwards its heartbeats report), over a measured stretch, per generated token.

On a machine whose cores the forward's threads fill, every millisecond another
process spends per token comes out of the forward's share: these two figures show
how much the bus costs in CPU and how much longer the forwards take beside it."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Workers publish their counters every half heartbeat (0.5 s at the benchmark's 1 s):
# wait this long before reading the "after" snapshot so that it covers the stretch.
PUBLISH_WAIT_S = 1.2


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Snapshot:
    cpu: dict[str, float]  # process name -> CPU seconds
    busy: dict[str, tuple[float, int]]  # worker layers "a:b" -> (busy seconds, forwards)


def snapshot(cluster: Any) -> Snapshot:
    """The counters of ``cluster`` (a testbed Cluster) now."""
    cpu = {p.name: cpu_seconds(p.popen.pid) for p in cluster.procs if p.alive()}
    busy = {}
    for w in cluster.status().get("workers", []):
        stats = w.get("stats", {})
        layers = f"{w['layers'][0]}:{w['layers'][1]}"
        busy[layers] = (float(stats.get("busy_s", 0.0)), int(stats.get("forwards", 0)))
    return Snapshot(cpu, busy)


@dataclass
class Usage:
    """CPU and forward time summed over measured stretches, and the tokens they made."""

    tokens: int = 0
    cpu: dict[str, float] = field(default_factory=dict)
    forward: dict[str, float] = field(default_factory=dict)

    def add(self, before: Snapshot, after: Snapshot, tokens: int) -> None:
        self.tokens += tokens
        for name, t in after.cpu.items():
            self.cpu[name] = self.cpu.get(name, 0.0) + t - before.cpu.get(name, t)
        for layers, (busy, _) in after.busy.items():
            start = before.busy.get(layers, (busy, 0))[0]
            self.forward[layers] = self.forward.get(layers, 0.0) + busy - start

    def per_token_ms(self) -> dict[str, dict[str, float]]:
        n = max(self.tokens, 1)
        return {
            "cpu_ms_per_token": {k: round(v / n * 1e3, 3) for k, v in self.cpu.items()},
            "forward_ms_per_token": {k: round(v / n * 1e3, 3) for k, v in self.forward.items()},
        }


def measured(cluster: Any, usage: Usage, tokens: int, run: Any) -> Any:
    """``run()`` with the cluster's counters read around it into ``usage``."""
    before = snapshot(cluster)
    result = run()
    time.sleep(PUBLISH_WAIT_S)
    usage.add(before, snapshot(cluster), tokens)
    return result
