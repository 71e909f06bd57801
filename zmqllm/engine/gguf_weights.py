"""A shard's tensors read straight from a GGUF file's blocks.

Q4_1 blocks become int4 weights and Q8_0 blocks int8 weights as they are
(engine.quant): no float32 copy of a matmul weight is made. F32 tensors (the
norms) load as tensors. Names are mapped to the Hugging Face checkpoint's, and
the rows of q and k are put back in transformers' order (llama.cpp's converter
interleaves each head's two rotary halves; transformers' GGUF loader reverses it
the same way). The file is memory-mapped: only this shard's tensors are read.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import torch

from zmqllm.engine.quant import GROUP, QuantTensor
from zmqllm.engine.weights import shard_tensor_groups
from zmqllm.models.checkpoint import CheckpointError
from zmqllm.models.model_args import ModelArgs
from zmqllm.models.prepare import SOURCE_FILE

# What each GGUF tensor type becomes.
QUANT_OF_TYPE = {"Q4_1": "int4", "Q8_0": "int8"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

Loaded: TypeAlias = torch.Tensor | QuantTensor


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def gguf_source(directory: Path, quant: str) -> Path | None:
    """The GGUF file whose blocks serve ``quant`` for a prepared model directory, if
    it is at hand: the one the default model was converted from, or one written beside
    the safetensors (``prepare-model --random``)."""
    record = directory / SOURCE_FILE
    if not record.exists():
        return None
    info = json.loads(record.read_text())
    from zmqllm.models.prepare import DEFAULT_GGUF, DEFAULT_MODEL_PACKAGE, find_default_gguf

    if info.get("package") == DEFAULT_MODEL_PACKAGE and info.get("gguf") == DEFAULT_GGUF:
        try:
            return find_default_gguf(install=False)
        except RuntimeError:
            return None
    files = info.get("gguf")
    if isinstance(files, dict) and isinstance(files.get(quant), str):
        beside = directory / Path(files[quant]).name  # a name inside the directory only
        return beside if beside.is_file() else None
    path = info.get("path")
    return Path(path) if path and Path(path).exists() else None


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: in the file, each head's
    rows alternate between its two rotary halves; transformers has the halves whole."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)


class GGUFShardReader:
    """Reads groups of HF-named tensors from one GGUF file (see module doc)."""

    def __init__(self, path: Path, args: ModelArgs) -> None:
        import gguf

        self.path = path
        self.args = args
        self.reader = gguf.GGUFReader(str(path))
        self.by_name: dict[str, Any] = {}
        for t in self.reader.tensors:
            name = hf_name(t.name)
            if name is not None:
                self.by_name[name] = t
        if args.tie_word_embeddings:
            self.by_name.pop("lm_head.weight", None)
        self.names_read: list[str] = []

    def types(self, names: list[str]) -> set[str]:
        return {self.by_name[n].tensor_type.name for n in names if n in self.by_name}

    def read(self, names: list[str]) -> dict[str, Loaded]:
        out: dict[str, Loaded] = {}
        for name in names:
            if name not in self.by_name:
                raise CheckpointError(f"{self.path.name} has no tensor for {name}")
            out[name] = self._tensor(name, self.by_name[name])
            self.names_read.append(name)
        self._release_pages()
        return out

    def _release_pages(self) -> None:
        """Drop the file's pages read so far from this process (they stay in the page
        cache): the whole file is mapped, and every page a read touched would otherwise
        count in the resident set until the reader is gone, doubling a 7B load's peak."""
        mapping = getattr(self.reader.data, "_mmap", None)
        if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapping.madvise(mmap.MADV_DONTNEED)

    def _tensor(self, name: str, t: Any) -> Loaded:
        kind = t.tensor_type.name
        data = np.asarray(t.data)
        if kind == "F32":
            value: Loaded = torch.from_numpy(np.array(data, dtype=np.float32))
        elif kind == "Q4_1":
            value = _q4_1(data)
        elif kind == "Q8_0":
            value = _q8_0(data)
        else:
            raise CheckpointError(f"{name}: GGUF type {kind} is not supported (F32, Q4_1, Q8_0)")
        for proj, heads in (("q_proj", self.args.num_heads), ("k_proj", self.args.num_kv_heads)):
            if name.endswith(f"self_attn.{proj}.weight"):
                order = _unpermute_rows(value.shape[0], heads)
                value = value.rows(order) if isinstance(value, QuantTensor) else value[order]
        return value


def _fp16(raw: np.ndarray) -> torch.Tensor:
    """[rows, blocks, 2] bytes holding float16 -> float16 [rows, blocks], kept narrow:
    the kernel widens them a row at a time (csrc/quant.h), and reads 2 bytes, not 4."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].copy())


def _q4_1(data: np.ndarray) -> QuantTensor:
    """Q4_1 blocks: d (f16), m (f16), 16 bytes of nibbles; 20 bytes per 32 weights."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 20)
    q = np.ascontiguousarray(blocks[..., 4:]).reshape(rows, -1)
    return QuantTensor(
        "int4", torch.from_numpy(q), _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])
    )


def _q8_0(data: np.ndarray) -> QuantTensor:
    """Q8_0 blocks: d (f16), then 32 int8; 34 bytes per 32 weights."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 2 + GROUP)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, -1)
    return QuantTensor("int8", torch.from_numpy(q), _fp16(blocks[..., 0:2]), torch.empty(0))


def gguf_matches(
    reader: GGUFShardReader, args: ModelArgs, start: int, end: int, quant: str
) -> bool:
    """Whether the file's layer matmuls are already of the kind ``quant`` asks for."""
    names = [
        n
        for group in shard_tensor_groups(args, start, end)
        for n in group
        if n.startswith("model.layers.") and n.endswith("proj.weight")
    ]
    return bool(names) and {QUANT_OF_TYPE.get(k) for k in reader.types(names)} == {quant}
