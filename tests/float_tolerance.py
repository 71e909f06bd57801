"""How far apart two float32 results may be when the same sums ran in another order.

Two correct computations of a float32 forward (packed against plain GEMM, a batch
against one row, a compiled kernel against PyTorch, zmqllm against transformers) add
the same products in different orders, and which order a BLAS kernel picks depends on
the CPU (AVX2, AVX-512) and the shapes. Rounding makes each order's sum differ: for a
dot product of length K the standard bound is |error| <= K * eps * sum(|terms|). So the
tolerance is absolute, scaled by the reduction length and by the size of the values
(the largest magnitude in the reference stands in for the size of the terms), never a
fixed 1e-5: a logit near zero is the sum of terms as large as any other's, and its
rounding error is as large too. A real bug moves logits by orders of magnitude more.
"""

from __future__ import annotations

from typing import Any

# float32's machine epsilon (2**-23): the spacing of floats just above 1.0.
FLOAT32_EPS = 2.0**-23

__all__ = ["FLOAT32_EPS", "reduction_length", "reorder_tolerance"]


def reduction_length(args: Any) -> int:
    """The longest dot product in a Mistral forward: the MLP's down projection sums over
    intermediate_size, every other matmul over hidden_size or less."""
    return max(int(args.hidden_size), int(args.intermediate_size))


def reorder_tolerance(reference: Any, reduction: int) -> dict[str, float]:
    """``torch.testing.assert_close`` tolerances for float32 results that differ only in
    the order of their sums: atol = K * eps * max|reference|, no relative part."""
    scale = float(reference.abs().max())
    return {"rtol": 0.0, "atol": reduction * FLOAT32_EPS * scale}
