"""What `zmqllm up` starts, worked out without starting anything: the config (file and
flags), each child's command line, where children connect, whether the ports are free,
and the log file names.

The children read the same config file themselves, so a command line carries only what
differs from the file (``plan``). ``launcher.py`` starts the planned children and
watches them. Torch-free.
"""

from __future__ import annotations

import argparse
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import zmqllm
from zmqllm.config.flags import apply_flags, changed_flags, role_settings
from zmqllm.config.loading import load_config
from zmqllm.config.machine import memory_available
from zmqllm.config.paths import log_dir, zmqllm_home
from zmqllm.config.settings import Config, StageSpec

__all__ = [
    "DEFAULT_STAGES",
    "Child",
    "connect_address",
    "cpu_lock_path",
    "layer_flags",
    "local_host",
    "log_path",
    "memory_share_mb",
    "plan",
    "port_errors",
    "port_problem",
    "repo_config",
    "stage_slug",
    "stages_of",
    "up_config",
]

DEFAULT_STAGES = (StageSpec("1/2"), StageSpec("2/2"))
_TCP_RE = re.compile(r"tcp://(?P<host>\[[^\]]*\]|[^:/]+):(?P<port>[0-9]+)")
_ANY_HOST = ("*", "0.0.0.0", "::", "[::]", "")


@dataclass(frozen=True)
class Child:
    name: str  # log file stem and worker name: "broker", "worker-1of2-0", "gateway"
    role: str
    argv: tuple[str, ...]
    # (path, text) written (owner-only) before it starts: what its command line must not
    # show in `ps`, such as a remote model's URL.
    files: tuple[tuple[str, str], ...] = ()


def repo_config() -> Path | None:
    """configs/local.toml of the checkout zmqllm runs from, if there is one."""
    path = Path(zmqllm.__file__).resolve().parents[1] / "configs" / "local.toml"
    return path if path.is_file() else None


def up_config(ns: argparse.Namespace) -> tuple[Config, Path | None]:
    """The config `zmqllm up` runs (file + flags) and the file the children are given."""
    path = Path(ns.config).expanduser().resolve() if ns.config else repo_config()
    return apply_flags(load_config(path), "up", ns), path


def stages_of(cfg: Config) -> list[StageSpec]:
    return list(cfg.stages) or list(DEFAULT_STAGES)


def stage_slug(layers: str) -> str:
    """A file-name-safe form of a layer spec: "1/2" -> "1of2", "0:15" -> "0-15"."""
    text = layers.replace(" ", "")
    if text in ("", ":"):
        return "all"
    if "/" in text:
        return text.replace("/", "of")
    start, _, end = text.partition(":")
    return f"{start or 0}-{end or 'end'}"


# What the broker and the gateway of `zmqllm up` are left of the machine's free memory.
FRONT_END_BYTES = 1 << 30


def cpu_lock_path() -> Path:
    """One lock per machine: every worker of every local cluster shares its cores."""
    return zmqllm_home() / "cpu.lock"


def memory_share_mb(cfg: Config) -> int:
    """What each worker of a local cluster is given of the machine's free memory (the
    front end keeps some), when there are several and the config sets nothing (0 then):
    each sizes its KV budget from the memory given to it, so several must not each take
    what the machine has free."""
    n_workers = sum(stage.count for stage in stages_of(cfg))
    if n_workers < 2 or cfg.worker.max_memory_mb or cfg.worker.max_kv_tokens:
        return 0
    free, _source = memory_available()
    return max(1, max(0, free - FRONT_END_BYTES) // n_workers >> 20)


def layer_flags(layers: str) -> list[str]:
    # ":" rather than "" so the flag is visibly "all layers" in `ps` and the logs.
    return ["--stage", layers] if "/" in layers else ["--layers", layers or ":"]


def connect_address(endpoint: str) -> str:
    """How a process on this machine reaches a bind endpoint ("tcp://*:5555" -> 127.0.0.1)."""
    m = _TCP_RE.fullmatch(endpoint)
    if m and m["host"] in _ANY_HOST:
        return f"tcp://127.0.0.1:{m['port']}"
    return endpoint


def local_host(host: str) -> str:
    return "127.0.0.1" if host in _ANY_HOST else host


def plan(cfg: Config, config_path: Path | None, python: str = sys.executable) -> list[Child]:
    """The broker, every stage's replicas, the remote workers ([[remotes]]), then the
    gateway, as command lines.

    Children read the same config file themselves, so only what differs from that file
    becomes a flag: each of `up`'s own settings (--model, --port, --keys, --insecure,
    --api-key-file, ...) goes to the roles that take it. Connect addresses are derived from
    the broker's bind addresses because the launcher starts that very broker.
    """
    base = load_config(config_path)
    head = ["--config", str(config_path)] if config_path else []
    last = ["--log-format", "json"]  # one JSON object a line, whatever the terminal is
    if cfg.log.level != base.log.level:
        last += ["--log-level", cfg.log.level]
    passed = [s for s in role_settings("up") if s.section != "log"]  # [log]: `last`

    def command(role: str, *flags: str) -> tuple[str, ...]:
        return (python, "-m", "zmqllm.cli", role, *head, *flags, *last)

    def given(role: str) -> list[str]:
        return changed_flags(role, cfg, base, passed)

    children = [Child("broker", "broker", command("broker", *given("broker")))]
    backend = connect_address(cfg.broker.backend)
    # Every worker here shares this machine's cores. Unless the config says how, they
    # take turns (cpu_lock): each forward gets every core and batches merge across
    # stages, ahead of all computing at once on a share of the cores (README: throughput).
    n_workers = sum(stage.count for stage in stages_of(cfg))
    share = []
    if not cfg.worker.batch_threads and not cfg.worker.cpu_lock and n_workers > 1:
        share = ["--cpu-lock", str(cpu_lock_path())]
    # And its memory (memory_share_mb).
    if each_mb := memory_share_mb(cfg):
        share += ["--max-memory-mb", str(each_mb)]
    for stage in stages_of(cfg):
        for replica in range(stage.count):
            name = f"worker-{stage_slug(stage.layers)}-{replica}"
            flags = [*layer_flags(stage.layers), "--name", name, *given("worker"), *share]
            if cfg.worker.broker != backend:
                flags += ["--broker", backend]
            children.append(Child(name, "worker", command("worker", *flags)))
    for number, remote in enumerate(cfg.remotes):
        for replica in range(remote.count):
            name = f"remote-{number}-{replica}"
            # The URL by file: a command line is anyone's to read in `ps`.
            url_file = str(log_dir(cfg.log) / f"{name}.url")
            flags = ["--remote", f"@{url_file}", "--name", name, *given("worker")]
            for flag, value in (
                ("--remote-model", remote.model),
                ("--served-name", remote.served_name),
                ("--api-key-file", remote.api_key_file),
            ):
                if value:
                    flags += [flag, value]
            if cfg.worker.broker != backend:
                flags += ["--broker", backend]
            files = ((url_file, remote.url + "\n"),)
            children.append(Child(name, "worker", command("worker", *flags), files))
    flags = given("gateway")
    frontend = connect_address(cfg.broker.frontend)
    if cfg.gateway.broker != frontend:
        flags += ["--broker", frontend]
    children.append(Child("gateway", "gateway", command("gateway", *flags)))
    return children


def port_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on host:port, or None if it can."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # The servers set SO_REUSEADDR too: a port in TIME_WAIT is usable and must not
        # count as busy; Linux still refuses the bind while another socket listens.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            return err.strerror or str(err)
    return None


def port_errors(cfg: Config, config_path: Path | None) -> list[str]:
    """One message per port that is taken, naming the flag or config key that moves it."""
    where = f"in {config_path}" if config_path else "in a config file (--config)"
    wanted = [
        (cfg.gateway.host, cfg.gateway.port, "gateway", f"--port or [gateway] port {where}"),
    ]
    for key, other in (("frontend", "[gateway] broker"), ("backend", "[worker] broker")):
        m = _TCP_RE.fullmatch(getattr(cfg.broker, key))
        if m:  # ipc:// and inproc:// have no port
            change = f"[broker] {key} (and {other}) {where}"
            wanted.append((m["host"], int(m["port"]), f"broker {key}", change))
    errors: list[str] = []
    seen: dict[int, str] = {}
    for host, port, what, change in wanted:
        if port in seen:
            errors.append(f"port {port} is given to both the {seen[port]} and the {what}")
            continue
        seen[port] = what
        why = port_problem(local_host(host), port)
        if why:
            errors.append(f"port {port} ({what}) is not free on {host}: {why}; change {change}")
    return errors


def log_path(directory: Path, child: Child) -> Path:
    return directory / f"{child.name}.log"
