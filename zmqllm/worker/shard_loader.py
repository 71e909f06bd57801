"""Loading a worker's shard, and what the worker tells the broker about it.

A worker reads only the tensors of its own layer range (from a local directory or, from
the Hub, only the files that hold them), warms the stage up, and registers with the
model's fingerprint, so that a broker can refuse a worker of another model.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from zmqllm.bus.messages import Register
from zmqllm.bus.protocol import MAX_HEADER_BYTES
from zmqllm.config.layers import parse_layers
from zmqllm.config.loading import kv_dtype_of
from zmqllm.config.machine import rss_bytes
from zmqllm.config.paths import resolve_model_path, worker_served_name
from zmqllm.config.settings import Config
from zmqllm.engine import native
from zmqllm.engine.draft import load_draft
from zmqllm.engine.generator import gguf_serves, load_shard
from zmqllm.engine.linear import PACK_MIN_ROWS
from zmqllm.engine.memory_plan import StageDoesNotFit, plan_stage
from zmqllm.engine.rules import GrammarTokenizer
from zmqllm.engine.stage import Stage
from zmqllm.engine.weights import model_fingerprint, resolve_checkpoint
from zmqllm.log import get_logger
from zmqllm.models.model_args import ModelArgs
from zmqllm.version import __version__
from zmqllm.worker.build_info import build_info
from zmqllm.worker.shell import host_name

__all__ = ["Loaded", "load_stage", "max_frame_bytes", "register_message"]

log = get_logger("zmqllm.worker")


@dataclass
class Loaded:
    stage: Stage
    fingerprint: dict[str, Any]
    start: int
    end: int
    num_layers: int
    context: int
    # The units the quantized products of several rows use (native.use_matrix_units).
    matrix_units: str = ""
    # What the worker measured of itself before loading (--layers auto), for REGISTER.
    measured: dict[str, float | int] = field(default_factory=dict)


def load_stage(cfg: Config) -> Loaded:
    """Resolve the checkpoint, read only this shard's tensors, warm it up."""
    w = cfg.worker
    if w.threads:
        torch.set_num_threads(w.threads)
    spec = resolve_model_path(cfg.model.path)

    def layer_range(args: ModelArgs) -> tuple[int, int]:
        return parse_layers(w.layers, args.num_layers, args.head_cost)

    # From the Hub: config first, then only the files holding this range's tensors.
    directory = resolve_checkpoint(spec, layer_range, cfg.model.revision)
    args = ModelArgs.from_dir(directory)
    start, end = layer_range(args)
    m = cfg.model
    draft = None
    if w.speculative == "draft":  # refused before the shard's weights load if it cannot be
        last = end == args.num_layers
        spec = resolve_model_path(w.draft_model)
        draft = load_draft(spec, directory, args, last, m.dtype, m.device)
    plan = plan_stage(
        args,
        start,
        end,
        m.dtype,
        m.quant,
        w.max_kv_tokens,
        w.max_memory_mb,
        packed=w.packed_rows >= PACK_MIN_ROWS and m.device == "cpu",
        available=_device_free(m.device),
        gguf=gguf_serves(directory, args, start, end, m.quant),
        max_sessions=w.max_sessions,
        kv_dtype=kv_dtype_of(w.kv_dtype, m.dtype),
    )
    if not plan.fits():
        raise StageDoesNotFit(plan.refusal())

    t0 = time.perf_counter()
    shard = load_shard(directory, start, end, m.dtype, m.device, args, m.quant)
    kernel = shard.use_kernel(native.load()) if w.native_attention else False
    shard.use_kv_dtype(w.kv_dtype)  # as planned above
    if draft is not None and kernel:
        draft.use_kernel(native.load())
    units = native.use_matrix_units(w.matrix_units, w.int8_activations) if kernel else ""
    # Resident growth, not the packed tensors' sizes: MKL's buffers are allocated
    # larger than they are filled.
    rss = rss_bytes()
    packed = shard.pack(w.packed_rows)
    packed_mib = (rss_bytes() - rss) >> 20 if packed else 0
    # The last stage samples: it applies response_format grammars.
    grammars = GrammarTokenizer(directory, args.vocab_size) if shard.is_last else None
    if grammars is not None:
        grammars.prepare()
    stage = Stage(
        shard,
        w.max_sessions,
        plan.kv_tokens,  # max_kv_tokens, or (0) what the memory given holds
        w.prefill_chunk,
        w.max_memory_mb,
        w.prefix_cache,
        grammars,
        micro_batches=w.micro_batches or (1 if w.cpu_lock else 0),
        speculative=w.speculative,
        max_draft_tokens=w.max_draft_tokens,
        draft=draft,
        busy_prefill_chunk=w.busy_prefill_chunk,
    )
    stage.model = worker_served_name(cfg)
    stage.warmup()
    log.info(
        "shard loaded",
        layers=f"{start}:{end}",
        parameters=shard.num_parameters(),
        seconds=round(time.perf_counter() - t0, 2),
        kv_bytes_per_token=plan.kv_bytes_per_token,
        kv_budget_mib=plan.kv_budget_bytes >> 20,
        kv_tokens=plan.kv_tokens,
        kv_sized_from_memory=plan.kv_sized,
        memory_given_mib=plan.given_bytes >> 20,
        memory_given_from=plan.given_from,
        dtype=cfg.model.dtype,
        kv_dtype=str(shard.kv_dtype).removeprefix("torch."),
        device=cfg.model.device,
        quant=cfg.model.quant,
        weights_from=shard.weights_from,
        weights_mib=shard.weight_bytes() >> 20,
        rss_mib=rss_bytes() >> 20,
        batched_decode_attention="compiled kernel" if kernel else "pytorch",
        matrix_units=units or "off",
        packed_weights_mib=packed_mib,
        speculative=stage.speculation.mode if stage.proposes else "off",
    )
    fp = model_fingerprint(directory, args, cfg.model.dtype)
    return Loaded(stage, fp, start, end, args.num_layers, args.max_position_embeddings, units)


def _device_free(device: str) -> tuple[int, str] | None:
    """Free memory of a cuda device (the stage's weights and KV live there)."""
    if not device.startswith("cuda"):
        return None
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free), f"free on {device}"


def max_frame_bytes(stage: Stage, context: int) -> int:
    """The largest frame this worker can be sent: a prefill chunk's activation (in
    float32, the widest wire dtype a previous stage may send) or a whole prompt's token
    ids, plus room for a header."""
    activation = stage.prefill_chunk * stage.shard.args.hidden_size * 4
    return max(activation, context * 4) + MAX_HEADER_BYTES


def units_shown(units: str, int8_activations: bool) -> str:
    """The matrix units as a worker's build names them: "off", or the units and whether
    activations go to them in 8 bits."""
    if not units:
        return "off"
    return f"{units}+int8" if int8_activations else units


def register_message(cfg: Config, ld: Loaded) -> Register:
    """What this worker tells the broker it is."""
    # The summary's scalars (a model without a sliding window has None there).
    model = {k: v for k, v in ld.fingerprint.items() if isinstance(v, int | float | str | bool)}
    return Register(
        start=ld.start,
        end=ld.end,
        num_layers=ld.num_layers,
        capacity=ld.stage.pool.max_sessions,
        max_kv_tokens=ld.stage.pool.max_tokens,
        context=ld.context,
        version=__version__,
        fingerprint=str(ld.fingerprint["digest"]),
        model=model,
        host=host_name(),
        pid=os.getpid(),
        dtype=cfg.model.dtype,
        device=cfg.model.device,
        prefill_chunk=cfg.worker.prefill_chunk,
        served=worker_served_name(cfg),
        build=build_info(
            cfg,
            kernel_loaded=native.load() is not None,
            matrix_units=units_shown(ld.matrix_units, cfg.worker.int8_activations),
        ),
        measured=dict(ld.measured),
        proposes=ld.stage.proposes,
    )
