"""`zmqllm up` without the ML stack: keys by default, the refusal of a busy port, and the
supervision loop run against stand-in children (tiny Python processes), so nothing here
needs torch. What it plans (command lines, ports, log names): test_plan.py; when
it restarts a child: test_supervision.py."""

from __future__ import annotations

import functools
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from testbed.cluster import free_port
from tests.launch.test_plan import CONFIGS, ns, write_config
from zmqllm.config.settings import Config
from zmqllm.config.up_state import read_state
from zmqllm.launch import launcher
from zmqllm.launch.launcher import Cluster
from zmqllm.launch.plan import Child
from zmqllm.launch.supervision import GiveUp, Restart, RestartPolicy


def cfg_with(cfg: Config, section: str, **values: object) -> Config:
    from zmqllm.config.loading import with_overrides

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
    code = "import sys, zmqllm.launch.launcher; print('torch' in sys.modules)"
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
# Runs until SIGINT, then says so: the log shows the stop was clean and in order. Like
# FAKE_GATEWAY it installs no SIGINT handler of its own (as a role still importing): spawn
# starts every child with SIGINT at its default, even where the test runner was started
# with it ignored (a background job of a script), so Python's KeyboardInterrupt is there.
SLEEPER = """
import os, time
print("started", os.getpid(), flush=True)
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
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
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
        # The grace is 2 s in all; 60 s only guards a stop that waits for ever.
        stopping = threading.Thread(target=cluster.stop, daemon=True)
        stopping.start()
        stopping.join(timeout=60)
        assert not stopping.is_alive(), "stop() still waits for a child that ignores SIGINT"
    finally:
        for proc in cluster.procs.values():
            if proc.poll() is None:
                proc.kill()
    assert all(p.poll() is not None for p in cluster.procs.values())
    assert cluster.procs["worker-b"].returncode == -signal.SIGKILL
    # Killed once the grace was over, the only one that needed it.
    killed = [line for line in capsys.readouterr().err.splitlines() if "killing it" in line]
    assert killed == ["[zmqllm] worker-b did not stop in time; killing it"]

    def stopped_at(name: str) -> float:
        return float((tmp_path / f"{name}.log").read_text().split()[-1])

    assert stopped_at("gateway") <= stopped_at("worker-a") <= stopped_at("broker")


# Run by a process started with SIGINT ignored, as a script's `bin/up &`, nohup and some
# supervisors start one: a Cluster of SLEEPERs, stopped once all are up; prints how long
# the stop took and how each child ended.
IN_THE_BACKGROUND = """
import signal, sys, time
from pathlib import Path
from zmqllm.launch import launcher
from zmqllm.launch.plan import Child
print("SIGINT ignored:", signal.getsignal(signal.SIGINT) == signal.SIG_IGN, flush=True)
launcher.STOP_GRACE_S = 30.0  # a child that misses its SIGINT shows as a slow stop
directory, code = Path(sys.argv[1]), sys.argv[2]
roles = {"broker": "broker", "worker-a": "worker", "gateway": "gateway"}
children = [Child(name, role, (sys.executable, "-c", code)) for name, role in roles.items()]
cluster = launcher.Cluster(children, directory)
cluster.start()
for name in roles:
    log = directory / f"{name}.log"
    while not (log.exists() and "started" in log.read_text()):
        time.sleep(0.05)
begun = time.monotonic()
cluster.stop()
print(f"stopped in {time.monotonic() - begun:.3f}", flush=True)
for name, proc in cluster.procs.items():
    print(name, proc.returncode, flush=True)
"""


def test_children_stop_on_sigint_though_the_launcher_started_with_it_ignored(
    tmp_path: Path,
) -> None:
    """An ignored SIGINT is inherited across exec: without spawn setting it back to its
    default, every child would wait out the grace and be killed."""
    run = subprocess.run(
        py(IN_THE_BACKGROUND, str(tmp_path), SLEEPER),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "SIGINT ignored: True"  # the launcher really started that way
    assert "did not stop in time" not in run.stderr and "killing it" not in run.stderr
    assert sorted(lines[2:]) == ["broker 0", "gateway 0", "worker-a 0"]
    for name in ("broker", "worker-a", "gateway"):
        assert "stopped by SIGINT" in (tmp_path / f"{name}.log").read_text()
    # A child that missed its SIGINT would take a third of the 30 s grace or more.
    assert float(lines[1].split()[-1]) < 5.0


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
    handler_before = signal.getsignal(signal.SIGINT)
    said_up = threading.Event()
    say_up = launcher._say_up

    def saying_up(*args: Any) -> None:
        say_up(*args)
        said_up.set()

    monkeypatch.setattr(launcher, "_say_up", saying_up)

    def interrupt_when_up() -> None:
        # Once the launcher has printed its lines; 60 s only guards a launcher that never
        # sees the stand-ins ready (then the SIGINT ends it anyway, and the test fails).
        said_up.wait(timeout=60)
        # Only while run_up's handler is in place: a stray SIGINT would end pytest itself.
        if isinstance(signal.getsignal(signal.SIGINT), launcher._Signals):
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_when_up, daemon=True).start()
    assert launcher.run_up(ns(config=str(path))) == 0
    assert said_up.is_set()
    out, err = capsys.readouterr()
    assert "zmqllm is up: broker tcp://127.0.0.1:" in out
    assert f'curl -N -d "Why is the sky blue?" http://127.0.0.1:{port}/chat' in out
    assert f"logs: {tmp_path / 'logs'}" in out
    assert "status: zmqllm status --broker tcp://127.0.0.1:" in out
    assert "Traceback" not in err
    logs = tmp_path / "logs"
    assert "gateway stopped" in (logs / "gateway.log").read_text()
    assert "stopped by SIGINT" in (logs / "broker.log").read_text()
    # The handlers of the process that called run_up are back.
    assert signal.getsignal(signal.SIGINT) is handler_before


def pids_started(log: Path) -> list[int]:
    """The pid of each run a stand-in's log shows (SLEEPER prints one as it starts)."""
    text = log.read_text() if log.exists() else ""
    return [int(line.split()[1]) for line in text.splitlines() if line.startswith("started ")]


def wait_until(predicate: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1):
            return True
    except OSError:
        return False


def then_ctrl_c(action: Callable[[], None]) -> list[BaseException]:
    """Run ``action`` in a thread while run_up runs, then SIGINT this process as a Ctrl-C
    would; what the action raised lands in the list returned."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            action()
        except BaseException as err:
            errors.append(err)
        # Only while run_up's handler is in place: a stray SIGINT would end pytest itself.
        if isinstance(signal.getsignal(signal.SIGINT), launcher._Signals):
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=run, daemon=True).start()
    return errors


def test_run_up_restarts_a_child_that_dies_and_its_log_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path, port = stand_in_config(tmp_path)
    monkeypatch.setattr(launcher, "plan", lambda cfg, config_path: fake_cluster(port))
    log = tmp_path / "logs" / "broker.log"

    def kill_the_broker() -> None:
        wait_until(lambda: ready(port) and pids_started(log), "the stand-ins to be up")
        os.kill(pids_started(log)[0], signal.SIGKILL)
        wait_until(lambda: len(pids_started(log)) == 2, "the broker to start again")

    errors = then_ctrl_c(kill_the_broker)
    assert launcher.run_up(ns(config=str(path))) == 0
    assert errors == []
    out, err = capsys.readouterr()
    assert out.count("zmqllm is up") == 1
    first, second = pids_started(log)
    assert first != second
    assert (
        "[zmqllm] broker killed by SIGKILL; restarting it in 0.5 s "
        "(1st exit within 60 s; the 5th stops everything)"
    ) in err
    assert f"broker started again (pid {second})" in err
    assert "Traceback" not in err
    # One log across the restart; the second run was stopped cleanly by the Ctrl-C.
    assert log.read_text().count("stopped by SIGINT") == 1
    assert not log.with_name("broker.log.1").exists()


def test_run_up_stops_everything_when_the_gateway_keeps_exiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path, port = stand_in_config(tmp_path)
    # Shorter backoffs than 0.5 s doubling, so the test takes seconds; still long enough
    # that the other stand-ins are up (a SIGINT during interpreter start-up kills before
    # any handler exists, and their logs would not say they stopped cleanly).
    monkeypatch.setattr(launcher, "RestartPolicy", functools.partial(RestartPolicy, first=0.2))
    crash = py("import sys; print('loading weights'); print('boom: no such file'); sys.exit(3)")
    children = [*fake_cluster(port)[:2], Child("gateway", "gateway", crash)]
    monkeypatch.setattr(launcher, "plan", lambda cfg, config_path: children)
    assert launcher.run_up(ns(config=str(path))) == 1
    out, err = capsys.readouterr()
    assert "zmqllm is up" not in out
    logs = tmp_path / "logs"
    for n, delay in enumerate(["0.2", "0.4", "0.8", "1.6"], start=1):
        assert f"gateway exited with code 3; restarting it in {delay} s ({n}" in err
    assert "(1st exit within 60 s; the 5th stops everything)" in err
    assert err.count("gateway started again") == 4
    assert (
        "gateway exited with code 3, its 5th exit within 60 s: it does not stay up, "
        f"so `zmqllm up` stops everything\nlast lines of {logs / 'gateway.log'}:\n"
    ) in err
    assert err.rstrip().endswith("[zmqllm] stopped")
    assert "boom: no such file" in err  # the tail of its log
    assert (logs / "gateway.log").read_text().count("loading weights") == 5
    assert "stopped by SIGINT" in (logs / "worker-1of1-0.log").read_text()
    assert "stopped by SIGINT" in (logs / "broker.log").read_text()
    assert not (logs / "up-state.json").exists()  # removed at the stop


def test_a_worker_in_a_crash_loop_is_marked_failing_and_the_rest_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path, port = stand_in_config(tmp_path)
    monkeypatch.setattr(launcher, "RestartPolicy", functools.partial(RestartPolicy, first=0.1))
    crash = py("import sys; print('upstream down'); sys.exit(1)")
    monkeypatch.setattr(launcher, "plan", lambda cfg, config_path: fake_cluster(port, crash))
    state_path = tmp_path / "logs" / "up-state.json"
    seen: dict[str, Any] = {}

    def failing_then_stop() -> None:
        def failing() -> bool:
            state = read_state(state_path)
            if state is None:
                return False
            seen["state"] = state
            return any(c["state"] == "failing" for c in state["children"])

        wait_until(failing, "the worker to be marked failing")
        seen["ready"] = ready(port)  # the gateway still answers

    errors = then_ctrl_c(failing_then_stop)
    assert launcher.run_up(ns(config=str(path))) == 0
    assert errors == [] and seen["ready"]
    out, err = capsys.readouterr()
    assert out.count("zmqllm is up") == 1
    assert (
        "worker-1of1-0 exited with code 1, its 5th exit within 60 s: it is failing; "
        "restarting it in 1.6 s (backing off up to 60 s), everything else keeps serving"
    ) in err
    children = {c["name"]: c for c in seen["state"]["children"]}
    worker = children["worker-1of1-0"]
    assert worker["state"] == "failing" and worker["exits"] >= 5
    assert worker["last_exit"] == "exited with code 1"
    assert worker["log"] == str(tmp_path / "logs" / "worker-1of1-0.log")
    assert children["broker"]["state"] == children["gateway"]["state"] == "running"
    assert children["broker"]["pid"] and children["gateway"]["pid"]
    assert "stopped by SIGINT" in (tmp_path / "logs" / "broker.log").read_text()
    assert not state_path.exists()


def test_a_stop_during_a_backoff_starts_nothing_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path, port = stand_in_config(tmp_path)
    told = threading.Event()

    class Watched(RestartPolicy):
        def exited(self, name: str, code: int, now: float) -> Restart | GiveUp:
            decision = super().exited(name, code, now)
            told.set()
            return decision

    # A backoff far longer than the test: the restart is still pending at the Ctrl-C.
    monkeypatch.setattr(
        launcher,
        "RestartPolicy",
        lambda **kw: Watched(first=3600, most=3600, failing_most=3600, **kw),
    )
    quits = py("import os; print('started', os.getpid()); raise SystemExit(1)")
    monkeypatch.setattr(launcher, "plan", lambda cfg, config_path: fake_cluster(port, quits))
    broker = tmp_path / "logs" / "broker.log"
    errors = then_ctrl_c(
        lambda: wait_until(lambda: told.is_set() and pids_started(broker), "the worker's exit")
    )
    assert launcher.run_up(ns(config=str(path))) == 0
    assert errors == []
    err = capsys.readouterr().err
    assert "worker-1of1-0 exited with code 1; restarting it in 3600 s" in err
    assert "started again" not in err
    assert len(pids_started(tmp_path / "logs" / "worker-1of1-0.log")) == 1
    assert "stopped by SIGINT" in broker.read_text()


@pytest.mark.parametrize("code", [0, 1])
def test_preparing_the_model_keeps_its_output_in_a_log(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    code: int,
) -> None:
    """Progress bars and the directory prepare-model prints for scripts go to a log; the
    terminal gets one line before and one after (or the log's last lines on failure)."""
    monkeypatch.setenv("ZMQLLM_HOME", str(tmp_path / "home"))
    stand_in = tmp_path / "python"  # stands in for sys.executable -m zmqllm.cli prepare-model
    stand_in.write_text(
        "#!/bin/sh\nprintf 'converting  10%%\\rconverting 100%%\\n' >&2\n"
        f"echo /some/model/dir\nexit {code}\n"
    )
    stand_in.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(stand_in))
    cfg = cfg_with(Config(), "model", path="tiny")
    if code:
        with pytest.raises(launcher.UpError, match="could not prepare the tiny model") as err:
            launcher.prepare_model(cfg)
        assert "/some/model/dir" in str(err.value)  # the log's last lines
    else:
        launcher.prepare_model(cfg)
    out, errs = capfd.readouterr()
    log = tmp_path / "home" / "prepare-model.log"
    assert "/some/model/dir" in log.read_text() and "converting 100%" in log.read_text()
    assert "/some/model/dir" not in out + errs and "\r" not in out + errs
    assert f"its log: {log}" in errs
    assert ("model ready" in errs) == (code == 0)
