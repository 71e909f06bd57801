"""`zmqllm up`: start the broker, the workers and the gateway of one machine, Ctrl-C stops all.

The launcher only starts and watches processes, so it never imports torch: each role runs
as ``python -m zmqllm.cli ROLE`` with its own log file, and the default model is converted
by a ``zmqllm prepare-model`` subprocess. Children get their own session (process group),
so a Ctrl-C in the terminal reaches the launcher alone; it then stops them in order
(gateway, workers, broker) instead of every process racing to shut down at once.

What it starts (command lines, ports, log names) is planned in ``launch_plan.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import BinaryIO

from zmqllm.config import (
    DEFAULT_MODEL,
    TINY_MODEL,
    Config,
    log_dir,
    resolve_model_path,
    zmqllm_home,
)
from zmqllm.config_load import with_overrides
from zmqllm.keys import init_keys, keys_dir, load_peer_keys
from zmqllm.launch_plan import (
    Child,
    connect_address,
    local_host,
    log_path,
    plan,
    port_errors,
    stages_of,
    up_config,
)

POLL_S = 0.5  # how often readiness and children are checked
STOP_GRACE_S = 10.0  # after this, children still running get SIGKILL
TAIL_LINES = 20
LOG_DIR_MODE = 0o700  # owner only: see private_log_dir
LOG_FILE_MODE = 0o600


class UpError(RuntimeError):
    """Something that stops `zmqllm up` before it starts, told in one message."""


# --- log files ---------------------------------------------------------------------------


def private_log_dir(directory: Path) -> None:
    """Make the log folder, readable by its owner only.

    Logs name requests, routes and errors (at debug level, more): other users of the
    machine have no business reading them. A shared folder (sticky, like /tmp) is left as
    it is; the files in it are private anyway.
    """
    directory.mkdir(parents=True, exist_ok=True, mode=LOG_DIR_MODE)
    mode = directory.stat().st_mode
    if not mode & stat.S_ISVTX and stat.S_IMODE(mode) & (stat.S_IRWXG | stat.S_IRWXO):
        directory.chmod(LOG_DIR_MODE)


def open_private_log(path: Path) -> BinaryIO:
    """A fresh log file for writing, created 0600 whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, LOG_FILE_MODE)
    os.fchmod(fd, LOG_FILE_MODE)  # the file may have existed with a wider mode
    return os.fdopen(fd, "wb")


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


# --- processes -------------------------------------------------------------------------


def say(msg: str) -> None:
    print(f"[zmqllm] {msg}", file=sys.stderr, flush=True)


def prepare_model(cfg: Config) -> None:
    """Convert the default model (or make the tiny one) in a subprocess: that needs torch."""
    from zmqllm.models import is_prepared  # torch-free at import time

    alias = cfg.model.path
    target = Path(resolve_model_path(alias))
    if alias not in (DEFAULT_MODEL, TINY_MODEL) or is_prepared(target):
        return
    extra = [] if alias == DEFAULT_MODEL else ["--tiny", str(target)]
    say(f"preparing the {alias} model in {target} (once)")
    # Its stdout (the directory) goes to stderr too: stdout is for the "is up" lines.
    cmd = [sys.executable, "-m", "zmqllm.cli", "prepare-model", *extra]
    sys.stderr.flush()
    if subprocess.call(cmd, stdout=2) != 0:
        raise UpError(f"could not prepare the {alias} model: {' '.join(cmd)} failed")


def _die_with_parent() -> None:
    # Runs in the child before exec: if the launcher is SIGKILLed, the kernel sends
    # SIGTERM to the child, so no orphan keeps holding the ports (Linux only).
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Cluster:
    def __init__(self, children: list[Child], directory: Path) -> None:
        self.children = children
        self.dir = directory
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.reported: set[str] = set()

    def start(self) -> None:
        private_log_dir(self.dir)
        env = dict(os.environ, PYTHONUNBUFFERED="1")  # lines reach the log as they happen
        linux = sys.platform.startswith("linux")
        for child in self.children:
            path = log_path(self.dir, child)
            if path.exists():  # keep one previous run for a look after a restart
                older = path.with_name(path.name + ".1")
                path.replace(older)
                older.chmod(LOG_FILE_MODE)  # a log from before logs were private
            with open_private_log(path) as out:
                self.procs[child.name] = subprocess.Popen(
                    child.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    preexec_fn=_die_with_parent if linux else None,
                )

    def newly_exited(self) -> list[tuple[Child, int]]:
        out = []
        for child in self.children:
            code = self.procs[child.name].poll()
            if code is not None and child.name not in self.reported:
                self.reported.add(child.name)
                out.append((child, code))
        return out

    def report(self, child: Child, code: int) -> None:
        path = log_path(self.dir, child)
        say(f"{child.name} exited with code {code}; last lines of {path}:\n{tail(path)}")

    def _signal(self, child: Child, sig: int) -> None:
        # The whole group: a child is its session's leader, so this reaches anything it
        # started too, as the terminal would.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.procs[child.name].pid, sig)

    def stop(self, hurry: Callable[[], bool] = lambda: False) -> None:
        """SIGINT tier by tier (gateway, workers, broker), then SIGKILL what is left."""
        deadline = time.monotonic() + STOP_GRACE_S
        tiers = [[c for c in self.children if c.role == r] for r in ("gateway", "worker", "broker")]
        for index, tier in enumerate(tiers):
            alive = [c for c in tier if c.name in self.procs and self.procs[c.name].poll() is None]
            for child in alive:
                self._signal(child, signal.SIGINT)
            # Each tier gets a share of the grace left, so a gateway finishing a long
            # stream cannot use it all and leave the broker no time to close cleanly.
            share = time.monotonic() + (deadline - time.monotonic()) / (len(tiers) - index)
            while time.monotonic() < share and not hurry():
                if all(self.procs[c.name].poll() is not None for c in alive):
                    break
                time.sleep(0.05)
        for child in self.children:
            proc = self.procs.get(child.name)  # None if start() failed before it
            if proc and proc.poll() is None:
                say(f"{child.name} did not stop in time; killing it")
                self._signal(child, signal.SIGKILL)
            if proc:
                proc.wait()


# --- run ------------------------------------------------------------------------------


class _Signals:
    """Counts SIGINT/SIGTERM: the main loops look at it, so no exception unwinds mid-way."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1


def http_status(url: str) -> int | None:
    """The HTTP status of a GET, or None while nothing listens."""
    # Our own gateway's readiness: over https its certificate may be self-signed.
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return None


def _workers(cfg: Config) -> list[list[int]] | None:
    """Layer ranges of the registered workers, from the broker (None if it won't say)."""
    from zmqllm.status import fetch_status  # zmq only, no torch

    try:
        folder = keys_dir(cfg.security)
        keys = load_peer_keys(folder, "client") if folder is not None else None
        st = fetch_status(connect_address(cfg.broker.frontend), timeout=0.5, keys=keys)
    except Exception:  # progress is best-effort: an answer later will do
        return None
    return sorted(w["layers"] for w in st.get("workers", []))


class _Progress:
    """One line while waiting: rewritten in place on a terminal, a line per note in a file."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.shown = False
        self.last = 0.0  # seconds waited at the last note

    def due(self, waited: float) -> bool:
        return waited - self.last >= (2.0 if self.tty else 10.0)

    def note(self, waited: float, text: str) -> None:
        self.last = waited
        if self.tty:
            self.shown = True
            print(f"\r\033[K[zmqllm] {text}", end="", file=sys.stderr, flush=True)
        else:
            say(text)

    def clear(self) -> None:
        if self.shown:  # so whatever is printed next starts on a clean line
            print("\r\033[K", end="", file=sys.stderr, flush=True)
            self.shown = False


def wait_ready(cluster: Cluster, cfg: Config, url: str, timeout: float, sig: _Signals) -> str:
    """Poll the gateway's /ready: "ready", "signal", "exited" (a child died) or "timeout"."""
    start = time.monotonic()
    expected = sum(s.count for s in stages_of(cfg))
    progress = _Progress()
    try:
        while not sig.count:
            exited = cluster.newly_exited()
            if exited:
                progress.clear()
                for child, code in exited:
                    cluster.report(child, code)
                return "exited"
            status = http_status(url)
            if status == 200:
                return "ready"
            waited = time.monotonic() - start
            if waited > timeout:
                return "timeout"
            if progress.due(waited):  # not every poll: asking the broker takes up to 0.5 s
                workers = _workers(cfg)
                known = "?" if workers is None else str(len(workers))
                gateway = "not listening yet" if status is None else f"/ready {status}"
                text = f"{known}/{expected} workers registered, gateway {gateway}"
                progress.note(waited, f"waiting ({waited:.0f}s): {text}")
            time.sleep(POLL_S)
        return "signal"
    finally:
        progress.clear()


def secure_by_default(cfg: Config) -> tuple[Config, str]:
    """``cfg`` with the key folder every child is given, made in $ZMQLLM_HOME/keys on
    first use; and a line saying so. --insecure keeps the bus plaintext."""
    if cfg.security.insecure:
        return cfg, "CURVE off (--insecure): the bus is plaintext"
    folder = keys_dir(cfg.security)
    note = f"CURVE keys: {folder}"
    if folder is None:
        folder = init_keys(zmqllm_home() / "keys")
        note = f"CURVE keys made in {folder} (add a worker on another host: zmqllm keys add)"
    return with_overrides(cfg, "security", {"keys": str(folder)}), note


def run_up(ns: argparse.Namespace) -> int:
    cfg, config_path = up_config(ns)
    cfg, keys_note = secure_by_default(cfg)
    say(keys_note)
    gw = cfg.gateway
    if gw.port == 0:  # "pick a free port": pick it here so the launcher knows where to look
        with socket.socket() as sock:
            sock.bind((local_host(gw.host), 0))
            cfg = with_overrides(cfg, "gateway", {"port": sock.getsockname()[1]})
    try:
        errors = port_errors(cfg, config_path)
        if errors:
            raise UpError("\n".join(errors))
        prepare_model(cfg)
    except UpError as err:
        say(str(err))
        return 1
    directory = log_dir(cfg.log)
    cluster = Cluster(plan(cfg, config_path), directory)
    sig = _Signals()
    previous = {s: signal.signal(s, sig) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        cluster.start()
        say(f"starting {len(cluster.children)} processes; logs in {directory}")
        return _supervise(cluster, cfg, ns, sig)
    finally:
        cluster.stop(hurry=lambda: sig.count > 1)  # a second Ctrl-C: kill at once
        for s, handler in previous.items():
            signal.signal(s, handler)
        say("stopped")


def _supervise(cluster: Cluster, cfg: Config, ns: argparse.Namespace, sig: _Signals) -> int:
    host, port = local_host(cfg.gateway.host), cfg.gateway.port
    url = f"{'https' if cfg.gateway.ssl_certfile else 'http'}://{host}:{port}"
    timeout = float(getattr(ns, "ready_timeout", 600.0))
    state = wait_ready(cluster, cfg, f"{url}/ready", timeout, sig)
    if state == "timeout":
        say(f"not ready after {timeout:g}s (--ready-timeout); logs in {cluster.dir}")
    if state != "ready":
        say("stopping")
        return 0 if state == "signal" else 1
    ranges = _workers(cfg) or []
    layers = ", ".join(f"{a}:{b}" for a, b in ranges) or ", ".join(s.layers for s in stages_of(cfg))
    count = len(ranges) or len(cluster.children) - 2
    frontend = connect_address(cfg.broker.frontend)
    keyed = cfg.gateway.api_keys_file or os.environ.get("ZMQLLM_API_KEY")
    auth = ' -H "Authorization: Bearer $KEY"' if keyed else ""
    print(
        f"zmqllm is up: broker {frontend}, {count} workers (layers {layers}), gateway {url}\n"
        f'try:  curl -N{auth} -d "Why is the sky blue?" {url}/chat\n'
        f"logs: {cluster.dir}\n"
        "stop: Ctrl-C",
        flush=True,
    )
    while not sig.count:
        for child, code in cluster.newly_exited():
            cluster.report(child, code)
            if child.role != "worker":  # without the broker or the gateway nothing serves
                say(f"the {child.role} is gone; stopping everything")
                return 1
            say("the other processes keep serving")
        time.sleep(POLL_S)
    say("stopping")
    return 0
