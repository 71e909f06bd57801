"""Whole-model generation in one process: shards chained in-process.

Used by ``zmqllm generate``, the engine benchmark and the exactness tests.
Workers use :func:`load_shard` and the same sampling.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from zmqllm.bus.sampling_params import SamplingParams
from zmqllm.engine import native
from zmqllm.engine.cache import CachePool
from zmqllm.engine.decoder_layer import Segment
from zmqllm.engine.gguf_weights import GGUFShardReader, gguf_matches, gguf_source
from zmqllm.engine.model import TORCH_DTYPES, MistralShard
from zmqllm.engine.sampling import sample
from zmqllm.engine.weights import load_shard_tensors, shard_tensor_groups
from zmqllm.log import get_logger
from zmqllm.models.checkpoint import weight_map
from zmqllm.models.model_args import ModelArgs

log = get_logger("zmqllm.engine")


def torch_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(TORCH_DTYPES)}") from None


def load_shard(
    directory: Path,
    start: int,
    end: int,
    dtype: str = "float32",
    device: str = "cpu",
    args: ModelArgs | None = None,
    quant: str = "none",
) -> MistralShard:
    """Build the shard for layers [start, end) and read only its tensors.

    With ``quant`` int8/int4, a model prepared from a GGUF file whose layer weights
    are already of that kind (the default model's Q4_1 for int4) loads its blocks
    from that file as they are; otherwise the safetensors weights are quantized as
    they load. ``shard.weights_from`` says which.
    """
    args = args or ModelArgs.from_dir(directory)
    shard = MistralShard(args, start, end, torch_dtype(dtype), device, quant)
    # A group at a time (embedding, each layer, head): peak memory stays near
    # the shard's own size instead of twice it.
    groups = shard_tensor_groups(args, start, end)
    reader = _gguf_reader(directory, args, start, end, quant)
    if reader is not None:
        shard.weights_from = f"gguf:{reader.path.name}"
        for group in groups:
            shard.load(reader.read(group), strict=False)
    else:
        wmap = weight_map(directory)
        for group in groups:
            tensors = load_shard_tensors(directory, args, start, end, group, wmap).tensors
            shard.load(dict(tensors), strict=False)
    shard.check_loaded()
    return shard.eval()


def gguf_serves(directory: Path, args: ModelArgs, start: int, end: int, quant: str) -> bool:
    """Whether load_shard would read this range's blocks from a GGUF file as they are."""
    return _gguf_reader(directory, args, start, end, quant) is not None


def _gguf_reader(
    directory: Path, args: ModelArgs, start: int, end: int, quant: str
) -> GGUFShardReader | None:
    if quant == "none":
        return None
    path = gguf_source(directory, quant)
    if path is None:
        return None
    try:
        reader = GGUFShardReader(path, args)
    except ImportError:
        log.warning("the gguf package is missing: quantizing the safetensors weights instead")
        return None
    return reader if gguf_matches(reader, args, start, end, quant) else None


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = ""


class Generator:
    """A model split into ``bounds`` shards, chained in one process."""

    def __init__(
        self,
        directory: str | Path,
        bounds: Sequence[tuple[int, int]] | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        compiled: bool = True,
        quant: str = "none",
        kv_dtype: str = "auto",
    ) -> None:
        """``compiled``: use the compiled kernels (engine.native) where they load:
        the fast single-stream path; False keeps PyTorch's ops throughout.
        ``quant``: "none", "int8" or "int4" (see load_shard); ``kv_dtype``: the caches'
        (MistralShard.use_kv_dtype)."""
        self.directory = Path(directory)
        self.args = ModelArgs.from_dir(self.directory)
        bounds = bounds or [(0, self.args.num_layers)]
        self.shards = [
            load_shard(self.directory, s, e, dtype, device, self.args, quant) for s, e in bounds
        ]
        kernel = native.load() if compiled else None
        for shard in self.shards:
            shard.use_kernel(kernel)
            shard.use_kv_dtype(kv_dtype)
        self.pools = [
            CachePool(self.args, sh.num_local_layers, sh.kv_dtype, device) for sh in self.shards
        ]

    def forward(self, sessions: Sequence[str], inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """One batched step through every shard: each session brings its tokens
        (a prefill chunk or one decode token). Returns last-token logits [B, vocab]."""
        flat = torch.tensor([t for toks in inputs for t in toks], dtype=torch.long)
        h: torch.Tensor = flat
        for shard, pool in zip(self.shards, self.pools, strict=True):
            segs = [
                Segment(pool.get(s), len(toks)) for s, toks in zip(sessions, inputs, strict=True)
            ]
            h = shard(h, segs)
        return h

    def all_logits(
        self, ids: Sequence[int], session: str = "all-logits", chunk: int = 0
    ) -> torch.Tensor:
        """Logits at every position of ``ids``: [len(ids), vocab] (teacher-forced
        agreement and perplexity), from one prefill or from forwards of ``chunk`` tokens
        (the products of a chunk's row count, as a worker's prefill_chunk makes them)."""
        step = chunk or len(ids)
        self.open(session, len(ids))
        try:
            parts = []
            for i in range(0, len(ids), step):
                part = list(ids[i : i + step])
                h = torch.tensor(part, dtype=torch.long)
                for shard, pool in zip(self.shards, self.pools, strict=True):
                    segment = Segment(pool.get(session), len(part))
                    h = shard(h, [segment], all_logits=shard.is_last)
                parts.append(h)
            return torch.cat(parts)
        finally:
            self.close(session)

    def open(self, session: str, max_len: int) -> None:
        for pool in self.pools:
            pool.allocate(session, max_len)

    def close(self, session: str) -> None:
        for pool in self.pools:
            pool.free(session)

    def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        params: SamplingParams | None = None,
        stop_ids: Sequence[int] = (),
        stats: GenerationStats | None = None,
        session: str = "local",
    ) -> Iterator[int]:
        """Yield generated token ids one by one (a stop token is yielded, then it ends)."""
        params = params or SamplingParams()
        stats = stats if stats is not None else GenerationStats()
        stats.prompt_tokens = len(prompt)
        if not prompt:
            raise ValueError("empty prompt")
        self.open(session, len(prompt) + max_tokens)
        try:
            t0 = time.perf_counter()
            logits = self.forward([session], [list(prompt)])
            stats.prefill_s = time.perf_counter() - t0
            stop = set(stop_ids)
            t1 = time.perf_counter()
            for step in range(max_tokens):
                token = sample(logits[0].numpy(), params, step)
                stats.generated_tokens += 1
                yield token
                if token in stop:
                    stats.finish_reason = "stop"
                    break
                if step + 1 == max_tokens:
                    stats.finish_reason = "length"
                    break
                logits = self.forward([session], [[token]])
            stats.decode_s = time.perf_counter() - t1
        finally:
            self.close(session)
