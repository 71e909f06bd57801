"""The front end (protocol, config, logs, tokenizer, sampling) never needs torch."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

FRONT_END_MODULES = [
    "zmqllm.protocol",
    "zmqllm.config",
    "zmqllm.log",
    "zmqllm.tokenizer",
    "zmqllm.model_args",
    "zmqllm.engine.sampling",
    "zmqllm.cli",
    "zmqllm.broker",
    "zmqllm.client",
    "zmqllm.status",
    "zmqllm.launcher",
    "zmqllm.gateway.app",
    "zmqllm.gateway.server",
]


@pytest.mark.skipif(
    not os.environ.get("ZMQLLM_EXPECT_NO_TORCH"), reason="only in the front-end tox envs"
)
def test_torch_is_not_installed_here() -> None:
    assert importlib.util.find_spec("torch") is None


def test_front_end_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in FRONT_END_MODULES)
        + "bad = sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules)\n"
        + "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "", f"front-end imports pulled in: {out}"


def test_cli_help_runs_without_the_ml_stack() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "zmqllm.cli", "--help"], capture_output=True, text=True
    )
    assert res.returncode == 0
    assert "generate" in res.stdout and "prepare-model" in res.stdout
