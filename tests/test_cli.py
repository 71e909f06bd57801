"""The `zmqllm` command line: prepare-model and generate, as a user runs them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.torch


def zmqllm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zmqllm.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_prepare_tiny_prints_its_directory_last(tmp_path: Path) -> None:
    target = tmp_path / "tiny"
    first = zmqllm("prepare-model", "--tiny", str(target))
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip().splitlines()[-1] == str(target)
    again = zmqllm("prepare-model", "--tiny", str(target))  # idempotent
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == str(target)
    assert "already prepared" in again.stderr


def test_generate_streams_hf_greedy_text_and_nothing_else(tiny_model_dir: Path) -> None:
    from zmqllm.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    prompt = "Tell me about the sea"
    out = zmqllm(
        "generate", "--model", str(tiny_model_dir), "--max-tokens", "24", "--stages", "2", prompt
    )
    assert out.returncode == 0, out.stderr
    ids = tok.encode_chat([{"role": "user", "content": prompt}])
    model = transformers.MistralForCausalLM.from_pretrained(tiny_model_dir).eval()
    x = torch.tensor([ids])
    gen = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=24,
        do_sample=False,
        eos_token_id=sorted(tok.eos_token_ids),
        pad_token_id=0,
    )
    assert out.stdout == tok.decode(gen[0, len(ids) :].tolist()) + "\n"


def test_generate_stats_go_to_stderr(tiny_model_dir: Path) -> None:
    args = ("generate", "--model", str(tiny_model_dir), "--max-tokens", "8", "--raw", "hi")
    plain, timed = zmqllm(*args), zmqllm(*args, "--stats")
    assert plain.returncode == 0 and timed.returncode == 0, timed.stderr
    assert timed.stdout == plain.stdout  # the text alone on stdout
    assert re.search(r"prefill [\d.]+ ms; \d+ tokens, decode [\d.]+ ms/token", timed.stderr)


def test_generate_raw_sampling_is_seeded(tiny_model_dir: Path) -> None:
    args = [
        "generate",
        "--model",
        str(tiny_model_dir),
        "--raw",
        "--max-tokens",
        "16",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--top-k",
        "40",
        "--seed",
        "7",
        "Once",
    ]
    a, b = zmqllm(*args), zmqllm(*args)
    assert a.returncode == 0 and a.stdout == b.stdout


def test_generate_rejects_bad_input(tiny_model_dir: Path) -> None:
    empty = zmqllm("generate", "--model", str(tiny_model_dir), "   ")
    assert empty.returncode == 2 and "empty" in empty.stderr
    bad = zmqllm("generate", "--model", str(tiny_model_dir), "--top-p", "0", "hi")
    assert bad.returncode == 2 and "top_p" in bad.stderr


def test_a_worker_refuses_a_kv_dtype_it_cannot_keep_before_loading(tiny_model_dir: Path) -> None:
    """bfloat16 caches under a float16 model: exit 2 naming kv_dtype, no broker needed
    (nothing was loaded or connected)."""
    done = zmqllm(
        "worker", "--model", str(tiny_model_dir), "--dtype", "float16", "--kv-dtype", "bfloat16",
        "--broker", "tcp://127.0.0.1:9",
    )  # fmt: skip
    assert done.returncode == 2 and "kv_dtype" in done.stderr, done.stderr
