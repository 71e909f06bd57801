"""Prefix caching on the default model: a chat's second turn, started after the first
turn's prompt taken from the stages' prefix caches, gives transformers' greedy tokens in
float32, as the same turn computed from its first token does."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.engine.test_stage import Pipeline, Req  # noqa: E402
from zmqllm.bus.prefix import PREFIX_BLOCK, prefix_blocks  # noqa: E402
from zmqllm.engine.generator import load_shard  # noqa: E402
from zmqllm.engine.stage import Stage  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.torch]

SYSTEM = " ".join(
    f"Rule {i}: when asked about {topic}, answer in one short paragraph."
    for i, topic in enumerate(["trains", "boats", "planes", "bikes", "buses", "roads"] * 3)
)
TOKENS = 16


def test_second_turn_from_the_cache_equals_hf_and_the_cold_turn(default_model_dir: Path) -> None:
    from zmqllm.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir)
    shards = [load_shard(default_model_dir, 0, 15), load_shard(default_model_dir, 15, 30)]
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Tell me about trains."},
    ]
    first = tok.encode_chat(messages)
    cached = Pipeline([Stage(s) for s in shards])
    cached.open(Req("t1", first, TOKENS))
    cached.run_until_idle()
    messages += [
        {"role": "assistant", "content": tok.decode(cached.tokens["t1"])},
        {"role": "user", "content": "And boats?"},
    ]
    second = tok.encode_chat(messages)
    assert second[: len(first)] == first
    cached.open(Req("t2", second, TOKENS))
    assert cached.stages[0].sessions["t2"].reused == prefix_blocks(len(first)) * PREFIX_BLOCK
    cached.run_until_idle()

    cold = Pipeline([Stage(s, prefix_cache=False) for s in shards])
    cold.open(Req("t2", second, TOKENS))
    cold.run_until_idle()
    assert cached.tokens["t2"] == cold.tokens["t2"]

    model = transformers.MistralForCausalLM.from_pretrained(default_model_dir).eval()
    ids = torch.tensor([second])
    hf = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, do_sample=False,
        eos_token_id=None,
    )[0, len(second) :].tolist()  # fmt: skip
    assert cached.tokens["t2"] == hf
