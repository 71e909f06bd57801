"""The compiled decode attention (csrc/decode_attention.cpp, attention_avx512.cpp) against
softmax(q K^T / sqrt(D)) V: head sizes of every path, float32 and bfloat16 caches, the
new rows it writes, and a head's bits whichever task its group was split into."""

from __future__ import annotations

from types import ModuleType

import pytest

torch = pytest.importorskip("torch")

from tests.float_tolerance import reorder_tolerance  # noqa: E402

pytestmark = pytest.mark.torch

LAYERS, MAX_LEN = 2, 320


def _caches(
    n: int, kv_heads: int, head_dim: int, dtype: torch.dtype, g: torch.Generator
) -> list[torch.Tensor]:
    shape = (LAYERS, kv_heads, MAX_LEN, head_dim)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(n)]


def _new_rows(n: int, kv_heads: int, head_dim: int, g: torch.Generator) -> torch.Tensor:
    """Random rows with a few numbers halfway between two bfloat16s (1 + 2^-8 rounds
    down to 1, 1 + 3 * 2^-8 up to 1 + 2^-6: ties go to even) and one exactly 0."""
    rows = torch.randn(n, kv_heads, head_dim, generator=g)
    rows[0, 0, :3] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 0.0])
    return rows


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(9, 3, 16), (9, 3, 24), (8, 2, 48), (9, 3, 64), (8, 2, 80), (8, 2, 128), (18, 1, 64)],
)
@pytest.mark.parametrize(("past", "lo"), [(0, 0), (37, 0), (300, 290)])
def test_decode_attention_matches_softmax_attention(
    kernel: ModuleType,
    cache_dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    past: int,
    lo: int,
) -> None:
    """Two sessions, grouped-query heads, keys from ``lo`` (a sliding window) to the new
    one: the kernel writes the new rows into the caches (bfloat16 ones rounded as
    PyTorch rounds) and equals softmax(q K^T / sqrt(D)) V over the cached numbers.
    Heads of a multiple of 16 numbers up to 128 take the AVX-512 path where the CPU
    has it (the default model's 64, Mistral 7B's 128), others the generic loops; a
    group of 18 query heads goes in two passes."""
    g = torch.Generator().manual_seed(head_dim + past)
    caches = _caches(4, kv_heads, head_dim, cache_dtype, g)
    q = torch.randn(2, heads, head_dim, generator=g)
    k_new = _new_rows(2, kv_heads, head_dim, g)
    v_new = _new_rows(2, kv_heads, head_dim, g)
    batch = kernel.DecodeBatch(caches[:2], caches[2:], [1, 0], [past, past + 5], [lo, lo])
    out = torch.zeros(2, heads * head_dim)
    layer = 1
    kernel.decode_attention(out, q, k_new, v_new, batch, layer, head_dim**-0.5)
    for session, row, pos in ((0, 1, past), (1, 0, past + 5)):
        kc, vc = caches[session][layer], caches[2 + session][layer]
        assert torch.equal(kc[:, pos], k_new[row].to(cache_dtype))
        assert torch.equal(vc[:, pos], v_new[row].to(cache_dtype))
        group = heads // kv_heads
        keys = kc[:, lo : pos + 1].float().repeat_interleave(group, dim=0)
        values = vc[:, lo : pos + 1].float().repeat_interleave(group, dim=0)
        weights = torch.softmax(q[row, :, None, :] @ keys.transpose(1, 2) * head_dim**-0.5, -1)
        want = (weights @ values).reshape(-1)
        torch.testing.assert_close(
            out[row], want, **reorder_tolerance(want, max(head_dim, pos + 1 - lo))
        )


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 2, 128), (18, 1, 64)])
def test_a_head_gets_the_same_bits_alone_and_in_a_crowd(
    kernel: ModuleType, cache_dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    """One session alone splits its query heads into one task each (to use both
    threads); among many, each kv head's group is one task (18 heads: in two passes):
    the same numbers either way."""
    past = 200
    g = torch.Generator().manual_seed(7)
    kc, vc = (
        _caches(8, kv_heads, head_dim, cache_dtype, g),
        _caches(8, kv_heads, head_dim, cache_dtype, g),
    )
    q = torch.randn(8, heads, head_dim, generator=g)
    k_new, v_new = _new_rows(8, kv_heads, head_dim, g), _new_rows(8, kv_heads, head_dim, g)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        alone = torch.zeros(1, heads * head_dim)
        solo = kernel.DecodeBatch([kc[0].clone()], [vc[0].clone()], [0], [past], [0])
        kernel.decode_attention(alone, q[:1], k_new[:1], v_new[:1], solo, 0, head_dim**-0.5)
        crowd = torch.zeros(8, heads * head_dim)
        batch = kernel.DecodeBatch(kc, vc, list(range(8)), [past] * 8, [0] * 8)
        kernel.decode_attention(crowd, q, k_new, v_new, batch, 0, head_dim**-0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone[0], crowd[0])


def test_caches_of_mixed_or_other_dtypes_are_refused(kernel: ModuleType) -> None:
    f32 = torch.zeros(1, 1, 4, 16)
    with pytest.raises(RuntimeError, match="all float32 or all bfloat16"):
        kernel.DecodeBatch([f32, f32.bfloat16()], [f32, f32.bfloat16()], [0, 1], [0, 0], [0, 0])
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.DecodeBatch([f32.half()], [f32.half()], [0], [0], [0])
