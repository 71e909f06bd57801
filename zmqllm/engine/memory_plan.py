"""Whether a stage fits the memory given to it, decided before its weights load.

A stage needs its weights as held at run time (quantized ones at their packed size),
the KV budget it admits sessions up to (``max_kv_tokens`` tokens of its layers' keys
and values), and the runtime's own memory. When that exceeds the memory given to it
(``max_memory_mb``, else what the machine or its cgroup has available), the worker
refuses to start with both figures named, instead of being killed by the kernel later.
No torch here: the figures come from the config alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from zmqllm.config.machine import memory_available
from zmqllm.models.model_args import ModelArgs

GROUP = 32  # weights per quantized block (engine/quant.py)
# Bytes per weight as a stage holds it: int8/int4 codes plus a float32 scale and
# offset per block of 32 (engine/quant.py).
BYTES_PER_WEIGHT = {
    "float32": 4.0,
    "bfloat16": 2.0,
    "float16": 2.0,
    "int8": 1 + 8 / GROUP,
    "int4": 0.5 + 8 / GROUP,
}
# A GGUF file's blocks, loaded as they are: Q4_1 (20 bytes a block of 32) and Q8_0 (34),
# whose head and embedding are Q8_0 too.
GGUF_BYTES_PER_WEIGHT = {"int4": 20 / GROUP, "int8": 34 / GROUP}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
# The interpreter, torch and its thread pools, the tokenizer, activations: measured
# as a worker's RSS less its weights on the default model, with room to spare.
RUNTIME_BYTES = 768 << 20
GIB = 1 << 30
# max_kv_tokens = 0: the KV budget is what the memory given holds after the weights and
# the runtime, less this margin (the page cache of the checkpoint, the allocator's slack).
KV_MARGIN_FRACTION = 0.1
KV_MARGIN_MIN = 256 << 20
# A budget sized from memory must hold at least a session of this many tokens (or of
# the whole context, if shorter), else the stage does not fit.
MIN_KV_TOKENS = 4096


class StageDoesNotFit(RuntimeError):
    """The stage's weights and KV budget exceed the memory given to it."""


@dataclass(frozen=True)
class StagePlan:
    layers: tuple[int, int]
    weight_bytes: int
    packed_bytes: int  # the MKL-packed second copy (float32 batches), if any
    kv_bytes_per_token: int
    kv_tokens: int
    given_bytes: int
    given_from: str  # "max_memory_mb", "cgroup memory.max" or "MemAvailable"
    kv_sized: bool = False  # kv_tokens was sized from the memory (max_kv_tokens 0)
    kv_minimum: int = 0  # with kv_sized: the least budget that makes sense

    @property
    def kv_budget_bytes(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token

    @property
    def need_bytes(self) -> int:
        return self.weight_bytes + self.packed_bytes + self.kv_budget_bytes + RUNTIME_BYTES

    def fits(self) -> bool:
        if self.kv_sized and self.kv_tokens < self.kv_minimum:
            return False
        return self.need_bytes <= self.given_bytes

    def max_kv_tokens_that_fit(self) -> int:
        room = self.given_bytes - self.weight_bytes - self.packed_bytes - RUNTIME_BYTES
        return max(0, room // self.kv_bytes_per_token)

    def refusal(self) -> str:
        a, b = self.layers
        if self.kv_sized:
            return (
                f"stage {a}:{b} does not fit: weights {self.weight_bytes / GIB:.2f} GiB"
                + (f" + packed copy {self.packed_bytes / GIB:.2f} GiB" if self.packed_bytes else "")
                + f" + runtime {RUNTIME_BYTES / GIB:.2f} GiB leave room for "
                f"{self.kv_tokens} KV tokens ({self.kv_bytes_per_token} bytes each) of the "
                f"{self.given_bytes / GIB:.2f} GiB given ({self.given_from}), fewer than the "
                f"{self.kv_minimum} a session needs; use --quant int4 or int8, or give the "
                "stage more memory"
            )
        tokens = self.max_kv_tokens_that_fit()
        advice = f"set max_kv_tokens to at most {tokens}" if tokens else "use --quant int4 or int8"
        return (
            f"stage {a}:{b} does not fit: weights {self.weight_bytes / GIB:.2f} GiB"
            + (f" + packed copy {self.packed_bytes / GIB:.2f} GiB" if self.packed_bytes else "")
            + f" + KV budget {self.kv_budget_bytes / GIB:.2f} GiB ({self.kv_tokens} tokens x "
            f"{self.kv_bytes_per_token} bytes) + runtime {RUNTIME_BYTES / GIB:.2f} GiB = "
            f"{self.need_bytes / GIB:.2f} GiB > {self.given_bytes / GIB:.2f} GiB given "
            f"({self.given_from}); {advice}, or give the stage more memory"
        )


def layer_matmul_weights(args: ModelArgs) -> int:
    """Weights of one decoder layer's matmuls (q, k, v, o, gate, up, down)."""
    h, f = args.hidden_size, args.intermediate_size
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    return h * (q + 2 * kv) + q * h + 3 * h * f


def weight_bytes(
    args: ModelArgs, start: int, end: int, dtype: str, quant: str, gguf: bool = False
) -> int:
    """Bytes of the weights a stage of layers [start, end) holds (engine/model.py):
    layer matmuls in ``quant`` (or ``dtype``), embedding and head at 8 bits when
    quantized, norms in ``dtype``; ``gguf``: the quantized ones as a GGUF file's blocks."""
    h = args.hidden_size
    per_layer = layer_matmul_weights(args)
    matmul = BYTES_PER_WEIGHT[dtype if quant == "none" else quant]
    ends = BYTES_PER_WEIGHT[dtype if quant == "none" else "int8"]
    if gguf and quant != "none":
        matmul, ends = GGUF_BYTES_PER_WEIGHT[quant], GGUF_BYTES_PER_WEIGHT["int8"]
    total = (end - start) * (per_layer * matmul + 2 * h * ITEMSIZE[dtype])
    table = args.vocab_size * h
    first, last = start == 0, end == args.num_layers
    if first:
        total += table * ends
    if last:
        total += h * ITEMSIZE[dtype]
        if not args.tie_word_embeddings or not first:
            total += table * ends
    return int(total)


def plan_stage(
    args: ModelArgs,
    start: int,
    end: int,
    dtype: str,
    quant: str,
    kv_tokens: int,
    max_memory_mb: int = 0,
    packed: bool = False,
    available: tuple[int, str] | None = None,
    gguf: bool = False,
    max_sessions: int = 64,
    kv_dtype: str | None = None,
) -> StagePlan:
    """The stage's figures against the memory given to it (see module doc);
    ``available``: what the device has free, where it is not this machine's memory;
    ``gguf``: the weights come as a GGUF file's blocks. ``kv_tokens`` 0: as many as the
    memory holds after the weights, the runtime and a margin, at most ``max_sessions``
    sessions of the whole context. ``kv_dtype``: the caches' (None: ``dtype``)."""
    weights = weight_bytes(args, start, end, dtype, quant, gguf)
    packed_bytes = 0
    if packed and quant == "none" and dtype == "float32":
        # Every float32 matmul (the layers' and the head's) gets a packed copy.
        packed_bytes = (end - start) * layer_matmul_weights(args) * 4
        if end == args.num_layers:
            packed_bytes += args.vocab_size * args.hidden_size * 4
    if max_memory_mb:
        given, source = max_memory_mb << 20, "max_memory_mb"
    else:
        given, source = available or memory_available()
    per_token = args.kv_bytes_per_token(end - start, ITEMSIZE[kv_dtype or dtype])
    if kv_tokens:
        return StagePlan((start, end), weights, packed_bytes, per_token, kv_tokens, given, source)
    margin = max(KV_MARGIN_MIN, int(given * KV_MARGIN_FRACTION))
    room = given - weights - packed_bytes - RUNTIME_BYTES - margin
    context = args.max_position_embeddings
    sized = max(0, min(room // per_token, max_sessions * context))
    return StagePlan(
        (start, end),
        weights,
        packed_bytes,
        per_token,
        sized,
        given,
        source,
        kv_sized=True,
        kv_minimum=min(MIN_KV_TOKENS, context),
    )


def range_costs(
    args: ModelArgs,
    dtype: str,
    quant: str,
    packed: bool = False,
    gguf: bool = False,
    kv_dtype: str | None = None,
) -> tuple[int, int, int, int]:
    """Bytes a stage needs per layer (weights, packed copy, and the KV of a minimal
    budget), for the embedding (stage 0), for the head (the last stage), and for the
    runtime with its margin: the terms of config/weighted_split.fits. ``kv_dtype``: the
    caches' (None: ``dtype``)."""
    deep = dataclasses.replace(args, num_layers=3)
    layer = weight_bytes(deep, 1, 2, dtype, quant, gguf)
    first = weight_bytes(deep, 0, 1, dtype, quant, gguf) - layer
    last = weight_bytes(deep, 2, 3, dtype, quant, gguf) - layer
    if packed and quant == "none" and dtype == "float32":
        layer += layer_matmul_weights(args) * 4
        last += args.vocab_size * args.hidden_size * 4
    kv = args.kv_bytes_per_token(1, ITEMSIZE[kv_dtype or dtype]) * min(
        MIN_KV_TOKENS, args.max_position_embeddings
    )
    return layer + kv, first, last, RUNTIME_BYTES + KV_MARGIN_MIN
