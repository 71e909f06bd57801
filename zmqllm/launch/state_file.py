"""What `zmqllm up` publishes about its children (``up-state.json``, see
``zmqllm.config.up_state``), and which children it cannot serve without."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from zmqllm.config.up_state import STATE_FILE, write_state
from zmqllm.launch.child_process import ChildProcess, describe_exit
from zmqllm.launch.plan import Child
from zmqllm.launch.supervision import RestartPolicy

__all__ = ["StateFile", "essential_children"]


class ClusterLike(Protocol):
    """What the state is read from: the launcher's Cluster."""

    @property
    def children(self) -> list[Child]: ...

    @property
    def procs(self) -> Mapping[str, ChildProcess]: ...

    def log_of(self, child: Child) -> Path: ...


def essential_children(children: list[Child]) -> frozenset[str]:
    """The children without which nothing serves: the broker, and the gateway when it is
    the only one. A crash loop of one of these stops everything; of any other, only it."""
    gateways = [c.name for c in children if c.role == "gateway"]
    broker = {c.name for c in children if c.role == "broker"}
    return frozenset(broker | (set(gateways) if len(gateways) == 1 else set()))


class StateFile:
    """``up-state.json`` in the log folder, rewritten when what it says changes."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / STATE_FILE
        self._last: list[dict[str, object]] | None = None

    def update(self, cluster: ClusterLike, policy: RestartPolicy) -> None:
        now, wall = time.monotonic(), time.time()
        children: list[dict[str, object]] = []
        for child in cluster.children:
            proc = cluster.procs.get(child.name)
            running = proc is not None and proc.poll() is None
            # One rule for the state, shared with `zmqllm ray status` (supervision.py).
            shown = policy.state_of(child.name, now)
            due, last = shown.due, shown.last_exit
            children.append(
                {
                    "name": child.name,
                    "role": child.role,
                    "pid": proc.pid if running and proc is not None else None,
                    "state": shown.state,
                    "exits": shown.exits,
                    "last_exit": None if last is None else describe_exit(last),
                    "next_start_at": None if due is None else round(wall + due - now, 1),
                    "log": str(cluster.log_of(child)),
                }
            )
        if children != self._last:
            self._last = children
            try:
                write_state(self.path, children, wall)
            except OSError as err:  # status is best-effort; serving is not
                print(f"[zmqllm] cannot write {self.path}: {err.strerror}", file=sys.stderr)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
