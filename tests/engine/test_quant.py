"""Quantized weights (engine.quant) and the compiled int8/int4 products against
PyTorch on the dequantized weight; quantized shards of the tiny model."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

from tests.float_tolerance import FLOAT32_EPS, reorder_tolerance  # noqa: E402
from zmqllm.engine import native, quant  # noqa: E402
from zmqllm.engine.generator import Generator, load_shard  # noqa: E402
from zmqllm.engine.linear import QuantLinear  # noqa: E402
from zmqllm.engine.quant import QuantTensor  # noqa: E402


def product_tolerance(w: torch.Tensor, x: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    """The kernel meets few rows in 16-bit steps of each block's largest |x| (at most
    half a step, max|x_b| / 65534, off per element) and sums in another order."""
    cols = w.shape[1]
    blocks = x.abs().view(x.shape[0], cols // 32, 32).amax(-1)  # [rows, blocks]
    steps = (blocks / 65534).repeat_interleave(32, dim=1)  # per element of x
    bound = float((steps @ w.abs().T).max())
    tol = reorder_tolerance(want, cols)
    return {"rtol": 0.0, "atol": tol["atol"] + 1.01 * bound}


def bf16_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The matrix-unit path's reference: both operands rounded to bfloat16 (nearest even),
    the products summed in float32 (in float64 here, then rounded)."""
    return (x.bfloat16().double() @ w.bfloat16().double().T).float()


def codes_product(
    x: torch.Tensor, t: QuantTensor, w: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """The codes path's reference: activations rounded to bfloat16 (nearest even), the
    dequantized weight as it is (float64, then rounded); and its tolerance. The kernel
    sums each block's codes times x in float32 (16 steps of two products; int4's codes
    as 128 + q, int8's as q), scales it by d, adds the offset (int4: m - 128 d; int8: m,
    if any) times sum(x) and sums the blocks: its error is at most that many float32
    roundings of the largest such terms, not of the weight's own size."""
    xb = x.bfloat16().double()
    want = (xb @ w.double().T).float()
    d = t.d.double().repeat_interleave(32, dim=1)
    m = t.m.double().repeat_interleave(32, dim=1) if t.m.numel() else torch.zeros_like(d)
    if t.kind == "int4":
        terms = xb.abs() @ (143 * d.abs() + (m - 128 * d).abs()).T  # [rows, out]
    else:
        terms = xb.abs() @ (128 * d.abs() + m.abs()).T
    steps = 16 + 2 + w.shape[1] // 32
    return want, {"rtol": 0.0, "atol": steps * FLOAT32_EPS * float(terms.max())}


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the VNNI path meets it: in steps max|x_b| / 127 of each block of 32, rounded
    to nearest even (float64)."""
    rows, cols = x.shape
    blocks = x.view(rows, cols // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    # 127 / amax divided as the kernel divides (``127.0 / t`` would multiply by 1 / t).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv)
    return (codes.double() * (amax / 127.0).double()).view(rows, cols)


def vnni_product(
    x: torch.Tensor, w: torch.Tensor, m: torch.Tensor, d: torch.Tensor | None = None
) -> torch.Tensor:
    """The VNNI path's reference: the codes' share of each weight times the int8
    activations, the offsets' share times x itself (float64, then rounded). Int4 (``d``
    given) takes its codes as q - 8 and its offsets as m + 8 d (one float32 rounding)."""
    if m.numel() == 0:
        m = torch.zeros(w.shape[0], w.shape[1] // 32)
    if d is not None:
        m = torch.addcmul(m.float(), d.float(), torch.full_like(d.float(), 8.0))
    offsets = m.double().repeat_interleave(32, dim=1)
    return (int8_activations(x) @ (w.double() - offsets).T + x.double() @ offsets.T).float()


def path_reference(
    path: str, x: torch.Tensor, w: torch.Tensor, t: QuantTensor | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """What a named path of the kernel's product must equal, and how closely: the
    bfloat16, codes and VNNI paths their own rounding up to the order of their float32
    sums (codes and VNNI need the quantized weight ``t`` whose dequantized form is
    ``w``); the others the float32 product up to their 16-bit activations
    (product_tolerance)."""
    if path in ("bf16", "brgemm"):
        want = bf16_product(x, w)
        return want, reorder_tolerance(want, w.shape[1])
    if path == "codes":
        assert t is not None, "the codes reference needs the quantized weight"
        return codes_product(x, t, w)
    if path == "vnni":
        assert t is not None, "the VNNI reference needs the quantized weight"
        want = vnni_product(x, w, t.m, t.d if t.kind == "int4" else None)
        return want, reorder_tolerance(want, w.shape[1])
    want = x @ w.T
    return want, product_tolerance(w, x, want)


def built_paths(kernel: ModuleType) -> list[str]:
    """The paths this CPU's build has beside the portable ones: on AVX512_BF16, bf16
    (our AMX tiles where granted), brgemm (oneDNN's, the same numbers) and codes; VNNI.
    Every path takes int8 and int4 weights."""
    bf16 = ["bf16", "brgemm", "codes"] if kernel.bf16_built() else []
    return bf16 + (["vnni"] if kernel.vnni_built() else [])


def _q4_exact(out: int, cols: int, seed: int) -> torch.Tensor:
    """A weight every block of which is d * q + m with q in 0..15 using 0 and 15:
    what a Q4_1 file dequantizes to."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out, cols // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(out, cols // 32, 1, generator=g) * 0.1 + 0.01
    m = -torch.rand(out, cols // 32, 1, generator=g)
    return (d * q + m).view(out, cols)


def test_int4_represents_a_q4_weight_to_rounding() -> None:
    w = _q4_exact(24, 96, seed=1)
    t = quant.quantize_int4(w)
    assert t.q.dtype is torch.uint8 and t.q.shape == (24, 48) and t.d.shape == (24, 3)
    assert t.shape == (24, 96)
    torch.testing.assert_close(quant.dequantize(t), w, rtol=0, atol=1e-6)


def test_int8_error_is_within_half_a_step_per_block() -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 64, generator=g)
    t = quant.quantize_int8(w)
    blocks = w.view(16, 2, 32)
    step = (blocks.amax(-1) - blocks.amin(-1)) / 255
    assert t.q.dtype is torch.int8 and t.d.shape == t.m.shape == (16, 2)
    err = (quant.dequantize(t) - w).view(16, 2, 32).abs()
    assert (err <= step[..., None] / 2 + 1e-6).all()


def test_int8_holds_a_q4_weight_to_rounding() -> None:
    """255 = 15 * 17: every level of a 4-bit block is an 8-bit level too."""
    w = _q4_exact(8, 64, seed=3)
    torch.testing.assert_close(quant.dequantize(quant.quantize_int8(w)), w, rtol=0, atol=1e-6)


def test_constant_and_zero_blocks_quantize_without_dividing_by_zero() -> None:
    w = torch.zeros(2, 64)
    w[1] = 0.25
    for kind in ("int8", "int4"):
        back = quant.dequantize(quant.quantize(w, kind))
        assert torch.equal(back, w), kind


def test_a_dimension_off_the_block_size_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize_int4(torch.randn(4, 40))
    with pytest.raises(ValueError, match="not one of"):
        quant.quantize(torch.randn(4, 64), "int3")


def test_fusing_keeps_rows_in_order_and_refuses_mixed_kinds() -> None:
    a, b = quant.quantize_int4(torch.randn(4, 64)), quant.quantize_int4(torch.randn(2, 64))
    both = quant.cat([a, b])
    torch.testing.assert_close(
        quant.dequantize(both), torch.cat([quant.dequantize(a), quant.dequantize(b)])
    )
    with pytest.raises(ValueError, match="kinds"):
        quant.cat([a, quant.quantize_int8(torch.randn(2, 64))])


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, 17, 40, 130])
@pytest.mark.parametrize(("out", "cols"), [(13, 64), (300, 576), (576, 1536), (7, 96), (5, 32)])
def test_kernel_product_matches_pytorch_on_the_dequantized_weight(
    kernel: ModuleType, kind: str, rows: int, out: int, cols: int
) -> None:
    """Each row count through the path the kernel chooses for it, and every path that
    can take it: up to 16 rows the widening loop in one pass, more that loop 16 at a time
    (chunks) or the dequantized slices, and from 8 rows the bfloat16 matrix-unit path
    where it is built. Row counts off the 4-row chunks and output counts off the task
    grain and the 32-row panels take the tails, and an odd number of blocks per row the
    last block alone (the AVX2 loop steps two blocks; AVX-512 meets blocks in pairs)."""
    g = torch.Generator().manual_seed(rows * out + cols)
    t = quant.quantize(torch.randn(out, cols, generator=g), kind)
    x = torch.randn(rows, cols, generator=g)
    matrix = kernel.Matrix(quant.KIND[kind], t.q, t.d, t.m)
    w = quant.dequantize(t)
    want, tol = path_reference(kernel.matmul_choice(matrix, rows), x, w, t)
    torch.testing.assert_close(kernel.matmul(x, matrix), want, **tol)
    paths = ["chunks", "dequant"] + (["direct"] if rows <= 16 else [])
    for path in paths + built_paths(kernel):
        want, tol = path_reference(path, x, w, t)
        torch.testing.assert_close(kernel.matmul_path(x, matrix, path), want, **tol, msg=path)
    torch.testing.assert_close(kernel.dequantize(matrix), quant.dequantize(t))


@pytest.mark.parametrize("rows", [1, 24])
def test_bf16_path_widens_float16_scales_as_dequantize_does(kernel: ModuleType, rows: int) -> None:
    """GGUF's float16 scales and minimums (Q4_1 blocks as loaded) through every path."""
    g = torch.Generator().manual_seed(rows)
    t = quant.quantize(torch.randn(200, 2112, generator=g), "int4")
    half = QuantTensor("int4", t.q, t.d.half(), t.m.half())
    matrix = kernel.Matrix(2, half.q, half.d, half.m)
    w = quant.dequantize(QuantTensor("int4", t.q, half.d.float(), half.m.float()))
    x = torch.randn(rows, 2112, generator=g)
    for path in ["chunks", "dequant", *built_paths(kernel)]:
        want, tol = path_reference(
            path, x, w, QuantTensor("int4", t.q, half.d.float(), half.m.float())
        )
        torch.testing.assert_close(kernel.matmul_path(x, matrix, path), want, **tol, msg=path)


def test_matrix_units_can_be_turned_off(kernel: ModuleType) -> None:
    """Off: the 16-bit widening loop, in chunks of 16 rows, then dequantize + GEMM. On:
    the widening loop up to 7 rows (5 with AMX tiles), then bfloat16 where built (without
    AMX the codes path for int4 and int8 at 8-16 and 24-32 rows). With
    int8 activations too: VNNI from 5 rows, bfloat16 from 12 rows on AMX tiles."""
    t = quant.quantize(torch.randn(40, 64), "int4")
    matrix = kernel.Matrix(2, t.q, t.d, t.m)
    rows = (4, 5, 6, 8, 11, 12, 16, 17, 23, 24, 32, 33, 45, 48, 72, 300)
    try:
        kernel.set_matrix_units(False)
        assert kernel.matrix_units() == ""
        assert [kernel.matmul_choice(matrix, n) for n in (1, 16, 17, 128)] == [
            "direct",
            "direct",
            "chunks",
            "dequant",
        ]
        kernel.set_matrix_units(True)
        units = kernel.matrix_units().split(",") if kernel.matrix_units() else []
        amx = "amx" in units
        assert units == (["amx" if amx else "avx512_bf16"] if kernel.bf16_built() else [])
        choices = [kernel.matmul_choice(matrix, n) for n in rows]
        if kernel.bf16_built():
            # Without AMX: the codes path for 8-16 and 24-32 rows, else oneDNN's.
            first = 6 if amx else 8
            codes = {8, 11, 12, 16, 24, 32}
            many = ["codes" if n in codes and not amx else "bf16" for n in rows]
            assert choices == [
                m if n >= first else "direct" for n, m in zip(rows, many, strict=True)
            ]
            int8 = quant.quantize(torch.randn(40, 64), "int8")
            int8_matrix = kernel.Matrix(1, int8.q, int8.d, int8.m)
            assert [kernel.matmul_choice(int8_matrix, n) for n in rows] == choices
        kernel.set_matrix_units(True, vnni=True)
        if kernel.vnni_built():
            assert kernel.matrix_units().split(",")[0] == "avx512_vnni"
            many = "bf16" if amx else "vnni"
            assert [kernel.matmul_choice(matrix, n) for n in rows] == (
                ["direct"] + ["vnni"] * 4 + [many] * 11
            )
        kernel.set_matrix_units(False, vnni=True)  # VNNI needs the units on
        assert kernel.matrix_units() == ""
    finally:
        kernel.set_matrix_units(True)
    with pytest.raises(RuntimeError, match="up to 16 rows"):
        kernel.matmul_path(torch.randn(17, 64), matrix, "direct")
    with pytest.raises(ValueError, match="unknown path"):
        kernel.matmul_path(torch.randn(2, 64), matrix, "amx")


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_codes_path_gives_a_row_the_same_bits_in_any_batch(kernel: ModuleType, kind: str) -> None:
    """Rows are the vector lanes of the codes path: a row's products do not depend on the
    other rows of the call, their number, or its place among them. A build without
    AVX512_BF16 has no such path and says so."""
    g = torch.Generator().manual_seed(7)
    t = quant.quantize(torch.randn(40, 1024, generator=g), kind)
    matrix = kernel.Matrix(quant.KIND[kind], t.q, t.d, t.m)
    x = torch.randn(37, 1024, generator=g)
    if not kernel.bf16_built():
        with pytest.raises(RuntimeError, match="no bfloat16 matrix-unit path"):
            kernel.matmul_path(x, matrix, "codes")
        return
    whole = kernel.matmul_path(x, matrix, "codes")
    for i in (0, 15, 16, 36):
        assert torch.equal(kernel.matmul_path(x[i : i + 1], matrix, "codes")[0], whole[i])
    assert torch.equal(kernel.matmul_path(x[5:21], matrix, "codes"), whole[5:21])


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 12, 24])
def test_kernel_product_of_q8_0_blocks_without_offsets(
    kernel: ModuleType, rows: int, half: bool
) -> None:
    """GGUF's Q8_0 (a scale per block, no offset; float16 as the file holds it, or
    float32) through the same product."""
    g = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (70, 96), generator=g, dtype=torch.int8)
    d = torch.rand(70, 3, generator=g) / 100
    t = QuantTensor("int8", q, d.half().float() if half else d, torch.empty(0))
    x = torch.randn(rows, 96, generator=g)
    w = quant.dequantize(t)
    matrix = kernel.Matrix(1, t.q, d.half() if half else d, t.m)
    for path in [kernel.matmul_choice(matrix, rows), *built_paths(kernel)]:
        want, tol = path_reference(path, x, w, t)
        torch.testing.assert_close(kernel.matmul_path(x, matrix, path), want, **tol, msg=path)


def test_kernel_refuses_what_it_cannot_multiply(kernel: ModuleType) -> None:
    t = quant.quantize_int4(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.Matrix(2, torch.zeros(8, 20, dtype=torch.uint8), t.d, t.m)
    with pytest.raises(RuntimeError, match="uint8"):
        kernel.Matrix(2, t.q.to(torch.int8), t.d, t.m)
    with pytest.raises(RuntimeError, match="scale"):
        kernel.Matrix(2, t.q, t.d[:, :1].contiguous(), t.m)
    with pytest.raises(RuntimeError, match="kind"):
        kernel.Matrix(7, t.q, t.d, t.m)
    with pytest.raises(RuntimeError, match="minimums"):
        kernel.Matrix(2, t.q, t.d, torch.empty(0))
    matrix = kernel.Matrix(2, t.q, t.d, t.m)
    with pytest.raises(RuntimeError, match="matmul"):
        kernel.matmul(torch.randn(1, 32), matrix)
    with pytest.raises(RuntimeError, match="matmul"):
        kernel.matmul(torch.randn(1, 64, dtype=torch.float64), matrix)


def test_quant_linear_without_the_kernel_computes_the_same(kernel: ModuleType) -> None:
    t = quant.quantize_int4(torch.randn(40, 128))
    lin = QuantLinear(t)
    x = torch.randn(3, 128)
    lin.use(None)
    plain = lin(x)
    lin.use(kernel)
    torch.testing.assert_close(lin(x), plain, **product_tolerance(quant.dequantize(t), x, plain))
    assert lin.num_weights == 40 * 128


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_shards_hold_quantized_weights(tiny_model_dir: Path, kind: str) -> None:
    fp32 = load_shard(tiny_model_dir, 0, 4)
    shard = load_shard(tiny_model_dir, 0, 4, quant=kind)
    assert shard.weights_from == "safetensors"
    linears = [m for m in shard.modules() if isinstance(m, QuantLinear)]
    assert {m.kind for m in linears} == ({"int8"} if kind == "int8" else {"int4", "int8"})
    assert all(m.m.numel() for m in linears)  # quantized at load: with offsets
    assert isinstance(shard.embed, QuantTensor) and shard.embed.kind == "int8"  # and the head
    assert shard.num_parameters() == fp32.num_parameters()
    assert shard.weight_bytes() < fp32.weight_bytes() / 3


def test_quant_needs_float32_on_the_cpu(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="float32 on the cpu"):
        load_shard(tiny_model_dir, 0, 4, dtype="bfloat16", quant="int4")
    with pytest.raises(ValueError, match="not one of"):
        load_shard(tiny_model_dir, 0, 4, quant="fp8")


def round_as_the_kernel(gen: Generator, kernel: ModuleType) -> None:
    """Make the PyTorch products of ``gen``'s quantized linears round as the path the
    kernel chooses for each row count: the reference of a generation through it."""
    for shard in gen.shards:
        for lin in [m for m in shard.modules() if isinstance(m, QuantLinear)]:
            matrix = kernel.Matrix(quant.KIND[lin.kind], lin.q, lin.d, lin.m)

            def forward(x: torch.Tensor, lin: QuantLinear = lin, matrix: object = matrix):
                w = quant.dequantize(lin.tensor)
                path = kernel.matmul_choice(matrix, x.shape[0])
                if path == "bf16":
                    return bf16_product(x, w)
                if path == "codes":
                    return codes_product(x, lin.tensor, w)[0]
                if path == "vnni":
                    return vnni_product(x, w, lin.m, lin.d if lin.kind == "int4" else None)
                return x @ w.T

            lin.forward = forward  # type: ignore[method-assign]


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("bounds", [[(0, 4)], [(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]])
def test_quantized_generation_kernel_equals_pytorch_path(
    tiny_model_dir: Path, kind: str, bounds: list[tuple[int, int]]
) -> None:
    """The compiled single-stream step (decode_layers over int8/int4 matrices) and
    batched products give the greedy tokens of PyTorch on the dequantized weights, each
    product rounded as the path the kernel takes for its rows (the 10-token prompt: the
    bfloat16 path where it is built)."""
    prompt = [5, 17, 3, 99, 42, 7, 11, 60, 2, 81]
    fast = Generator(tiny_model_dir, bounds, quant=kind)
    slow = Generator(tiny_model_dir, bounds, quant=kind, compiled=False)
    assert fast.shards[0].kernel is not None or native.load() is None
    if fast.shards[0].kernel is not None:
        round_as_the_kernel(slow, fast.shards[0].kernel)
    check_generation(fast, slow, prompt)


def check_generation(fast: Generator, slow: Generator, prompt: list[int]) -> None:
    assert list(fast.generate(prompt, 24)) == list(slow.generate(prompt, 24))
    # A batch of three decode rows through the same weights (the batched path).
    for g in (fast, slow):
        for s in ("a", "b", "c"):
            g.open(s, 16)
        g.forward(["a", "b", "c"], [prompt[:4], prompt[:6], prompt[:3]])
    ours = fast.forward(["a", "b", "c"], [[1], [2], [3]])
    ref = slow.forward(["a", "b", "c"], [[1], [2], [3]])
    # Four layers of 16-bit activations in the kernel's products (product_tolerance)
    torch.testing.assert_close(ours, ref, rtol=0, atol=3e-3 * float(ref.abs().max()))
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
