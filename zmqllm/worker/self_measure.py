"""A worker measuring itself before it loads anything: what `--layers auto` reports.

The probe builds decoder layers of the model's shape with random weights, in the dtype
and quant the worker serves with, through the same paths a loaded stage takes (compiled
kernel, packed weights), and times decode forwards of 1 and 16 rows against a short
context: the milliseconds one layer costs there, then the final norm and output layer
alone at the same row counts (what the last stage adds). Random weights cost what real
ones do (the work is the same shapes), and the probe reads nothing of the checkpoint but its
config. With the memory the stage may use and what a layer, the embedding and the head
need (engine/memory_plan.py), these are the figures (config/weighted_split.Figures) the
broker places a worker by, `zmqllm plan` splits by, and `zmqllm status` shows.

``zmqllm measure`` prints them as JSON, for `zmqllm plan --figures` on another machine.
Kept short: about 4 s (a 1 s window per row count, layer and head), a few more on a
7B-shaped layer.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from zmqllm.config.loading import kv_dtype_of
from zmqllm.config.machine import memory_available
from zmqllm.config.settings import Config
from zmqllm.config.weighted_split import ROWS, Figures
from zmqllm.engine import native
from zmqllm.engine.cache import CachePool
from zmqllm.engine.decoder_layer import Segment
from zmqllm.engine.generator import torch_dtype
from zmqllm.engine.linear import PACK_MIN_ROWS
from zmqllm.engine.memory_plan import range_costs
from zmqllm.engine.model import MistralShard
from zmqllm.engine.quant import QuantTensor
from zmqllm.models.model_args import ModelArgs

__all__ = ["measure", "measure_dir", "probe_head_ms", "probe_ms"]

CONTEXT = 32  # tokens each probe session holds before its timed steps
WARM = 2  # untimed forwards per row count (the kernels' paths for that many rows)
MIN_REPS = 3
# Forwards are timed over at least this long a window, as a mean: a CPU quota (cgroup
# cpu.max, a period of 100 ms by default) lets a short forward run unthrottled, and only
# a window of many periods sees the share the worker really gets (over 0.3 s, whether 2
# or 3 throttled periods fell in it moved a half-core host's figure by a third).
WINDOW_S = 1.0
MAX_REPS = 1000  # each forward adds a token to every probe session's cache
# Two layers amortize the forward's fixed cost, unless one is already large.
ONE_LAYER_BYTES = 64 << 20


def _random_layer(args: ModelArgs, index: int) -> dict[str, torch.Tensor | QuantTensor]:
    """One layer's checkpoint tensors, random, named as in a Hugging Face checkpoint."""
    h, f = args.hidden_size, args.intermediate_size
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    p = f"model.layers.{index}."
    shapes = {
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
    }
    out: dict[str, torch.Tensor | QuantTensor] = {
        p + name: torch.randn(shape) * 0.02 for name, shape in shapes.items()
    }
    out[p + "input_layernorm.weight"] = torch.ones(h)
    out[p + "post_attention_layernorm.weight"] = torch.ones(h)
    return out


def _timed_ms(run: Callable[[], object], most: int, device: str) -> float:
    """The mean milliseconds of ``run()`` over a window of WINDOW_S (at least MIN_REPS,
    at most ``most`` calls), after WARM untimed calls (the paths for that many rows)."""

    def now() -> float:
        if device.startswith("cuda"):  # a GPU's work is queued: time what ran, not the queue
            torch.cuda.synchronize(device)
        return time.perf_counter()

    for _ in range(WARM):
        run()
    count, t0 = 0, now()
    while count < MIN_REPS or (now() - t0 < WINDOW_S and count < most):
        run()
        count += 1
    return (now() - t0) * 1000 / count


def _probe_shard(cfg: Config, args: ModelArgs, layers: int, last: bool) -> MistralShard:
    """Layers 1..layers of random weights (and the final norm and head when ``last``),
    on the paths a loaded stage takes."""
    m, w = cfg.model, cfg.worker
    # Middle layers of a deeper model of this shape: no embedding, and a head only when
    # asked for.
    deep = dataclasses.replace(args, num_layers=layers + (1 if last else 2))
    shard = MistralShard(deep, 1, 1 + layers, torch_dtype(m.dtype), m.device, m.quant)
    for index in range(1, 1 + layers):
        shard.load(_random_layer(args, index), strict=False)
    if last:
        vocab = torch.randn(args.vocab_size, args.hidden_size) * 0.02
        ends: dict[str, torch.Tensor | QuantTensor] = {
            "model.norm.weight": torch.ones(args.hidden_size)
        }
        ends["model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"] = vocab
        shard.load(ends, strict=False)
    if w.native_attention:
        shard.use_kernel(native.load())
    shard.use_kv_dtype(w.kv_dtype)
    if w.packed_rows >= PACK_MIN_ROWS:
        shard.pack(w.packed_rows)
    return shard


def probe_ms(cfg: Config, args: ModelArgs) -> tuple[float, float]:
    """Milliseconds one decoder layer's decode forward takes at 1 and at 16 rows here."""
    m, w = cfg.model, cfg.worker
    if w.threads:
        torch.set_num_threads(w.threads)
    itemsize = 4 if m.dtype == "float32" else 2
    layers = 1 if args.layer_params * itemsize > ONE_LAYER_BYTES else 2
    shard = _probe_shard(cfg, args, layers, last=False)
    pool = CachePool(shard.args, layers, shard.kv_dtype, m.device, max_sessions=ROWS)
    names = [f"probe-{i}" for i in range(ROWS)]
    room = min(args.max_position_embeddings, CONTEXT + 2 * (WARM + MAX_REPS))
    most = max(MIN_REPS, (room - CONTEXT) // 2 - WARM)  # forwards per row count
    for name in names:
        pool.allocate(name, room)
    h = args.hidden_size
    timed: dict[int, float] = {}
    with torch.inference_mode():
        shard(torch.randn(CONTEXT * ROWS, h), [Segment(pool.get(n), CONTEXT) for n in names])
        for rows in (1, ROWS):
            x = torch.randn(rows, h, dtype=shard.dtype, device=m.device)
            segments = [Segment(pool.get(n), 1) for n in names[:rows]]
            timed[rows] = (
                _timed_ms(functools.partial(shard.forward, x, segments), most, m.device) / layers
            )
    return timed[1], timed[ROWS]


def probe_head_ms(cfg: Config, args: ModelArgs) -> tuple[float, float]:
    """Milliseconds the final norm and output layer take at 1 and at 16 rows here: what
    the last stage adds to its layers. Timed, not taken from the weights' size: at 16
    rows the head's one large product runs nearer the CPU's peak than a layer's small ones
    and its attention (the default model's float32 head costs what 4-6 of its layers do
    there on 2 AVX2 cores, not the 8 its weights make), and it stays int8 under int4
    layers."""
    if cfg.worker.threads:
        torch.set_num_threads(cfg.worker.threads)
    shard = _probe_shard(cfg, args, 1, last=True)
    assert shard.norm is not None and shard.head is not None
    last = nn.Sequential(shard.norm, shard.head)
    timed: dict[int, float] = {}
    with torch.inference_mode():
        for rows in (1, ROWS):
            x = torch.randn(rows, args.hidden_size, dtype=shard.dtype, device=cfg.model.device)
            timed[rows] = _timed_ms(functools.partial(last, x), MAX_REPS, cfg.model.device)
    return timed[1], timed[ROWS]


def measure(cfg: Config, directory: Path) -> Figures:
    """This worker's figures for the model in ``directory`` (only its config is read)."""
    m, w = cfg.model, cfg.worker
    args = ModelArgs.from_dir(directory)
    ms_1, ms_16 = probe_ms(cfg, args)
    head_1, head_16 = probe_head_ms(cfg, args)
    if w.max_memory_mb:
        memory = w.max_memory_mb << 20
    elif m.device.startswith("cuda"):
        memory = int(torch.cuda.mem_get_info(torch.device(m.device))[0])
    else:
        memory = memory_available()[0]
    packed = w.packed_rows >= PACK_MIN_ROWS and m.device == "cpu"
    kv = kv_dtype_of(w.kv_dtype, m.dtype)
    layer, first, last, runtime = range_costs(args, m.dtype, m.quant, packed, kv_dtype=kv)
    return Figures(
        ms_1=round(ms_1, 4),
        ms_16=round(ms_16, 4),
        memory_bytes=int(memory),
        layer_bytes=layer,
        first_bytes=first,
        last_bytes=last,
        runtime_bytes=runtime,
        head_cost=args.head_cost,
        head_ms_1=round(head_1, 4),
        head_ms_16=round(head_16, 4),
    )


def measure_dir(cfg: Config) -> Path:
    """The model directory a probe reads the config of (from the Hub: its config and
    index only, no weights)."""
    from zmqllm.config.paths import resolve_model_path
    from zmqllm.engine.weights import META_PATTERNS

    spec = resolve_model_path(cfg.model.path)
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    pattern = list(META_PATTERNS)
    return Path(snapshot_download(spec, revision=cfg.model.revision, allow_patterns=pattern))


def figures_json(f: Figures) -> str:
    return json.dumps(f.to_dict(), indent=2, sort_keys=True)
