"""Random checkpoints with a real model's geometry, for measuring at scale.

``zmqllm prepare-model --random mistral-7b [--layers N] [--seed S] --output DIR``
writes a Mistral-format directory: config.json with Mistral-7B-v0.3's geometry (or N
layers of it), bf16 safetensors streamed tensor by tensor, the default model's
tokenizer (so zmqllm and llama.cpp tokenize alike), and the same weights as GGUF
files (``model-Q4_1.gguf``, ``model-BF16.gguf``) that llama.cpp loads and that
``--quant int4`` reads as they are (models/gguf_export.py).

Weights are N(0, 0.02), norms 1: every layer's output stays finite. Each tensor comes
from a generator seeded by (seed, tensor name), so any one tensor of a checkpoint can
be made again without the others.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from zmqllm.models.checkpoint import CheckpointWriter, TensorSpec
from zmqllm.models.model_args import ModelArgs
from zmqllm.models.prepare import (
    SOURCE_FILE,
    Progress,
    ProgressMeter,
    _stderr,
    building,
    is_prepared,
)

# The geometry of each model --random can make (Hugging Face config keys).
GEOMETRIES: dict[str, dict[str, Any]] = {
    # mistralai/Mistral-7B-v0.3 (and its Instruct): untied head, no sliding window.
    "mistral-7b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "max_position_embeddings": 32768,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
}
STD = 0.02
# The GGUF files written beside the safetensors, and the --quant each one serves.
GGUF_FILES = {"Q4_1": "model-Q4_1.gguf", "BF16": "model-BF16.gguf"}
GGUF_FOR_QUANT = {"int4": GGUF_FILES["Q4_1"]}
# Rows generated at a time: a large tensor's float32 copy never exists whole.
CHUNK_ELEMENTS = 1 << 24
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def random_config(kind: str, layers: int | None, vocab_size: int, special: dict[str, Any]) -> dict:
    if kind not in GEOMETRIES:
        raise ValueError(f"--random {kind!r} is not one of {', '.join(GEOMETRIES)}")
    geometry = dict(GEOMETRIES[kind])
    full = geometry["num_hidden_layers"]
    if layers is not None:
        if not 1 <= layers <= full:
            raise ValueError(f"--layers must be 1..{full} for {kind}, not {layers}")
        geometry["num_hidden_layers"] = layers
    return {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": STD,
        "torch_dtype": "bfloat16",
        "vocab_size": vocab_size,
        **geometry,
        **special,
    }


def tensor_specs(args: ModelArgs) -> list[TensorSpec]:
    """Every tensor of the checkpoint in the order a pipeline reads them."""
    h, f = args.hidden_size, args.intermediate_size
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    specs = [TensorSpec("model.embed_tokens.weight", "BF16", (args.vocab_size, h))]
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        specs += [
            TensorSpec(p + "input_layernorm.weight", "BF16", (h,)),
            TensorSpec(p + "self_attn.q_proj.weight", "BF16", (q, h)),
            TensorSpec(p + "self_attn.k_proj.weight", "BF16", (kv, h)),
            TensorSpec(p + "self_attn.v_proj.weight", "BF16", (kv, h)),
            TensorSpec(p + "self_attn.o_proj.weight", "BF16", (h, q)),
            TensorSpec(p + "post_attention_layernorm.weight", "BF16", (h,)),
            TensorSpec(p + "mlp.gate_proj.weight", "BF16", (f, h)),
            TensorSpec(p + "mlp.up_proj.weight", "BF16", (f, h)),
            TensorSpec(p + "mlp.down_proj.weight", "BF16", (h, f)),
        ]
    specs.append(TensorSpec("model.norm.weight", "BF16", (h,)))
    if not args.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", "BF16", (args.vocab_size, h)))
    return specs


def tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def random_tensor_chunks(spec: TensorSpec, seed: int) -> list[torch.Tensor]:
    """The tensor's values in bf16, as row chunks: ones for a norm, else N(0, STD)."""
    if len(spec.shape) == 1:
        return [torch.ones(spec.shape, dtype=torch.bfloat16)]
    gen = torch.Generator().manual_seed(tensor_seed(seed, spec.name))
    rows, cols = spec.shape
    step = max(1, CHUNK_ELEMENTS // cols)
    chunks = []
    for r in range(0, rows, step):
        n = min(step, rows - r)
        chunks.append(torch.randn(n, cols, generator=gen).mul_(STD).to(torch.bfloat16))
    return chunks


def _tokenizer_source(progress: Progress) -> tuple[Path, Path]:
    """The default model's directory (its tokenizer files) and its GGUF (the
    tokenizer's GGUF metadata), preparing the default model when it is not yet."""
    from zmqllm.config.paths import default_model_dir
    from zmqllm.models.prepare import find_default_gguf, prepare_default_model

    directory = default_model_dir()
    if not is_prepared(directory):
        prepare_default_model(directory, progress)
    return directory, find_default_gguf(progress=progress)


def prepare_random_model(
    target: Path,
    kind: str = "mistral-7b",
    layers: int | None = None,
    seed: int = 0,
    gguf: bool = True,
    progress: Progress = _stderr,
) -> Path:
    """Write a random checkpoint of ``kind``'s geometry to ``target`` (see module doc).

    Idempotent: a finished directory made with the same settings is returned at once.
    """
    record: dict[str, Any] = {"random": kind, "layers": layers, "seed": seed, "std": STD}
    if is_prepared(target):
        source = target / SOURCE_FILE
        have = json.loads(source.read_text()) if source.exists() else {}
        if {k: have.get(k) for k in record} == record and (not gguf or "gguf" in have):
            progress(f"random model already prepared at {target}")
            return target
        raise ValueError(f"{target} holds another model: remove it or choose another --output")
    tok_dir, donor = _tokenizer_source(progress)
    tok_cfg = json.loads((tok_dir / "config.json").read_text())
    special = {k: tok_cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = random_config(kind, layers, int(tok_cfg["vocab_size"]), special)
    args = ModelArgs.from_dict(config)
    specs = tensor_specs(args)
    total = sum(s.nbytes for s in specs)
    t0 = time.monotonic()
    with building(target) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        generation = {k: v for k, v in special.items() if v is not None}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        for name in TOKENIZER_FILES:
            if (tok_dir / name).exists():
                shutil.copyfile(tok_dir / name, tmp / name)
        progress(
            f"writing {kind} ({args.num_layers} layers, {total / 2**30:.1f} GiB in bf16) "
            f"to {target}"
        )
        writer = CheckpointWriter(tmp, specs)
        meter = ProgressMeter(progress, "safetensors", total, len(specs))
        for spec in specs:
            chunks = random_tensor_chunks(spec, seed)
            writer.write(spec.name, (c.view(torch.uint8).numpy().data for c in chunks))
            meter.advance(spec.nbytes)
        writer.close()
        if gguf:
            from zmqllm.models.gguf_export import export_gguf

            outputs = {ft: tmp / name for ft, name in GGUF_FILES.items()}
            export_gguf(tmp, outputs, donor, progress, name=f"zmqllm random {kind}")
            record["gguf"] = GGUF_FOR_QUANT
        (tmp / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    progress(f"random {kind} ready at {target} ({time.monotonic() - t0:.0f} s)")
    return target


__all__ = ["GEOMETRIES", "prepare_random_model", "random_config"]
