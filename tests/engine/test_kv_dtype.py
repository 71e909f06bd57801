"""A bfloat16 KV cache under a float32 model (``[worker] kv_dtype``): logits beside
float32 caches, the pool's and the memory plan's figures at two bytes a number, and
only the model's own dtype or bfloat16 under float32 taken. That the compiled decode
attention and the PyTorch path read the same cached numbers: tests/engine/test_native.py
(batched decode) and test_decode_attention.py."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from zmqllm.config.settings import KV_DTYPE_CHOICES, ConfigError  # noqa: E402
from zmqllm.engine.cache import CachePool  # noqa: E402
from zmqllm.engine.generator import Generator, load_shard  # noqa: E402
from zmqllm.engine.memory_plan import plan_stage  # noqa: E402
from zmqllm.models.model_args import ModelArgs  # noqa: E402

pytestmark = pytest.mark.torch


def test_a_bfloat16_cache_is_rounded_once_and_tracks_float32(tiny_model_dir: Path) -> None:
    """Every logit of a prompt, through two stages with bfloat16 caches, within 2 % of the
    largest of float32 caches' (keys and values rounded to 8 significant bits, once;
    greedy text is asserted against HF on the default model, where the tiny random
    model's near-ties do not decide it: tests/engine/test_kv_dtype_default_model.py)."""
    ids = [5, 17, 99, 3, 250, 31, 8, 40, 41, 42, 7]
    wide = Generator(tiny_model_dir, [(0, 2), (2, 4)])
    narrow = Generator(tiny_model_dir, [(0, 2), (2, 4)], kv_dtype="bfloat16")
    assert [p.dtype for p in narrow.pools] == [torch.bfloat16] * 2
    want, got = wide.all_logits(ids), narrow.all_logits(ids)
    assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max())
    assert not torch.equal(got, want)  # the caches did round


def test_a_bfloat16_cache_counts_two_bytes_a_number(tiny_model_dir: Path) -> None:
    args = ModelArgs.from_dir(tiny_model_dir)
    pools = {d: CachePool(args, 4, d, "cpu") for d in (torch.float32, torch.bfloat16)}
    for pool in pools.values():
        pool.allocate("s", 32).length = 10
    wide, narrow = (pools[d].stats() for d in (torch.float32, torch.bfloat16))
    assert narrow.bytes_reserved * 2 == wide.bytes_reserved > 0
    assert narrow.bytes_used * 2 == wide.bytes_used > 0
    plans = {
        kv: plan_stage(args, 0, 4, "float32", "none", 0, max_memory_mb=1024, kv_dtype=kv)
        for kv in ("float32", "bfloat16")
    }
    assert plans["bfloat16"].kv_bytes_per_token * 2 == plans["float32"].kv_bytes_per_token
    # The same memory holds twice the tokens (up to the sessions' whole contexts).
    assert plans["bfloat16"].kv_tokens >= min(2 * plans["float32"].kv_tokens - 1, 64 * 2048)


@pytest.mark.parametrize(
    ("model", "name"),
    [
        ("float32", "float16"),
        ("float32", "int8"),
        ("float32", ""),
        ("float32", "bf16"),
        ("bfloat16", "float32"),  # twice the bytes for nothing
        ("float16", "bfloat16"),  # fewer mantissa bits than the model computes with
    ],
)
def test_other_kv_dtypes_are_refused(tiny_model_dir: Path, model: str, name: str) -> None:
    shard = load_shard(tiny_model_dir, 0, 1, dtype=model)
    with pytest.raises(ConfigError, match="kv_dtype"):
        shard.use_kv_dtype(name)
    assert shard.kv_dtype is shard.dtype
    assert shard.use_kv_dtype("auto") is shard.dtype
    if model in KV_DTYPE_CHOICES:  # its own dtype, named
        assert shard.use_kv_dtype(model) is shard.dtype
