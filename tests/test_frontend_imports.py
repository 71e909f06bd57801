"""The front end (protocol, config, logs, tokenizer, sampling) never needs torch."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

FRONT_END_MODULES = [
    "zmqllm.bus.protocol",
    "zmqllm.bus.messages",
    "zmqllm.bus.wire_types",
    "zmqllm.bus.sampling_params",
    "zmqllm.bus.sockets",
    "testbed.fuzz",
    "testbed.fuzz_messages",
    "testbed.fuzz_peers",
    "zmqllm.broker.registry",
    "zmqllm.broker.session_table",
    "zmqllm.config.settings",
    "zmqllm.config.paths",
    "zmqllm.config.loading",
    "zmqllm.config.layers",
    "zmqllm.log",
    "zmqllm.models.tokenizer",
    "zmqllm.models.model_args",
    "zmqllm.cli",
    "zmqllm.broker",
    "zmqllm.broker.main",
    "zmqllm.bus.auth",
    "zmqllm.client",
    "zmqllm.client.status",
    "zmqllm.launch.launcher",
    "zmqllm.launch.plan",
    "zmqllm.launch.child_process",
    "zmqllm.launch.supervision",
    "zmqllm.gateway.app",
    "zmqllm.gateway.main",
    "zmqllm.remote.sse",
    "zmqllm.remote.upstream",
    "zmqllm.bus.ask_body",
    "zmqllm.remote.main",
    "zmqllm.remote.worker",
    "zmqllm.broker.route_search",
    "zmqllm.broker.session_records",
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
