"""`zmqllm up` without the ML stack: keys by default, the refusal of a busy port, and the
supervision loop run against stand-in children (tiny Python processes), so nothing here
needs torch. What it plans (command lines, ports, log names): test_launch_plan.py."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.test_launch_plan import CONFIGS, free_port, ns, write_config
from zmqllm import launcher
from zmqllm.config import Config
from zmqllm.launch_plan import Child
from zmqllm.launcher import Cluster, open_private_log, private_log_dir


def cfg_with(cfg: Config, section: str, **values: object) -> Config:
    from zmqllm.config_load import with_overrides

    return with_overrides(cfg, section, values)


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
