"""Exactness at Mistral-7B's geometry (hidden 4096, GQA 32/8, head dim 128, FFN 14336,
4 of its layers, random weights): greedy over 32 tokens equals transformers' in
float32, in bf16 against bf16, and for int4 (the Q4_1 GGUF's blocks as they are)
against transformers on the dequantized weights; in one shard and split in two."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from zmqllm.engine.generator import Generator  # noqa: E402
from zmqllm.engine.gguf_weights import GGUFShardReader  # noqa: E402
from zmqllm.engine.memory_plan import plan_stage  # noqa: E402
from zmqllm.engine.quant import QuantTensor, dequantize  # noqa: E402
from zmqllm.models.checkpoint import read_header  # noqa: E402
from zmqllm.models.model_args import ModelArgs  # noqa: E402
from zmqllm.models.random_model import GEOMETRIES, random_tensor_chunks, tensor_specs  # noqa: E402
from zmqllm.models.tokenizer import Tokenizer  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

N = 32
SPLIT = [(0, 2), (2, 4)]


def _prompt(directory: Path) -> list[int]:
    return Tokenizer.from_dir(directory).encode("The history of the bus, in short:")


def _hf_greedy(model: object, ids: list[int]) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(  # type: ignore[attr-defined]
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=N,
            do_sample=False,
            eos_token_id=None,  # every one of the N tokens, as stop_ids=() below
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def _ours(gen: Generator, ids: list[int]) -> list[int]:
    return list(gen.generate(ids, N))


@pytest.fixture(scope="module")
def hf_fp32(random_7b_dir: Path):
    return transformers.MistralForCausalLM.from_pretrained(
        random_7b_dir, dtype=torch.float32
    ).eval()


def test_the_checkpoint_has_mistral_7bs_geometry(random_7b_dir: Path) -> None:
    args = ModelArgs.from_dir(random_7b_dir)
    geometry = GEOMETRIES["mistral-7b"]
    assert (args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim) == (
        4096,
        32,
        8,
        128,
    )
    assert args.intermediate_size == geometry["intermediate_size"] == 14336
    assert (args.rms_norm_eps, args.rope_theta) == (1e-5, 1e6)
    assert not args.tie_word_embeddings and args.sliding_window is None
    assert args.num_layers == 4
    header = read_header(random_7b_dir / "model.safetensors")
    assert {v["dtype"] for v in header.values()} == {"BF16"}
    assert len(header) == len(tensor_specs(args)) == 4 * 9 + 3
    # The vocabulary is the default model's: both runtimes tokenize alike.
    from zmqllm.config.paths import default_model_dir

    default = json.loads((default_model_dir() / "tokenizer.json").read_text())
    assert json.loads((random_7b_dir / "tokenizer.json").read_text()) == default
    # Each tensor is made again from (seed, name) alone.
    from safetensors import safe_open

    spec = next(s for s in tensor_specs(args) if s.name.endswith("1.self_attn.k_proj.weight"))
    with safe_open(str(random_7b_dir / "model.safetensors"), framework="pt") as f:
        stored = f.get_tensor(spec.name)
    assert torch.equal(torch.cat(random_tensor_chunks(spec, seed=0)), stored)
    assert 0.019 < float(stored.float().std()) < 0.021


def test_float32_greedy_equals_hf(random_7b_dir: Path, hf_fp32) -> None:
    ids = _prompt(random_7b_dir)
    want = _hf_greedy(hf_fp32, ids)
    assert len(set(want)) > 4, "a sequence that tells runs apart"
    assert _ours(Generator(random_7b_dir), ids) == want
    assert _ours(Generator(random_7b_dir, SPLIT), ids) == want


def test_int4_from_the_q4_1_gguf_equals_hf_on_its_dequantized_weights(
    random_7b_dir: Path, hf_fp32
) -> None:
    args = ModelArgs.from_dir(random_7b_dir)
    reader = GGUFShardReader(random_7b_dir / "model-Q4_1.gguf", args)
    state = {}
    for name in list(reader.by_name):
        value = reader.read([name])[name]
        state[name] = dequantize(value) if isinstance(value, QuantTensor) else value
    original = {k: v.clone() for k, v in hf_fp32.state_dict().items()}
    hf_fp32.load_state_dict(state, strict=True)
    try:
        ids = _prompt(random_7b_dir)
        want = _hf_greedy(hf_fp32, ids)
    finally:
        hf_fp32.load_state_dict(original)
    one = Generator(random_7b_dir, quant="int4")
    assert [s.weights_from for s in one.shards] == ["gguf:model-Q4_1.gguf"]
    assert _ours(one, ids) == want
    del one
    assert _ours(Generator(random_7b_dir, SPLIT, quant="int4"), ids) == want


def test_bfloat16_greedy_equals_hf_bfloat16(random_7b_dir: Path) -> None:
    hf = transformers.MistralForCausalLM.from_pretrained(random_7b_dir, dtype=torch.bfloat16)
    ids = _prompt(random_7b_dir)
    want = _hf_greedy(hf.eval(), ids)
    del hf
    gen = Generator(random_7b_dir, dtype="bfloat16")
    assert all(p.dtype is torch.bfloat16 for s in gen.shards for p in s.parameters())
    assert _ours(gen, ids) == want


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_the_memory_plan_counts_what_a_stage_holds(random_7b_dir: Path, quant: str) -> None:
    """The figures a worker checks before it loads, against the loaded shards' own."""
    args = ModelArgs.from_dir(random_7b_dir)
    dtype = "bfloat16" if quant == "none" else "float32"
    gen = Generator(random_7b_dir, SPLIT, dtype=dtype, quant=quant)
    for (start, end), shard in zip(SPLIT, gen.shards, strict=True):
        # int4 comes as the Q4_1 file's blocks (float16 scales, a Q8_0 head).
        plan = plan_stage(args, start, end, dtype, quant, 1024, gguf=quant != "none")
        held = shard.weight_bytes()
        assert held <= plan.weight_bytes <= held * 1.01, (start, end)
        assert plan.kv_bytes_per_token == 2 * 2 * 8 * 128 * (2 if quant == "none" else 4)
