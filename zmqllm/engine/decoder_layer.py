"""One decoder layer of a Mistral model in plain PyTorch, and what a forward
call hands every layer (the batch's segments, its rotary tables, the decode
sessions the compiled kernel attends).

The arithmetic follows transformers' MistralForCausalLM operation for
operation (RMSNorm in float32, rotate-half rotary embeddings, a window where
query i sees key j when 0 <= i - j < sliding_window). The matmul weights are
Linear modules (engine.linear), swapped at load for the fastest available.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zmqllm.engine.cache import KVCache
from zmqllm.engine.linear import Linear
from zmqllm.models.model_args import ModelArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        # In the model dtype, as in transformers: the scale multiplies in that dtype.
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the model dtype, then scale in it.
        dtype = x.dtype
        if dtype is torch.float32:  # skip two no-op casts in the hot path
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


@dataclass
class Segment:
    """One session's share of a batched forward: ``n`` tokens after its cache."""

    cache: KVCache
    n: int


@dataclass
class ForwardPlan:
    """What every layer of one forward call needs, computed once per call."""

    cos: torch.Tensor  # [T, 1, head_dim/2]
    sin: torch.Tensor  # [T, 1, head_dim/2]
    # per segment attended in Python: (row offset, n, past length, first visible
    # key, mask or None), and the segments themselves
    spans: list[tuple[int, int, int, int, torch.Tensor | None]]
    segments: Sequence[Segment]
    # The decode segments (one token each) that the compiled kernel attends in one
    # call per layer, when it is loaded and there are two or more: a DecodeBatch.
    decode: Any = None
    kernel: ModuleType | None = None


LINEAR_NAMES = ("wqkv", "wo", "w_gate_up", "w_down")


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.args = args
        h, kvh, d = args.num_heads, args.num_kv_heads, args.head_dim
        hidden, inter = args.hidden_size, args.intermediate_size
        # q, k and v projections fused into one weight: one matmul, one read.
        # Each is a Linear (engine.linear), swapped for faster ones at load.
        self.wqkv: nn.Module = Linear(torch.empty((h + 2 * kvh) * d, hidden, dtype=dtype))
        self.wo: nn.Module = Linear(torch.empty(hidden, h * d, dtype=dtype))
        # gate and up projections fused the same way.
        self.w_gate_up: nn.Module = Linear(torch.empty(2 * inter, hidden, dtype=dtype))
        self.w_down: nn.Module = Linear(torch.empty(hidden, inter, dtype=dtype))
        self.input_norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.post_norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, plan: ForwardPlan, local: int) -> torch.Tensor:
        args = self.args
        t = x.shape[0]
        h, kvh, d = args.num_heads, args.num_kv_heads, args.head_dim
        # Decode steps in the batch (the compiled kernel attends): small steps fused too.
        fused = plan.kernel if plan.decode is not None else None
        if fused is not None:
            normed = fused.rms_norm(x, self.input_norm.weight, self.input_norm.eps)
            qkv = self.wqkv(normed)  # [T, (H + 2 KVH) * D]
            fused.rope_(qkv, plan.cos[:, 0], plan.sin[:, 0], h + kvh, d)
            q = qkv[:, : h * d].view(t, h, d)  # [T, H, D]
            k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)  # [T, KVH, D]
        else:
            qkv = self.wqkv(self.input_norm(x))
            qk = _rope(qkv[:, : (h + kvh) * d].view(t, h + kvh, d), plan.cos, plan.sin)
            q, k = qk[:, :h], qk[:, h:]
        v = qkv[:, (h + kvh) * d :].view(t, kvh, d)

        single = plan.decode is None and len(plan.spans) == 1
        attn = x if single else torch.empty(t, h * d, dtype=x.dtype, device=x.device)
        if plan.decode is not None:
            assert plan.kernel is not None
            plan.kernel.decode_attention(attn, q, k, v, plan.decode, local, 1.0 / math.sqrt(d))
        for (off, n, past, lo, mask), seg in zip(plan.spans, plan.segments, strict=True):
            ck, cv = seg.cache.k[local], seg.cache.v[local]  # [KVH, max_len, D]
            ck[:, past : past + n].copy_(k[off : off + n].transpose(0, 1))
            cv[:, past : past + n].copy_(v[off : off + n].transpose(0, 1))
            keys, values = ck[:, lo : past + n], cv[:, lo : past + n]
            if keys.dtype != q.dtype:  # a bfloat16 cache of a float32 model (kv_dtype)
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            out = _attend(q[off : off + n], keys, values, mask)
            if single:
                attn = out  # one session: no gather buffer
            else:
                attn[off : off + n] = out
        x = x + self.wo(attn)
        if fused is not None:
            normed = fused.rms_norm(x, self.post_norm.weight, self.post_norm.eps)
            act = fused.silu_mul(self.w_gate_up(normed))
        else:
            gate, up = self.w_gate_up(self.post_norm(x)).chunk(2, dim=-1)
            act = F.silu(gate) * up
        return x + self.w_down(act)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half layout; x is [T, heads, D], cos/sin [T, 1, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Grouped-query attention of one session.

    q is [n, H, D]; k and v are [KVH, L, D] views into the cache. The G query
    heads that share a key/value head are stacked as extra query rows, so the
    cache is read in place with no repeat: q becomes [KVH, G * n, D].
    Returns [n, H * D].
    """
    n, h, d = q.shape
    kvh = k.shape[0]
    g = h // kvh
    if n == 1 and mask is None and q.dtype is not torch.float32:
        # A half-precision decode step in transformers' own layout (one query row per
        # head, enable_gqa): the stacked layout below runs another kernel shape, whose
        # bf16 roundings differ from it now and then. float32 decodes attend in the
        # compiled kernel.
        out = F.scaled_dot_product_attention(q.view(1, h, 1, d), k[None], v[None], enable_gqa=True)
        return out.view(1, h * d)
    qg = q.view(n, kvh, g, d).permute(1, 2, 0, 3).reshape(1, kvh, g * n, d)
    # 4-D inputs take PyTorch's fused CPU attention kernel (3-D ones fall back to
    # the unfused math path, slower at decode).
    out = F.scaled_dot_product_attention(qg, k[None], v[None], attn_mask=mask)
    return out.view(kvh, g, n, d).permute(2, 0, 1, 3).reshape(n, h * d)  # [n, H*D]
