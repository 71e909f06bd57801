"""The forward of one pipeline stage: a batch of work in, the stage's outputs out.

:class:`ModelRunner` runs the batch the scheduler (:mod:`zmqllm.engine.batching`)
chose as ONE forward over the shard, every session a segment of its rows, and turns
the result into outputs: hidden states for the next stage, or (last stage) a sampled
token per session whose step is final. It decides nothing about what runs.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch

from zmqllm.bus.messages import Finish
from zmqllm.bus.sampling_params import NO_LOGPROBS
from zmqllm.bus.wire_types import SessionKey
from zmqllm.engine.batching import Refusal, Work
from zmqllm.engine.cache import CachePool, bytes_free, is_out_of_memory
from zmqllm.engine.decoder_layer import Segment
from zmqllm.engine.model import MistralShard
from zmqllm.engine.prefix_cache import PrefixStore
from zmqllm.engine.sampling import logprobs_of, sample
from zmqllm.log import get_logger

log = get_logger("zmqllm.engine.runner")


def _bytes_asked(exc: BaseException) -> int | None:
    """What the allocator was asked for, as its message says (cuda: "Tried to allocate
    20.00 MiB"; the CPU allocator: "you tried to allocate 123456 bytes")."""
    text = str(exc)
    found = re.search(r"[Tt]ried to allocate ([0-9.]+) ?(bytes|B|KiB|MiB|GiB)", text)
    if found is None:
        return None
    scale = {"bytes": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    return int(float(found.group(1)) * scale[found.group(2)])


class BatchFailed(RuntimeError):
    """A forward raised; ``keys`` are the sessions that were in its batch."""

    def __init__(self, keys: list[SessionKey], cause: BaseException) -> None:
        super().__init__(f"forward of {len(keys)} sessions failed: {type(cause).__name__}")
        self.keys = keys


@dataclass
class Output:
    session: SessionKey
    request_id: str
    step: int
    final: bool
    hidden: torch.Tensor | None = None  # [n, hidden] for the next stage
    prefix: int = 0  # Work.prefix, for the next stage
    token: int | None = None  # last stage: the sampled token
    finish: Finish | None = None  # last stage: why the session ends here, if it does
    # last stage, when the session asked: the ids and log-probabilities of the sampled
    # token, then of the most likely ones (engine.sampling.logprobs_of)
    logprobs: tuple[tuple[int, ...], tuple[float, ...]] | None = None


@dataclass
class StageStats:
    forwards: int = 0
    tokens: int = 0
    last_batch: int = 0
    max_batch: int = 0
    batch_sum: int = 0
    forward_s: float = 0.0
    last_forward_ms: float = 0.0

    def record(self, batch: int, tokens: int, seconds: float) -> None:
        self.forwards += 1
        self.tokens += tokens
        self.last_batch = batch
        self.max_batch = max(self.max_batch, batch)
        self.batch_sum += batch
        self.forward_s += seconds
        self.last_forward_ms = seconds * 1e3

    def figures(self) -> dict[str, float | int]:
        """The heartbeat's view of the forwards so far."""
        n = self.forwards
        return {
            "forwards": n,
            "tokens": self.tokens,
            "last_batch": self.last_batch,
            "max_batch": self.max_batch,
            "mean_batch": round(self.batch_sum / n, 3) if n else 0.0,
            "mean_forward_ms": round(self.forward_s / n * 1e3, 3) if n else 0.0,
            "last_forward_ms": round(self.last_forward_ms, 3),
            "busy_s": round(self.forward_s, 4),  # total time in forwards: utilisation
        }


class ModelRunner:
    """Runs batches through one shard; ``pool`` and ``prefixes`` are the stage's own
    (a prompt that has run in full leaves its blocks in the prefix store)."""

    def __init__(self, shard: MistralShard, pool: CachePool, prefixes: PrefixStore | None) -> None:
        self.shard = shard
        self.model = ""  # the served name, for log lines
        self.pool = pool
        self.prefixes = prefixes
        self.stats = StageStats()

    def run(self, batch: list[Work], refused: list[Refusal]) -> list[Output]:
        """One forward of ``batch`` (at most one work item per session). Raises
        BatchFailed if the forward does (its sessions must fail; the others are
        untouched). A row that cannot be sampled goes to ``refused``.

        Out of memory is not a bug of the batch: it is run again in halves, down to
        single sessions, so only a session that cannot run even alone fails (it goes to
        ``refused``). A failed forward wrote nothing a retry depends on: each segment's
        cache length moves only once the whole forward is done."""
        try:
            return self._forward(batch, refused)
        except BatchFailed as failed:
            cause = failed.__cause__
            if cause is None or not is_out_of_memory(cause):
                raise
            free = bytes_free(self.shard.device)
            if self.shard.device.type == "cuda":
                torch.cuda.empty_cache()  # what the failed forward left cached
            log.warning(
                "forward out of memory",
                request_ids=[w.session.request_id for w in batch][:16],
                model=self.model,
                batch_size=len(batch),
                bytes_asked=_bytes_asked(cause),
                bytes_free=free,
                retry="in halves" if len(batch) > 1 else "none: the session fails",
            )
            if len(batch) == 1:
                s = batch[0].session
                refused.append((s.id, s.request_id, f"out of memory: {str(cause)[:160]}"))
                return []
        half = len(batch) // 2
        return self.run(batch[:half], refused) + self.run(batch[half:], refused)

    def _forward(self, batch: list[Work], refused: list[Refusal]) -> list[Output]:
        segs = [Segment(w.session.cache, w.rows) for w in batch]
        lengths = [seg.cache.length for seg in segs]
        t0 = time.perf_counter()
        try:
            # Prompt chunks come as numpy slices: viewed, not copied.
            inputs = [torch.as_tensor(w.inputs) for w in batch]
            x = torch.cat(inputs) if len(inputs) > 1 else inputs[0]
            out = self.shard(x, segs)
        except Exception as exc:
            # The shard moves the lengths before its output layer: a failure there must
            # not leave them moved (a retry would skip positions).
            for seg, length in zip(segs, lengths, strict=True):
                seg.cache.length = length
            raise BatchFailed([w.session.id for w in batch], exc) from exc
        self.stats.record(len(batch), int(x.shape[0]), time.perf_counter() - t0)
        self._keep_prefixes(batch)
        if not self.shard.is_last:
            return self._hidden_outputs(batch, segs, out)
        return self._sampled_outputs(batch, out, refused)

    @staticmethod
    def _hidden_outputs(batch: list[Work], segs: list[Segment], out: torch.Tensor) -> list[Output]:
        """Each session's rows of ``out`` ([total rows, hidden]) for the next stage."""
        outputs = []
        off = 0
        for w, seg in zip(batch, segs, strict=True):
            s = w.session
            hidden = out[off : off + seg.n]
            outputs.append(Output(s.id, s.request_id, w.step, w.final, hidden, w.prefix))
            off += seg.n
        return outputs

    @staticmethod
    def _sampled_outputs(
        batch: list[Work], out: torch.Tensor, refused: list[Refusal]
    ) -> list[Output]:
        """A token per session whose step is final, from ``out``: logits [B, vocab]."""
        logits = out.numpy()  # [B, vocab] float32
        outputs = []
        for row, w in enumerate(batch):
            if not w.final:
                continue  # a prompt chunk that is not the last: nothing to sample yet
            s = w.session
            try:
                if s.rules is None:
                    token = sample(logits[row], s.sampling, w.step)
                else:
                    token = sample(s.rules.apply(logits[row]), s.sampling, w.step)
                    s.rules.accept(token)
            except ValueError as exc:  # e.g. NaN logits: this row's session only
                refused.append((s.id, s.request_id, f"sampling failed: {exc}"))
                continue
            finish = None
            if token in s.stop_ids or (s.rules is not None and s.rules.done()):
                finish = Finish.STOP
            elif w.step + 1 >= s.max_tokens:
                finish = Finish.LENGTH
            top = s.sampling.logprobs
            lp = logprobs_of(logits[row], token, top) if top != NO_LOGPROBS else None
            outputs.append(
                Output(s.id, s.request_id, w.step, True, token=token, finish=finish, logprobs=lp)
            )
        return outputs

    def _keep_prefixes(self, batch: list[Work]) -> None:
        """Store the blocks of each prompt that has just run in full."""
        store = self.prefixes
        if store is None:
            return
        for w in batch:
            s = w.session
            if w.final and w.step == 0 and s.chain:
                store.save(s.chain, s.cache, self.pool.max_tokens - self.pool.reserved)
