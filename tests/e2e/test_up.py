"""`zmqllm up` for real: the tiny model on free ports, a /chat answer, then Ctrl-C stops all."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

pytestmark = pytest.mark.e2e


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def children_of(pid: int) -> list[int]:
    """Direct children from /proc: the launcher's children are in sessions of their own, so
    its process group does not find them."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:  # gone meanwhile
            continue
        if f"\nPPid:\t{pid}\n" in status:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
@pytest.mark.skipif(
    importlib.util.find_spec("zmqllm.gateway.server") is None,
    reason="zmqllm gateway is not there yet (zmqllm.gateway.server missing)",
)
def test_up_serves_chat_and_stops_on_ctrl_c(tmp_path: Path, e2e_model: Path, reference) -> None:
    model = e2e_model
    home = tmp_path / "home"  # a fresh $ZMQLLM_HOME: no keys yet
    env = dict(os.environ, PYTHONUNBUFFERED="1", ZMQLLM_HOME=str(home))
    frontend = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    config = tmp_path / "up.toml"
    config.write_text(
        f'[model]\npath = "{model}"\n'
        f'[broker]\nfrontend = "{frontend}"\nbackend = "tcp://127.0.0.1:{free_port()}"\n'
        f"heartbeat_interval = 0.5\n"
        f"[gateway]\nport = {port}\n"
        f'[log]\ndir = "{tmp_path / "logs"}"\n'
        '[[stages]]\nlayers = "1/2"\n[[stages]]\nlayers = "2/2"\n'
    )
    out, err = tmp_path / "up.out", tmp_path / "up.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        up = subprocess.Popen(
            [sys.executable, "-m", "zmqllm.cli", "up", "--config", str(config)],
            stdout=stdout,
            stderr=stderr,
            env=env,
            start_new_session=True,
        )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while "zmqllm is up" not in out.read_text():
            assert up.poll() is None, f"zmqllm up exited {up.returncode}:\n{err.read_text()}"
            assert time.monotonic() < deadline, f"not up in 120 s:\n{err.read_text()}"
            time.sleep(0.2)
        text = out.read_text()
        assert f'curl -N -d "Why is the sky blue?" http://127.0.0.1:{port}/chat' in text
        assert "2 workers (layers 0:2, 2:4)" in text

        assert f"CURVE keys made in {home / 'keys'}" in err.read_text() + text
        assert (home / "keys" / "broker.key_secret").is_file()

        pids = children_of(up.pid)
        assert len(pids) == 4  # broker, 2 workers, gateway
        # No key flags: status finds the keys `up` made in $ZMQLLM_HOME/keys.
        status = subprocess.run(
            [sys.executable, "-m", "zmqllm.cli", "status", "--broker", frontend, "--json"],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        st = json.loads(status.stdout)
        assert st["curve"] is True
        assert {w["info"]["pid"] for w in st["workers"]} <= set(pids)

        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/chat?max_tokens=8", data=b"Hello", method="POST"
        )
        with urllib.request.urlopen(request, timeout=60) as resp:
            assert resp.status == 200
            assert resp.read().decode() == reference("Hello", 8)

        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=20) == 0
        assert "Traceback" not in err.read_text()
        assert [pid for pid in pids if alive(pid)] == []
        names = sorted(p.name for p in (tmp_path / "logs").iterdir())
        assert names == ["broker.log", "gateway.log", "worker-1of2-0.log", "worker-2of2-0.log"]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
