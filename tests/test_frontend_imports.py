"""The front end (protocol, config, logs, tokenizer, sampling) never needs torch."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

FRONT_END_MODULES = [
    "zmqllm.protocol",
    "zmqllm.messages",
    "zmqllm.wire_types",
    "zmqllm.sampling_params",
    "zmqllm.bus",
    "zmqllm.fuzz",
    "zmqllm.fuzz_messages",
    "zmqllm.fuzz_peers",
    "zmqllm.registry",
    "zmqllm.broker_state",
    "zmqllm.config",
    "zmqllm.config_load",
    "zmqllm.layers",
    "zmqllm.log",
    "zmqllm.tokenizer",
    "zmqllm.model_args",
    "zmqllm.cli",
    "zmqllm.broker",
    "zmqllm.broker_main",
    "zmqllm.auth",
    "zmqllm.client",
    "zmqllm.status",
    "zmqllm.launcher",
    "zmqllm.launch_plan",
    "zmqllm.child_process",
    "zmqllm.supervision",
    "zmqllm.gateway.app",
    "zmqllm.gateway.server",
    "zmqllm.upstream",
    "zmqllm.ask_body",
    "zmqllm.remote_worker",
    "zmqllm.route_search",
    "zmqllm.session_records",
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


# Only the worker's modules and the CLI may import the engine (and with it torch);
# everything else, the whole front end included, reads what it needs from torch-free
# modules.
ENGINE_USERS = ("zmqllm/worker", "zmqllm/cpu_turns.py", "zmqllm/shard_loader.py", "zmqllm/cli.py")


def test_only_the_worker_and_the_cli_import_the_engine() -> None:
    root = Path(__file__).resolve().parents[1]
    offenders = []
    for path in sorted((root / "zmqllm").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("zmqllm/engine/", *ENGINE_USERS)):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [f"{rel}: {n}" for n in names if n.startswith("zmqllm.engine")]
    assert offenders == []
