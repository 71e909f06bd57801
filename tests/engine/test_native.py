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
from zmqllm.engine.decoder_layer import Segment  # noqa: E402
from zmqllm.engine.generator import load_shard  # noqa: E402
from zmqllm.engine.model import SPEC_ROW_STEP, MistralShard  # noqa: E402

pytestmark = pytest.mark.torch


def _caches(
    shard: MistralShard, lengths: list[int], dtype: torch.dtype | None = None
) -> list[KVCache]:
    a = shard.args
    kv = dtype or shard.dtype
    return [
        KVCache(shard.num_local_layers, a.num_kv_heads, n, a.head_dim, kv, "cpu") for n in lengths
    ]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_batched_decode_matches_the_pytorch_path(
    kernel: ModuleType, tiny_model_dir: Path, kv_dtype: torch.dtype
) -> None:
    """Sessions of different lengths (some beyond the sliding window of 8), decoding
    together, with a prefill chunk joining midway: same logits, same greedy tokens. With
    bfloat16 caches (``kv_dtype``) both paths widen the cached numbers and round new ones
    as PyTorch rounds."""
    plain = load_shard(tiny_model_dir, 0, 4)
    fast = load_shard(tiny_model_dir, 0, 4)
    assert fast.use_kernel(kernel) and not plain.use_kernel(None)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, size=n) for n in (1, 3, 7, 9, 12)]
    late = rng.integers(3, 200, size=6)
    caches = {
        name: _caches(s, [40] * 6, kv_dtype) for name, s in (("plain", plain), ("fast", fast))
    }
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
                if kv_dtype is torch.bfloat16:
                    # Those last-bit differences in a new key or value can round it to the
                    # other bfloat16 neighbour (a step of 2^-8 of it): the logits' bound is
                    # then bfloat16's step of the largest, far above what it moves them.
                    tolerance["atol"] = 2**-8 * float(reference[step].abs().max())
                torch.testing.assert_close(logits, reference[step], **tolerance)
            nxt = [int(t) for t in logits[:5].argmax(-1)]
            out += nxt
        tokens[name] = out
    assert tokens["fast"] == tokens["plain"]
    # The window was crossed: the longest session ended past 8 + 14 tokens.
    assert caches["fast"][4].length == 12 + 14
    assert all(c.k.dtype is kv_dtype and c.v.dtype is kv_dtype for c in caches["fast"])


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

    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("ZMQLLM_NATIVE", "1")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("ZMQLLM_HOME", str(tmp_path))  # nothing built there yet
    assert native.load() is None  # logged as a warning; the worker goes on


def test_fused_layer_steps_match_pytorch(kernel: ModuleType) -> None:
    """RMSNorm, rotary embedding and silu(gate) * up of a batched decode forward."""
    import torch.nn.functional as F

    from zmqllm.engine.decoder_layer import RMSNorm, _rope

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=g) * 3
    norm = RMSNorm(64, 1e-5)
    norm.weight.copy_(torch.randn(64, generator=g))
    # The kernel's AVX2 sum of squares against PyTorch's (whose SIMD width depends on the
    # CPU): a float32 reduction over 64 elements in another order, not a fixed 1e-5.
    normed = norm(x)
    tolerance = reorder_tolerance(normed, 64)
    torch.testing.assert_close(kernel.rms_norm(x, norm.weight, 1e-5), normed, **tolerance)

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


def test_a_built_module_loads_without_the_build_step(kernel: ModuleType) -> None:
    """Another process (another checkout or venv, same torch) imports the built
    module straight from the cache: torch's loader, whose ninja check would see
    another venv's include paths and rebuild, is never called."""
    built = native.build_root() / native.cache_key() / "zmqllm_native.so"
    assert built.is_file() and Path(kernel.__file__ or "") == built
    code = (
        "from torch.utils import cpp_extension\n"
        "def refuse(**_): raise AssertionError('rebuilt')\n"
        "cpp_extension.load = refuse\n"
        "from zmqllm.engine import native\n"
        "assert native.load() is not None"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", code], env=env, timeout=300, check=False)
    assert done.returncode == 0


def test_the_cache_key_is_what_determines_the_binary(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    key = native.cache_key()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    assert native.cache_key() == key  # not the checkout's or the venv's path
    monkeypatch.setattr(native, "CFLAGS", (*native.CFLAGS, "-DNDEBUG"))
    flags = native.cache_key()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert len({key, flags, native.cache_key()}) == 3


def test_every_csrc_file_is_built_and_keyed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each kernel, each instruction set's file and the bindings are compiled, and a
    change to any of them (a header too) is a new binary."""
    on_disk = {p.name for p in native.CSRC.iterdir() if p.suffix in (".cpp", ".h")}
    assert {p.name for p in (*native.SOURCES, *native.HEADERS)} == on_disk
    assert {"bindings.cpp", "quant.cpp", "quant_avx2.cpp", "quant_avx512.cpp"} <= on_disk
    copy = tmp_path / "csrc"
    copy.mkdir()
    for name in on_disk:
        (copy / name).write_bytes((native.CSRC / name).read_bytes())
    keys = set()
    for name in sorted(on_disk):
        monkeypatch.setattr(native, "SOURCES", native.sources(copy))
        monkeypatch.setattr(native, "HEADERS", native.headers(copy))
        keys.add(native.cache_key())
        with open(copy / name, "a") as f:
            f.write("// changed\n")
    monkeypatch.setattr(native, "SOURCES", native.sources(copy))
    monkeypatch.setattr(native, "HEADERS", native.headers(copy))
    keys.add(native.cache_key())
    assert len(keys) == len(on_disk) + 1


@pytest.mark.parametrize(("out", "inp"), [(4, 16), (13, 37), (960, 576), (576, 1536), (1, 8)])
def test_gemv_matches_f_linear(kernel: ModuleType, out: int, inp: int) -> None:
    """Row counts off the 4-row blocks and lengths off the 16-wide loop take the tails;
    1 to GEMV_MAX_ROWS rows of x, each row the same bits as when it is alone (a
    speculative pass's rows compute what the same steps decoded one by one would)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(out * inp)
    most = kernel.GEMV_MAX_ROWS
    x, w = torch.randn(most, inp, generator=g), torch.randn(out, inp, generator=g)
    alone = torch.cat([kernel.gemv(x[i : i + 1], w) for i in range(most)])
    for rows in range(1, most + 1):
        want = F.linear(x[:rows], w)
        got = kernel.gemv(x[:rows], w)
        torch.testing.assert_close(got, want, **reorder_tolerance(want, inp))
        assert torch.equal(got, alone[:rows]), rows
    with pytest.raises(RuntimeError, match="gemv"):
        kernel.gemv(torch.randn(most + 1, inp), w)
    with pytest.raises(RuntimeError, match="gemv"):
        kernel.gemv(x[:1].double(), w.double())


def test_single_stream_fast_path_tracks_the_pytorch_path(
    kernel: ModuleType, tiny_model_dir: Path
) -> None:
    """One session, decoding past the window: one-row products in the compiled gemv,
    attention and the small steps in the kernel; logits equal the PyTorch path's to
    float32 rounding at every step, and so do the greedy tokens."""
    from zmqllm.engine.linear import GemvLinear

    plain = load_shard(tiny_model_dir, 0, 4)
    fast = load_shard(tiny_model_dir, 0, 4)
    assert fast.use_kernel(kernel) and isinstance(fast.layers[0].wqkv, GemvLinear)
    assert isinstance(fast.head, GemvLinear)
    tokens: dict[str, list[int]] = {"plain": [], "fast": []}
    (cp,), (cf,) = _caches(plain, [40]), _caches(fast, [40])
    prompt = torch.tensor([5, 17, 99, 3, 250])
    want, got = plain(prompt, [Segment(cp, 5)]), fast(prompt, [Segment(cf, 5)])
    for _ in range(20):
        torch.testing.assert_close(
            got, want, **reorder_tolerance(want, reduction_length(plain.args))
        )
        tokens["plain"].append(int(want[0].argmax()))
        tokens["fast"].append(int(got[0].argmax()))
        want = plain(torch.tensor(tokens["plain"][-1:]), [Segment(cp, 1)])
        got = fast(torch.tensor(tokens["fast"][-1:]), [Segment(cf, 1)])
    assert tokens["fast"] == tokens["plain"]
    assert cf.length == 5 + 20 > 8  # past the sliding window


@pytest.mark.parametrize("units", [True, False])
@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
@pytest.mark.parametrize(("beside", "most"), [(False, False), (True, False), (True, True)])
def test_a_speculative_pass_computes_the_bits_of_steps_decoded_one_by_one(
    kernel: ModuleType, tiny_model_dir: Path, beside: bool, most: bool, quant: str, units: bool
) -> None:
    """A session's token and its proposals as one segment of a few rows (a speculative
    pass), past the sliding window: every row attends in the decode kernel and goes
    through the few-row gemv, so its logits are the same bits as the same positions
    decoded one step at a time (what lets speculation keep greedy text as it is),
    alone in its forward or beside another session's decode step; ``most``: the pass
    and that step fill the rows speculation may take (exact_row_count: the kernel's
    GEMV_MAX_ROWS, fewer for int8/int4 where the matrix units, on with ``units``, take
    the products in bfloat16 from fewer rows)."""
    kernel.set_matrix_units(units)
    try:
        _speculative_pass_bits(kernel, tiny_model_dir, beside, most, quant)
    finally:
        kernel.set_matrix_units(True)


def _speculative_pass_bits(
    kernel: ModuleType, tiny_model_dir: Path, beside: bool, most: bool, quant: str
) -> None:
    fast = load_shard(tiny_model_dir, 0, 4, quant=quant)  # int8/int4: the kernel's products
    assert fast.use_kernel(kernel)
    assert fast.row_steps()[0] == min(SPEC_ROW_STEP, fast.exact_row_count())
    (one, spec, other) = _caches(fast, [60, 60, 60])
    prompt = torch.tensor([5, 17, 99, 3, 250, 8, 1])
    fast(prompt, [Segment(one, 7)])
    fast(prompt, [Segment(spec, 7)])
    fast(prompt[:3], [Segment(other, 3)])
    exact = fast.exact_row_count()
    mat = fast._decode_layers[1][0] if fast._decode_layers else None
    if quant != "none" and mat is not None and exact < kernel.GEMV_MAX_ROWS:
        assert kernel.matrix_units() and kernel.matmul_choice(mat, exact + 1) != "direct"
    # any tokens: proposals need not be the model's
    steps = [11, 42, 7, 300, 42, 5][: exact - int(beside)]
    if most:
        steps = [(7 * i + 11) % 300 for i in range(fast.exact_row_count() - 1)]
    n = len(steps)
    want = torch.cat([fast(torch.tensor([t]), [Segment(one, 1)]) for t in steps])
    if beside:
        x = torch.tensor([*steps, 9])
        got = fast(x, [Segment(spec, n), Segment(other, 1)], logit_rows=[n, 1])[:n]
    else:
        got = fast(torch.tensor(steps), [Segment(spec, n)], logit_rows=[n])
    assert spec.length == one.length == 7 + n > 8  # past the window of 8
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("dtype", "quant", "with_kernel", "proposes"),
    [
        ("float32", "none", True, True),
        ("float32", "int4", True, True),
        ("float32", "none", False, False),  # ZMQLLM_NATIVE=0, no compiler
        ("bfloat16", "none", True, False),  # no kernel in bfloat16
    ],
)
def test_speculative_auto_proposes_only_where_a_pass_keeps_each_row_s_bits(
    kernel: ModuleType, tiny_model_dir: Path, dtype: str, quant: str, with_kernel: bool,
    proposes: bool,
) -> None:  # fmt: skip
    """The default, speculative = "auto", is lookup exactly where the test above holds."""
    from zmqllm.engine.stage import Stage

    shard = load_shard(tiny_model_dir, 2, 4, dtype=dtype, quant=quant)
    shard.use_kernel(kernel if with_kernel else None)
    assert shard.exact_rows() is proposes
    stage = Stage(shard, speculative="auto")
    assert stage.proposes is proposes
    assert stage.speculation.mode == ("lookup" if proposes else "off")
    first = Stage(load_shard(tiny_model_dir, 0, 2), speculative="auto")
    assert not first.proposes  # only a last stage proposes


def test_speculation_stops_at_8_rows_where_the_few_row_path_takes_more(
    kernel: ModuleType, tiny_model_dir: Path
) -> None:
    """The steps of a forward's cost that proposals do not cross (MistralShard.row_steps):
    8 rows, the few-row path's own (16 on AVX2 builds), then 32 for float32; for
    int8/int4 with the matrix units on, the last row before they take over."""
    shard = load_shard(tiny_model_dir, 0, 4)
    assert shard.row_steps() == (32,)  # no kernel: only the W @ xᵀ band's end
    shard.use_kernel(kernel)
    few = kernel.GEMV_MAX_ROWS
    assert few in (8, 16)  # 8 on AVX-512 builds, 16 on AVX2 (csrc/ops.h)
    assert shard.row_steps() == ((8, 32) if few == 8 else (8, 16, 32))
    int4 = load_shard(tiny_model_dir, 0, 4, quant="int4")  # computes in float32
    assert int4.use_kernel(kernel)
    kernel.set_matrix_units(False)
    try:
        assert int4.row_steps() == shard.row_steps()
    finally:
        kernel.set_matrix_units(True)
    if kernel.matrix_units():  # bfloat16 from fewer rows than the few-row path: stop there
        assert int4.row_steps() == (min(8, int4.exact_row_count()),)
        assert int4.exact_row_count() < few
    else:
        assert int4.row_steps() == shard.row_steps()
