"""The GGUF writer's pieces: llama.cpp's block formats and row order, and a small
checkpoint exported and read back as zmqllm reads a GGUF shard."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from zmqllm.engine.gguf_weights import GGUFShardReader, _unpermute_rows, hf_name  # noqa: E402
from zmqllm.engine.quant import QuantTensor, dequantize  # noqa: E402
from zmqllm.models.checkpoint import checkpoint_shapes  # noqa: E402
from zmqllm.models.gguf_export import (  # noqa: E402
    export_gguf,
    gguf_name,
    permute_rows,
    quantize_q4_1,
    quantize_q8_0,
    tensor_kind,
)
from zmqllm.models.model_args import ModelArgs  # noqa: E402


def _weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[0, :32] = 0.5  # a constant block: d = 0
    w[1, :32] = torch.linspace(-1, 1, 32)
    return w


@pytest.mark.parametrize(
    ("ours", "qtype"),
    [
        (quantize_q4_1, gguf.GGMLQuantizationType.Q4_1),
        (quantize_q8_0, gguf.GGMLQuantizationType.Q8_0),
    ],
)
def test_blocks_are_llama_cpps_reference_quantization(ours, qtype) -> None:
    """gguf-py's numpy quantizers follow llama.cpp's quantize_row_*_ref: the same bytes,
    up to a code on the rounding boundary (float32 order of operations)."""
    w = _weights(64, 256, seed=1)
    mine = ours(w).numpy()
    ref = gguf.quants.quantize(w.numpy(), qtype)
    assert mine.shape == ref.shape and mine.dtype == ref.dtype == np.uint8
    back_mine = gguf.quants.dequantize(mine, qtype)
    back_ref = gguf.quants.dequantize(ref, qtype)
    step = np.abs(back_ref - w.numpy()).max()
    assert (mine != ref).mean() < 1e-3, "the bytes of a few boundary codes at most"
    np.testing.assert_allclose(back_mine, back_ref, atol=2 * step)


def test_q_and_k_rows_permuted_as_llama_cpp_and_back() -> None:
    w = torch.arange(8 * 4 * 3, dtype=torch.float32).view(32, 3)  # 4 heads of 8 rows
    p = permute_rows(w, heads=4)
    # In a head, row 2i comes from the first rotary half, row 2i+1 from the second.
    assert p[0].tolist() == w[0].tolist() and p[1].tolist() == w[4].tolist()
    assert torch.equal(p[_unpermute_rows(32, 4)], w)


def test_names_map_both_ways() -> None:
    for hf in (
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.12.mlp.down_proj.weight",
        "model.layers.0.post_attention_layernorm.weight",
    ):
        assert hf_name(gguf_name(hf)) == hf
    with pytest.raises(ValueError, match="not a Mistral"):
        gguf_name("model.layers.x.mlp.down_proj.weight")
    assert tensor_kind("model.layers.0.mlp.up_proj.weight", (64, 256), "Q4_1") == "Q4_1"
    assert tensor_kind("lm_head.weight", (64, 256), "Q4_1") == "Q8_0"
    assert tensor_kind("model.norm.weight", (256,), "Q4_1") == "F32"
    assert tensor_kind("lm_head.weight", (64, 256), "BF16") == "BF16"


def test_a_checkpoint_exported_reads_back_as_zmqllm_loads_gguf(
    tiny_model_dir: Path, default_gguf: Path, tmp_path: Path
) -> None:
    outputs = {"Q4_1": tmp_path / "q4.gguf", "BF16": tmp_path / "bf16.gguf"}
    said: list[str] = []
    export_gguf(tiny_model_dir, outputs, default_gguf, said.append)
    assert said and "written" in said[-1]
    args = ModelArgs.from_dir(tiny_model_dir)
    from safetensors import safe_open

    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as f:
        want = {n: f.get_tensor(n).float() for n in checkpoint_shapes(tiny_model_dir)}
    q4 = GGUFShardReader(outputs["Q4_1"], args)
    bf = GGUFShardReader(outputs["BF16"], args)
    assert set(q4.by_name) == set(want)
    for name, w in want.items():
        got = q4.read([name])[name]
        if w.dim() == 1:
            assert torch.equal(got, w), name  # norms F32, as they were
            continue
        assert isinstance(got, QuantTensor)
        assert got.kind == (
            "int8" if name in ("model.embed_tokens.weight", "lm_head.weight") else "int4"
        )
        step = (w.view(w.shape[0], -1, 32).amax(-1) - w.view(w.shape[0], -1, 32).amin(-1)).max()
        # Back in transformers' row order, within a quantization step of the weight.
        assert (dequantize(got) - w).abs().max() <= step / 15 * 0.51 + 1e-3, name
    reader = gguf.GGUFReader(str(outputs["BF16"]))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "BF16" and types["output_norm.weight"] == "F32"
    fields = {
        k: f.contents()
        for k, f in reader.fields.items()
        if not k.startswith("tokenizer.ggml.tokens")
    }
    assert fields["general.architecture"] == "llama"
    assert fields["llama.block_count"] == args.num_layers
    assert fields["llama.attention.head_count_kv"] == args.num_kv_heads
    assert "tokenizer.ggml.model" in fields  # copied from the donor
    assert bf.by_name.keys() == q4.by_name.keys()
    assert json.dumps(fields["llama.rope.freq_base"])
