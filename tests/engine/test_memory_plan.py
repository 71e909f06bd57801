"""The KV budget sized from the memory given (max_kv_tokens 0, the default): what is left
after the weights, the runtime and a margin, capped at every session at full context;
too little for one session and the stage refuses to start, saying what to change."""

from __future__ import annotations

from zmqllm.engine.memory_plan import (
    KV_MARGIN_MIN,
    MIN_KV_TOKENS,
    RUNTIME_BYTES,
    plan_stage,
)
from zmqllm.models.model_args import ModelArgs

MISTRAL_7B = ModelArgs.from_dict(
    {
        "model_type": "mistral",
        "vocab_size": 32768,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 32768,
    }
)
GIB = 1 << 30


def test_the_budget_is_what_the_memory_holds_after_the_weights() -> None:
    plan = plan_stage(MISTRAL_7B, 0, 16, "float32", "int4", 0, max_memory_mb=14 * 1024)
    given = 14 * GIB
    margin = max(KV_MARGIN_MIN, given // 10)
    room = given - plan.weight_bytes - RUNTIME_BYTES - margin
    assert plan.kv_sized and plan.kv_tokens == room // plan.kv_bytes_per_token
    assert plan.fits()
    assert margin <= plan.given_bytes - plan.need_bytes < margin + plan.kv_bytes_per_token
    # 16 layers x 8 KV heads x 128 x (k, v) x 4 bytes: 128 KiB a token, ~79,000 tokens here.
    assert plan.kv_bytes_per_token == 128 << 10 and 70_000 < plan.kv_tokens < 90_000


def test_the_budget_stops_at_every_session_at_full_context() -> None:
    plan = plan_stage(MISTRAL_7B, 0, 2, "float32", "int4", 0, 512 * 1024, max_sessions=2)
    assert plan.kv_tokens == 2 * 32768


def test_an_explicit_budget_is_kept() -> None:
    plan = plan_stage(MISTRAL_7B, 0, 16, "float32", "int4", 1000, max_memory_mb=14 * 1024)
    assert not plan.kv_sized and plan.kv_tokens == 1000


def test_too_little_memory_for_one_session_refuses_naming_the_figures() -> None:
    plan = plan_stage(MISTRAL_7B, 0, 16, "float32", "int4", 0, max_memory_mb=4 * 1024)
    assert not plan.fits() and plan.kv_tokens < MIN_KV_TOKENS
    said = plan.refusal()
    assert said.startswith("stage 0:16 does not fit: weights ")
    assert f"fewer than the {MIN_KV_TOKENS} a session needs" in said
    assert "(max_memory_mb)" in said and "use --quant int4 or int8" in said
