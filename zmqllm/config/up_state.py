"""What `zmqllm up` tells the rest of the machine about its children: one JSON file.

The launcher rewrites ``up-state.json`` in its log folder whenever a child starts, exits
or stops failing; its children learn the path from ``ZMQLLM_UP_STATE`` (the gateway puts
the failing ones in ``/ready``'s answer), and ``zmqllm status`` reads it from the log
folder of the config it is given. A file whose launcher is gone is ignored.

{"launcher_pid": 123, "written_at": 1764752400.0,
 "children": [{"name": "remote-0-0", "role": "worker", "pid": 456 | null,
               "state": "running" | "restarting" | "failing", "exits": 7,
               "last_exit": "exited with code 1" | null, "next_start_at": 1764752460.0 | null,
               "log": "/root/.cache/zmqllm/logs/remote-0-0.log"}]}
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["STATE_ENV", "STATE_FILE", "failing_children", "read_state", "write_state"]

STATE_ENV = "ZMQLLM_UP_STATE"
STATE_FILE = "up-state.json"
# Larger files are not ours: a reader never loads more than this.
MAX_STATE_BYTES = 1 << 20


def write_state(path: Path, children: Sequence[dict[str, Any]], now: float) -> None:
    """Replace the file at once (a reader sees the old one or the new, never half)."""
    body = {"launcher_pid": os.getpid(), "written_at": now, "children": list(children)}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    tmp.chmod(0o600)
    tmp.replace(path)


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def read_state(path: Path | str | None) -> dict[str, Any] | None:
    """The launcher's state, or None: no file, not readable, not ours, launcher gone."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_STATE_BYTES + 1)
        if len(raw) > MAX_STATE_BYTES:
            return None
        state = json.loads(raw)
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or not isinstance(state.get("children"), list):
        return None
    return state if _alive(state.get("launcher_pid")) else None


def failing_children(state: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The children the launcher marks failing (name, exits, last exit, next start)."""
    if state is None:
        return []
    keep = ("name", "role", "exits", "last_exit", "next_start_at", "log")
    return [
        {k: c.get(k) for k in keep}
        for c in state["children"]
        if isinstance(c, dict) and c.get("state") == "failing"
    ]
