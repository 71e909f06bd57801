"""The compiled decode-attention kernel against the PyTorch path it replaces."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.float_tolerance import reduction_length, reorder_tolerance  # noqa: E402
from zmqllm.engine import native  # noqa: E402
from zmqllm.engine.cache import KVCache  # noqa: E402
from zmqllm.engine.generator import load_shard  # noqa: E402
from zmqllm.engine.model import MistralShard, Segment  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def kernel() -> ModuleType:
    module = native.load()
    if module is None:
        if os.environ.get("CI"):
            pytest.fail("the decode-attention kernel must build in CI (compiler and ninja)")
        pytest.skip("no C++ toolchain here: the kernel cannot be built")
    return module


def _caches(shard: MistralShard, lengths: list[int]) -> list[KVCache]:
    a = shard.args
    return [
        KVCache(shard.num_local_layers, a.num_kv_heads, n, a.head_dim, shard.dtype, "cpu")
        for n in lengths
    ]


def test_batched_decode_matches_the_pytorch_path(kernel: ModuleType, tiny_model_dir: Path) -> None:
    """Sessions of different lengths (some beyond the sliding window of 8), decoding
    together, with a prefill chunk joining midway: same logits, same greedy tokens."""
    plain = load_shard(tiny_model_dir, 0, 4)
    fast = load_shard(tiny_model_dir, 0, 4)
    assert fast.use_kernel(kernel) and not plain.use_kernel(None)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, size=n) for n in (1, 3, 7, 9, 12)]
    late = rng.integers(3, 200, size=6)
    caches = {name: _caches(s, [40] * 6) for name, s in (("plain", plain), ("fast", fast))}
    tokens: dict[str, list[int]] = {}
    reference: list[torch.Tensor] = []  # the PyTorch path's logits, step by step
    for name, shard in (("plain", plain), ("fast", fast)):
        cs = caches[name]
        # Prefill each prompt on its own (the PyTorch path either way).
        nxt = [
            int(shard(torch.from_numpy(p), [Segment(c, p.size)])[0].argmax())
            for p, c in zip(prompts, cs[:5], strict=True)
        ]
        out: list[int] = []
        for step in range(14):
            ids = list(nxt)
            segs = [Segment(c, 1) for c in cs[:5]]
            if step == 5:  # a new session's prompt joins the decode batch
                ids += [int(x) for x in late]
                segs.append(Segment(cs[5], late.size))
            logits = shard(torch.tensor(ids), segs)
            if name == "plain":
                reference.append(logits)
            else:
                # Another order of the same float32 sums (tests/float_tolerance.py).
                tolerance = reorder_tolerance(reference[step], reduction_length(shard.args))
                torch.testing.assert_close(logits, reference[step], **tolerance)
            nxt = [int(t) for t in logits[:5].argmax(-1)]
            out += nxt
        tokens[name] = out
    assert tokens["fast"] == tokens["plain"]
    # The window was crossed: the longest session ended past 8 + 14 tokens.
    assert caches["fast"][4].length == 12 + 14


def test_only_float32_cpu_shards_take_the_kernel(kernel: ModuleType, tiny_model_dir: Path) -> None:
    assert not load_shard(tiny_model_dir, 0, 2, dtype="bfloat16").use_kernel(kernel)
    shard = load_shard(tiny_model_dir, 0, 2)
    assert shard.use_kernel(kernel) and shard.kernel is kernel
    assert not shard.use_kernel(None) and shard.kernel is None


def test_bad_positions_are_refused(kernel: ModuleType, tiny_model_dir: Path) -> None:
    shard = load_shard(tiny_model_dir, 0, 2)
    (c,) = _caches(shard, [4])
    with pytest.raises(RuntimeError, match="position outside the cache"):
        kernel.DecodeBatch([c.k], [c.v], [0], [4], [0])  # position 4 of a 4-token cache
    with pytest.raises(RuntimeError, match="one cache pair"):
        kernel.DecodeBatch([c.k], [c.v], [0, 1], [0], [0])


def test_disabled_or_unbuildable_means_the_pytorch_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("ZMQLLM_NATIVE", "0")
    assert native.load() is None

    from torch.utils import cpp_extension

    def no_compiler(**_: object) -> None:
        raise RuntimeError("error: command 'c++' failed: No such file or directory")

    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("ZMQLLM_NATIVE", "1")
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert native.load() is None  # logged as a warning; the worker goes on


def test_fused_layer_steps_match_pytorch(kernel: ModuleType) -> None:
    """RMSNorm, rotary embedding and silu(gate) * up of a batched decode forward."""
    import torch.nn.functional as F

    from zmqllm.engine.model import RMSNorm, _rope

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=g) * 3
    norm = RMSNorm(64, 1e-5)
    norm.weight.copy_(torch.randn(64, generator=g))
    torch.testing.assert_close(kernel.rms_norm(x, norm.weight, 1e-5), norm(x))

    # q and k heads (4 + 2) roped in place; the v heads (2) after them untouched.
    qkv = torch.randn(5, 8 * 16, generator=g)
    angles = torch.rand(5, 8, generator=g) * 100
    cos, sin = angles.cos(), angles.sin()
    want = _rope(qkv[:, : 6 * 16].view(5, 6, 16), cos[:, None], sin[:, None])
    got = qkv.clone()
    kernel.rope_(got, cos, sin, 6, 16)
    torch.testing.assert_close(got[:, : 6 * 16].view(5, 6, 16), want)
    assert torch.equal(got[:, 6 * 16 :], qkv[:, 6 * 16 :])

    gate_up = torch.randn(7, 48, generator=g) * 4
    torch.testing.assert_close(kernel.silu_mul(gate_up), F.silu(gate_up[:, :24]) * gate_up[:, 24:])

    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernel.rms_norm(x.t(), norm.weight, 1e-5)
    with pytest.raises(RuntimeError, match="rope_"):
        kernel.rope_(got, cos[:4], sin[:4], 6, 16)  # a table for 4 rows, not 5
    with pytest.raises(RuntimeError, match="silu_mul"):
        kernel.silu_mul(gate_up.double())


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load(kernel: ModuleType) -> None:
    # torch's loader waits on a "lock" file as long as it exists; a builder killed
    # mid-build leaves one behind. A fresh process must load the kernel anyway.
    (stale,) = [d / "lock" for d in native.build_dir().iterdir() if d.name == kernel.__name__]
    stale.write_text("")
    code = "from zmqllm.engine import native; assert native.load() is not None"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", code], env=env, timeout=300, check=False)
    assert done.returncode == 0
    assert not stale.exists()
