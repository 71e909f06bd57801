"""`zmqllm up`: start the broker, the workers and the gateway of one machine, Ctrl-C stops all.

The launcher only starts and watches processes, so it never imports torch: each role runs
as ``python -m zmqllm.cli ROLE`` with its own log file, and the default model is converted
by a ``zmqllm prepare-model`` subprocess. Children get their own session (process group),
so a Ctrl-C in the terminal reaches the launcher alone; it then stops them in order
(gateway, workers, broker) instead of every process racing to shut down at once.

A child that exits while the cluster runs (or while it starts) is started again with the
same command line after a backoff; one that keeps exiting stops everything with its last
log lines (``supervision.py`` decides which). A restarted broker binds the same ports, and
the workers and the gateway find it again by themselves.

What it starts (command lines, ports, log names) is planned in ``plan.py``; how a
child is started, signalled and read back is ``child_process.py``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from zmqllm.bus.keys import init_keys, keys_dir, load_peer_keys
from zmqllm.config.loading import with_overrides
from zmqllm.config.paths import log_dir, resolve_model_path, zmqllm_home
from zmqllm.config.settings import DEFAULT_MODEL, TINY_MODEL, Config
from zmqllm.config.up_state import STATE_ENV
from zmqllm.launch.child_process import (
    LOG_FILE_MODE,
    ChildProcess,
    private_log_dir,
    spawn,
    tail,
)
from zmqllm.launch.plan import (
    Child,
    connect_address,
    local_host,
    log_path,
    plan,
    port_errors,
    stages_of,
    up_config,
)
from zmqllm.launch.split import auto_stages
from zmqllm.launch.state_file import StateFile, essential_children
from zmqllm.launch.supervision import GiveUp, RestartPolicy
from zmqllm.log import KERNELS_BUILDING, KERNELS_BUILT

POLL_S = 0.5  # how often readiness and children are checked
STOP_GRACE_S = 10.0  # after this, children still running get SIGKILL
LOG_PEEK_BYTES = 16384  # how much of a worker log's end is read for the kernel build


class UpError(RuntimeError):
    """Something that stops `zmqllm up` before it starts, told in one message."""


def say(msg: str) -> None:
    print(f"[zmqllm] {msg}", file=sys.stderr, flush=True)


def prepare_model(cfg: Config) -> None:
    """Convert the default model (or make the tiny one) in a subprocess: that needs torch."""
    from zmqllm.models.prepare import is_prepared  # torch-free at import time

    alias = cfg.model.path
    target = Path(resolve_model_path(alias))
    if alias not in (DEFAULT_MODEL, TINY_MODEL) or is_prepared(target):
        return
    extra = [] if alias == DEFAULT_MODEL else ["--tiny", str(target)]
    home = zmqllm_home()
    home.mkdir(parents=True, exist_ok=True)
    log = home / "prepare-model.log"
    say(f"preparing the {alias} model in {target} (once; its log: {log})")
    cmd = [sys.executable, "-m", "zmqllm.cli", "prepare-model", *extra]
    # Its output (progress bars, the directory it prints for scripts) goes to the log:
    # the terminal gets the lines above and below.
    started = time.monotonic()
    with log.open("wb") as out:
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        raise UpError(
            f"could not prepare the {alias} model: {' '.join(cmd)} failed\n"
            f"last lines of {log}:\n{tail(log)}"
        )
    say(f"model ready ({time.monotonic() - started:.0f}s)")


def write_private(path: Path, text: str) -> None:
    """A file only this user can read, made so before anything is in it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


class Cluster:
    """The children of one `zmqllm up`: started, restarted one by one, stopped together."""

    def __init__(self, children: list[Child], directory: Path) -> None:
        self.children = children
        self.dir = directory
        self.procs: dict[str, ChildProcess] = {}
        self.reported: set[str] = set()  # exited, and told so by newly_exited

    def start(self) -> None:
        private_log_dir(self.dir)
        for child in self.children:
            path = self.log_of(child)
            if path.exists():  # keep one previous run for a look after a restart
                older = path.with_name(path.name + ".1")
                path.replace(older)
                older.chmod(LOG_FILE_MODE)  # a log from before logs were private
            for name, text in child.files:
                write_private(Path(name), text)
            self.procs[child.name] = spawn(child.name, child.argv, path)

    def restart(self, name: str) -> ChildProcess:
        """Start an exited child again with the same command line (so a broker binds the
        same ports); its output goes on in the same log, after the last run's last words."""
        child = next(c for c in self.children if c.name == name)
        self.procs[name] = spawn(name, child.argv, self.log_of(child), append=True)
        self.reported.discard(name)
        return self.procs[name]

    def log_of(self, child: Child) -> Path:
        return log_path(self.dir, child)

    def kernels_building(self) -> bool:
        """Whether a worker's log says it is compiling the kernels right now (the first
        start on a machine waits for that)."""
        for child in self.children:
            if not child.name.startswith("worker"):
                continue
            try:
                with self.log_of(child).open("rb") as f:
                    f.seek(0, os.SEEK_END)
                    f.seek(max(0, f.tell() - LOG_PEEK_BYTES))
                    text = f.read()
            except OSError:
                continue
            if text.rfind(KERNELS_BUILDING.encode()) > text.rfind(KERNELS_BUILT.encode()):
                return True
        return False

    def newly_exited(self) -> list[tuple[Child, int]]:
        out = []
        for child in self.children:
            code = self.procs[child.name].poll()
            if code is not None and child.name not in self.reported:
                self.reported.add(child.name)
                out.append((child, code))
        return out

    def stop(self, hurry: Callable[[], bool] = lambda: False) -> None:
        """SIGINT tier by tier (gateway, workers, broker), then SIGKILL what is left."""
        deadline = time.monotonic() + STOP_GRACE_S
        tiers = [[c for c in self.children if c.role == r] for r in ("gateway", "worker", "broker")]
        for index, tier in enumerate(tiers):
            procs = (self.procs.get(c.name) for c in tier)
            alive = [proc for proc in procs if proc is not None and proc.alive()]
            for proc in alive:
                proc.signal(signal.SIGINT)
            # Each tier gets a share of the grace left, so a gateway finishing a long
            # stream cannot use it all and leave the broker no time to close cleanly.
            share = time.monotonic() + (deadline - time.monotonic()) / (len(tiers) - index)
            while time.monotonic() < share and not hurry():
                if not any(proc.alive() for proc in alive):
                    break
                time.sleep(0.05)
        for name, proc in self.procs.items():  # not all children if start() failed
            if proc.alive():
                say(f"{name} did not stop in time; killing it")
                proc.signal(signal.SIGKILL)
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
    """Layer ranges of the registered workers of layers, from the broker (None if it
    won't say); remote workers are not among them."""
    from zmqllm.client.status import fetch_status  # zmq only, no torch

    try:
        folder = keys_dir(cfg.security)
        keys = load_peer_keys(folder, "client") if folder is not None else None
        st = fetch_status(connect_address(cfg.broker.frontend), timeout=0.5, keys=keys)
    except Exception:  # progress is best-effort: an answer later will do
        return None
    return sorted(w["layers"] for w in st.get("workers", []) if not w.get("text_model"))


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
        # layers = "auto": each stage's range from this machine's measured figures.
        cfg = auto_stages(cfg, config_path, say=say)
    except UpError as err:
        say(str(err))
        return 1
    directory = log_dir(cfg.log)
    cluster = Cluster(plan(cfg, config_path), directory)
    policy = RestartPolicy(essential=essential_children(cluster.children))
    state = StateFile(directory)
    sig = _Signals()
    previous = {s: signal.signal(s, sig) for s in (signal.SIGINT, signal.SIGTERM)}
    # The children (the gateway's /ready) read the failing ones from the state file.
    env_before = os.environ.get(STATE_ENV)
    os.environ[STATE_ENV] = str(state.path)
    try:
        cluster.start()
        for child in cluster.children:
            policy.started(child.name, time.monotonic())
        say(f"starting {len(cluster.children)} processes; logs in {directory}")
        return _supervise(cluster, cfg, ns, sig, policy, state)
    finally:
        cluster.stop(hurry=lambda: sig.count > 1)  # a second Ctrl-C: kill at once
        state.remove()
        if env_before is None:
            os.environ.pop(STATE_ENV, None)
        else:
            os.environ[STATE_ENV] = env_before
        for s, handler in previous.items():
            signal.signal(s, handler)
        say("stopped")


def _supervise(
    cluster: Cluster,
    cfg: Config,
    ns: argparse.Namespace,
    sig: _Signals,
    policy: RestartPolicy,
    published: StateFile,
) -> int:
    """Until a signal: wait for /ready and say the cluster is up, and all along start again
    every child that exits (``policy`` says when, or that it is time to give up)."""
    host, port = local_host(cfg.gateway.host), cfg.gateway.port
    url = f"{'https' if cfg.gateway.ssl_certfile else 'http'}://{host}:{port}"
    timeout = float(getattr(ns, "ready_timeout", 600.0))
    begun = time.monotonic()
    progress = _Progress()
    ready = False
    try:
        while not sig.count:
            now = time.monotonic()
            for child, code in cluster.newly_exited():
                progress.clear()
                decision = policy.exited(child.name, code, now)
                path = cluster.log_of(child)
                if isinstance(decision, GiveUp):
                    say(f"{decision.message()}\nlast lines of {path}:\n{tail(path)}")
                    return 1
                say(f"{decision.message()}; its log: {path}")
            for name in policy.due(now):
                # Once a stop is asked nothing more starts. A signal during a start only
                # counts (nothing unwinds), so that child is in cluster.procs and the stop
                # that follows stops it with the rest.
                if sig.count:
                    break
                policy.started(name, time.monotonic())
                say(f"{name} started again (pid {cluster.restart(name).pid})")
            published.update(cluster, policy)
            if not ready:
                waited = time.monotonic() - begun
                state = _check_ready(cfg, f"{url}/ready", waited, progress, cluster)
                if state == "ready":
                    ready = True
                    _say_up(cluster, cfg, url)
                elif waited > timeout:
                    progress.clear()
                    say(f"not ready after {timeout:g}s (--ready-timeout); logs in {cluster.dir}")
                    say("stopping")
                    return 1
            pause = POLL_S
            due = policy.next_due()
            if due is not None:  # a restart's backoff may end before the next poll
                pause = min(pause, max(0.0, due - time.monotonic()))
            time.sleep(pause)
    finally:
        progress.clear()
    say("stopping")
    return 0


def _check_ready(
    cfg: Config, url: str, waited: float, progress: _Progress, cluster: Cluster
) -> str:
    """One look at the gateway's /ready: "ready", or "waiting" after noting progress."""
    status = http_status(url)
    if status == 200:
        progress.clear()
        return "ready"
    if progress.due(waited):  # not every poll: asking the broker takes up to 0.5 s
        expected = sum(s.count for s in stages_of(cfg))
        workers = _workers(cfg)
        known = "?" if workers is None else str(len(workers))
        gateway = "not listening yet" if status is None else f"/ready {status}"
        text = f"{known}/{expected} workers registered, gateway {gateway}"
        if cluster.kernels_building():
            text += "; compiling the kernels (once per machine: 1-2 minutes)"
        progress.note(waited, f"waiting ({waited:.0f}s): {text}")
    return "waiting"


def _say_up(cluster: Cluster, cfg: Config, url: str) -> None:
    """The lines that tell a person the cluster serves, and how to try it."""
    ranges = _workers(cfg) or []
    layers = ", ".join(f"{a}:{b}" for a, b in ranges) or ", ".join(s.layers for s in stages_of(cfg))
    count = len(ranges) or len(cluster.children) - 2 - sum(r.count for r in cfg.remotes)
    frontend = connect_address(cfg.broker.frontend)
    keyed = cfg.gateway.api_keys_file or os.environ.get("ZMQLLM_API_KEY")
    auth = ' -H "Authorization: Bearer $KEY"' if keyed else ""
    # The bus address and key folder as this cluster has them: status works as printed.
    status = f"{os.environ.get('ZMQLLM_CLI', 'zmqllm')} status --broker {frontend}"
    if cfg.security.keys and not cfg.security.insecure:
        status += f" --keys {cfg.security.keys}"
    # Not the URL: it may hold a password or a key.
    remote = [r.served_name or r.model or "(the upstream's first)" for r in cfg.remotes]
    more = f", remote models {', '.join(remote)}" if remote else ""
    print(
        f"zmqllm is up: broker {frontend}, {count} workers (layers {layers}){more}, "
        f"gateway {url}\n"
        f'try:  curl -N{auth} -d "Why is the sky blue?" {url}/chat\n'
        f"status: {status}\n"
        f"logs: {cluster.dir}\n"
        "stop: Ctrl-C",
        flush=True,
    )
