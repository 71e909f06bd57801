"""A contiguous range of a Mistral model's decoder layers, in plain PyTorch.

One forward call runs a batch of sessions at once. Their tokens are packed
into one flat [tokens, hidden] tensor, so every matrix multiply reads each
weight once for the whole batch; only attention runs per session, against that
session's own cache. A session may bring a prefill chunk (many tokens) or one
decode token, at any past length: prefill and decode mix freely in one call.

The layers themselves are in decoder_layer.py, their matmuls in linear.py. A
single stream's decode step runs all layers in one call of the compiled kernel
when it is loaded. Greedy output matches transformers' MistralForCausalLM token
for token.
"""

from __future__ import annotations

import itertools
from collections.abc import MutableMapping, Sequence
from types import ModuleType
from typing import TypeAlias

import torch
import torch.nn.functional as F
from torch import nn

from zmqllm.config.loading import kv_dtype_of
from zmqllm.config.settings import MAX_DRAFT_TOKENS, QUANTS
from zmqllm.engine import linear, quant
from zmqllm.engine.decoder_layer import LINEAR_NAMES, DecoderLayer, ForwardPlan, RMSNorm, Segment
from zmqllm.engine.linear import CPU_MM_MAX_ROWS_HEAD, Linear, QuantLinear
from zmqllm.engine.quant import QuantTensor
from zmqllm.models.model_args import ModelArgs

# The dtypes a shard computes in or caches its keys and values in, by their config names.
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The most rows of one segment that attend in the compiled decode kernel: a decode step
# with the most proposals a step may carry; longer segments (prompt chunks) take SDPA.
KERNEL_ROWS = 1 + MAX_DRAFT_TOKENS

__all__ = ["MistralShard"]

Tensors: TypeAlias = (
    torch.Tensor | QuantTensor
)  # what a loader hands load(): GGUF gives quantized ones


# Where the few-row path takes more than 8 rows (16 on AVX2 builds: csrc/ops.h) speculation
# still stops at 8: a row past 8 costs a forward about what one before it does (~3.3 ms
# of the default model's 51 ms at 8 rows on 2 AVX2 cores), and proposals in such busy
# forwards mostly fail; letting them run to 16 rows cost 8 streams ~8 % of their tokens/s.
SPEC_ROW_STEP = 8


class MistralShard(nn.Module):
    """Decoder layers ``[start, end)``; stage 0 also embeds, the last stage also
    applies the final norm and the lm_head. Layers keep their global indices
    for loading; ``local`` indices address the cache."""

    def __init__(
        self,
        args: ModelArgs,
        start: int,
        end: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quant_kind: str = "none",
    ) -> None:
        """``quant_kind`` "int8" or "int4" quantizes float32 matmul weights at load
        (engine.quant; the head and embedding to int8); weights that arrive
        quantized (from GGUF) are kept as they are either way."""
        super().__init__()
        if not 0 <= start < end <= args.num_layers:
            raise ValueError(f"layer range [{start}, {end}) is outside [0, {args.num_layers})")
        if quant_kind not in QUANTS:
            raise ValueError(f"quant {quant_kind!r} is not one of {', '.join(QUANTS)}")
        if quant_kind != "none" and (
            dtype is not torch.float32 or torch.device(device).type != "cpu"
        ):
            raise ValueError("quantized weights need dtype float32 on the cpu")
        self.quant = quant_kind
        self.weights_from = "safetensors"  # or "gguf:<file>" (engine.generator.load_shard)
        self.args = args
        self.start, self.end = start, end
        self.is_first = start == 0
        self.is_last = end == args.num_layers
        self.dtype = dtype
        self.kv_dtype = dtype  # of the KV caches its stage allocates: see use_kv_dtype
        self.device = torch.device(device)
        self.embed: torch.Tensor | QuantTensor | None = None  # [vocab, hidden]
        self.lm_head: torch.Tensor | QuantTensor | None = None  # [vocab, hidden]
        self.layers = nn.ModuleList(DecoderLayer(args, dtype) for _ in range(start, end))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype) if self.is_last else None
        self._loaded: set[str] = set()  # groups loaded: layer prefixes, embedding, head
        self._rope_len = 0
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)
        self.head: nn.Module | None = None  # a Linear over lm_head, set at load
        self.kernel: ModuleType | None = None  # see use_kernel
        self.packed_rows = 0  # see pack
        # Every layer's two norm weights and four matrices, as the kernel's
        # decode_layers takes them, when a forward of a few decode rows (a single
        # stream's step, a speculative pass, a few sessions) runs the layers in one call;
        # up to how many rows (the kernel's gemv rows: past them the Python layers'
        # batched products are faster).
        self._decode_layers: tuple[list[torch.Tensor], list[object]] | None = None
        self._decode_layers_rows = 1

    def use_kv_dtype(self, name: str) -> torch.dtype:
        """Keys and values cached in ``name`` (config.loading.kv_dtype_of: "auto" is the
        model's dtype, "bfloat16" halves a float32 model's cache; others refused with
        ConfigError); attention computes in the model's dtype either way."""
        own = next(n for n, t in TORCH_DTYPES.items() if t is self.dtype)
        self.kv_dtype = TORCH_DTYPES[kv_dtype_of(name, own)]
        return self.kv_dtype

    def _cpu_float32(self) -> bool:
        """The compiled kernel and the packed weights exist for float32 on the CPU only."""
        return self.device.type == "cpu" and self.dtype is torch.float32

    def _linears(self) -> list[tuple[nn.Module, str]]:
        """(owner, attribute) of every matmul weight's Linear."""
        found: list[tuple[nn.Module, str]] = [
            (layer, name) for layer in self.layers for name in LINEAR_NAMES
        ]
        if self.head is not None:
            found.append((self, "head"))
        return found

    def _choose_linears(self) -> None:
        """Swap every Linear for the implementations the kernel and packing settings
        make available (engine.linear.choose)."""
        for owner, name in self._linears():
            setattr(owner, name, linear.choose(getattr(owner, name), self.kernel, self.packed_rows))
        self._decode_layers = None
        kernel = self.kernel
        if kernel is not None and hasattr(kernel, "decode_layers") and hasattr(kernel, "Matrix"):
            norms = [
                t
                for layer in self.layers
                for t in (layer.input_norm.weight, layer.post_norm.weight)
            ]
            mats = [
                linear.kernel_matrix(getattr(layer, name), kernel)
                for layer in self.layers
                for name in LINEAR_NAMES
            ]
            self._decode_layers = (norms, mats)
            self._decode_layers_rows = int(getattr(kernel, "GEMV_MAX_ROWS", 1))

    def row_steps(self) -> tuple[int, ...]:
        """The row counts past which a forward of this shard costs a step more (where
        speculation stops adding rows: engine/batching.py's draft_room): SPEC_ROW_STEP and
        the rows of the one-call decode path (8, or 8 and 16 on AVX2 builds; for int8/int4
        with the matrix units on, only the rows before they take over), then, for
        float32 on the CPU, the most rows whose products run as ``W @ xᵀ``
        (linear.CPU_MM_MAX_ROWS). None on other devices."""
        if self.device.type != "cpu":
            return ()
        steps = []
        exact = self.exact_row_count()
        if exact > 1:
            steps.append(min(SPEC_ROW_STEP, exact))
            if exact > SPEC_ROW_STEP:
                steps.append(exact)
            if exact < self._decode_layers_rows:  # the matrix units' rows: none past them
                return tuple(steps)
        if self._cpu_float32():
            steps.append(linear.CPU_MM_MAX_ROWS)
        return tuple(steps)

    def exact_row_count(self) -> int:
        """The most rows of a decode forward whose every row gets the bits of a forward of
        its own: the few-row path's rows, fewer for int8/int4 where the matrix units take
        the products from fewer rows (native.use_matrix_units: in bfloat16 from 8 rows on
        AVX512_BF16, 6 on AMX tiles; asked each time, as the units may be switched after
        load). 1 where there is no few-row path."""
        if self._decode_layers is None or self.kernel is None:
            return 1
        one_row_paths = ("direct", "gemv")  # the widening loop, float32's gemv
        layer_mats = self._decode_layers[1][: len(LINEAR_NAMES)]
        rows = 1
        while rows < self._decode_layers_rows and all(
            self.kernel.matmul_choice(m, rows + 1) in one_row_paths for m in layer_mats
        ):
            rows += 1
        return rows

    def exact_rows(self) -> bool:
        """A decode forward of a few rows (up to exact_row_count) gives each row the bits
        it gets in a forward of its own: the few-row path (float32, int8, int4 on the CPU:
        tests/engine/test_native.py). Elsewhere (bfloat16, a GPU, no kernel) a few rows
        sum in other orders than one (where speculative = "auto" does not propose)."""
        return self.exact_row_count() > 1

    def pack(self, rows: int) -> bool:
        """Keep an MKL-packed copy of every matmul weight for batches of up to ``rows``
        rows (from PACK_MIN_ROWS): about a second copy of the weights in memory for
        faster batched decode forwards (linear.PackedLinear). float32 on the CPU with MKL only;
        returns whether the weights were packed."""
        if not linear.packing_available(self.dtype, self.device, rows):
            return False
        self.packed_rows = rows
        with torch.no_grad():
            self._choose_linears()
        return True

    def use_kernel(self, kernel: ModuleType | None) -> bool:
        """Use the compiled kernels (engine.native): decode attention and the fused
        per-layer steps of decode forwards, and one-row matrix-vector products.

        Only float32 on the CPU; elsewhere, or with None, the PyTorch path stays.
        Returns whether the kernel is in use.
        """
        ok = kernel is not None and self._cpu_float32()
        self.kernel = kernel if ok else None
        self._choose_linears()
        return ok

    @property
    def num_local_layers(self) -> int:
        return self.end - self.start

    def load(self, tensors: MutableMapping[str, Tensors], strict: bool = True) -> None:
        """Move in checkpoint tensors named as in the HF checkpoint (global indices).

        ``tensors`` may hold only some of the shard's groups (the embedding, one
        layer, the final norm and head): loaders feed it a group at a time so the
        peak memory of a load is the model plus one layer. Tensors are popped
        once copied. ``strict`` checks that every group has been loaded.
        """
        with torch.no_grad():
            for local, layer in enumerate(self.layers):
                p = f"model.layers.{self.start + local}."
                if p + "self_attn.q_proj.weight" in tensors:
                    assert isinstance(layer, DecoderLayer)
                    self._load_layer(layer, p, tensors)
                    self._loaded.add(p)
            embed = "model.embed_tokens.weight"
            if self.is_first and embed in tensors:
                self.embed = self._quantized(self._take(tensors, embed, keep=True), "int8")
                self._loaded.add(embed)
            if self.is_last and "model.norm.weight" in tensors:
                assert self.norm is not None
                self.norm.weight.copy_(self._tensor(tensors, "model.norm.weight"))
                if not self.args.tie_word_embeddings:
                    self.lm_head = self._take(tensors, "lm_head.weight")
                elif self.embed is not None:
                    self.lm_head = self.embed  # one tensor serves both ends
                else:
                    self.lm_head = self._take(tensors, embed)
                # The head stays at 8 bits whatever the layers' quant (as llama.cpp's
                # files keep it): the logits decide the tokens.
                self.lm_head = self._quantized(self.lm_head, "int8")
                self.head = (
                    QuantLinear(self.lm_head)
                    if isinstance(self.lm_head, QuantTensor)
                    else Linear(self.lm_head, CPU_MM_MAX_ROWS_HEAD)
                )
                self._choose_linears()
                self._loaded.add("head")
        if strict:
            self.check_loaded()

    def _quantized(self, t: torch.Tensor | QuantTensor, kind: str) -> torch.Tensor | QuantTensor:
        """``t`` quantized to ``kind`` when this shard quantizes and it is not yet."""
        if self.quant == "none" or isinstance(t, QuantTensor):
            return t
        return quant.quantize(t, kind)

    def _take(
        self, tensors: MutableMapping[str, Tensors], name: str, keep: bool = False
    ) -> torch.Tensor | QuantTensor:
        try:
            t = tensors[name] if keep else tensors.pop(name)
        except KeyError:
            raise KeyError(f"checkpoint tensor {name!r} missing for this shard") from None
        if isinstance(t, QuantTensor):
            return t
        if self.quant != "none" and t.dim() == 2:
            return t  # quantized as it is, a chunk of rows at a time (engine.quant)
        return t.to(device=self.device, dtype=self.dtype)

    def _tensor(self, tensors: MutableMapping[str, Tensors], name: str) -> torch.Tensor:
        t = self._take(tensors, name)
        if isinstance(t, QuantTensor):
            raise TypeError(f"{name} must be a float tensor, not {t.kind}")
        return t

    def _matmul(self, current: nn.Module, parts: list[torch.Tensor | QuantTensor]) -> nn.Module:
        """The linear for weights ``parts`` stacked: quantized as they came or as this
        shard quantizes, else copied into ``current`` (a float Linear)."""
        if any(isinstance(p, QuantTensor) for p in parts):
            if not all(isinstance(p, QuantTensor) for p in parts):
                raise TypeError("cannot fuse quantized and float weights")
            return QuantLinear(quant.cat([p for p in parts if isinstance(p, QuantTensor)]))
        floats = [p for p in parts if isinstance(p, torch.Tensor)]
        w = torch.cat(floats) if len(floats) > 1 else floats[0]
        if self.quant != "none":
            return QuantLinear(quant.quantize(w, self.quant))
        current.weight.copy_(w)
        return current

    def _load_layer(
        self, layer: DecoderLayer, p: str, tensors: MutableMapping[str, torch.Tensor]
    ) -> None:
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv = [self._take(tensors, attn + f"{x}_proj.weight") for x in ("q", "k", "v")]
        layer.wqkv = self._matmul(layer.wqkv, qkv)
        layer.wo = self._matmul(layer.wo, [self._take(tensors, attn + "o_proj.weight")])
        gate_up = [self._take(tensors, mlp + f"{x}_proj.weight") for x in ("gate", "up")]
        layer.w_gate_up = self._matmul(layer.w_gate_up, gate_up)
        layer.w_down = self._matmul(layer.w_down, [self._take(tensors, mlp + "down_proj.weight")])
        layer.input_norm.weight.copy_(self._tensor(tensors, p + "input_layernorm.weight"))
        layer.post_norm.weight.copy_(self._tensor(tensors, p + "post_attention_layernorm.weight"))

    def check_loaded(self) -> None:
        want = {f"model.layers.{i}." for i in range(self.start, self.end)}
        if self.is_first:
            want.add("model.embed_tokens.weight")
        if self.is_last:
            want.add("head")
        missing = sorted(want - self._loaded)
        if missing:
            raise KeyError(f"shard [{self.start}, {self.end}) was not given: {', '.join(missing)}")

    def num_parameters(self) -> int:
        # Each tensor once: the head may be the embedding, a wrapper shares its weight.
        counts = {t.data_ptr(): t.numel() for t in self.parameters()}
        for module in self.modules():
            if isinstance(module, QuantLinear):
                counts[module.q.data_ptr()] = module.num_weights
        if isinstance(self.embed, QuantTensor):
            counts[self.embed.q.data_ptr()] = self.embed.shape[0] * self.embed.shape[1]
        elif self.embed is not None:
            counts[self.embed.data_ptr()] = self.embed.numel()
        return sum(counts.values())

    def weight_bytes(self) -> int:
        """Bytes of this shard's weights as held (quantized ones at their size)."""
        sizes = {t.data_ptr(): t.numel() * t.element_size() for t in self.parameters()}
        for module in self.modules():
            if isinstance(module, QuantLinear):
                sizes[module.q.data_ptr()] = module.tensor.nbytes
        if isinstance(self.embed, QuantTensor):
            sizes[self.embed.q.data_ptr()] = self.embed.nbytes
        elif self.embed is not None:
            sizes[self.embed.data_ptr()] = self.embed.numel() * self.embed.element_size()
        return sum(sizes.values())

    def _rope_tables(self, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        if upto > self._rope_len:
            # Grow in powers of two; computed in float32 exactly as transformers does.
            size = max(256, 1 << (upto - 1).bit_length())
            d = self.args.head_dim
            inv_freq = 1.0 / (
                self.args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
            )
            freqs = torch.arange(size, dtype=torch.float32)[:, None] * inv_freq[None, :]
            self._cos = freqs.cos().to(device=self.device, dtype=self.dtype)
            self._sin = freqs.sin().to(device=self.device, dtype=self.dtype)
            self._rope_len = size
        return self._cos, self._sin

    def _plan(self, segments: Sequence[Segment]) -> ForwardPlan:
        window = self.args.sliding_window
        spans: list[tuple[int, int, int, int, torch.Tensor | None]] = []
        positions: list[torch.Tensor] = []
        # Every decode step, a single stream's too, attends in the compiled kernel, and so
        # does a speculative pass (its token and proposals: a few rows): each row an
        # entry of its own, the key/value rows of all written before any attends, so row
        # j sees the rows before it; a row's arithmetic is then that of the same position
        # decoded alone, and a pass with proposals costs the batch no Python attention.
        batched = self.kernel is not None and any(seg.n <= KERNEL_ROWS for seg in segments)
        python_segs: list[Segment] = []
        dk: list[torch.Tensor] = []
        dv: list[torch.Tensor] = []
        rows: list[int] = []
        pasts: list[int] = []
        los: list[int] = []
        off = 0
        for seg in segments:
            past, n = seg.cache.length, seg.n
            if n <= 0:
                raise ValueError("a segment needs at least one token")
            if past + n > seg.cache.max_len:
                raise ValueError(
                    f"segment of {n} tokens after {past} overflows a cache of {seg.cache.max_len}"
                )
            # First key any query of this segment can see.
            lo = max(0, past + 1 - window) if window else 0
            positions.append(torch.arange(past, past + n, device=self.device))
            if batched and n <= KERNEL_ROWS:
                # Row j sees [lo_j, past + j]: never more than the window, no mask.
                for j in range(n):
                    dk.append(seg.cache.k)
                    dv.append(seg.cache.v)
                    rows.append(off + j)
                    pasts.append(past + j)
                    los.append(max(0, past + j + 1 - window) if window else 0)
                off += n
                continue
            mask = None
            if n > 1 or (window and past + n - lo > window):
                qpos = torch.arange(past, past + n, device=self.device)[:, None]
                kpos = torch.arange(lo, past + n, device=self.device)[None, :]
                visible = kpos <= qpos
                if window:
                    visible &= qpos - kpos < window
                g = self.args.kv_groups
                mask = visible.repeat(g, 1)  # [G * n, L]: rows ordered (group, token)
            spans.append((off, n, past, lo, mask))
            python_segs.append(seg)
            off += n
        pos = torch.cat(positions) if len(positions) > 1 else positions[0]
        cos, sin = self._rope_tables(int(pos.max()) + 1)
        decode = None
        if rows:
            assert self.kernel is not None
            decode = self.kernel.DecodeBatch(dk, dv, rows, pasts, los)
        return ForwardPlan(
            cos=cos[pos][:, None, :],
            sin=sin[pos][:, None, :],
            spans=spans,
            segments=python_segs,
            decode=decode,
            kernel=self.kernel,
        )

    @torch.inference_mode()
    def forward(
        self,
        x: torch.Tensor,
        segments: Sequence[Segment],
        all_logits: bool = False,
        logit_rows: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Run the shard over a batch.

        x is token ids [T] (int64/int32) on stage 0, hidden states [T, hidden]
        elsewhere, with T = sum of the segments' n, in segment order. Returns
        hidden states [T, hidden], or on the last stage logits [B, vocab] for
        each segment's last token ([T, vocab] with all_logits; with ``logit_rows``,
        [sum(logit_rows), vocab] for each segment's last logit_rows[i] tokens: a
        speculative pass verifies all its rows) in float32.
        Each segment's cache length advances by its n.
        """
        plan = self._plan(segments)
        if self.is_first:
            assert self.embed is not None
            ids = x.to(device=self.device, dtype=torch.long)
            if isinstance(self.embed, QuantTensor):  # only the looked-up rows widened
                h = quant.dequantize(self.embed.rows(ids))
            else:
                h = F.embedding(ids, self.embed)
        else:
            h = x.to(device=self.device, dtype=self.dtype)
        if (
            self._decode_layers is not None
            and plan.decode is not None
            and not plan.spans
            and h.shape[0] <= self._decode_layers_rows
        ):
            assert plan.kernel is not None
            a = self.args
            norms, mats = self._decode_layers
            h = plan.kernel.decode_layers(  # one call: see csrc/decode_attention.cpp
                h.contiguous(), plan.decode, norms, mats, a.rms_norm_eps,
                plan.cos[:, 0], plan.sin[:, 0], a.num_heads, a.num_kv_heads, a.head_dim,
            )  # fmt: skip
        else:
            for local, layer in enumerate(self.layers):
                h = layer(h, plan, local)
        for seg in segments:
            seg.cache.length += seg.n
        if not self.is_last:
            return h
        assert self.norm is not None and self.head is not None
        if not all_logits:
            ends = list(itertools.accumulate(seg.n for seg in segments))
            counts = logit_rows or [1] * len(segments)
            rows = [i for e, r in zip(ends, counts, strict=True) for i in range(e - r, e)]
            h = h[torch.tensor(rows, device=self.device)]
        h = self.norm(h)
        return self.head(h).float()
