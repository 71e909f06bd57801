"""bfloat16 on a GPU: the engine's greedy tokens against transformers' on the same device
and dtype, whole and split in shards. Skipped where torch sees no cuda device (this
project's CI machine has none; see docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from zmqllm.engine.generator import Generator  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a cuda device"),
]

PROMPT = [1, 17, 99, 4, 250, 31, 8, 64]


@pytest.mark.parametrize("bounds", [None, [(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]])
def test_bf16_greedy_equals_transformers_on_cuda(
    tiny_model_dir: Path, bounds: list[tuple[int, int]] | None
) -> None:
    ref = transformers.MistralForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    ref = ref.to("cuda").eval()
    ids = torch.tensor([PROMPT], device="cuda")
    want = ref.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
        eos_token_id=None,
    )[0, len(PROMPT) :].tolist()  # fmt: skip
    gen = Generator(tiny_model_dir, bounds, dtype="bfloat16", device="cuda")
    assert list(gen.generate(PROMPT, 24)) == want
