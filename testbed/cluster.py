"""A local cluster of real processes on 127.0.0.1 with free ports (tests, benchmarks).

Each process is started the way `zmqllm up` starts its children
(``zmqllm.launch.child_process.spawn``: a process group of its own, a log file, dying with the
test run), but one by one, with any flags a test needs, and stopped with SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zmqllm.launch.child_process import ChildProcess, spawn

__all__ = ["Cluster", "free_port"]

_handed_out: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now, never one this process handed out before (the
    OS may offer a just-closed port again before its first user binds it)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


@dataclass
class Cluster:
    root: Path
    model_dir: Path
    heartbeat: float = 0.5
    liveness: int = 3
    threads: int = 1  # torch threads per worker
    batch_threads: int = 0  # threads while several sessions are in flight (0: same)
    cpu_lock: bool = False  # workers take turns on the cores (a shared lock file)
    queue_timeout: float = 10.0  # seconds a request waits for a route
    quant: str = "none"  # the workers' --quant
    worker_flags: tuple[str, ...] = ()  # more flags for every worker
    # A CURVE key folder every process uses; None = plaintext (--insecure), whatever
    # $ZMQLLM_HOME/keys holds.
    keys: Path | None = None
    procs: list[ChildProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.frontend = f"tcp://127.0.0.1:{free_port()}"
        self.backend = f"tcp://127.0.0.1:{free_port()}"
        self.http_port = free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.root.mkdir(parents=True, exist_ok=True)
        self._n = 0

    # -- processes -------------------------------------------------------------
    def _start(self, name: str, args: list[str]) -> ChildProcess:
        self._n += 1
        log = self.root / f"{self._n:02d}-{name}.log"
        cmd = [sys.executable, "-m", "zmqllm.cli", *args, "--log-format", "json"]
        proc = spawn(name, cmd, log)
        self.procs.append(proc)
        return proc

    def security(self) -> list[str]:
        return ["--keys", str(self.keys)] if self.keys is not None else ["--insecure"]

    def beats(self) -> list[str]:
        return [
            "--heartbeat-interval",
            str(self.heartbeat),
            "--heartbeat-liveness",
            str(self.liveness),
        ]

    def start_broker(self) -> ChildProcess:
        args = ["broker", "--frontend", self.frontend, "--backend", self.backend]
        args += ["--queue-timeout", str(self.queue_timeout)]
        return self._start("broker", [*args, *self.beats(), *self.security()])

    def start_worker(
        self,
        layers: str,
        model: Path | None = None,
        name: str = "",
        broker: str = "",
        keys: Path | None = None,
        flags: tuple[str, ...] = (),
    ) -> ChildProcess:
        """A worker; ``broker`` replaces the backend address (a relay in front of it),
        ``keys`` the cluster's key folder (a worker with a key of its own); ``flags`` are
        more `zmqllm worker` flags."""
        args = ["worker", "--model", str(model or self.model_dir), "--layers", layers]
        args += ["--broker", broker or self.backend, "--threads", str(self.threads)]
        security = ["--keys", str(keys)] if keys is not None else self.security()
        args += [*self.beats(), *security]
        if name:
            args += ["--name", name]
        if self.batch_threads:
            args += ["--batch-threads", str(self.batch_threads)]
        if self.cpu_lock:
            args += ["--cpu-lock", str(self.root / "cpu.lock")]
        if self.quant != "none":
            args += ["--quant", self.quant]
        args += [*self.worker_flags, *flags]
        return self._start(f"worker-{layers.replace(':', '-')}", args)

    def start_remote_worker(self, url: str, *flags: str, name: str = "") -> ChildProcess:
        """A remote worker forwarding to the OpenAI-compatible API at ``url``; ``flags``
        are more `zmqllm worker` flags (--served-name, --api-key-file ...)."""
        args = ["worker", "--remote", url, "--broker", self.backend]
        args += [*self.beats(), *self.security(), *flags]
        if name:
            args += ["--name", name]
        return self._start("worker-remote", args)

    def start_gateway(self, *flags: str) -> ChildProcess:
        """The gateway; ``flags`` are more `zmqllm gateway` flags (--max-queued 3 ...)."""
        args = ["gateway", "--port", str(self.http_port), "--broker", self.frontend]
        args += ["--model", str(self.model_dir), *self.beats(), *self.security(), *flags]
        return self._start("gateway", args)

    def start_all(
        self, splits: tuple[str, ...] = ("0:2", "2:4"), remote: str = "", *remote_flags: str
    ) -> None:
        """Broker, a worker per split and the gateway, ready; with ``remote`` (an
        OpenAI-compatible URL) also a remote worker for a second model, both listed."""
        self.start_broker()
        for layers in splits:
            self.start_worker(layers)
        if remote:
            self.start_remote_worker(remote, *remote_flags)
        self.start_gateway()
        self.wait_ready()
        if remote:
            self.wait_for(lambda: len(self.status().get("models", [])) == 2, what="both models")

    def stop(self) -> None:
        for p in self.procs:
            if p.alive():
                p.signal(signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)

    def kill(self, proc: ChildProcess, sig: int = signal.SIGKILL) -> None:
        proc.signal(sig)
        proc.wait(timeout=20)

    def by_name(self, prefix: str) -> list[ChildProcess]:
        return [p for p in self.procs if p.name.startswith(prefix) and p.alive()]

    # -- observing -------------------------------------------------------------
    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for role in ("broker", "gateway"):
                mine = [p for p in self.procs if p.name == role]
                if mine and not mine[-1].alive():
                    raise RuntimeError(f"{role} exited early:\n{mine[-1].text()[-3000:]}")
            try:
                if self.get("/ready")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        logs = "\n".join(f"--- {p.name}\n{p.text()[-1500:]}" for p in self.procs)
        raise TimeoutError(f"cluster not ready in {timeout}s\n{logs}")

    def status(self) -> dict[str, Any]:
        from zmqllm.bus.keys import load_peer_keys
        from zmqllm.client.status import fetch_status

        keys = load_peer_keys(self.keys, "client") if self.keys is not None else None
        return fetch_status(self.frontend, timeout=5, keys=keys)

    def wait_for(self, predicate: Any, timeout: float = 15.0, what: str = "") -> Any:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = predicate()
            if last:
                return last
            time.sleep(0.1)
        raise TimeoutError(f"timed out waiting for {what or predicate}; last: {last!r}")

    def log_lines(self, proc: ChildProcess) -> list[dict[str, Any]]:
        out = []
        for line in proc.text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out
