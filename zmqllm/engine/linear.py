"""Linear layers as swappable implementations, chosen once at load.

Every matmul weight of a shard lives in a :class:`Linear` (the portable
PyTorch path). At load, :func:`choose` wraps it in the implementations that are
faster for some batch sizes on this machine; each one handles its row counts and
hands every other batch to the one it wraps. ``forward`` never asks which kind
of weight it has (the shape of gpt-fast's quantize.py, which swaps Linear
modules for quantized ones before the first forward).

- :class:`Linear`: PyTorch's float32 (or bf16, fp16) product, any device.
- :class:`GemvLinear`: one row, or a few, through the compiled AVX2/FMA (or
  AVX-512) matrix-vector product (engine.native): a decode step, or a speculative
  pass's few rows, at about the cost of one.
- :class:`PackedLinear`: MKL's packed GEMM for batches of PACK_MIN_ROWS..rows.
- :class:`QuantLinear`: an int8 or int4 weight (engine.quant) through the compiled
  kernel's products, or dequantized by PyTorch where the kernel is not loaded.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from zmqllm.engine.quant import KIND, QuantTensor, dequantize

# The CPU tuning thresholds, in one place.
# Row counts for which `Linear` multiplies as W @ x^T on the CPU (see there).
CPU_MM_MIN_ROWS = 7
CPU_MM_MAX_ROWS = 32
CPU_MM_MAX_ROWS_HEAD = 15
# Batches from this many rows up to the packed row count take the packed GEMM.
PACK_MIN_ROWS = 7
# Whether this CPU multiplies bfloat16 in hardware (AVX512_BF16, which every AMX CPU has).
BF16_UNITS = torch.cpu._is_avx512_bf16_supported()


class Linear(nn.Module):
    """y = x @ weight^T with PyTorch's kernels; ``weight`` is [out, in]."""

    def __init__(self, weight: torch.Tensor, max_mm_rows: int = CPU_MM_MAX_ROWS) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.max_mm_rows = max_mm_rows

    @property
    def base(self) -> Linear:
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """PyTorch's float32 linear on the CPU handles 4..15 rows a few at a time,
        re-reading the weight each time; computed as W @ x^T the same product reads
        the weight once, which pays in the band CPU_MM_MIN_ROWS..max_mm_rows. Outside
        it F.linear is as fast or faster (and is what transformers uses). Where the CPU
        has bfloat16 units (AMX or AVX512_BF16), bfloat16 always takes F.linear, HF's own
        call, which oneDNN runs on them: 1.2-1.6x faster than W @ x^T at 8-32 rows
        (docs/scale.md); elsewhere bfloat16 keeps the band, as before."""
        if (
            x.device.type == "cpu"
            and (x.dtype is torch.float32 or (x.dtype is torch.bfloat16 and not BF16_UNITS))
            and CPU_MM_MIN_ROWS <= x.shape[0] <= self.max_mm_rows
        ):
            return torch.mm(self.weight, x.t()).t().contiguous()
        return F.linear(x, self.weight)


class _Wrapper(nn.Module):
    """An implementation for some row counts in front of another (``inner``)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    @property
    def base(self) -> Linear:
        base = self.inner.base
        assert isinstance(base, Linear)
        return base

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight


class GemvLinear(_Wrapper):
    """Up to the kernel's GEMV_MAX_ROWS rows: the compiled matrix-vector product, which
    streams the weight at close to the read bandwidth where PyTorch's one-row float32
    path does not, and reads it once for all the rows, where PyTorch's reads it again
    for every few rows from 4 on. Its sums run in another order than PyTorch's: equal
    up to float32 rounding; a row's result is the same bits alone or with others."""

    def __init__(self, inner: nn.Module, kernel: ModuleType) -> None:
        super().__init__(inner)
        self.kernel = kernel
        self.max_rows = int(getattr(kernel, "GEMV_MAX_ROWS", 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.max_rows:
            return self.kernel.gemv(x.contiguous(), self.weight)
        return self.inner(x)


class PackedLinear(_Wrapper):
    """Batches of PACK_MIN_ROWS..rows rows through MKL's packed GEMM, padded to
    ``rows``: the same sgemm as F.linear minus packing the weight on every call,
    which pays when the weights come from memory. Costs a second copy of the weight."""

    def __init__(self, inner: nn.Module, rows: int) -> None:
        super().__init__(inner)
        self.rows = rows
        # w reordered by MKL for exactly ``rows`` rows.
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if not PACK_MIN_ROWS <= m <= self.rows:
            return self.inner(x)
        if m < self.rows:
            x = F.pad(x, (0, 0, 0, self.rows - m))
        out = torch.ops.mkl._mkl_linear(x, self.packed, self.weight, None, self.rows)
        return out[:m] if m < self.rows else out


def packing_available(dtype: torch.dtype, device: torch.device, rows: int) -> bool:
    return (
        rows >= PACK_MIN_ROWS
        and device.type == "cpu"
        and dtype is torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    )


def gemv_available(kernel: ModuleType | None, dtype: torch.dtype, device: torch.device) -> bool:
    return (
        kernel is not None
        and hasattr(kernel, "gemv")
        and device.type == "cpu"
        and dtype is torch.float32
    )


class QuantLinear(nn.Module):
    """y = x @ W^T for a quantized W. With the compiled kernel: its int8/int4
    products, which read the quantized blocks and widen them in registers; without
    it (no compiler, another device): PyTorch on the dequantized weight, slow but
    the same numbers up to rounding order."""

    def __init__(self, weight: QuantTensor) -> None:
        super().__init__()
        self.kind = weight.kind
        self.register_buffer("q", weight.q)
        self.register_buffer("d", weight.d)
        self.register_buffer("m", weight.m)
        self.kernel: ModuleType | None = None
        self.matrix: object | None = None  # the kernel's Matrix over q, d and m

    @property
    def base(self) -> QuantLinear:
        return self

    @property
    def tensor(self) -> QuantTensor:
        return QuantTensor(self.kind, self.q, self.d, self.m)

    @property
    def num_weights(self) -> int:
        out, cols = self.tensor.shape
        return out * cols

    def use(self, kernel: ModuleType | None) -> None:
        self.kernel, self.matrix = None, None
        if kernel is not None and hasattr(kernel, "Matrix") and self.q.device.type == "cpu":
            self.kernel = kernel
            self.matrix = kernel.Matrix(KIND[self.kind], self.q, self.d, self.m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dtype is torch.float32:
            return self.kernel.matmul(x, self.matrix)
        return F.linear(x, dequantize(self.tensor).to(x.dtype))


def kernel_matrix(linear: nn.Module, kernel: ModuleType) -> object:
    """The kernel's Matrix for a chosen linear (decode_layers takes these)."""
    base = linear.base
    if isinstance(base, QuantLinear):
        assert base.matrix is not None, "QuantLinear.use(kernel) comes first"
        return base.matrix
    empty = torch.empty(0)
    return kernel.Matrix(KIND["float32"], base.weight, empty, empty)


def choose(linear: nn.Module, kernel: ModuleType | None, packed_rows: int) -> nn.Module:
    """The implementation for ``linear``'s weight: its plain :class:`Linear`, wrapped
    in those this machine and these settings make available; a quantized weight
    keeps its :class:`QuantLinear`, with the kernel or without."""
    if isinstance(linear, QuantLinear):
        linear.use(kernel)
        return linear
    base = linear.base
    assert isinstance(base, Linear)
    w = base.weight
    chosen: nn.Module = base
    if packing_available(w.dtype, w.device, packed_rows):
        packed = _find_packed(linear)  # packing again costs a second; keep a packed copy
        chosen = (
            packed if packed and packed.rows == packed_rows else PackedLinear(base, packed_rows)
        )
    if kernel is not None and gemv_available(kernel, w.dtype, w.device):
        chosen = GemvLinear(chosen, kernel)
    return chosen


def _find_packed(linear: nn.Module) -> PackedLinear | None:
    while isinstance(linear, _Wrapper):
        if isinstance(linear, PackedLinear):
            return linear
        linear = linear.inner
    return None
