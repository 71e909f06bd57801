"""`zmqllm up` without the ML stack: command lines, ports, log names, and the supervision
loop run against stand-in children (tiny Python processes), so nothing here needs torch."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from zmqllm import launcher
from zmqllm.cli import _load as cli_load
from zmqllm.cli import build_parser
from zmqllm.config import Config
from zmqllm.launcher import (
    Child,
    Cluster,
    connect_address,
    cpu_lock_path,
    layer_flags,
    log_path,
    open_private_log,
    plan,
    port_errors,
    port_problem,
    private_log_dir,
    stage_slug,
    up_config,
)

CONFIGS = Path(__file__).parents[1] / "configs"
PY = "/usr/bin/python-for-test"
CLI = (PY, "-m", "zmqllm.cli")
JSON = ("--log-format", "json")


def ns(**kw: object) -> argparse.Namespace:
    """The Namespace `zmqllm up` gets from argparse, flags not given left at None."""
    fields: dict[str, object] = dict(
        config=None, log_level=None, log_format=None, port=None, model=None, log_dir=None
    )
    fields["ready_timeout"] = 600.0
    return argparse.Namespace(**{**fields, **kw})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return path


# --- command lines ----------------------------------------------------------------------


# Workers on this machine take turns on its cores.
SHARE = ("--cpu-lock", str(cpu_lock_path()))


def cfg_with(cfg: Config, section: str, **values: object) -> Config:
    from zmqllm.config_load import with_overrides

    return with_overrides(cfg, section, values)


def test_local_toml_plan() -> None:
    path = (CONFIGS / "local.toml").resolve()
    cfg, used = up_config(ns(config=str(CONFIGS / "local.toml")))
    assert used == path
    head = ("--config", str(path))
    assert [(c.name, c.role, c.argv) for c in plan(cfg, used, python=PY)] == [
        ("broker", "broker", (*CLI, "broker", *head, *JSON)),
        (
            "worker-1of2-0",
            "worker",
            (*CLI, "worker", *head, "--stage", "1/2", "--name", "worker-1of2-0", *SHARE, *JSON),
        ),
        (
            "worker-2of2-0",
            "worker",
            (*CLI, "worker", *head, "--stage", "2/2", "--name", "worker-2of2-0", *SHARE, *JSON),
        ),
        ("gateway", "gateway", (*CLI, "gateway", *head, *JSON)),
    ]


def test_tiny_toml_plan_with_overrides(tmp_path: Path) -> None:
    flags = ns(config=str(CONFIGS / "tiny.toml"), port=9123, model="/m", log_level="debug")
    cfg, used = up_config(flags)
    children = plan(cfg, used, python=PY)
    assert [c.name for c in children] == ["broker", "worker-1of2-0", "worker-2of2-0", "gateway"]
    level = ("--log-level", "debug")
    assert children[0].argv[-4:] == (*JSON, *level)
    assert children[1].argv[-9:] == ("worker-1of2-0", "--model", "/m", *SHARE, *JSON, *level)
    # The gateway needs the model too: its tokenizer and chat template come from there.
    gateway = children[-1].argv
    assert gateway[4:] == ("--config", str(used), "--model", "/m", "--port", "9123", *JSON, *level)


def test_workers_take_turns_on_the_cores_unless_the_config_says_how(tmp_path: Path) -> None:
    def worker_flags(body: str) -> list[tuple[str, ...]]:
        cfg, used = up_config(ns(config=str(write_config(tmp_path, body))))
        return [c.argv for c in plan(cfg, used, python=PY) if c.role == "worker"]

    two = '[[stages]]\nlayers = "0:2"\n[[stages]]\nlayers = "2:"\n'
    assert all("--cpu-lock" in argv for argv in worker_flags(two))
    # The config chose: threads per stage, or its own lock file (read by the workers).
    for setting in ("batch_threads = 1", 'cpu_lock = "/tmp/x.lock"'):
        for argv in worker_flags(f"[worker]\n{setting}\n{two}"):
            assert "--cpu-lock" not in argv and "--batch-threads" not in argv
    # One worker has no one to take turns with.
    (alone,) = worker_flags('[[stages]]\nlayers = ":"\n')
    assert "--cpu-lock" not in alone


def test_unchanged_values_are_left_to_the_config_file() -> None:
    # Same values as tiny.toml: nothing to override, so no flags.
    cfg, used = up_config(ns(config=str(CONFIGS / "tiny.toml"), port=8081, model="tiny"))
    for child in plan(cfg, used, python=PY):
        assert "--port" not in child.argv and "--model" not in child.argv


def up_flags(*argv: str) -> argparse.Namespace:
    """The Namespace of `zmqllm up ARGV`, parsed by the real command line."""
    return build_parser().parse_args(["up", *argv])


def child_config(child: Child) -> Config:
    """What a child runs: its command line parsed and applied the way `zmqllm ROLE` does."""
    return cli_load(build_parser().parse_args(list(child.argv[3:])))


def test_up_passes_security_and_gateway_files_to_the_children_that_take_them() -> None:
    flags = up_flags(
        *("--config", str(CONFIGS / "tiny.toml"), "--keys", "/k", "--insecure"),
        *("--api-key-file", "/a", "--ssl-certfile", "/c", "--ssl-keyfile", "/p"),
    )
    cfg, used = up_config(flags)
    assert cfg.security.keys == "/k" and cfg.security.insecure
    children = plan(cfg, used, python=PY)
    for child in children:
        assert child.argv.count("--keys") == 1 and "--insecure" in child.argv
        assert child_config(child).security == cfg.security
        files = {"--api-key-file", "--ssl-certfile", "--ssl-keyfile"} & set(child.argv)
        assert bool(files) == (child.role == "gateway"), child.argv
    gateway = child_config(children[-1]).gateway
    assert (gateway.api_keys_file, gateway.ssl_certfile, gateway.ssl_keyfile) == ("/a", "/c", "/p")
    # Nothing else changes: each child still runs the launcher's config.
    for child in children:
        own = child_config(child)
        assert own.model == cfg.model and own.log.level == cfg.log.level


def test_up_is_secure_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZMQLLM_HOME", str(tmp_path / "home"))
    cfg, note = launcher.secure_by_default(Config())
    folder = tmp_path / "home" / "keys"
    assert (folder / "broker.key_secret").is_file() and "made" in note
    assert cfg.security.keys == str(folder)  # every child is given the folder
    again, note = launcher.secure_by_default(Config())
    assert again.security.keys == str(folder) and "made" not in note  # kept, not remade
    plain, note = launcher.secure_by_default(cfg_with(Config(), "security", insecure=True))
    assert plain.security.keys == "" and "--insecure" in note


def test_up_passes_a_bool_turned_off_as_its_no_flag(tmp_path: Path) -> None:
    path = write_config(tmp_path, "[security]\ninsecure = true\n")
    cfg, used = up_config(up_flags("--config", str(path), "--no-insecure"))
    for child in plan(cfg, used, python=PY):
        assert "--no-insecure" in child.argv and not child_config(child).security.insecure


def test_up_flags_equal_to_the_file_are_not_passed(tmp_path: Path) -> None:
    path = write_config(tmp_path, '[security]\nkeys = "/k"\n[gateway]\napi_keys_file = "/a"\n')
    flags = up_flags("--config", str(path), "--keys", "/k", "--api-key-file", "/a")
    cfg, used = up_config(flags)
    for child in plan(cfg, used, python=PY):
        assert "--keys" not in child.argv and "--api-key-file" not in child.argv
        assert child_config(child).security.keys == "/k"


def test_replicas_and_layer_ranges(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        """
        [[stages]]
        layers = "0:2"
        count = 2

        [[stages]]
        layers = "2:"
        """,
    )
    cfg, used = up_config(ns(config=str(path)))
    workers = [c for c in plan(cfg, used, python=PY) if c.role == "worker"]
    assert [c.name for c in workers] == ["worker-0-2-0", "worker-0-2-1", "worker-2-end-0"]
    assert [c.argv[6:8] for c in workers] == [("--layers", "0:2")] * 2 + [("--layers", "2:")]


def test_no_config_file_gives_two_stages_and_no_config_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(launcher, "repo_config", lambda: None)
    cfg, used = up_config(ns())
    assert used is None
    children = plan(cfg, used, python=PY)
    assert [c.name for c in children] == ["broker", "worker-1of2-0", "worker-2of2-0", "gateway"]
    assert all("--config" not in c.argv for c in children)
    assert cfg.gateway.port == 8080


def test_default_config_is_the_checkouts_local_toml() -> None:
    assert launcher.repo_config() == (CONFIGS / "local.toml").resolve()


def test_broker_bind_addresses_decide_where_children_connect(tmp_path: Path) -> None:
    # Only [broker] was edited: the gateway and workers must follow it, not the defaults.
    path = write_config(
        tmp_path,
        """
        [broker]
        frontend = "tcp://*:7001"
        backend = "tcp://0.0.0.0:7002"
        """,
    )
    cfg, used = up_config(ns(config=str(path)))
    children = plan(cfg, used, python=PY)
    for child in children[1:-1]:
        assert child.argv[-4:-2] == ("--broker", "tcp://127.0.0.1:7002")
    assert children[-1].argv[-4:-2] == ("--broker", "tcp://127.0.0.1:7001")


def test_log_dir_override(tmp_path: Path) -> None:
    cfg, _ = up_config(ns(config=str(CONFIGS / "tiny.toml"), log_dir=str(tmp_path / "logs")))
    assert cfg.log.dir == str(tmp_path / "logs")


@pytest.mark.parametrize(
    ("layers", "slug", "flags"),
    [
        ("1/2", "1of2", ["--stage", "1/2"]),
        ("0:15", "0-15", ["--layers", "0:15"]),
        (":15", "0-15", ["--layers", ":15"]),
        ("15:", "15-end", ["--layers", "15:"]),
        ("", "all", ["--layers", ":"]),
        (":", "all", ["--layers", ":"]),
    ],
)
def test_stage_slug_and_flags(layers: str, slug: str, flags: list[str]) -> None:
    assert stage_slug(layers) == slug
    assert layer_flags(layers) == flags


def test_log_names(tmp_path: Path) -> None:
    cfg, used = up_config(ns(config=str(CONFIGS / "local.toml")))
    names = [log_path(tmp_path, c).name for c in plan(cfg, used)]
    assert names == ["broker.log", "worker-1of2-0.log", "worker-2of2-0.log", "gateway.log"]


def test_connect_address() -> None:
    assert connect_address("tcp://*:5555") == "tcp://127.0.0.1:5555"
    assert connect_address("tcp://0.0.0.0:5555") == "tcp://127.0.0.1:5555"
    assert connect_address("tcp://10.1.2.3:5555") == "tcp://10.1.2.3:5555"
    assert connect_address("ipc:///tmp/broker") == "ipc:///tmp/broker"


# --- ports ------------------------------------------------------------------------------


@pytest.fixture()
def listening() -> Iterator[int]:
    """A port some other program is listening on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_port_problem(listening: int) -> None:
    assert port_problem("127.0.0.1", listening)
    assert port_problem("127.0.0.1", free_port()) is None


def test_busy_gateway_port_names_the_flag_and_key(tmp_path: Path, listening: int) -> None:
    cfg, used = up_config(ns(config=str(CONFIGS / "tiny.toml"), port=listening))
    errors = [e for e in port_errors(cfg, used) if str(listening) in e]
    assert len(errors) == 1
    assert "gateway" in errors[0] and "--port" in errors[0] and "[gateway] port" in errors[0]


def test_busy_broker_port_names_the_config_key(tmp_path: Path, listening: int) -> None:
    path = write_config(tmp_path, f'[broker]\nbackend = "tcp://127.0.0.1:{listening}"\n')
    cfg, used = up_config(ns(config=str(path), port=free_port()))
    (error,) = [e for e in port_errors(cfg, used) if str(listening) in e]
    assert "[broker] backend" in error and str(path) in error


def test_free_ports_give_no_errors(tmp_path: Path) -> None:
    a, b, c = free_port(), free_port(), free_port()
    path = write_config(
        tmp_path,
        f"""
        [broker]
        frontend = "tcp://127.0.0.1:{a}"
        backend = "tcp://127.0.0.1:{b}"
        [gateway]
        port = {c}
        """,
    )
    assert port_errors(*up_config(ns(config=str(path)))) == []


def test_one_port_for_two_roles_is_an_error(tmp_path: Path) -> None:
    port = free_port()
    path = write_config(tmp_path, f'[broker]\nfrontend = "tcp://127.0.0.1:{port}"\n')
    cfg, used = up_config(ns(config=str(path), port=port))
    assert any("both" in e and str(port) in e for e in port_errors(cfg, used))


def test_run_up_refuses_a_busy_port_before_starting_anything(
    capsys: pytest.CaptureFixture[str], listening: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_start(self: Cluster) -> None:
        raise AssertionError("nothing may start while a port is busy")

    monkeypatch.setattr(Cluster, "start", no_start)
    assert launcher.run_up(ns(config=str(CONFIGS / "tiny.toml"), port=listening)) == 1
    err = capsys.readouterr().err
    assert f"port {listening} (gateway)" in err and "--port" in err


def test_launcher_does_not_import_torch() -> None:
    code = "import sys, zmqllm.launcher; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- supervision, with stand-in children ------------------------------------------------

# Answers /ready with 200, like a gateway whose route has warmed up.
FAKE_GATEWAY = """
import http.server, sys
class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/ready" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
print("gateway up", flush=True)
try:
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ready).serve_forever()
except KeyboardInterrupt:
    print("gateway stopped", flush=True)
"""
# Runs until SIGINT, then says so: the log shows the stop was clean and in order.
SLEEPER = """
import sys, time
print("started", flush=True)
try:
    time.sleep(600)
except KeyboardInterrupt:
    print("stopped by SIGINT at", time.monotonic(), flush=True)
"""
STUBBORN = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)"


def py(code: str, *args: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code, *args)


def fake_cluster(port: int, worker: tuple[str, ...] = py(SLEEPER)) -> list[Child]:
    return [
        Child("broker", "broker", py(SLEEPER)),
        Child("worker-1of1-0", "worker", worker),
        Child("gateway", "gateway", py(FAKE_GATEWAY, str(port))),
    ]


def wait_for_log(path: Path, text: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.05)
    raise TimeoutError(f"{text!r} not in {path}")


def test_cluster_stops_in_order_and_kills_stragglers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launcher, "STOP_GRACE_S", 2.0)
    children = [
        Child("broker", "broker", py(SLEEPER)),
        Child("worker-a", "worker", py(SLEEPER)),
        Child("worker-b", "worker", py(STUBBORN)),
        Child("gateway", "gateway", py(SLEEPER)),
    ]
    cluster = Cluster(children, tmp_path)
    cluster.start()
    try:
        for name in ("broker", "worker-a", "gateway"):
            wait_for_log(tmp_path / f"{name}.log", "started")
        started = time.monotonic()
        cluster.stop()
        assert time.monotonic() - started < 5
    finally:
        for proc in cluster.procs.values():
            if proc.poll() is None:
                proc.kill()
    assert all(p.poll() is not None for p in cluster.procs.values())
    assert cluster.procs["worker-b"].returncode == -signal.SIGKILL

    def stopped_at(name: str) -> float:
        return float((tmp_path / f"{name}.log").read_text().split()[-1])

    assert stopped_at("gateway") <= stopped_at("worker-a") <= stopped_at("broker")


def test_a_previous_log_is_kept_once(tmp_path: Path) -> None:
    (tmp_path / "broker.log").write_text("old run\n")
    cluster = Cluster([Child("broker", "broker", py("print('new run')"))], tmp_path)
    cluster.start()
    cluster.procs["broker"].wait(timeout=10)
    assert (tmp_path / "broker.log.1").read_text() == "old run\n"
    assert (tmp_path / "broker.log").read_text() == "new run\n"
    assert [c.name for c, code in cluster.newly_exited()] == ["broker"]
    assert cluster.newly_exited() == []  # each exit is told once


def test_logs_are_private_whatever_the_umask(tmp_path: Path) -> None:
    shared = tmp_path / "logs"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # a folder left world-readable (and writable) by an older run
    (shared / "broker.log").write_text("old run\n")
    (shared / "broker.log").chmod(0o644)
    old_umask = os.umask(0)
    try:
        fresh = tmp_path / "new" / "logs"
        for directory in (shared, fresh):
            cluster = Cluster([Child("broker", "broker", py("print('new run')"))], directory)
            cluster.start()
            cluster.procs["broker"].wait(timeout=10)
            assert stat.S_IMODE(directory.stat().st_mode) == 0o700
            assert stat.S_IMODE((directory / "broker.log").stat().st_mode) == 0o600
            assert (directory / "broker.log").read_text() == "new run\n"
        assert stat.S_IMODE((shared / "broker.log.1").stat().st_mode) == 0o600
    finally:
        os.umask(old_umask)


def test_a_shared_sticky_folder_is_left_as_it_is(tmp_path: Path) -> None:
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    private_log_dir(sticky)
    assert stat.S_IMODE(sticky.stat().st_mode) == 0o1777
    with open_private_log(sticky / "gateway.log") as out:
        out.write(b"x")
    assert stat.S_IMODE((sticky / "gateway.log").stat().st_mode) == 0o600


def stand_in_config(tmp_path: Path) -> tuple[Path, int]:
    port = free_port()
    path = write_config(
        tmp_path,
        f"""
        [model]
        path = "{tmp_path / "model"}"
        [broker]
        frontend = "tcp://127.0.0.1:{free_port()}"
        backend = "tcp://127.0.0.1:{free_port()}"
        [gateway]
        port = {port}
        [log]
        dir = "{tmp_path / "logs"}"
        [[stages]]
        layers = "1/1"
        """,
    )
    return path, port


def test_run_up_reports_ready_and_stops_on_sigint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path, port = stand_in_config(tmp_path)
    monkeypatch.setattr(launcher, "plan", lambda cfg, config_path: fake_cluster(port))

    def interrupt_when_ready() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1):
                    break
            except OSError:
                time.sleep(0.1)
        time.sleep(1.5)  # let the launcher see it too and print its lines
        # Only while run_up's handler is in place: a stray SIGINT would end pytest itself.
        if isinstance(signal.getsignal(signal.SIGINT), launcher._Signals):
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_when_ready, daemon=True).start()
    started = time.monotonic()
    assert launcher.run_up(ns(config=str(path))) == 0
    assert time.monotonic() - started < 30
    out, err = capsys.readouterr()
    assert "zmqllm is up: broker tcp://127.0.0.1:" in out
    assert f'curl -N -d "Why is the sky blue?" http://127.0.0.1:{port}/chat' in out
    assert f"logs: {tmp_path / 'logs'}" in out
    assert "Traceback" not in err
    logs = tmp_path / "logs"
    assert "gateway stopped" in (logs / "gateway.log").read_text()
    assert "stopped by SIGINT" in (logs / "broker.log").read_text()
    # The handlers of the process that called run_up are back.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_run_up_stops_everything_when_a_child_dies_early(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path, port = stand_in_config(tmp_path)
    # The crash comes a moment after start, so the other stand-ins are up (a SIGINT during
    # interpreter start-up kills before any handler exists, and their logs stay empty).
    crash = py(
        "import sys, time; time.sleep(1.5); print('loading weights'); "
        "print('boom: no such file'); sys.exit(3)"
    )
    gateway_never_ready = py(SLEEPER)
    children = [
        *fake_cluster(port, worker=crash)[:2],
        Child("gateway", "gateway", gateway_never_ready),
    ]
    monkeypatch.setattr(launcher, "plan", lambda cfg, config_path: children)
    assert launcher.run_up(ns(config=str(path))) == 1
    err = capsys.readouterr().err
    assert "worker-1of1-0 exited with code 3" in err
    assert "boom: no such file" in err  # the tail of its log
    logs = tmp_path / "logs"
    assert "stopped by SIGINT" in (logs / "gateway.log").read_text()
    assert "stopped by SIGINT" in (logs / "broker.log").read_text()
