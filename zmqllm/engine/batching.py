"""The batching policy of one pipeline stage: which work goes into the next forward.

A :class:`Scheduler` holds the work that is ready (decode steps, prompt chunks sent
by the previous stage) and the sessions whose prompts this stage still has to
cut into chunks (stage 0). It decides, without running anything:

- what the next forward takes (:meth:`Scheduler.take_batch`): decode work first,
  then prompt chunks within a token budget, at most one segment per session;
- whether ready work should wait for sessions that are on another stage
  (:meth:`Scheduler.coalesce_wait`), so that groups of sessions merge into one batch.

On stage 0 of a pipeline route, :class:`~zmqllm.engine.micro_batches.MicroBatches`
says which ready sessions each forward takes, so that the route's sessions move in as
many groups as it has stages; every stage waits for the rest of a group it has seen
part of (:class:`~zmqllm.engine.micro_batches.Arrivals`).

It never touches a tensor's values: work carries its inputs (token ids or hidden
states) as they came, and :mod:`zmqllm.engine.runner` turns a batch into one forward.
Admission (which sessions and steps are valid at all) is :mod:`zmqllm.engine.stage`'s.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from zmqllm.bus.wire_types import SessionKey
from zmqllm.engine.micro_batches import Arrivals, Member, MicroBatches

if TYPE_CHECKING:
    import torch

    from zmqllm.bus.sampling_params import SamplingParams
    from zmqllm.engine.cache import KVCache
    from zmqllm.engine.prompt_lookup import Speculator
    from zmqllm.engine.rules import SessionRules

# How long ready work may wait for more sessions while the cores are free (see
# Scheduler.coalesce_wait; time another stage spends computing does not count, up to
# the worker's LOCK_WAIT_MAX_S): a safety net, far above one forward of a shard.
COALESCE_MAX_S = 0.25

# Proposed rows (speculative decoding) all sessions together may add to one forward on
# stage 0, past which proposals are cut: speculation never crowds out the decode steps
# and prompt chunks of sessions that do not speculate.
DRAFT_ROWS_PER_FORWARD = 16


def draft_room(rows: int, steps: tuple[int, ...], most: int) -> int:
    """How many proposed rows a forward of ``rows`` other rows may take: at most
    ``most``, and never past the next of ``steps``, the row counts past which the shard's
    forward costs a step more (MistralShard.row_steps; on 2 AVX2 cores a 17th row costs
    the default model's forward 1.9x: docs/benchmarks.md, "A pass of a few rows"),
    where a proposal costs the whole batch more than it saves. None past the last step;
    ``most`` where the shard names none."""
    if not steps:
        return most
    for step in steps:
        if rows <= step:
            return max(0, min(most, step - rows))
    return 0


# (session key, request id, reason): work refused before or after a forward; the
# socket side reports and closes those sessions. One bad session must not fail a batch.
Refusal = tuple[SessionKey, str, str]


@dataclass
class SessionState:
    id: SessionKey
    request_id: str
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    cache: KVCache
    # Stage 0 only: prompt tokens not yet run (chunked prefill).
    prompt_left: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    next_hop: str = ""  # the worker its results go to next (the worker groups by it)
    # The worker's own: this session's peer links (peer_link.PeerRoute), if any.
    link: Any = None
    # The decode step this stage expects next; 0 while the prompt is still coming
    # (stage 0: until its last chunk runs; later stages: until the final chunk arrives).
    next_step: int = 0
    # Prefix caching: the prompt's block keys, the prompt tokens copied into the cache
    # from the prefix cache at open, and (stage 0) the later stages yet to say how much
    # they hold; the prompt starts after the least any stage holds.
    chain: tuple[int, ...] = ()
    held: int = 0
    acks: int = 0
    reused: int = 0  # prompt tokens not computed (the first chunk tells later stages)
    told: bool = False  # stage 0: the first prompt chunk has left
    rules: SessionRules | None = None  # last stage: penalties and a grammar, if asked for
    stages: int = 1  # stages on the session's route (stage 0 groups its sessions by it)
    opened_at: float = field(default_factory=time.monotonic)
    group: int = -1  # stage 0: the forward it last went in (its micro-batch)
    # Speculative decoding: the proposals among the rows of its last decode step (the
    # next step may come up to this many steps later, and the rows it skips past are
    # dropped), and on a last stage that speculates for it, its proposer.
    window: int = 0
    spec: Speculator | None = None
    spec_sent: float = 0.0  # last stage: when its last pass's tokens left (monotonic)

    def prompt_waiting(self) -> bool:
        """Stage 0: prompt tokens are left and no later stage's word is awaited."""
        return bool(self.prompt_left.size) and not self.acks


@dataclass
class Work:
    session: SessionState
    step: int
    # Stage 0: token ids [n] (a tensor for a decode step, the numpy slice of the prompt
    # for a prompt chunk); later stages: hidden states [n, hidden] on the shard's device.
    inputs: torch.Tensor | np.ndarray
    final: bool  # the last chunk of the prompt, or a decode step: the last stage samples
    ready_at: float = field(default_factory=time.monotonic)
    prefix: int = 0  # the first prompt chunk: the prompt tokens before it, not computed
    # A speculative decode step: of its rows, the proposals after its token; and the
    # rows of the session's previous pass whose proposals were rejected, dropped from
    # its cache before this work runs.
    draft: int = 0
    drop: int = 0

    @property
    def rows(self) -> int:
        """The tokens this work adds to its session's cache."""
        return int(self.inputs.shape[0])


class Scheduler:
    """Ready work of one stage and the policy that batches it.

    ``sessions`` is the stage's own table (shared, not copied): prompts are cut from
    the sessions in it, in the order they opened. ``prefill_chunk`` is the token budget
    of the prompt chunks in one forward. ``first``: stage 0, which forms the routes'
    micro-batches by ``micro``'s policy; ``busy_chunk`` (0: ``prefill_chunk``) is its
    budget while any of its sessions decodes."""

    def __init__(
        self,
        sessions: dict[SessionKey, SessionState],
        prefill_chunk: int,
        first: bool = False,
        micro: MicroBatches | None = None,
        draft_rows: int = DRAFT_ROWS_PER_FORWARD,
        row_steps: Callable[[], tuple[int, ...]] = tuple,
        busy_chunk: int = 0,
    ) -> None:
        self.sessions = sessions
        self.draft_rows = draft_rows
        self.row_steps = row_steps  # the shard's, asked each forward: see draft_room
        self.prefill_chunk = prefill_chunk
        self.busy_chunk = min(busy_chunk or prefill_chunk, prefill_chunk)
        self.ready: deque[Work] = deque()
        self.first = first
        self.micro = micro or MicroBatches()
        self.arrivals = Arrivals()
        self.forwards = 0  # forwards taken: stage 0 names its micro-batches by them
        self.last_forward_s = 0.0  # the stage's last forward (bounds a left-over's wait)

    def add(self, work: Work) -> None:
        self.ready.append(work)

    def drop(self, s: SessionState) -> None:
        """Forget the ready work of a session that closed."""
        self.ready = deque(w for w in self.ready if w.session is not s)

    def queued(self, s: SessionState) -> Iterable[Work]:
        return (w for w in self.ready if w.session is s)

    def queued_rows(self, s: SessionState) -> int:
        """The tokens of a session's ready work, not yet in its cache."""
        return sum(w.rows - w.drop for w in self.queued(s))

    def has_work(self) -> bool:
        return bool(self.ready) or any(s.prompt_waiting() for s in self.sessions.values())

    def others_pending(self) -> bool:
        """Work is ready, no prompt waits, and some sessions are not ready here."""
        if not self.ready or any(s.prompt_waiting() for s in self.sessions.values()):
            return False
        return len({w.session.id for w in self.ready}) < len(self.sessions)

    def oldest_ready(self) -> float:
        """When the longest-waiting ready work arrived (inf: none)."""
        return min((w.ready_at for w in self.ready), default=math.inf)

    def coalesce_wait(self, now: float, since: float = 0.0) -> float:
        """Seconds the ready work may still wait for the sessions that are elsewhere.

        When stages share the cores and take turns, sessions split into groups that
        reach each stage at different times, and a forward of 16 rows costs little
        more than one of 8: ready work is worth holding back until the sessions now
        on another stage come back, so that the groups merge into one batch (the
        worker decides when they are coming; see Worker._coalesce_wait). This is the
        bound on that wait: 0 when every session is ready, when a prompt waits, or
        when COALESCE_MAX_S has passed since the oldest ready work arrived or, if
        later, since `since` (the worker passes when it last saw another stage
        computing: time we could not have computed in does not count).
        """
        if not self.others_pending():
            return 0.0
        start = max(self.oldest_ready(), since)
        return max(0.0, start + COALESCE_MAX_S - now)

    # -- micro-batches ------------------------------------------------------------
    def note_arrival(self, group: tuple[str, int] | None, now: float | None = None) -> None:
        """A STEP or ACTIVATION came (valid or not): count it towards its group."""
        self.arrivals.note(group, time.monotonic() if now is None else now)

    def plan(self, now: float) -> tuple[frozenset[SessionKey] | None, float]:
        """The sessions the next forward may take (None: any, off stage 0 or with one
        group) and, when it may take none, how long the ready work waits for the group
        it is to join."""
        if not self.first or self.micro.groups == 1:
            return None, 0.0
        arrived: dict[SessionKey, float] = {}
        for w in self.ready:
            arrived.setdefault(w.session.id, w.ready_at)
        routes: dict[str, list[Member]] = {}
        stages: dict[str, int] = {}
        for s in self.sessions.values():
            if s.acks:
                continue  # not started: waiting for the later stages' word
            prompt = s.prompt_waiting()
            member = Member(s.id, s.group, s.opened_at if prompt else arrived.get(s.id), prompt)
            routes.setdefault(s.next_hop, []).append(member)
            stages[s.next_hop] = max(stages.get(s.next_hop, 1), s.stages)
        limit = self.micro.hold_limit(self.last_forward_s)
        allowed: set[SessionKey] = set()
        waits: list[float] = []
        for hop, members in routes.items():
            share = self.micro.share(members, stages[hop], now, limit)
            allowed.update(share.run)
            if share.wait:
                waits.append(share.wait)
        return frozenset(allowed), (min(waits) if waits and not allowed else 0.0)

    def wait(self, now: float) -> float:
        """Seconds the ready work should wait before a forward (0: run now): for the
        rest of a group seen in part, or (stage 0) for the group a left-over joins."""
        if not self.has_work():
            return 0.0
        return self.arrivals.wait(now) or self.plan(now)[1]

    # -- batches --------------------------------------------------------------------
    def prefill_budget(self) -> int:
        """The prompt tokens the next forward may take: ``prefill_chunk``, or on stage 0
        ``busy_chunk`` while a session has its prompt behind it. Each of its steps waits
        on the forward, which a whole chunk of a long prompt would hold for seconds;
        cut smaller, the prompt still moves every forward (decode work goes first, the
        prompt takes the rest), so neither starves the other. A burst of prompts
        arriving at once, with none decoding yet, still goes in one forward."""
        if self.first and any(s.next_step > 0 for s in self.sessions.values()):
            return self.busy_chunk
        return self.prefill_chunk

    def take_batch(self, refused: list[Refusal], now: float | None = None) -> list[Work]:
        """The next forward's work: decode work first, then prefill chunks within the
        token budget; at most one segment per session (a cache advances once per
        forward), and on stage 0 only the sessions of this forward's micro-batch. Work
        that would overflow its cache is dropped into ``refused``."""
        allowed, _ = self.plan(time.monotonic() if now is None else now)
        batch: list[Work] = []
        seen: set[SessionKey] = set()
        later: deque[Work] = deque()
        budget = self.prefill_budget()
        while self.ready:
            w = self.ready.popleft()
            n = w.rows
            cache = w.session.cache
            if cache.length - w.drop + n > cache.max_len:
                reason = f"{n} more tokens after {cache.length} overflow a cache of {cache.max_len}"
                refused.append((w.session.id, w.session.request_id, reason))
                continue
            held = allowed is not None and w.session.id not in allowed
            prompt = n > 1 and not w.draft  # a prompt chunk spends the token budget
            if held or w.session.id in seen or (prompt and n > budget and batch):
                later.append(w)
                continue
            batch.append(w)
            seen.add(w.session.id)
            if prompt:
                budget -= n
        self.ready = later
        for s in self.sessions.values():
            if budget <= 0:
                break
            if allowed is not None and s.id not in allowed:
                continue
            if s.prompt_waiting() and s.id not in seen:
                batch.append(self._prompt_chunk(s, budget))
                seen.add(s.id)
                budget -= batch[-1].rows
        if self.first and any(w.draft for w in batch):  # row_steps asks the kernel
            rows = sum(w.rows - w.draft for w in batch)
            drafts = draft_room(rows, self.row_steps(), self.draft_rows)
            for w in batch:
                if w.draft:
                    drafts -= self._cut_draft(w, drafts)
        if batch:
            self.forwards += 1
            for w in batch:
                w.session.group = self.forwards
        return batch

    @staticmethod
    def _cut_draft(w: Work, most: int) -> int:
        """Stage 0: keep at most ``most`` of a step's proposals (the last stage verifies
        what arrives); returns how many are kept."""
        keep = max(0, min(w.draft, most))
        if keep < w.draft:
            w.inputs = w.inputs[: 1 + keep]
            w.draft = w.session.window = keep
        return keep

    @staticmethod
    def _prompt_chunk(s: SessionState, budget: int) -> Work:
        """Stage 0: cut the next chunk (up to ``budget`` tokens) off a session's prompt."""
        n = min(budget, s.prompt_left.size)
        chunk, s.prompt_left = s.prompt_left[:n], s.prompt_left[n:]
        final = s.prompt_left.size == 0
        if final:
            s.next_step = 1  # its first token comes from this forward
        prefix = 0 if s.told else s.reused
        s.told = True
        return Work(s, 0, chunk, final, prefix=prefix)
