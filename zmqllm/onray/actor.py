"""The actor that holds one role process on its Ray node.

Ray places and restarts; the role (broker, worker, gateway) stays the program `zmqllm up`
runs, as a child of the actor's process. When the role exits, the actor starts it again
after `zmqllm up`'s backoff (role_keeper.py) and keeps its state for `zmqllm ray status`;
it no longer ends itself for Ray to restart it, which Ray does at once, with no backoff.
The child cannot outlive the actor: it is made with PR_SET_PDEATHSIG by a thread that
lives as long as the actor's process (the signal follows the thread that forked, not the
process), so when the actor's process or its node dies, the role goes too, and Ray
starts the actor (and with it the role) again, on the same node or, when the node is
gone, on another that has room.

Imported only where ``ray`` is installed (the ``ray`` extra); the class itself is plain
Python and is made an actor by ``ray.remote`` at the call site.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from zmqllm.config.paths import zmqllm_home
from zmqllm.onray.plan import NODE_IP
from zmqllm.onray.role_keeper import RoleKeeper

__all__ = ["RoleActor", "node_address"]

_PR_SET_PDEATHSIG = 1
# How long the first start may take (the gateway prepares the model first).
FIRST_START_S = 60.0


def node_address() -> str:
    """This node's address as Ray knows it (never loopback across nodes)."""
    import ray

    return str(ray.util.get_node_ip_address())


def _model_of(args: list[str]) -> str:
    return args[args.index("--model") + 1] if "--model" in args[:-1] else "default"


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class RoleActor:
    """One role process: ``zmqllm ROLE ARGS`` started at once, watched, and started again
    with a backoff whenever it exits (until ``stop``)."""

    def __init__(self, name: str, role: str, args: list[str]) -> None:
        self.name, self.role = name, role
        self.node_ip = node_address()
        # Where it binds is this node's address, found again on every restart: Ray may
        # have moved the actor to another node.
        self.args = [a.replace(NODE_IP, self.node_ip) for a in args]
        self.started_at = time.time()
        log_dir = zmqllm_home() / "logs" / "ray"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self.keeper = RoleKeeper(name, self._spawn, note=self._note)
        # Every start happens on this thread, which lives as long as the actor's process:
        # the role's death signal follows the thread that forked it.
        self._watch = threading.Thread(target=self._run, daemon=True)
        self._watch.start()
        self.keeper.first_start.wait(FIRST_START_S)
        if self.keeper.proc is None:
            self.keeper.stop()
            raise RuntimeError(f"{name}: could not start zmqllm {role}")

    def _command(self) -> list[str]:
        return [sys.executable, "-m", "zmqllm.cli", self.role, *self.args]

    def _run(self) -> None:
        if self.role == "gateway" and _model_of(self.args) == "default":
            # The gateway reads the tokenizer from the model's folder and, unlike a
            # worker, does not convert the default model itself: once per node. Not in
            # a start: a stop must not wait for it.
            with open(self.log_path, "ab") as log:
                prepare = [sys.executable, "-m", "zmqllm.cli", "prepare-model"]
                subprocess.run(prepare, stdout=log, stderr=subprocess.STDOUT, check=False)
        self.keeper.run()

    def _spawn(self) -> subprocess.Popen[bytes]:
        with open(self.log_path, "ab") as log:
            return subprocess.Popen(
                self._command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    def _note(self, line: str) -> None:
        """A line of the actor's own in the role's log, where `ray status` points."""
        with contextlib.suppress(OSError), open(self.log_path, "a") as log:
            log.write(f"[zmqllm ray] {line}\n")

    def role_state(self) -> dict[str, Any]:
        """The role's state, exits and next start (no Ray needed: tests call it)."""
        return self.keeper.state()

    def info(self) -> dict[str, Any]:
        """Where and what this actor runs (``zmqllm ray status``)."""
        import ray

        ctx = ray.get_runtime_context()
        role = self.role_state()
        return {
            "name": self.name,
            "role": self.role,
            "node_ip": self.node_ip,
            "node_id": ctx.get_node_id(),
            "pid": os.getpid(),
            "running": role["child_pid"] is not None,
            "started_at": self.started_at,
            "restarted": bool(ctx.was_current_actor_reconstructed),
            "log": str(self.log_path),
            **role,
        }

    def log_tail(self, chars: int = 4000) -> str:
        try:
            data = Path(self.log_path).read_bytes()[-chars:]
        except OSError:
            return ""
        return data.decode("utf-8", "replace")

    def stop(self) -> bool:
        """Stop the role (SIGTERM, then SIGKILL) and start it no more, before the actor
        is killed."""
        return self.keeper.stop()
