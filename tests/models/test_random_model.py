"""``zmqllm prepare-model --random``: the command as a user runs it, its memory bound
(peak RSS of the process at most 2 GB whatever the model's size: tensors stream), its
files, and its errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")

from zmqllm.models.checkpoint import read_header

pytestmark = [pytest.mark.torch, pytest.mark.slow]

PEAK_RSS_LIMIT = 2 << 30


def _prepare(*args: str) -> tuple[int, str, str]:
    """Run the command: (exit status, stdout, stderr)."""
    cmd = [sys.executable, "-m", "zmqllm.cli", "prepare-model", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    return done.returncode, done.stdout, done.stderr


# Runs the command in this interpreter and says its own peak RSS (VmHWM, of the process
# after exec) on the last line of stderr. wait4's ru_maxrss would not do: exec records the
# forked copy of the caller's memory as the child's peak, and pytest may hold gigabytes.
MEASURED = """
import sys
from zmqllm.cli import main
try:
    code = main(sys.argv[1:])
finally:
    hwm = [ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:")][0]
    print("peak-rss-kb", hwm.split()[1], file=sys.stderr)
sys.exit(code)
"""


def _prepare_measured(*args: str) -> tuple[int, str, str, int]:
    """As _prepare, and the peak RSS of that process alone."""
    cmd = [sys.executable, "-c", MEASURED, "prepare-model", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    *rest, last = done.stderr.rstrip("\n").split("\n")
    assert last.startswith("peak-rss-kb "), done.stderr[-3000:]
    return done.returncode, done.stdout, "\n".join(rest), int(last.split()[1]) * 1024


def test_one_layer_streams_within_2_gb_and_is_complete(tmp_path: Path) -> None:
    target = tmp_path / "m"
    rc, out, err, peak = _prepare_measured(
        "--random", "mistral-7b", "--layers", "1", "--seed", "3", "--output", str(target)
    )  # fmt: skip
    assert rc == 0, err[-3000:]
    assert out.strip().splitlines()[-1] == str(target)
    assert "safetensors:" in err and "gguf:" in err  # progress as it goes
    # The embedding and the head are 49152 x 4096 (400 MB each in bf16) and one layer's
    # FFN 14336 x 4096: the process never holds more than a tensor and its copies.
    assert peak <= PEAK_RSS_LIMIT, f"peak RSS {peak >> 20} MiB"
    config = json.loads((target / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["torch_dtype"] == "bfloat16"
    header = read_header(target / "model.safetensors")
    assert header["lm_head.weight"]["shape"] == [config["vocab_size"], 4096]
    assert header["model.layers.0.mlp.down_proj.weight"]["shape"] == [4096, 14336]
    source = json.loads((target / "zmqllm-source.json").read_text())
    assert source["gguf"] == {"int4": "model-Q4_1.gguf"} and source["seed"] == 3
    for name in ("model-Q4_1.gguf", "model-BF16.gguf", "tokenizer.json"):
        assert (target / name).stat().st_size > 0
    # Made once: asked again with the same settings, it is there at once.
    rc, out, err = _prepare("--random", "mistral-7b", "--layers", "1", "--seed", "3",
                               "--output", str(target))  # fmt: skip
    assert rc == 0 and "already prepared" in err
    # Other settings over it: refused, nothing overwritten.
    rc, out, err = _prepare("--random", "mistral-7b", "--layers", "2", "--output", str(target))
    assert rc == 2 and "holds another model" in err
    assert json.loads((target / "config.json").read_text())["num_hidden_layers"] == 1


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--random", "mistral-7b", "--layers", "0"], "--layers must be 1..32"),
        (["--random", "mistral-7b", "--layers", "33"], "--layers must be 1..32"),
        (["--random", "mistral-7b"], "--random needs --output DIR"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(
    tmp_path: Path, args: list[str], said: str
) -> None:
    extra = ["--output", str(tmp_path / "m")] if "--layers" in args else []
    rc, _, err = _prepare(*args, *extra)
    assert rc == 2 and said in err
    assert not (tmp_path / "m").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".prepare-")]
