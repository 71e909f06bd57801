"""The shard forward against HF MistralForCausalLM: logits, greedy tokens, batching."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.float_tolerance import reduction_length, reorder_tolerance  # noqa: E402
from zmqllm.engine.cache import KVCache  # noqa: E402
from zmqllm.engine.decoder_layer import Segment  # noqa: E402
from zmqllm.engine.generator import Generator, load_shard  # noqa: E402
from zmqllm.engine.model import MistralShard  # noqa: E402
from zmqllm.models.model_args import ModelArgs  # noqa: E402

pytestmark = pytest.mark.torch

SPLITS = {1: [(0, 4)], 2: [(0, 2), (2, 4)], 3: [(0, 1), (1, 3), (3, 4)]}


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir: Path):
    return transformers.MistralForCausalLM.from_pretrained(tiny_model_dir).eval()


def _prompt(n: int, seed: int = 1, vocab: int = 500) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """HF generate, greedy, exactly n tokens (no stop on EOS).

    The attention mask is passed explicitly: without it, generate infers one from
    the pad token, and the default model's pad id is its <|im_end|>, which chat
    prompts contain.
    """
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


def _chain(shards: list[MistralShard], caches: list[KVCache], x, all_logits: bool = False):
    h = x
    for shard, cache in zip(shards, caches, strict=True):
        h = shard(h, [Segment(cache, x.shape[0])], all_logits=all_logits)
    return h


def _close(actual: torch.Tensor, expected: torch.Tensor, shard: MistralShard) -> None:
    """Equal up to float32 sums taken in another order (tests/float_tolerance.py)."""
    tolerance = reorder_tolerance(expected, reduction_length(shard.args))
    torch.testing.assert_close(actual, expected, **tolerance)


def _caches(shards: list[MistralShard], max_len: int) -> list[KVCache]:
    a = shards[0].args
    return [
        KVCache(s.num_local_layers, a.num_kv_heads, max_len, a.head_dim, s.dtype, "cpu")
        for s in shards
    ]


def test_tiny_model_has_a_window_shorter_than_the_prompt(tiny_model_dir: Path) -> None:
    args = ModelArgs.from_dir(tiny_model_dir)
    assert args.sliding_window == 8
    assert args.num_kv_heads < args.num_heads  # GQA path exercised


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_prefill_logits_match_hf(tiny_model_dir: Path, hf_tiny, stages: int) -> None:
    ids = torch.tensor(_prompt(30))  # 30 tokens > window of 8
    shards = [load_shard(tiny_model_dir, s, e) for s, e in SPLITS[stages]]
    ours = _chain(shards, _caches(shards, 64), ids, all_logits=True)
    with torch.no_grad():
        ref = hf_tiny(ids[None]).logits[0]
    assert ours.shape == ref.shape
    _close(ours, ref, shards[0])


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_40_greedy_tokens_match_hf_generate(tiny_model_dir: Path, hf_tiny, stages: int) -> None:
    prompt = _prompt(12, seed=2)
    gen = Generator(tiny_model_dir, SPLITS[stages])
    ours = list(gen.generate(prompt, 40))
    ref = _hf_greedy(hf_tiny, prompt, 40)
    assert len(ref) == 40
    assert ours == ref


def test_decode_logits_match_hf_step_by_step(tiny_model_dir: Path, hf_tiny) -> None:
    """Every decode position past the window gives HF's full-sequence logits."""
    prompt = _prompt(5, seed=3)
    shards = [load_shard(tiny_model_dir, s, e) for s, e in SPLITS[2]]
    caches = _caches(shards, 40)
    seq = list(prompt)
    _chain(shards, caches, torch.tensor(prompt))
    for tok in _prompt(20, seed=4):
        seq.append(tok)
        ours = _chain(shards, caches, torch.tensor([tok]))[0]
        with torch.no_grad():
            ref = hf_tiny(torch.tensor([seq])).logits[0, -1]
        _close(ours, ref, shards[0])


def _alone(shards, prompt: list[int], extra: list[int]) -> torch.Tensor:
    caches = _caches(shards, 64)
    _chain(shards, caches, torch.tensor(prompt))
    out = None
    for tok in extra:
        out = _chain(shards, caches, torch.tensor([tok]))[0]
    assert out is not None
    return out


def test_batched_decode_equals_each_session_alone(tiny_model_dir: Path) -> None:
    shards = [load_shard(tiny_model_dir, s, e) for s, e in SPLITS[2]]
    prompts = [_prompt(n, seed=10 + n) for n in (3, 9, 17, 26)]
    nexts = [_prompt(3, seed=20 + i) for i in range(4)]
    caches = [_caches(shards, 64) for _ in prompts]
    for p, c in zip(prompts, caches, strict=True):
        _chain(shards, c, torch.tensor(p))
    for step in range(3):
        h = torch.tensor([n[step] for n in nexts])
        for i, shard in enumerate(shards):
            h = shard(h, [Segment(c[i], 1) for c in caches])
    assert h.shape == (4, shards[-1].args.vocab_size)
    for row, (p, n) in enumerate(zip(prompts, nexts, strict=True)):
        _close(h[row], _alone(shards, p, n), shards[0])


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="packing needs MKL")
def test_packed_weights_give_the_same_logits(tiny_model_dir: Path) -> None:
    """Batches within the packed row count (padded up to it) and beyond (unpacked path):
    the same logits as without packing, up to float32 rounding: MKL's packed GEMM adds
    the products in its own order, which depends on the CPU (AVX2 or AVX-512), so the
    logits agree within K * eps * max|logit| (tests/float_tolerance.py), not bit for bit."""
    plain = [load_shard(tiny_model_dir, s, e) for s, e in SPLITS[2]]
    packed = [load_shard(tiny_model_dir, s, e) for s, e in SPLITS[2]]
    assert all(sh.pack(8) > 0 for sh in packed)
    for rows in (7, 8, 11):
        tokens = torch.tensor(_prompt(rows, seed=rows))
        want = _chain(plain, _caches(plain, 32), tokens, all_logits=True)
        got = _chain(packed, _caches(packed, 32), tokens, all_logits=True)
        _close(got, want, plain[0])
    assert load_shard(tiny_model_dir, 0, 2, dtype="bfloat16").pack(8) == 0  # float32 only
    assert load_shard(tiny_model_dir, 0, 2).pack(4) == 0  # below PACK_MIN_ROWS: nothing to gain


def test_prefill_and_decode_mixed_in_one_call(tiny_model_dir: Path) -> None:
    shards = [load_shard(tiny_model_dir, s, e) for s, e in SPLITS[2]]
    old, new = _prompt(11, seed=30), _prompt(14, seed=31)
    dec = _prompt(2, seed=32)
    c_old, c_new = _caches(shards, 64), _caches(shards, 64)
    _chain(shards, c_old, torch.tensor(old))
    _chain(shards, c_old, torch.tensor([dec[0]]))
    # One call: a decode token for `old` and the whole prompt of `new`.
    h = torch.tensor([dec[1], *new])
    for i, shard in enumerate(shards):
        h = shard(h, [Segment(c_old[i], 1), Segment(c_new[i], len(new))])
    _close(h[0], _alone(shards, old, dec), shards[0])
    ref_new = _chain(shards, _caches(shards, 64), torch.tensor(new))[-1]
    _close(h[1], ref_new, shards[0])


def test_chunked_prefill_equals_one_shot(tiny_model_dir: Path) -> None:
    shards = [load_shard(tiny_model_dir, s, e) for s, e in SPLITS[1]]
    prompt = _prompt(29, seed=40)
    caches = _caches(shards, 64)
    for lo in range(0, 29, 7):  # chunks of 7 cross the window boundary
        out = _chain(shards, caches, torch.tensor(prompt[lo : lo + 7]))
    ref = _chain(shards, _caches(shards, 64), torch.tensor(prompt))
    _close(out, ref, shards[0])


def test_cache_overflow_is_refused(tiny_model_dir: Path) -> None:
    shards = [load_shard(tiny_model_dir, 0, 4)]
    caches = _caches(shards, 4)
    with pytest.raises(ValueError, match="overflows"):
        _chain(shards, caches, torch.tensor(_prompt(5)))


def test_bad_layer_range_is_refused(tiny_model_dir: Path) -> None:
    args = ModelArgs.from_dir(tiny_model_dir)
    with pytest.raises(ValueError, match="outside"):
        MistralShard(args, 2, 9)


@pytest.mark.slow
def test_default_model_two_shards_match_hf_generate(default_model_dir: Path) -> None:
    from zmqllm.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir)
    ref_model = transformers.MistralForCausalLM.from_pretrained(default_model_dir).eval()
    gen = Generator(default_model_dir, [(0, 15), (15, 30)])
    prompts = [
        "Write a haiku about the sea.",
        "Explain what a message broker does, in two sentences.",
        "List three uses of the Python programming language.",
    ]
    for text in prompts:
        ids = tok.encode_chat([{"role": "user", "content": text}])
        ours = list(gen.generate(ids, 32))
        ref = _hf_greedy(ref_model, ids, 32)
        assert len(ref) == 32
        assert ours == ref, text


@pytest.mark.parametrize("rows", [1, 8, 16, 32, 40])
def test_bfloat16_batches_take_hfs_own_product(rows: int) -> None:
    """Where the CPU has bfloat16 units, a bfloat16 weight multiplies batches of any size
    with F.linear, HF's own call (oneDNN on the units), bit for bit; float32 batches of
    7-32 rows take W @ x^T (and bfloat16 ones on CPUs without the units)."""
    import torch.nn.functional as F

    from zmqllm.engine.linear import BF16_UNITS, Linear

    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g)
    x = torch.randn(rows, 64, generator=g)
    wb, xb = w.bfloat16(), x.bfloat16()
    band = 7 <= rows <= 32
    want = torch.mm(wb, xb.t()).t().contiguous() if band and not BF16_UNITS else F.linear(xb, wb)
    assert torch.equal(Linear(wb)(xb), want)
    if band:
        assert torch.equal(Linear(w)(x), torch.mm(w, x.t()).t().contiguous())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_shards_track_hf_in_the_same_dtype(tiny_model_dir: Path, dtype: str) -> None:
    tdtype = getattr(torch, dtype)
    ref_model = transformers.MistralForCausalLM.from_pretrained(tiny_model_dir, dtype=tdtype)
    ids = torch.tensor(_prompt(20, seed=50))
    shards = [load_shard(tiny_model_dir, s, e, dtype=dtype) for s, e in SPLITS[2]]
    assert all(p.dtype == tdtype for s in shards for p in s.parameters())
    ours = _chain(shards, _caches(shards, 32), ids, all_logits=True)
    with torch.no_grad():
        ref = ref_model.eval()(ids[None]).logits[0].float()
    # Half precision: agreement to its own rounding, not float32's.
    torch.testing.assert_close(ours, ref, rtol=5e-2, atol=5e-2)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
