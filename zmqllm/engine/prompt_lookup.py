"""Speculative proposals by prompt lookup, and how many to make: no model, no sockets.

The stage that samples (the last one) keeps each speculating session's history (its prompt,
then every token it keeps) in a :class:`PromptLookup`: when the history's last n tokens
appeared before, the tokens that followed them then are proposed as the next ones (the
longest such n-gram first, its most recent occurrence). Stage 0 runs the last token and the
proposals as one session's rows of one forward; the last stage keeps the longest prefix of
them its own choice agrees with, plus its next token (engine/runner.py), so a text that
quotes its prompt, or repeats itself, costs fewer passes per token and the same tokens.

:class:`DraftLength` says how many to propose from how many were accepted before, so that
text that does not repeat costs (almost) nothing extra: proposals that keep failing stop
for a while (k = 0), and longer and longer while they keep failing after.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from zmqllm.config.settings import SPECULATIVE_CHOICES

__all__ = [
    "LINK_BOUND",
    "SPECULATIVE_MODES",
    "DraftLength",
    "PromptLookup",
    "Proposer",
    "SpecStats",
    "Speculator",
    "resolved_mode",
]

# [worker] speculative: auto, off, lookup (this module) or draft (a draft model,
# engine/draft.py).
SPECULATIVE_MODES = SPECULATIVE_CHOICES


def resolved_mode(mode: str, exact_rows: bool) -> str:
    """The mode a stage runs: "auto" is lookup where a pass of a few rows gives each row
    the bits it gets alone (``exact_rows``: MistralShard.exact_rows), so proposals cannot
    move greedy text at a near tie, and off elsewhere; other modes as they are."""
    if mode != "auto":
        return mode
    return "lookup" if exact_rows else "off"


# The n-grams looked up, longest first: a 1-gram matches common tokens of any text and
# its proposals mostly fail, which costs rows of every forward for nothing.
MAX_NGRAM = 3
MIN_NGRAM = 2
# In a busy forward (more than BUSY_SESSIONS sessions decoding) a proposed row is no longer
# nearly free (a few rows cost what one does: csrc/gemv.h), so proposals then need a match
# of BUSY_MIN_NGRAM tokens: about as many passes saved (1.09 against 1.09 tokens a pass on
# the benchmark's plain prompts, 1.78 against 1.78 on its repeating ones at 4 proposals)
# for half the failed rows (proposals accepted 0.68 against 0.41 on the plain prompts).
BUSY_SESSIONS = 4
BUSY_MIN_NGRAM = 3
# A session whose pass takes more than LINK_BOUND times the last stage's forward to come
# back (links, the stages before: engine/runner.py measures it) keeps proposing its full
# window after a pass that accepted only some: its rows then cost little beside the round
# trip, and each token a longer window gets right saves one (2.08 against 1.97 tokens a
# pass on the benchmark's repeating prompts at 6 proposals).
LINK_BOUND = 3.0
# Passes in a row whose proposals all failed before proposing pauses; the pause, in
# tokens, doubles each time it ends in failure again (up to PAUSE_MAX).
MISSES_BEFORE_PAUSE = 2
PAUSE_MIN = 8
PAUSE_MAX = 256


class PromptLookup:
    """One session's tokens and, for each of their n-grams (MIN_NGRAM..MAX_NGRAM), where
    its most recent occurrence that something followed ends: a proposal costs a few dict
    look-ups, whatever the length of the history."""

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = []
        # n-gram -> the index of the token that followed its latest occurrence
        self._follows: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        t = self.tokens
        end = len(t)
        # The n-grams that end with the current last token get a continuation now; the
        # history's own last n-grams are indexed only once something follows them, so a
        # look-up never finds the suffix it is looking for.
        for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
            self._follows[tuple(t[end - n : end])] = end
        t.append(int(token))

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(token)

    def propose(self, k: int, shortest: int = MIN_NGRAM) -> list[int]:
        """``k`` tokens that followed the longest n-gram (of ``shortest`` tokens or more)
        ending the history the last time it occurred ([]: none occurred before, or k is
        0). Where they run into the history's end, the text is taken to go on repeating
        its last ``len - at`` tokens (a loop of that period): a loop shorter than k still
        proposes k tokens."""
        t = self.tokens
        if k <= 0:
            return []
        for n in range(min(MAX_NGRAM, len(t)), max(MIN_NGRAM, shortest) - 1, -1):
            at = self._follows.get(tuple(t[len(t) - n :]))
            if at is not None:
                follows = t[at : at + k]
                return [follows[i % len(follows)] for i in range(k)]
        return []


@dataclass
class DraftLength:
    """How many tokens one session proposes next (``k``), adapted to how many of its
    proposals were accepted: all of them, one more next time; some, as many as were
    accepted and one more; none, ``MISSES_BEFORE_PAUSE`` times in a row: none for a
    pause of tokens, doubling while proposals keep failing after each pause."""

    most: int
    k: int = 0
    misses: int = 0
    pause: int = 0  # tokens to go before proposing again
    backoff: int = PAUSE_MIN

    def __post_init__(self) -> None:
        self.k = self.k or self.most

    def allowed(self) -> int:
        return 0 if self.pause > 0 else min(self.k, self.most)

    def passed(self, proposed: int, accepted: int, tokens: int, free: bool = False) -> None:
        """A pass verified ``proposed`` proposals, accepted ``accepted`` of them and gave
        ``tokens`` tokens; ``free``: its rows cost little beside its round trip (LINK_BOUND),
        so the window stays full unless proposing pauses."""
        self._passed(proposed, accepted, tokens)
        if free and proposed > 0 and self.pause == 0:
            self.k = self.most

    def _passed(self, proposed: int, accepted: int, tokens: int) -> None:
        if self.pause > 0:
            self.pause = max(0, self.pause - tokens)
            return
        if proposed <= 0:
            return
        if accepted >= proposed:
            self.k = min(self.most, self.k + 1)
            self.misses = 0
            self.backoff = PAUSE_MIN
        elif accepted == 0:
            self.k = max(1, self.k // 2)
            self.misses += 1
            if self.misses >= MISSES_BEFORE_PAUSE:
                self.pause = self.backoff
                self.backoff = min(PAUSE_MAX, self.backoff * 2)
                self.misses = 0
        else:
            self.k = max(1, min(self.most, accepted + 1))
            self.misses = 0
            self.backoff = PAUSE_MIN


@dataclass
class SpecStats:
    """A stage's speculation since it started, for its heartbeat: tokens proposed and
    accepted, and the passes of speculating sessions with the tokens they gave."""

    proposed: int = 0
    accepted: int = 0
    passes: int = 0
    tokens: int = 0

    def figures(self) -> dict[str, float | int]:
        return {
            "spec_proposed": self.proposed,
            "spec_accepted": self.accepted,
            "spec_passes": self.passes,
            "spec_tokens": self.tokens,
            "spec_tokens_per_pass": round(self.tokens / self.passes, 3) if self.passes else 0.0,
        }

    def count(self, proposed: int, accepted: int, tokens: int) -> None:
        """One pass of a speculating session."""
        self.proposed += proposed
        self.accepted += accepted
        self.passes += 1
        self.tokens += tokens


class Speculator(Protocol):
    """What the stage and the runner ask of one session's proposer, whoever makes the
    proposals (prompt lookup's :class:`Proposer`, a draft model's in engine/draft.py)."""

    pending: list[int]  # the proposals in flight
    expect: int  # the step of the pass whose rows carry them

    def kept(
        self, tokens: Sequence[int], proposed: int, stats: SpecStats | None, free: bool = False
    ) -> None: ...

    def propose(
        self, next_step: int, max_tokens: int, room: int, busy: bool = False
    ) -> tuple[int, ...]: ...


@dataclass
class Proposer:
    """The last stage's speculation state of one session: its history, how many to
    propose, the proposals in flight and the step whose rows carry them."""

    lookup: PromptLookup
    length: DraftLength
    pending: list[int] = field(default_factory=list)
    expect: int = 0  # the step of the next pass (its rows carry ``pending``)

    @classmethod
    def of(cls, history: Sequence[int], most: int) -> Proposer:
        return cls(PromptLookup(history), DraftLength(most))

    def kept(
        self, tokens: Sequence[int], proposed: int, stats: SpecStats | None, free: bool = False
    ) -> None:
        """A pass kept ``tokens`` (its accepted proposals, then its own next token) of
        ``proposed`` proposals verified (counted in ``stats``: not the prompt's pass);
        ``free``: see DraftLength.passed."""
        accepted = len(tokens) - 1
        self.lookup.extend(tokens)
        self.length.passed(proposed, accepted, len(tokens), free)
        if stats is not None:
            stats.count(proposed, accepted, len(tokens))

    def propose(
        self, next_step: int, max_tokens: int, room: int, busy: bool = False
    ) -> tuple[int, ...]:
        """The proposals for the pass at ``next_step``: never past the session's last step
        (max_tokens - 1) nor more than ``room`` rows; in a ``busy`` forward only from a
        match of BUSY_MIN_NGRAM tokens or more."""
        k = min(self.length.allowed(), max_tokens - 1 - next_step, room)
        self.pending = self.lookup.propose(k, BUSY_MIN_NGRAM if busy else MIN_NGRAM)
        self.expect = next_step
        return tuple(self.pending)
