"""Speculative proposals from a draft model (``[worker] speculative = "draft"``): no sockets.

A small model that shares the served model's tokenizer (the default model drafts for any
model with its tokenizer, the 7B-shaped one included) runs on the stage that samples, the
last one, so drafting costs no crossing of a link: the proposals leave with the token as
prompt lookup's do. Each speculating session has a cache of its own in the draft's
:class:`~zmqllm.engine.cache.CachePool`. After a pass, the draft is cut back to what the
pass accepted of its proposals and fed the tokens kept since it last ran; then it picks
k tokens greedily, k adapted as prompt lookup's (:class:`DraftLength`). The runner
verifies them as any proposals, so the tokens stay the served model's, greedy or sampled:
the draft decides only how many passes they take. The sessions of one forward draft
together, one draft forward per proposal position for all of them.

:class:`Speculation` is a stage's choice of proposer for a session: none, prompt lookup's,
or the draft's.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias

import torch
from tokenizers import Tokenizer

from zmqllm.config.settings import MAX_DRAFT_TOKENS
from zmqllm.engine.cache import CacheFullError, CachePool, KVCache
from zmqllm.engine.decoder_layer import Segment
from zmqllm.engine.generator import load_shard
from zmqllm.engine.model import MistralShard
from zmqllm.engine.prompt_lookup import (
    SPECULATIVE_MODES,
    DraftLength,
    Proposer,
    SpecStats,
    Speculator,
)
from zmqllm.engine.weights import resolve_checkpoint
from zmqllm.log import get_logger
from zmqllm.models.model_args import ModelArgs

__all__ = [
    "DraftModel",
    "DraftModelError",
    "DraftProposer",
    "Speculation",
    "check_vocabulary",
    "load_draft",
    "propose_all",
]

log = get_logger("zmqllm.engine.draft")

# Tokens behind which a session's history is fed to the draft on its own, in pieces of
# FEED_CHUNK (a prompt, a long pause), before the batched drafting: a batch of sessions
# each bringing a whole prompt would hold all their activations at once.
CATCH_UP = 64
FEED_CHUNK = 2048

# (proposer, the step of the next pass, the session's max_tokens, the rows its cache has
# room for): what the runner asks proposals for, after a pass.
Ask: TypeAlias = tuple[Speculator, int, int, int]


class DraftModelError(ValueError):
    """A draft model this stage cannot use: another vocabulary, or not the last stage."""


def check_vocabulary(
    draft_dir: Path, draft_args: ModelArgs, served_dir: Path, served_args: ModelArgs
) -> None:
    """Refuse a draft whose token ids do not mean what the served model's do: a
    proposal is a token id, verified by the served model as its own."""
    if draft_args.vocab_size != served_args.vocab_size:
        raise DraftModelError(
            f"draft model {draft_dir} has a vocabulary of {draft_args.vocab_size} tokens, "
            f"the served model {served_dir} {served_args.vocab_size}: a draft model must "
            "share the served model's tokenizer"
        )
    files = [d / "tokenizer.json" for d in (draft_dir, served_dir)]
    for f in files:
        if not f.is_file():
            raise DraftModelError(
                f"no {f}: cannot check that draft model {draft_dir} shares the tokenizer "
                f"of the served model {served_dir}"
            )
    if files[0].read_bytes() == files[1].read_bytes():
        return
    # Files may differ in what does not change an id (normalizer spelling, padding).
    vocabs = [Tokenizer.from_file(str(f)).get_vocab(with_added_tokens=True) for f in files]
    if vocabs[0] != vocabs[1]:
        differ = sorted(set(vocabs[0].items()) ^ set(vocabs[1].items()))[:2]
        raise DraftModelError(
            f"draft model {draft_dir}'s tokenizer is not the served model {served_dir}'s "
            f"(tokens and ids differ, e.g. {differ}): a draft model must share it"
        )


def load_draft(
    model: Path | str,
    served_dir: Path,
    served_args: ModelArgs,
    last: bool,
    dtype: str = "float32",
    device: str = "cpu",
) -> MistralShard:
    """The draft model (a directory or a Hub repo id), all its layers, once it is known to
    fit the stage (the last one) and the served model (its vocabulary): checked before
    any weight is read, the stage before anything is downloaded."""
    if not last:
        raise DraftModelError(
            f'speculative "draft" on a stage that is not the last: the draft model '
            f"{model} runs on the stage that samples (give it to that worker only)"
        )
    directory = resolve_checkpoint(str(model))
    args = ModelArgs.from_dir(directory)
    check_vocabulary(directory, args, served_dir, served_args)
    return load_shard(directory, 0, args.num_layers, dtype, device, args)


@dataclass
class DraftProposer:
    """One session's drafting: its tokens (history, then every token kept), its cache in
    the draft (``cache.length`` of those tokens fed, then proposals), how many to propose,
    the proposals in flight and the step whose rows carry them."""

    model: DraftModel
    tokens: list[int]
    cache: KVCache
    length: DraftLength
    pending: list[int] = field(default_factory=list)
    expect: int = 0

    def kept(
        self, tokens: Sequence[int], proposed: int, stats: SpecStats | None, free: bool = False
    ) -> None:
        """A pass kept ``tokens`` (its accepted proposals, then its own next token).
        ``free`` is not used: each proposal costs a forward of the draft model."""
        accepted = len(tokens) - 1
        # The cache holds the proposals fed after the history (all but the last one):
        # those past the accepted ones were not the text, and are written over next.
        self.cache.length = min(self.cache.length, len(self.tokens) + accepted)
        self.tokens.extend(int(t) for t in tokens)
        self.length.passed(proposed, accepted, len(tokens))
        if stats is not None:
            stats.count(proposed, accepted, len(tokens))

    def limit(self, next_step: int, max_tokens: int, room: int, busy: bool = False) -> int:
        """How many to propose for the pass at ``next_step``: never past the session's
        last step, its cache's ``room``, nor the draft cache's (k - 1 proposals fed); none
        in a ``busy`` forward, where the draft's forwards and the proposed rows cost the
        other sessions' steps more than a few accepted tokens give back."""
        self.expect = next_step
        self.pending = []
        if busy:
            return 0
        own = self.cache.max_len - len(self.tokens) + 1
        return max(0, min(self.length.allowed(), max_tokens - 1 - next_step, room, own))

    def propose(
        self, next_step: int, max_tokens: int, room: int, busy: bool = False
    ) -> tuple[int, ...]:
        self.model.draft([(self, self.limit(next_step, max_tokens, room, busy))])
        return tuple(self.pending)


class DraftModel:
    """The draft model of a last stage and its sessions' caches (``pool``)."""

    def __init__(self, shard: MistralShard, pool: CachePool) -> None:
        if not (shard.is_first and shard.is_last):
            raise ValueError("a draft model runs all its layers")
        self.shard = shard
        self.pool = pool
        self.context = shard.args.max_position_embeddings

    def open(
        self, session: Hashable, history: Sequence[int], max_len: int, most: int
    ) -> DraftProposer | None:
        """A session's proposer, its cache reserved (up to the draft's context: past it,
        no more proposals); None when the pool has no room (it goes without)."""
        try:
            cache = self.pool.allocate(session, min(max_len, self.context))
        except CacheFullError as exc:
            log.info("no draft cache for a session: it does not speculate", reason=str(exc))
            return None
        return DraftProposer(self, [int(t) for t in history], cache, DraftLength(most))

    def close(self, session: Hashable) -> None:
        self.pool.free(session)

    def draft(self, asks: Sequence[tuple[DraftProposer, int]]) -> None:
        """Fill each proposer's ``pending`` with ``k`` greedy tokens of the draft. A draft
        forward that fails leaves every cache as it was and proposes nothing: the
        proposals are an aid, the served model's tokens do not wait on them."""
        live = [(p, k) for p, k in asks if k > 0]
        lengths = [p.cache.length for p, _ in live]
        try:
            self._draft(live)
        except Exception as exc:
            log.warning("draft forward failed: no proposals", error=str(exc)[:200])
            for (p, _), length in zip(live, lengths, strict=True):
                p.cache.length = length
                p.pending = []

    def _draft(self, live: list[tuple[DraftProposer, int]]) -> None:
        for p, _ in live:
            behind = len(p.tokens) - 1 - p.cache.length
            if behind > CATCH_UP:
                self._feed(p, len(p.tokens) - 1)
        # The tokens not fed yet: at least the last one kept (a cache cut back after a
        # pass ends before it).
        feed = [p.tokens[p.cache.length :] for p, _ in live]
        while live:
            picks = self._forward([p.cache for p, _ in live], feed)
            for (p, _), token in zip(live, picks, strict=True):
                p.pending.append(token)
            live = [(p, k) for p, k in live if len(p.pending) < k]
            feed = [[p.pending[-1]] for p, _ in live]

    def _feed(self, p: DraftProposer, upto: int) -> None:
        """One session's tokens up to ``upto`` into its cache, FEED_CHUNK at a time."""
        while p.cache.length < upto:
            n = min(FEED_CHUNK, upto - p.cache.length)
            self._forward([p.cache], [p.tokens[p.cache.length : p.cache.length + n]])

    def _forward(self, caches: list[KVCache], feed: list[list[int]]) -> list[int]:
        """One forward of the draft: each session's ``feed`` after its cache; the greedy
        next token of each."""
        x = torch.tensor([t for ids in feed for t in ids], dtype=torch.long)
        segs = [Segment(c, len(ids)) for c, ids in zip(caches, feed, strict=True)]
        logits = self.shard(x, segs)  # [sessions, vocab]
        return [int(t) for t in logits.argmax(dim=-1).tolist()]


def propose_all(asks: Sequence[Ask], busy: bool = False) -> list[tuple[int, ...]]:
    """The proposals of each ask, in order: prompt lookup's one by one, the draft's in
    one batch per draft model; ``busy``: the asks come from a forward of more than
    BUSY_SESSIONS sessions decoding (engine/prompt_lookup.py)."""
    drafted: dict[int, tuple[DraftModel, list[tuple[DraftProposer, int]]]] = {}
    for spec, next_step, max_tokens, room in asks:
        if isinstance(spec, DraftProposer):
            k = spec.limit(next_step, max_tokens, room, busy)
            drafted.setdefault(id(spec.model), (spec.model, []))[1].append((spec, k))
    for model, batch in drafted.values():
        model.draft(batch)
    return [
        tuple(spec.pending)
        if isinstance(spec, DraftProposer)
        else spec.propose(step, most, room, busy)
        for spec, step, most, room in asks
    ]


class Speculation:
    """A stage's speculative decoding: its mode (off, lookup or draft; "auto" is resolved
    before, by prompt_lookup.resolved_mode), the most tokens a session proposes per pass,
    and with "draft" the draft model. Only a last stage proposes; the others run what
    comes, whatever their mode, but a draft model is refused anywhere else (it would be
    loaded for nothing)."""

    def __init__(
        self,
        mode: str,
        most: int,
        last: bool,
        draft: MistralShard | None = None,
        max_sessions: int = 64,
        max_tokens: int = 65536,
    ) -> None:
        if mode not in SPECULATIVE_MODES or mode == "auto":  # auto: resolved_mode first
            modes = ", ".join(m for m in SPECULATIVE_MODES if m != "auto")
            raise ValueError(f"speculative {mode!r} is not one of {modes}")
        if not 1 <= most <= MAX_DRAFT_TOKENS:
            raise ValueError(f"max_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}]")
        if mode == "draft" and draft is None:
            raise ValueError('speculative "draft" needs a draft model (draft_model)')
        if mode == "draft" and not last:
            raise DraftModelError(
                'speculative "draft" on a stage that is not the last: the draft model runs '
                "on the stage that samples"
            )
        self.mode = mode
        self.most = most
        self.proposes = last and mode != "off"
        self.draft: DraftModel | None = None
        if mode == "draft" and draft is not None:
            a = draft.args
            pool = CachePool(a, a.num_layers, draft.dtype, draft.device, max_sessions, max_tokens)
            self.draft = DraftModel(draft, pool)

    def proposer(
        self, session: Hashable, history: Sequence[int], max_len: int
    ) -> Speculator | None:
        """A speculating session's proposer (None: this stage does not propose, or has
        no room in the draft's caches)."""
        if not self.proposes:
            return None
        if self.draft is None:
            return Proposer.of(history, self.most)
        return self.draft.open(session, history, max_len, self.most)

    def close(self, session: Hashable) -> None:
        """Free what the session held here (its draft cache)."""
        if self.draft is not None:
            self.draft.close(session)
