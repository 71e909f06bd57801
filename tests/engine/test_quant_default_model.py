"""Quantized shards of the default model: its Q4_1 GGUF blocks loaded as they are,
int4 greedy text against transformers in float32, int8 teacher-forced agreement."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from zmqllm.engine import quant  # noqa: E402
from zmqllm.engine.generator import Generator, load_shard  # noqa: E402
from zmqllm.engine.gguf_weights import GGUFShardReader, gguf_source  # noqa: E402
from zmqllm.engine.linear import QuantLinear  # noqa: E402
from zmqllm.engine.weights import load_shard_tensors, shard_tensor_names  # noqa: E402
from zmqllm.models.model_args import ModelArgs  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

PROMPTS = [
    "Write a haiku about the sea.",
    "Explain what a message broker does, in two sentences.",
    "List three uses of the Python programming language.",
]
TEXT = Path(__file__).parents[1] / "data" / "agreement.txt"


def _hf_greedy(model: object, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(  # type: ignore[attr-defined]
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
        eos_token_id=None,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_gguf_blocks_are_the_converted_weights(default_model_dir: Path) -> None:
    """Every tensor of a middle shard read from the Q4_1/Q8_0 blocks dequantizes to
    exactly the float32 checkpoint (q and k rows back in transformers' order), and
    only that shard's tensors are read."""
    args = ModelArgs.from_dir(default_model_dir)
    source = gguf_source(default_model_dir, "int4")
    assert source is not None and source.suffix == ".gguf"
    reader = GGUFShardReader(source, args)
    names = shard_tensor_names(args, 29, 30)  # last layer, norm, tied head
    got = reader.read(names)
    assert reader.names_read == names
    want = load_shard_tensors(default_model_dir, args, 29, 30).tensors
    for name in names:
        value = got[name]
        if isinstance(value, quant.QuantTensor):
            assert value.kind == ("int8" if "embed" in name else "int4"), name
            value = quant.dequantize(value)
        assert torch.equal(value, want[name]), name


def test_int4_shard_loads_the_gguf_blocks_at_a_fifth_of_the_size(default_model_dir: Path) -> None:
    fp32 = load_shard(default_model_dir, 10, 20)
    shard = load_shard(default_model_dir, 10, 20, quant="int4")
    assert shard.weights_from.startswith("gguf:")
    kinds = {m.kind for m in shard.modules() if isinstance(m, QuantLinear)}
    assert kinds == {"int4"}
    assert shard.num_parameters() == fp32.num_parameters()
    # 24 bytes per 32 weights (16 of nibbles, a float32 scale and minimum) against 128
    assert shard.weight_bytes() < fp32.weight_bytes() / 5
    # int8 requantizes the float32 checkpoint (the file's blocks are int4)
    assert load_shard(default_model_dir, 10, 11, quant="int8").weights_from == "safetensors"


@pytest.mark.parametrize("bounds", [[(0, 30)], [(0, 15), (15, 30)]])
def test_int4_greedy_equals_hf_float32(
    default_model_dir: Path, bounds: list[tuple[int, int]]
) -> None:
    from zmqllm.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir)
    ref_model = transformers.MistralForCausalLM.from_pretrained(default_model_dir).eval()
    gen = Generator(default_model_dir, bounds, quant="int4")
    for text in PROMPTS:
        ids = tok.encode_chat([{"role": "user", "content": text}])
        ours = list(gen.generate(ids, 32))
        assert ours == _hf_greedy(ref_model, ids, 32), text


def test_int8_teacher_forced_agreement_with_float32(default_model_dir: Path) -> None:
    """Top-1 of int8 against float32 at every position of a text the tests ship
    (the perplexities are in docs/benchmarks.md, from benchmarks/quant_accuracy.py)."""
    from zmqllm.models.tokenizer import Tokenizer

    ids = Tokenizer.from_dir(default_model_dir).encode(TEXT.read_text())
    assert len(ids) > 300
    ref = Generator(default_model_dir).all_logits(ids).argmax(-1)
    for kind, floor in (("int8", 0.99), ("int4", 0.99)):
        ours = Generator(default_model_dir, quant=kind).all_logits(ids).argmax(-1)
        agreement = (ours == ref).float().mean().item()
        assert agreement >= floor, (kind, agreement)
