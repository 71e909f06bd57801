"""The checkout's bin/ entries, run as a user runs them from a fresh clone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bin_zmqllm_is_the_zmqllm_command() -> None:
    # Without .venv/bin/zmqllm it runs the sources with the python3 on PATH: this one.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if (ROOT / ".venv" / "bin" / "zmqllm").exists():
        env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [str(ROOT / "bin" / "zmqllm"), "--help"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    for command in ("status", "generate", "prepare-model", "keys", "up", "worker"):
        assert command in done.stdout


def test_bin_up_names_this_checkouts_entry_for_the_banner() -> None:
    script = (ROOT / "bin" / "up").read_text()
    assert 'ZMQLLM_CLI="${ZMQLLM_CLI:-$ROOT/bin/zmqllm}"' in script
    assert os.access(ROOT / "bin" / "zmqllm", os.X_OK)
