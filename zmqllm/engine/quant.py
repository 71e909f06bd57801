"""Quantized weights: int8 and int4 in blocks of 32 along the input dimension.

- int8: ``w = d * q + m`` with q int8 and a scale d and an offset m per block,
  d = (max - min) / 255 (group-32 asymmetric, like int4 with 8 bits). GGUF's Q8_0
  blocks (a scale per block, no offset: m empty) load as they are. A scale per
  output channel, or a symmetric one per block, loses too much accuracy on the
  default model (teacher-forced top-1 agreement with float32; see the README).
- int4: ``w = d * q + m`` with q in 0..15 and a scale d and minimum m per block
  (group-32 asymmetric). Quantized at load from each block's minimum and maximum;
  GGUF's Q4_1 blocks load as they are, so a model that came from Q4_1 keeps its
  exact weights.

Both are kept as the compiled kernel reads them (csrc/quant.h): q [out, in] int8
or [out, in / 2] uint8 (byte j of a block holds weights j and j + 16), d and m
float32 [out, in / 32]. :func:`dequantize` is the PyTorch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GROUP", "KIND", "QuantTensor", "cat", "dequantize", "quantize"]

GROUP = 32
# The kernel's Matrix kinds (MatrixKind in csrc/quant.h).
KIND = {"float32": 0, "int8": 1, "int4": 2}


@dataclass
class QuantTensor:
    """A quantized [out, in] weight; ``m`` is empty for GGUF's Q8_0."""

    kind: str  # "int8" | "int4"
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        out, cols = self.q.shape
        return out, cols * 2 if self.kind == "int4" else cols

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m))

    def rows(self, index: torch.Tensor) -> QuantTensor:
        """The rows ``index`` (a row permutation, or an embedding's looked-up rows)."""
        m = self.m[index] if self.m.numel() else self.m
        return QuantTensor(self.kind, self.q[index], self.d[index], m)


def cat(parts: list[QuantTensor]) -> QuantTensor:
    """Stack weights of one kind along the output dimension (q, k and v fused)."""
    kinds = {p.kind for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"cannot fuse weights of kinds {sorted(kinds)}")
    return QuantTensor(
        parts[0].kind,
        torch.cat([p.q for p in parts]),
        torch.cat([p.d for p in parts]),
        torch.cat([p.m for p in parts]),
    )


def _check(w: torch.Tensor) -> torch.Tensor:
    if w.dim() != 2 or w.shape[1] % GROUP:
        raise ValueError(
            f"a weight of shape {tuple(w.shape)} cannot be quantized: the input "
            f"dimension must be a multiple of {GROUP}"
        )
    return w.detach().to(torch.float32)


def _blocks(w: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block of 32: the codes 0..levels-1, the step d and the minimum."""
    out, cols = w.shape
    blocks = w.view(out, cols // GROUP, GROUP)
    lo = blocks.amin(dim=-1)
    d = (blocks.amax(dim=-1) - lo) / (levels - 1)
    d = torch.where(d > 0, d, torch.ones_like(d))  # a constant block: code 0, w = m
    codes = torch.round((blocks - lo[..., None]) / d[..., None]).clamp_(0, levels - 1)
    return codes, d, lo


def quantize_int8(w: torch.Tensor) -> QuantTensor:
    """Asymmetric int8 per block of 32: codes 0..255 stored as q = code - 128,
    so w = d * q + (min + 128 d)."""
    w = _check(w)
    codes, d, lo = _blocks(w, 256)
    q = (codes - 128).to(torch.int8).reshape(w.shape)
    return QuantTensor("int8", q, d, (lo + 128 * d).contiguous())


def quantize_int4(w: torch.Tensor) -> QuantTensor:
    """Asymmetric int4 per block of 32: d = (max - min) / 15, m = min."""
    w = _check(w)
    out, cols = w.shape
    codes, d, lo = _blocks(w, 16)
    q = codes.to(torch.uint8)
    packed = q[..., : GROUP // 2] | (q[..., GROUP // 2 :] << 4)
    return QuantTensor("int4", packed.reshape(out, cols // 2).contiguous(), d, lo.contiguous())


# Rows quantized at a time: a large tensor's float32 copy and codes never exist whole
# (the peak of a load stays near the shard plus one tensor).
CHUNK_ELEMENTS = 1 << 23


def quantize(w: torch.Tensor, kind: str) -> QuantTensor:
    """``w`` [out, in] of any float dtype as ``kind``, a chunk of rows at a time."""
    if kind not in ("int8", "int4"):
        raise ValueError(f"quant {kind!r} is not one of int8, int4")
    one = quantize_int8 if kind == "int8" else quantize_int4
    if w.dim() != 2 or w.numel() <= CHUNK_ELEMENTS:
        return one(w)
    step = max(1, CHUNK_ELEMENTS // w.shape[1])
    parts = [one(w[r : r + step]) for r in range(0, w.shape[0], step)]
    return cat(parts)


def dequantize(t: QuantTensor) -> torch.Tensor:
    """The float32 weight [out, in]: d * q (+ m), as the kernel widens it."""
    out, cols = t.shape
    if t.kind == "int8":
        q = t.q.view(out, cols // GROUP, GROUP).to(torch.float32)
        w = q * t.d[..., None]
        return (w + t.m[..., None] if t.m.numel() else w).view(out, cols)
    half = GROUP // 2
    packed = t.q.view(out, cols // GROUP, half)
    q = torch.cat((packed & 15, packed >> 4), dim=-1).to(torch.float32)
    return (q * t.d[..., None] + t.m[..., None]).view(out, cols)
