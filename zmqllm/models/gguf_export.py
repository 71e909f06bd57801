"""A Mistral safetensors checkpoint written as GGUF files that llama.cpp loads.

One pass over the checkpoint, a tensor at a time (peak memory: one tensor and its
quantized copy), writes every requested file: ``BF16`` (the weights as they are),
``Q4_1`` or ``Q8_0`` (llama.cpp's block formats, quantized exactly as its reference
``quantize_row_q4_1_ref`` / ``quantize_row_q8_0_ref`` do). Embedding and head go to
Q8_0 in the quantized files, the norms stay F32. Rows of q and k are permuted the way
llama.cpp's converter does (each head's two rotary halves interleaved), which
engine/gguf_weights.py undoes on load; so zmqllm's ``--quant int4`` and llama.cpp
compute with the very same numbers from the same file.

The tokenizer's metadata is copied from a donor GGUF of the same vocabulary (the
default model's), so both runtimes tokenize alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zmqllm.models.model_args import ModelArgs
from zmqllm.models.prepare import Progress, ProgressMeter

BLOCK = 32  # weights per Q4_1 / Q8_0 block
# Bytes per block: Q4_1 d, m (f16) + 16 bytes of nibbles; Q8_0 d (f16) + 32 int8.
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
# llama.cpp's LLAMA_FTYPE of a file whose matmuls are of this type.
FILE_TYPE = {"BF16": 32, "Q4_1": 3, "Q8_0": 7}
# Row chunk for quantizing and converting: bounds the float32 copy of a big tensor.
CHUNK_ELEMENTS = 1 << 24

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a Hugging Face checkpoint tensor."""
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    prefix, _, rest = hf_name.partition(".layers.")
    index, _, tail = rest.partition(".")
    if prefix != "model" or not index.isdigit() or tail not in _LAYER:
        raise ValueError(f"{hf_name} is not a Mistral checkpoint tensor")
    return f"blk.{index}.{_LAYER[tail]}"


def permute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows [heads * head_dim, in] in llama.cpp's order: within each head, the
    rows of the two rotary halves interleaved (the inverse of gguf_weights's)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 [..., n] -> uint8 [..., 2 n] holding IEEE half words."""
    return x.to(torch.float16).view(torch.uint8)


def quantize_q4_1(w: torch.Tensor) -> torch.Tensor:
    """float32 [rows, cols] -> Q4_1 blocks as uint8 [rows, cols / 32 * 20]; codes from
    the unrounded d and min, as quantize_row_q4_1_ref."""
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // BLOCK, BLOCK)
    lo = blocks.amin(dim=-1)
    d = (blocks.amax(dim=-1) - lo) / 15
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    codes = ((blocks - lo[..., None]) * inv[..., None] + 0.5).floor_().clamp_(0, 15)
    codes_u8 = codes.to(torch.uint8)
    nibbles = codes_u8[..., : BLOCK // 2] | (codes_u8[..., BLOCK // 2 :] << 4)
    out = torch.cat((_fp16_bytes(d[..., None]), _fp16_bytes(lo[..., None]), nibbles), dim=-1)
    return out.reshape(rows, -1)


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """float32 [rows, cols] -> Q8_0 blocks as uint8 [rows, cols / 32 * 34]; codes
    rounded half away from zero, as roundf in quantize_row_q8_0_ref."""
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1) / 127
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    scaled = blocks * inv[..., None]
    codes = (scaled.abs() + 0.5).floor_().copysign_(scaled).to(torch.int8)
    out = torch.cat((_fp16_bytes(d[..., None]), codes.view(torch.uint8)), dim=-1)
    return out.reshape(rows, -1)


@dataclass(frozen=True)
class Planned:
    """One tensor of one output file: its type there and its bytes."""

    hf: str
    shape: tuple[int, ...]
    kind: str  # F32 | BF16 | Q4_1 | Q8_0

    @property
    def nbytes(self) -> int:
        elements = int(np.prod(self.shape))
        if self.kind in BLOCK_BYTES:
            return elements // BLOCK * BLOCK_BYTES[self.kind]
        return elements * (4 if self.kind == "F32" else 2)


def tensor_kind(hf: str, shape: tuple[int, ...], file_type: str) -> str:
    """The GGUF type of a tensor in a file of ``file_type``: norms F32; in quantized
    files the embedding and head Q8_0 (zmqllm keeps the head at 8 bits too)."""
    if len(shape) == 1:
        return "F32"
    if file_type == "BF16":
        return "BF16"
    if hf in ("model.embed_tokens.weight", "lm_head.weight") or shape[1] % BLOCK:
        return "Q8_0"
    return file_type


def convert(t: torch.Tensor, kind: str) -> np.ndarray:
    """A tensor (already in llama.cpp's row order) as the bytes of ``kind``, in row
    chunks so that a float32 copy of a large tensor never exists whole."""
    if kind == "F32":
        return t.to(torch.float32).numpy()
    if kind == "BF16":
        return t.to(torch.bfloat16).view(torch.uint8).numpy()
    quantize = quantize_q4_1 if kind == "Q4_1" else quantize_q8_0
    rows, cols = t.shape
    out = torch.empty(rows, cols // BLOCK * BLOCK_BYTES[kind], dtype=torch.uint8)
    step = max(1, CHUNK_ELEMENTS // cols)
    for r in range(0, rows, step):
        out[r : r + step] = quantize(t[r : r + step].to(torch.float32))
    return out.numpy()


def _llama_metadata(writer: Any, args: ModelArgs, file_type: str, name: str) -> None:
    import gguf

    writer.add_name(name)
    writer.add_context_length(args.max_position_embeddings)
    writer.add_embedding_length(args.hidden_size)
    writer.add_block_count(args.num_layers)
    writer.add_feed_forward_length(args.intermediate_size)
    writer.add_rope_dimension_count(args.head_dim)
    writer.add_head_count(args.num_heads)
    writer.add_head_count_kv(args.num_kv_heads)
    writer.add_key_length(args.head_dim)
    writer.add_value_length(args.head_dim)
    writer.add_layer_norm_rms_eps(args.rms_norm_eps)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_vocab_size(args.vocab_size)
    writer.add_file_type(FILE_TYPE[file_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def copy_tokenizer_fields(writer: Any, donor: Path) -> int:
    """Every ``tokenizer.*`` key of the donor GGUF into ``writer``; returns how many."""
    import gguf

    reader = gguf.GGUFReader(str(donor))
    copied = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.") or not field.types:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
        copied += 1
    return copied


def _tensors(directory: Path, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors ``names`` in that order. Each file is mapped for one tensor only: a
    mapping kept open while the whole file is read would hold all its pages resident."""
    from safetensors import safe_open

    from zmqllm.models.checkpoint import weight_map

    wmap = weight_map(directory)
    for name in names:
        with safe_open(str(directory / wmap[name]), framework="pt") as f:
            tensor = f.get_tensor(name)
        yield name, tensor


def export_gguf(
    directory: Path,
    outputs: dict[str, Path],
    donor: Path,
    progress: Progress,
    name: str = "zmqllm export",
) -> None:
    """Write ``outputs`` (file type -> path, types BF16, Q4_1, Q8_0) from the
    safetensors checkpoint in ``directory``, reading it once, a tensor at a time."""
    import gguf

    from zmqllm.models.checkpoint import checkpoint_shapes

    args = ModelArgs.from_dir(directory)
    shapes = checkpoint_shapes(directory)
    if args.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    names = list(shapes)
    plans = {
        ft: [Planned(n, shapes[n], tensor_kind(n, shapes[n], ft)) for n in names] for ft in outputs
    }
    writers = {}
    for ft, path in outputs.items():
        w = gguf.GGUFWriter(str(path), "llama")
        _llama_metadata(w, args, ft, name)
        copy_tokenizer_fields(w, donor)
        for p in plans[ft]:
            if p.kind == "F32":
                w.add_tensor_info(gguf_name(p.hf), p.shape, np.dtype(np.float32), p.nbytes)
                continue
            # Blocks as raw bytes: [rows, bytes per row]; gguf-py derives the weights' shape.
            byte_shape = (*p.shape[:-1], p.nbytes // int(np.prod(p.shape[:-1])))
            raw = gguf.GGMLQuantizationType[p.kind]
            w.add_tensor_info(gguf_name(p.hf), byte_shape, np.dtype(np.uint8), p.nbytes, raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        writers[ft] = w
    total = sum(p.nbytes for ps in plans.values() for p in ps)
    meter = ProgressMeter(progress, "gguf", total, len(names))
    try:
        for i, (hf, t) in enumerate(_tensors(directory, names)):
            if hf.endswith("q_proj.weight"):
                t = permute_rows(t, args.num_heads)
            elif hf.endswith("k_proj.weight"):
                t = permute_rows(t, args.num_kv_heads)
            for ft, w in writers.items():
                w.write_tensor_data(convert(t, plans[ft][i].kind))
            meter.advance(sum(plans[ft][i].nbytes for ft in writers))
            del t
    finally:
        for w in writers.values():
            w.close()
