"""A real `zmqllm up` for end-to-end tests: the tiny model, a private $ZMQLLM_HOME (so it
makes its own CURVE keys), free ports, its own log folder; the processes it started
found through /proc, and everything stopped at the end whatever happened."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from testbed.cluster import free_port


def children_of(pid: int) -> list[int]:
    """Direct children from /proc, ended ones (zombies) left out: the launcher's children
    are in sessions of their own, so its process group does not find them."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:  # gone meanwhile
            continue
        if f"\nPPid:\t{pid}\n" in status and "\nState:\tZ" not in status:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def child_name(pid: int) -> str | None:
    """ "broker", "gateway" or a worker's --name, from a child's command line
    (``python -m zmqllm.cli ROLE ... [--name NAME]``); None if it is gone."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return None
    if argv[1:3] != ["-m", "zmqllm.cli"]:
        return None
    if "--name" in argv:
        return argv[argv.index("--name") + 1]
    return argv[3] if len(argv) > 3 else None


class UpRun:
    """``zmqllm up --config FILE`` in a session of its own, stdout and stderr to files."""

    def __init__(
        self,
        root: Path,
        model: Path,
        stages: tuple[str, ...] = ("1/2", "2/2"),
        gateway: str = "",
        extra: str = "",
    ) -> None:
        """``gateway``: more lines for the config's [gateway] section; ``extra``: more
        tables at the end of the config ([[remotes]] ...)."""
        self.root = root
        self.extra = extra
        self.model = model
        self.stages = stages
        self.gateway = gateway
        self.home = root / "home"  # a fresh $ZMQLLM_HOME: `up` makes its keys there
        self.logs = root / "logs"
        self.frontend = f"tcp://127.0.0.1:{free_port()}"
        self.backend = f"tcp://127.0.0.1:{free_port()}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", ZMQLLM_HOME=str(self.home))
        self.out, self.err = root / "up.out", root / "up.err"
        self.proc: subprocess.Popen[bytes] | None = None
        self.seen: set[int] = set()  # every child pid ever found, for the final cleanup

    def start(self) -> UpRun:
        self.root.mkdir(parents=True, exist_ok=True)
        # Fresh, but with the compiled kernels of the tests' home (tests/conftest.py):
        # keyed by what determines the binary, they are built once, not in each `up`.
        kernels = Path(os.environ.get("ZMQLLM_HOME", "")) / "kernels"
        if os.environ.get("ZMQLLM_HOME") and kernels.is_dir():
            self.home.mkdir(parents=True, exist_ok=True)
            (self.home / "kernels").symlink_to(kernels.resolve(), target_is_directory=True)
        config = self.root / "up.toml"
        stages = "".join(f'[[stages]]\nlayers = "{layers}"\n' for layers in self.stages)
        config.write_text(
            f'[model]\npath = "{self.model}"\n'
            f'[broker]\nfrontend = "{self.frontend}"\nbackend = "{self.backend}"\n'
            # Short heartbeats: the broker drops a killed worker in 1.5 s, not 3.
            "heartbeat_interval = 0.5\n"
            f"[gateway]\nport = {self.port}\n{self.gateway}\n"
            f'[log]\ndir = "{self.logs}"\n' + stages + self.extra
        )
        with self.out.open("wb") as stdout, self.err.open("wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "zmqllm.cli", "up", "--config", str(config)],
                stdout=stdout,
                stderr=stderr,
                env=self.env,
                start_new_session=True,
            )
        return self

    # -- observing -----------------------------------------------------------------
    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def running(self) -> subprocess.Popen[bytes]:
        assert self.proc is not None, "start() first"
        return self.proc

    def wait_for(self, predicate: Callable[[], Any], what: str, timeout: float = 120.0) -> Any:
        """``predicate()`` once it is true; fails naming ``what`` with up's stderr if
        `up` exits meanwhile or the deadline (a generous bound, not a measurement) passes."""
        deadline = time.monotonic() + timeout
        while True:
            found = predicate()
            if found:
                return found
            code = self.running().poll()
            assert code is None, f"zmqllm up exited {code} waiting for {what}:\n{self.stderr()}"
            assert time.monotonic() < deadline, f"no {what} in {timeout} s:\n{self.stderr()}"
            time.sleep(0.2)

    def wait_up(self, timeout: float = 180.0) -> None:
        self.wait_for(lambda: "zmqllm is up" in self.stdout(), "'zmqllm is up'", timeout)

    def pids(self) -> dict[str, int]:
        """The running children by name: "broker", "gateway", "worker-1of2-0" ..."""
        named = {}
        for pid in children_of(self.running().pid):
            name = child_name(pid)
            if name is not None:
                named[name] = pid
                self.seen.add(pid)
        return named

    def status(self) -> dict[str, Any] | None:
        """The broker's status through the frontend (with the keys `up` made), or None
        while nothing answers there."""
        from zmqllm.bus.keys import load_peer_keys
        from zmqllm.client.status import fetch_status

        keys = load_peer_keys(self.home / "keys", "client")
        try:
            return fetch_status(self.frontend, timeout=2, keys=keys)
        except Exception:  # no broker yet, or one still starting: ask again later
            return None

    def worker_pids(self) -> list[int]:
        """The pids of the workers registered with the broker (empty while none answers)."""
        status = self.status()
        return sorted(w["info"]["pid"] for w in status["workers"]) if status else []

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/ready", timeout=5) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def chat(self, prompt: str, max_tokens: int) -> tuple[int, str]:
        request = urllib.request.Request(
            f"{self.url}/chat?max_tokens={max_tokens}", data=prompt.encode(), method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode(errors="replace")

    # -- stopping ------------------------------------------------------------------
    def stop(self, timeout: float = 30.0) -> int | None:
        """Ctrl-C, as a person would; then SIGKILL whatever is left, `up` and children.
        The exit status of `up` (None if it had to be killed)."""
        if self.proc is None:
            return None
        self.pids()  # remember the children running now
        code = None
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            for pid in self.seen:
                if child_name(pid) is None:  # gone (a pid reused since is not ours)
                    continue
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
        return code
