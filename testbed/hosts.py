"""A zmqllm cluster spread over testbed hosts, started with the commands a user types.

Host 1 runs the broker and the gateway; each layer range runs on a host of its own
(``workers={"0:2": 2, "2:4": 3}``). The broker binds its backend on host 1's address,
which it does only with CURVE keys: ``zmqllm keys init`` makes them in host 1's folder,
``zmqllm keys add worker host-N`` issues each worker host a key, and that folder is
copied to the host's own folder, as one would with scp. Every process is ``zmqllm
ROLE ...`` (the console script beside this Python) run with ``ip netns exec``.

Links are rate limited with tbf and delayed with netem where the kernel has it; where it
has not, a worker reaches the broker through a delaying relay (``testbed.relay``) on
host 1, so each of its messages still crosses its own host's link, then waits ``delay``.
The delay changes while the cluster runs (``set_delay``: netem replaced, or the relays'
delay files rewritten), and a worker can be restarted with other flags
(``restart_worker``). The test process speaks HTTP to the gateway from inside host 1
(``http``) and asks the broker for its status with ``zmqllm status`` run there.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.netns import Host, Testbed
from zmqllm.launch.child_process import ChildProcess, spawn

__all__ = ["FRONTEND_PORT", "HostCluster", "NetnsHTTPConnection", "zmqllm_command"]

REPO = Path(__file__).resolve().parents[1]
FRONTEND_PORT, BACKEND_PORT, HTTP_PORT = 5555, 5556, 8080  # a fresh namespace has them free
RELAY_PORT = 6000  # + the worker host's index


def zmqllm_command() -> list[str]:
    """The ``zmqllm`` console script of this Python's environment (what a user types);
    ``python -m zmqllm.cli`` where it is not installed."""
    script = Path(sys.executable).parent / "zmqllm"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "zmqllm.cli"]


def _env() -> dict[str, str]:
    # This checkout's sources first, whatever zmqllm the environment has installed.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")


class NetnsHTTPConnection(http.client.HTTPConnection):
    """An HTTPConnection whose socket is made inside a testbed host."""

    def __init__(self, host: Host, address: str, port: int, timeout: float = 60.0) -> None:
        super().__init__(address, port, timeout=timeout)
        self.netns_host = host

    def connect(self) -> None:
        with self.netns_host.entered():
            super().connect()


@dataclass
class HostCluster:
    bed: Testbed
    root: Path  # each host's folder (keys, logs) under it
    model_dir: Path
    workers: dict[str, int]  # layer range -> the host it runs on
    delay_ms: float = 0.0  # one way, on each worker host's link
    rate: str | None = None  # tbf rate of every host's link ("100mbit")
    relay: bool = False  # a relay even without delay (the same path at every delay)
    heartbeat: float = 0.5
    liveness: int = 3
    threads: int = 1
    worker_flags: tuple[str, ...] = ()  # more `zmqllm worker` flags (--wire-dtype ...)
    gateway_flags: tuple[str, ...] = ()
    broker_flags: tuple[str, ...] = ()  # more `zmqllm broker` flags (--announce ...)
    procs: list[ChildProcess] = field(default_factory=list)
    netem: bool = field(init=False, default=False)  # the delay is on the links
    relays: bool = field(init=False, default=False)  # workers reach the broker by relays
    _brokers: dict[str, str] = field(init=False, default_factory=dict)  # layers -> --broker

    def __post_init__(self) -> None:
        self.head = self.bed.host(1)
        self.frontend = f"tcp://127.0.0.1:{FRONTEND_PORT}"
        self.backend = f"tcp://{self.head.address}:{BACKEND_PORT}"
        self._n = 0

    def folder(self, index: int) -> Path:
        """Host ``index``'s own files (its disk, as far as the test goes)."""
        path = self.root / f"host{index}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def keys(self) -> Path:
        return self.folder(1) / "keys"

    # -- starting -----------------------------------------------------------------
    def _start(self, host: Host, name: str, args: list[str]) -> ChildProcess:
        self._n += 1
        log = self.folder(host.index) / f"{self._n:02d}-{name}.log"
        proc = spawn(name, host.command(*args), log, env=_env())
        self.procs.append(proc)
        return proc

    def _cli(self, host: Host, *args: str) -> str:
        done = host.run(*zmqllm_command(), *args)
        if done.returncode != 0:
            raise RuntimeError(f"zmqllm {' '.join(args)}: {done.stderr[-2000:]}")
        return done.stdout

    def make_keys(self) -> None:
        self._cli(self.head, "keys", "init", str(self.keys))
        for index in sorted(set(self.workers.values())):
            self._cli(self.head, "keys", "add", "worker", f"host-{index}", "--keys", str(self.keys))
            # The issued folder goes to that host, as an scp would take it.
            issued = self.keys / "issued" / f"host-{index}"
            shutil.copytree(issued, self.folder(index) / "keys", dirs_exist_ok=True)

    def beats(self) -> list[str]:
        interval, liveness = str(self.heartbeat), str(self.liveness)
        return ["--heartbeat-interval", interval, "--heartbeat-liveness", liveness]

    def _delay_file(self, index: int) -> Path:
        return self.folder(1) / f"relay-{index}.delay-ms"

    def _relay_delay_ms(self) -> float:
        return 0.0 if self.netem else self.delay_ms

    def _broker_address(self, index: int) -> str:
        """What the worker on host ``index`` gives as --broker: the broker itself, or a
        relay on host 1 that delays its link."""
        if not self.relays:
            return self.backend
        port = RELAY_PORT + index
        self._delay_file(index).write_text(str(self._relay_delay_ms()))
        args = [sys.executable, "-m", "testbed.relay", "--listen", f"{self.head.address}:{port}"]
        args += ["--to", f"{self.head.address}:{BACKEND_PORT}"]
        relay = self._start(
            self.head, f"relay-{index}", [*args, "--delay-file", str(self._delay_file(index))]
        )
        self.wait_for(lambda: "relay listening" in relay.text(), 30, f"relay {index}")
        return f"tcp://{self.head.address}:{port}"

    def _shape(self) -> None:
        hosts = set(self.workers.values())
        for h in self.bed.hosts:
            delay = self.delay_ms if self.netem and h.index in hosts else 0.0
            self.bed.shape_link(h.index, self.rate, delay)

    def start(self) -> None:
        """Links shaped, keys made and copied, then broker, workers and gateway; returns
        when the gateway is ready."""
        self.netem = self.bed.has_netem()
        self.relays = self.relay or (self.delay_ms > 0 and not self.netem)
        self._shape()
        self.make_keys()
        self.start_broker()
        for layers, index in self.workers.items():
            self.start_worker(layers, index, self._broker_address(index))
        self.start_gateway()
        self.wait_ready()

    def set_delay(self, delay_ms: float) -> None:
        """Change the worker hosts' one-way delay while the cluster runs (netem on their
        links, or the relays'; connections stay up). A cluster that should change its
        delay without netem must start with relays (``relay=True`` or a delay)."""
        if not self.netem and not self.relays:
            raise RuntimeError("no netem and no relays: start with relay=True")
        self.delay_ms = delay_ms
        if self.netem:
            self._shape()
            return
        for index in sorted(set(self.workers.values())):
            (relay,) = self.by_name(f"relay-{index}")
            told = relay.text().count("\ndelay ")
            path = self._delay_file(index)
            path.with_suffix(".tmp").write_text(str(self._relay_delay_ms()))
            path.with_suffix(".tmp").replace(path)

            def changed(relay: ChildProcess = relay, told: int = told) -> bool:
                return relay.text().count("\ndelay ") > told

            self.wait_for(changed, 10, f"relay {index} to take the new delay")

    def start_broker(self) -> ChildProcess:
        args = ["broker", "--frontend", self.frontend, "--backend", self.backend]
        args += [*self.beats(), "--keys", str(self.keys), *self.broker_flags]
        args += ["--log-format", "json"]
        return self._start(self.head, "broker", [*zmqllm_command(), *args])

    def start_worker(self, layers: str, index: int, broker: str) -> ChildProcess:
        self._brokers[layers] = broker
        args = ["worker", "--model", str(self.model_dir), "--layers", layers]
        args += ["--broker", broker, "--threads", str(self.threads), "--name", f"host-{index}"]
        args += [*self.beats(), "--keys", str(self.folder(index) / "keys")]
        args += [*self.worker_flags, "--log-format", "json"]
        name = f"worker-{layers.replace(':', '-')}"
        return self._start(self.bed.host(index), name, [*zmqllm_command(), *args])

    def start_gateway(self) -> ChildProcess:
        args = ["gateway", "--port", str(HTTP_PORT), "--broker", self.frontend]
        args += ["--model", str(self.model_dir), *self.beats(), "--keys", str(self.keys)]
        args += [*self.gateway_flags, "--log-format", "json"]
        return self._start(self.head, "gateway", [*zmqllm_command(), *args])

    def restart_worker(self, layers: str, flags: tuple[str, ...]) -> ChildProcess:
        """Stop the worker of ``layers`` (SIGINT: it says goodbye to the broker) and start
        it again on its host with ``flags`` as its extra flags; returns once the gateway
        is ready again."""
        (old,) = [p for p in self.by_name(f"worker-{layers.replace(':', '-')}") if p.alive()]
        os.killpg(old.popen.pid, signal.SIGINT)
        old.popen.wait(timeout=30)
        self.procs.remove(old)  # gone on purpose: not a process that failed
        self.worker_flags = flags
        new = self.start_worker(layers, self.workers[layers], self._brokers[layers])

        def registered() -> bool:
            with contextlib.suppress(RuntimeError):
                ids = [w["info"]["pid"] for w in self.status()["workers"]]
                return new.popen.pid in ids and old.popen.pid not in ids
            return False

        self.wait_for(registered, 300, f"the new worker of {layers}", pause=1.0)
        self.wait_ready()
        return new

    def stop(self) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=10)

    # -- observing ------------------------------------------------------------------
    def http(self, timeout: float = 60.0) -> NetnsHTTPConnection:
        """A connection to the gateway, made from host 1."""
        return NetnsHTTPConnection(self.head, "127.0.0.1", HTTP_PORT, timeout)

    def get(self, path: str) -> tuple[int, bytes]:
        conn = self.http(timeout=5)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def post_json(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        conn = self.http()
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def status(self) -> dict[str, Any]:
        """The broker's status, asked with `zmqllm status --json` on host 1."""
        out = self._cli(
            self.head, "status", "--broker", self.frontend, "--keys", str(self.keys), "--json"
        )
        status: dict[str, Any] = json.loads(out)
        return status

    def wait_ready(self, timeout: float = 300.0) -> None:
        def ready() -> bool:
            for p in self.procs:
                if p.popen.poll() is not None:
                    raise RuntimeError(f"{p.name} exited early:\n{p.text()[-3000:]}")
            with contextlib.suppress(OSError):
                return self.get("/ready")[0] == 200
            return False

        self.wait_for(ready, timeout, "the gateway to be ready", pause=0.3)

    def wait_for(self, predicate: Any, timeout: float, what: str, pause: float = 0.1) -> Any:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = predicate()
            if last:
                return last
            time.sleep(pause)
        logs = "\n".join(f"--- {p.name}\n{p.text()[-1500:]}" for p in self.procs)
        raise TimeoutError(f"timed out after {timeout}s waiting for {what}; last: {last!r}\n{logs}")

    def by_name(self, prefix: str) -> list[ChildProcess]:
        return [p for p in self.procs if p.name.startswith(prefix)]
