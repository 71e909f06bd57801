"""A bfloat16 KV cache under a float32 model (``[worker] kv_dtype``): greedy text and
logits beside float32 caches, the stage's memory figures at two bytes a number, and
only float32 or bfloat16 taken. That the compiled decode attention and the PyTorch path
read the same cached numbers: tests/engine/test_native.py (batched decode)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from zmqllm.engine.cache import CachePool  # noqa: E402
from zmqllm.engine.generator import Generator, load_shard  # noqa: E402
from zmqllm.engine.memory_plan import plan_stage  # noqa: E402
from zmqllm.models.model_args import ModelArgs  # noqa: E402

pytestmark = pytest.mark.torch


def test_a_bfloat16_cache_is_rounded_once_and_tracks_float32(tiny_model_dir: Path) -> None:
    """The single-stream path with a bfloat16 cache: its greedy tokens are float32's on
    the tiny model, its logits within 2 % of the largest (keys and values rounded to
    8 significant bits, once)."""
    ids = [5, 17, 99, 3, 250, 31, 8]
    wide = Generator(tiny_model_dir, [(0, 2), (2, 4)])
    narrow = Generator(tiny_model_dir, [(0, 2), (2, 4)], kv_dtype="bfloat16")
    assert [p.dtype for p in narrow.pools] == [torch.bfloat16] * 2
    assert list(narrow.generate(ids, 12)) == list(wide.generate(ids, 12))
    want, got = wide.all_logits(ids), narrow.all_logits(ids)
    assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max())


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


@pytest.mark.parametrize("name", ["float16", "int8", "", "bf16"])
def test_other_kv_dtypes_are_refused(tiny_model_dir: Path, name: str) -> None:
    shard = load_shard(tiny_model_dir, 0, 1)
    with pytest.raises(ValueError, match="kv dtype"):
        shard.use_kv_dtype(name)
    assert shard.kv_dtype is torch.float32
    assert shard.use_kv_dtype("auto") is torch.float32
