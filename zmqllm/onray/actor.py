"""The actor that holds one role process on its Ray node.

Ray places and restarts; the role (broker, worker, gateway) stays the program `zmqllm up`
runs, as a child of the actor's process. The child cannot outlive the actor: it is made
with PR_SET_PDEATHSIG by a thread that lives as long as the actor's process (the signal
follows the thread that forked, not the process), and that thread, when the child exits
for any reason, ends the actor's process so that Ray restarts the actor (and with it the
child), on the same node or, when the node is gone, on another that has room.

Imported only where ``ray`` is installed (the ``ray`` extra); the class itself is plain
Python and is made an actor by ``ray.remote`` at the call site.
"""

from __future__ import annotations

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

__all__ = ["RoleActor", "node_address"]

_PR_SET_PDEATHSIG = 1
# How long a child that was told to stop (SIGTERM) has before SIGKILL.
STOP_GRACE_S = 10.0


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
    """One role process: ``zmqllm ROLE ARGS`` started at once, watched, and the actor's
    own process ended when it ends (Ray then restarts the actor)."""

    def __init__(self, name: str, role: str, args: list[str]) -> None:
        self.name, self.role = name, role
        self.node_ip = node_address()
        # Where it binds is this node's address, found again on every restart: Ray may
        # have moved the actor to another node.
        self.args = [a.replace(NODE_IP, self.node_ip) for a in args]
        self.started_at = time.time()
        self.proc: subprocess.Popen[bytes] | None = None
        self.exit_code: int | None = None
        self.stopping = False  # `ray down`: the role's exit must not restart the actor
        log_dir = zmqllm_home() / "logs" / "ray"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        started = threading.Event()
        self._watch = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._watch.start()
        started.wait(60)
        if self.proc is None:
            raise RuntimeError(f"{name}: could not start zmqllm {role}")

    def _command(self) -> list[str]:
        return [sys.executable, "-m", "zmqllm.cli", self.role, *self.args]

    def _run(self, started: threading.Event) -> None:
        with open(self.log_path, "ab") as log:
            if self.role == "gateway" and _model_of(self.args) == "default":
                # The gateway reads the tokenizer from the model's folder and, unlike a
                # worker, does not convert the default model itself: once per node.
                prepare = [sys.executable, "-m", "zmqllm.cli", "prepare-model"]
                subprocess.run(prepare, stdout=log, stderr=subprocess.STDOUT, check=False)
            self.proc = subprocess.Popen(
                self._command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        started.set()
        self.exit_code = self.proc.wait()
        if self.stopping:
            return
        # The role is gone: so is this actor, and Ray starts both again (max_restarts).
        print(f"zmqllm {self.role} exited with {self.exit_code}", file=sys.stderr, flush=True)
        os._exit(1)

    def info(self) -> dict[str, Any]:
        """Where and what this actor runs (``zmqllm ray status``)."""
        import ray

        ctx = ray.get_runtime_context()
        return {
            "name": self.name,
            "role": self.role,
            "node_ip": self.node_ip,
            "node_id": ctx.get_node_id(),
            "pid": os.getpid(),
            "child_pid": self.proc.pid if self.proc else None,
            "running": self.proc is not None and self.proc.poll() is None,
            "started_at": self.started_at,
            "restarted": bool(ctx.was_current_actor_reconstructed),
            "log": str(self.log_path),
        }

    def log_tail(self, chars: int = 4000) -> str:
        try:
            data = Path(self.log_path).read_bytes()[-chars:]
        except OSError:
            return ""
        return data.decode("utf-8", "replace")

    def stop(self) -> bool:
        """Stop the role (SIGTERM, then SIGKILL) before the actor is killed."""
        self.stopping = True
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return False
        proc.terminate()
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
        return True
