"""The forward of one pipeline stage: a batch of work in, the stage's outputs out.

:class:`ModelRunner` runs the batch the scheduler (:mod:`zmqllm.engine.batching`)
chose as ONE forward over the shard, every session a segment of its rows, and turns
the result into outputs: hidden states for the next stage, or (last stage) a sampled
token per session whose step is final. It decides nothing about what runs.

A speculative pass (a session's token and the proposals after it, engine/prompt_lookup.py)
is verified here, on the last stage: each row's token is picked exactly as a decode step
of its own would pick it (greedy, or the (seed, step) draw on the session's penalties and
grammar), and the pass keeps the tokens up to the first that differs from the proposal at
its place, that one included. So speculation changes how many passes a text takes, never
its tokens, at any temperature: a replay after a failover gives the same ones.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import numpy as np
import torch

from zmqllm.bus.messages import Finish
from zmqllm.bus.sampling_params import NO_LOGPROBS
from zmqllm.bus.wire_types import SessionKey
from zmqllm.engine.batching import Refusal, Work
from zmqllm.engine.cache import CachePool, bytes_free, is_out_of_memory
from zmqllm.engine.decoder_layer import Segment
from zmqllm.engine.draft import Ask, propose_all
from zmqllm.engine.model import MistralShard
from zmqllm.engine.prefix_cache import PrefixStore
from zmqllm.engine.prompt_lookup import BUSY_SESSIONS, LINK_BOUND, SpecStats
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
    # last stage, speculative decoding: more tokens of the same pass follow this one (no
    # step follows it); on the pass's last token, the proposals for the next pass
    more: bool = False
    draft: tuple[int, ...] = ()


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
        self.spec = SpecStats()

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
        for w in batch:
            if w.drop:  # the rows of rejected proposals: overwritten from here on
                w.session.cache.length -= w.drop
                w.drop = 0
        segs = [Segment(w.session.cache, w.rows) for w in batch]
        lengths = [seg.cache.length for seg in segs]
        t0 = time.perf_counter()
        try:
            # Prompt chunks come as numpy slices: viewed, not copied.
            inputs = [torch.as_tensor(w.inputs) for w in batch]
            x = torch.cat(inputs) if len(inputs) > 1 else inputs[0]
            if self.shard.is_last and any(w.draft for w in batch):
                out = self.shard(x, segs, logit_rows=[1 + w.draft for w in batch])
            else:
                out = self.shard(x, segs)
        except Exception as exc:
            # The shard moves the lengths before its output layer: a failure there must
            # not leave them moved (a retry would skip positions).
            for seg, length in zip(segs, lengths, strict=True):
                seg.cache.length = length
            raise BatchFailed([w.session.id for w in batch], exc) from exc
        elapsed = time.perf_counter() - t0
        self.stats.record(len(batch), int(x.shape[0]), elapsed)
        self._keep_prefixes(batch)
        if not self.shard.is_last:
            return self._hidden_outputs(batch, segs, out)
        return self._sampled_outputs(batch, out, refused, elapsed)

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

    def _sampled_outputs(
        self, batch: list[Work], out: torch.Tensor, refused: list[Refusal], elapsed: float
    ) -> list[Output]:
        """The tokens of each session whose step is final, from ``out``: logits
        [rows, vocab], 1 + Work.draft rows per work; ``elapsed``: the forward's seconds."""
        logits = out.numpy()  # [rows, vocab] float32
        outputs: list[Output] = []
        # The passes that go on, and what their sessions are asked to propose next: all
        # at once, after the batch's tokens (a draft model drafts for them together).
        asks: list[tuple[Output, Ask]] = []
        row = 0
        for w in batch:
            rows = logits[row : row + 1 + w.draft]
            row += 1 + w.draft
            if not w.final:
                continue  # a prompt chunk that is not the last: nothing to sample yet
            s = w.session
            try:
                outputs += self._verified(w, rows, asks, elapsed)
            except ValueError as exc:  # e.g. NaN logits: this row's session only
                refused.append((s.id, s.request_id, f"sampling failed: {exc}"))
        # A busy forward: past a few sessions' steps a proposed row costs them time.
        busy = sum(1 for w in batch if w.final) > BUSY_SESSIONS
        proposals = propose_all([a for _, a in asks], busy)
        for (last, _), draft in zip(asks, proposals, strict=True):
            last.draft = draft
        return outputs

    def _verified(
        self, w: Work, rows: np.ndarray, asks: list[tuple[Output, Ask]], elapsed: float
    ) -> list[Output]:
        """The tokens one work keeps: its step's, then, while the token picked at each
        row is the proposal there, the next row's; none past a finish. A session that
        speculates and goes on then asks for proposals for its next pass (``asks``)."""
        s = w.session
        proposals = s.spec.pending[: w.draft] if s.spec is not None else []
        outputs: list[Output] = []
        for j in range(1 + w.draft):
            step = w.step + j
            if s.rules is None:
                token = sample(rows[j], s.sampling, step)
            else:
                token = sample(s.rules.apply(rows[j]), s.sampling, step)
                s.rules.accept(token)
            finish = None
            if token in s.stop_ids or (s.rules is not None and s.rules.done()):
                finish = Finish.STOP
            elif step + 1 >= s.max_tokens:
                finish = Finish.LENGTH
            top = s.sampling.logprobs
            lp = logprobs_of(rows[j], token, top) if top != NO_LOGPROBS else None
            outputs.append(
                Output(s.id, s.request_id, step, True, token=token, finish=finish, logprobs=lp)
            )
            if finish is not None or j == w.draft or token != proposals[j]:
                break
            outputs[-1].more = True
        last = outputs[-1]
        if s.spec is not None:
            kept = [o.token for o in outputs if o.token is not None]
            # The pass's round trip (from this stage's last tokens to this pass's rows)
            # against the forward: rows are nearly free where links dominate it.
            trip = w.ready_at - s.spec_sent if s.spec_sent else 0.0
            free = trip > LINK_BOUND * elapsed
            s.spec.kept(kept, w.draft, self.spec if w.step else None, free)
            s.spec_sent = time.monotonic()
            if last.finish is None:
                # Where the next pass starts: after this pass's kept rows.
                start = s.cache.length - (w.draft + 1 - len(kept))
                room = s.cache.max_len - start - 1
                asks.append((last, (s.spec, last.step + 1, s.max_tokens, room)))
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
