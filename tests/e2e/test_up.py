"""`zmqllm up` for real: the tiny model on free ports, a /chat answer, then Ctrl-C stops all."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from tests.e2e.up_runner import UpRun, alive, children_of

pytestmark = [pytest.mark.torch, pytest.mark.e2e]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
@pytest.mark.skipif(
    importlib.util.find_spec("zmqllm.gateway.main") is None,
    reason="zmqllm gateway is not there yet (zmqllm.gateway.main missing)",
)
def test_up_serves_chat_and_stops_on_ctrl_c(tmp_path: Path, e2e_model: Path, reference) -> None:
    up = UpRun(tmp_path, e2e_model).start()  # a fresh $ZMQLLM_HOME: no keys yet
    home, port = up.home, up.port
    try:
        up.wait_up(timeout=120)
        text = up.stdout()
        assert f'curl -N -d "Why is the sky blue?" http://127.0.0.1:{port}/chat' in text
        assert "2 workers (layers 0:2, 2:4)" in text

        assert f"CURVE keys made in {home / 'keys'}" in up.stderr() + text
        assert (home / "keys" / "broker.key_secret").is_file()

        pids = children_of(up.running().pid)
        assert len(pids) == 4  # broker, 2 workers, gateway
        # No key flags: status finds the keys `up` made in $ZMQLLM_HOME/keys.
        status = subprocess.run(
            [sys.executable, "-m", "zmqllm.cli", "status", "--broker", up.frontend, "--json"],
            capture_output=True,
            text=True,
            check=True,
            env=up.env,
        )
        st = json.loads(status.stdout)
        assert st["curve"] is True
        assert {w["info"]["pid"] for w in st["workers"]} <= set(pids)

        assert up.chat("Hello", 8) == (200, reference.body("Hello", 8))

        up.running().send_signal(signal.SIGINT)
        assert up.running().wait(timeout=20) == 0
        assert "Traceback" not in up.stderr()
        assert [pid for pid in pids if alive(pid)] == []
        names = sorted(p.name for p in up.logs.iterdir())
        assert names == ["broker.log", "gateway.log", "worker-1of2-0.log", "worker-2of2-0.log"]
    finally:
        up.stop()


def test_up_serves_a_remote_model_beside_its_own(
    tmp_path: Path, e2e_model: Path, reference
) -> None:
    """A [[remotes]] table: `up` starts a remote worker for it, and the one gateway answers
    for both models."""
    from testbed.fake_upstream import FakeUpstream

    with FakeUpstream() as fake:
        remotes = f'[[remotes]]\nurl = "{fake.url}"\nserved_name = "echo"\n'
        up = UpRun(tmp_path, e2e_model, extra=remotes).start()
        try:
            up.wait_up(timeout=120)
            assert "2 workers (layers 0:2, 2:4), remote models echo, gateway" in up.stdout()
            up.wait_for(lambda: "remote-0-0" in up.pids(), "the remote worker")
            # The upstream's URL reaches the remote worker by a private file: no command
            # line (anyone's to read in `ps`) shows it.
            for pid in up.pids().values():
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                assert fake.url not in cmdline.replace("\0", " ")
            url_file = up.logs / "remote-0-0.url"
            assert url_file.read_text().strip() == fake.url
            assert url_file.stat().st_mode & 0o777 == 0o600
            assert up.chat("Hello", 8) == (200, reference.body("Hello", 8))
            request = urllib.request.Request(
                f"{up.url}/chat?model=echo", data=b"hi there", method="POST"
            )
            with urllib.request.urlopen(request, timeout=60) as resp:
                assert resp.read().decode() == "echo: hi there\n"
            up.running().send_signal(signal.SIGINT)
            assert up.running().wait(timeout=20) == 0
            assert "remote-0-0.log" in {p.name for p in up.logs.iterdir()}
        finally:
            up.stop()
