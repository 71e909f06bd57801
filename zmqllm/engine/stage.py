"""One pipeline stage's sessions: admission, with no sockets.

A :class:`Stage` opens and closes sessions, validates every step and activation when it
arrives, and queues it with its :class:`~zmqllm.engine.batching.Scheduler`, which
decides what each forward takes (decode steps of every session, and prefill chunks up
to a token budget); its :class:`~zmqllm.engine.runner.ModelRunner` runs that as ONE
batched forward over the shard. Sessions join and leave between calls of
:meth:`Stage.run`.

Sessions are keyed by a :class:`~zmqllm.bus.wire_types.SessionKey` (session, attempt).
Work is validated when it arrives, before any tensor op sees it: a token id outside the
vocabulary, a hidden state of the wrong shape or dtype, a step out of order or for an
unknown session raises :class:`BadWork`, which costs that session alone. A forward that
raises anyway raises :class:`BatchFailed` naming the sessions that were in it.

Speculative decoding (``speculative="lookup"`` or ``"draft"``): the last stage proposes
tokens for a session's next pass from its history, given at open, by prompt lookup
(engine/prompt_lookup.py) or with a draft model (engine/draft.py);
stage 0 runs a step's token and those proposals as the session's rows of one forward, and
every stage takes the next step up to as many steps later as there were proposals,
dropping the rows of those rejected (``SessionState.window``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from zmqllm.bus.prefix import PREFIX_BLOCK, prefix_blocks
from zmqllm.bus.sampling_params import SamplingParams
from zmqllm.bus.wire_types import SessionKey
from zmqllm.config.machine import rss_bytes
from zmqllm.config.settings import MAX_DRAFT_TOKENS
from zmqllm.engine.batching import Refusal, Scheduler, SessionState, Work
from zmqllm.engine.cache import (
    CacheFullError,
    CachePool,
    KVAllocationFailed,
    cuda_memory,
    memory_in_use,
)
from zmqllm.engine.decoder_layer import Segment
from zmqllm.engine.draft import Speculation
from zmqllm.engine.frames import ACTIVATION_DTYPES
from zmqllm.engine.micro_batches import MicroBatches
from zmqllm.engine.model import MistralShard
from zmqllm.engine.prefix_cache import PrefixStore
from zmqllm.engine.prompt_lookup import resolved_mode
from zmqllm.engine.rules import GrammarTokenizer, SessionRules
from zmqllm.engine.runner import ModelRunner, Output, StageStats
from zmqllm.log import get_logger

__all__ = ["BadWork", "Stage"]

log = get_logger("zmqllm.engine.stage")


class BadWork(ValueError):
    """A step or activation this stage cannot run; the session it names must fail."""


class Stage:
    def __init__(
        self,
        shard: MistralShard,
        max_sessions: int = 64,
        max_kv_tokens: int = 65536,
        prefill_chunk: int = 2048,
        max_memory_mb: int = 0,
        prefix_cache: bool = True,
        grammar_tokenizer: GrammarTokenizer | None = None,
        micro_batches: int = 0,
        speculative: str = "off",
        max_draft_tokens: int = 6,
        draft: MistralShard | None = None,
        busy_prefill_chunk: int = 0,
    ) -> None:
        """``draft``: the draft model, for ``speculative="draft"`` (engine/draft.py);
        ``busy_prefill_chunk``: stage 0's prompt tokens a forward while sessions decode
        (0: ``prefill_chunk``)."""
        self.speculation = Speculation(
            resolved_mode(speculative, shard.exact_rows()),
            max_draft_tokens,
            shard.is_last,
            draft,
            max_sessions,
            max_kv_tokens,
        )
        self.pool = CachePool(
            shard.args,
            shard.num_local_layers,
            shard.kv_dtype,
            shard.device,
            max_sessions,
            max_kv_tokens,
        )
        self.max_memory = max_memory_mb << 20
        itemsize = torch.empty((), dtype=shard.kv_dtype).element_size()
        self._kv_bytes_per_token = shard.args.kv_bytes_per_token(shard.num_local_layers, itemsize)
        # What the stage holds before any session (weights, packed copies, the runtime):
        # measured once; sessions then count by the KV bytes they reserve.
        self._fixed_bytes = memory_in_use(shard.device) if max_memory_mb else 0
        self.prefixes = PrefixStore() if prefix_cache else None
        self.grammar_tokenizer = grammar_tokenizer
        self.sessions: dict[SessionKey, SessionState] = {}
        # micro_batches: groups of sessions in flight per route (0: one per stage).
        self.scheduler = Scheduler(
            self.sessions,
            prefill_chunk,
            shard.is_first,
            MicroBatches(micro_batches),
            row_steps=lambda: self.shard.row_steps(),
            busy_chunk=busy_prefill_chunk,
        )
        self.runner = ModelRunner(shard, self.pool, self.prefixes)
        # Sessions whose work was refused before or after a forward; the socket side
        # reports and closes them. One bad session must not fail a whole batch.
        self.failed: list[Refusal] = []

    @property
    def shard(self) -> MistralShard:
        return self.runner.shard

    @shard.setter
    def shard(self, shard: MistralShard) -> None:
        # One shard for admission and forward: the runner's (tests swap in failing ones).
        self.runner.shard = shard

    @property
    def model(self) -> str:
        """The served name, for log lines (the worker sets it)."""
        return self.runner.model

    @model.setter
    def model(self, name: str) -> None:
        self.runner.model = name

    @property
    def prefill_chunk(self) -> int:
        """The most prompt tokens one forward takes (and one activation may carry)."""
        return self.scheduler.prefill_chunk

    @property
    def stats(self) -> StageStats:
        return self.runner.stats

    # -- session control ------------------------------------------------------
    def open(
        self,
        session: SessionKey,
        request_id: str,
        max_len: int,
        max_tokens: int,
        sampling: SamplingParams,
        stop_ids: frozenset[int],
        prompt: np.ndarray | None = None,
        chain: tuple[int, ...] = (),
        stages: int = 1,
        prompt_len: int = 0,
        generated: Sequence[int] = (),
        history: np.ndarray | None = None,
        speculative: bool = True,
    ) -> SessionState:
        """Reserve the session's cache. Raises CacheFullError when there is no room and
        ValueError for a request this stage cannot serve (stage 0 needs the prompt's
        token ids, each in [0, vocab_size); later stages take none).

        ``chain``: the prompt's prefix keys; what this stage holds of them is copied into
        the new cache (``held``). Stage 0 of a route of ``stages`` then waits for the
        later stages' word (:meth:`cached`) before it starts the prompt.

        ``generated``: a replayed stream's tokens so far (the end of its prompt), for the
        last stage's penalties and grammar.

        ``history``: a later last stage's copy of the prompt's token ids, where the
        request lets it speculate (``speculative``) and it does."""
        if session in self.sessions:
            raise ValueError("session is already open on this stage")
        if self.shard.is_first:
            if prompt is None or prompt.ndim != 1 or prompt.size == 0:
                raise ValueError("stage 0 needs the prompt as one int32 array of token ids")
            if int(prompt.min()) < 0 or int(prompt.max()) >= self.shard.args.vocab_size:
                raise ValueError("prompt token ids must be in [0, vocab_size)")
            if prompt.size >= max_len:
                raise ValueError(f"a prompt of {prompt.size} tokens leaves no room in {max_len}")
        elif prompt is not None:
            raise ValueError("only stage 0 takes the prompt's token ids")
        if history is not None and (self.shard.is_first or not self.shard.is_last):
            raise ValueError("only a later last stage takes the prompt's ids as its history")
        if history is not None and (history.ndim != 1 or history.size != prompt_len):
            raise ValueError("the history must be the prompt's token ids, prompt_len of them")
        if self.shard.is_first:
            history = prompt
        rules = None
        if self.shard.is_last and sampling.needs_history:
            rules = SessionRules(
                sampling, self.shard.args.vocab_size, self.grammar_tokenizer, generated
            )
        if self.max_memory:
            self._check_memory(max_len)
        store = self.prefixes
        if store is not None:  # cached blocks give way to live sessions
            over = self.pool.reserved + max_len + store.tokens - self.pool.max_tokens
            if over > 0 and self.pool.can_admit(max_len):
                store.evict(over)
        try:
            cache = self.pool.allocate(session, max_len)
        except KVAllocationFailed as exc:
            log.warning(
                "KV cache allocation failed: session refused as full",
                request_id=request_id,
                model=self.model,
                batch_size=len(self.sessions),
                bytes_asked=exc.bytes_asked,
                bytes_free=exc.bytes_free,
            )
            raise
        s = SessionState(session, request_id, max_tokens, sampling, stop_ids, cache)
        s.rules = rules
        s.stages = stages
        if speculative and history is not None and max_tokens > 1:
            s.spec = self.speculation.proposer(session, history.tolist(), max_len)
        if prompt is not None:
            # Copied out of the receive frame: it must outlive this turn.
            s.prompt_left = np.array(prompt, dtype=np.int64)
            prompt_len = prompt.size
        if store is not None and chain:
            s.chain = chain
            blocks = min(store.held(s.chain), prefix_blocks(prompt_len))
            store.load(s.chain, blocks, cache)
            s.held = blocks * PREFIX_BLOCK
            store.stats.query_tokens += prompt_len
        self.sessions[session] = s
        if self.shard.is_first:
            if s.held and stages > 1:
                s.acks = stages - 1
            else:
                self._start_prompt(s)
        return s

    def _check_memory(self, max_len: int) -> None:
        """Refuse (FULL) a session whose KV would take the stage past ``max_memory_mb``,
        counting bytes reserved, not resident: ``torch.empty`` commits no pages until they
        are written, so RSS says nothing of what the sessions already hold."""
        need = max_len * self._kv_bytes_per_token
        store = self.prefixes
        held = self.pool.reserved + (store.tokens if store is not None else 0)
        used = self._fixed_bytes + held * self._kv_bytes_per_token
        if used + need > self.max_memory and store is not None and len(store):
            store.clear()  # what it held is freed before any session is refused
            used = self._fixed_bytes + self.pool.reserved * self._kv_bytes_per_token
        if used + need > self.max_memory:
            raise CacheFullError(
                f"stage memory: {used >> 20} MiB held (weights, runtime, KV reserved) + "
                f"{need >> 20} MiB for this session > max_memory_mb {self.max_memory >> 20}"
            )

    def cached(self, session: SessionKey, tokens: int) -> None:
        """Stage 0: a later stage holds ``tokens`` of the session's prompt; once every
        later stage has said, the prompt starts after the least of them."""
        if not self.shard.is_first:
            raise BadWork("only stage 0 takes what later stages hold")
        s = self.sessions.get(session)
        if s is None or not s.acks:
            return  # closed meanwhile, or not waiting (a duplicate): nothing to do
        s.held = min(s.held, tokens - tokens % PREFIX_BLOCK)
        s.acks -= 1
        if not s.acks:
            self._start_prompt(s)

    def _start_prompt(self, s: SessionState) -> None:
        """Stage 0: the prompt runs from ``held`` on; the tokens before are reused."""
        s.reused = s.held
        s.cache.length = s.held
        s.prompt_left = s.prompt_left[s.held :]
        if self.prefixes is not None and s.chain:
            self.prefixes.stats.hit_tokens += s.held

    def close(self, session: SessionKey) -> bool:
        s = self.sessions.pop(session, None)
        self.pool.free(session)
        self.speculation.close(session)
        if s is not None:
            self.scheduler.drop(s)
        return s is not None

    def reset(self) -> None:
        for sid in list(self.sessions):
            self.close(sid)

    def step(self, session: SessionKey, step: int, token: int, draft: Sequence[int] = ()) -> None:
        """Stage 0: the next decode step of a session (its previous token), and the last
        stage's proposals for the steps after it, if any."""
        s = self._known(session)
        if not self.shard.is_first:
            raise BadWork("only stage 0 takes decode steps")
        vocab = self.shard.args.vocab_size
        for t in (token, *draft):
            if not 0 <= t < vocab:
                raise BadWork(f"token id {t} is not in [0, {vocab})")
        if s.next_step == 0:
            raise BadWork("a decode step for a session still in prefill")
        if len(draft) > MAX_DRAFT_TOKENS:
            raise BadWork(f"{len(draft)} proposals, at most {MAX_DRAFT_TOKENS}")
        draft = tuple(draft)[: self.prefill_chunk - 1]  # rows an activation may carry
        drop = self._check_step(s, step)
        if s.spec is not None and draft != tuple(s.spec.pending[: len(draft)]):
            raise BadWork("proposals this stage did not make")
        self._check_room(s, 1 + len(draft) - drop)
        s.next_step, s.window = step + 1, len(draft)
        ids = torch.tensor([token, *draft], dtype=torch.long)
        self.scheduler.add(Work(s, step, ids, True, draft=len(draft), drop=drop))

    def activation(
        self, session: SessionKey, step: int, hidden: torch.Tensor, final: bool, prefix: int = 0
    ) -> None:
        """Later stages: hidden states from the previous stage ([n, hidden] on the CPU, a
        view on the received frame: only read, and moved to the shard's device and dtype
        here). ``prefix``, on the first prompt chunk: the tokens before it, which this
        stage must hold from its prefix cache."""
        s = self._known(session)
        if self.shard.is_first:
            raise BadWork("stage 0 takes token ids, not activations")
        if prefix:
            started = s.cache.length or s.next_step or any(self.scheduler.queued(s))
            if started or prefix > s.held or prefix % PREFIX_BLOCK:
                raise BadWork(f"a prefix of {prefix} tokens: this stage holds {s.held}")
            s.reused = s.cache.length = prefix
            if self.prefixes is not None:
                self.prefixes.stats.hit_tokens += prefix
        hidden_size = self.shard.args.hidden_size
        if hidden.ndim != 2 or hidden.shape[1] != hidden_size:
            raise BadWork(f"hidden states {tuple(hidden.shape)}, expected [n, {hidden_size}]")
        n = hidden.shape[0]
        if not 1 <= n <= self.prefill_chunk:
            raise BadWork(f"{n} rows, expected 1 to {self.prefill_chunk}")
        if hidden.dtype not in ACTIVATION_DTYPES:
            raise BadWork(f"hidden states of {hidden.dtype}, not float32, bfloat16 or float16")
        drop = 0
        if s.next_step == 0:  # prompt chunks: all step 0, the last one final
            if step != 0:
                raise BadWork(f"step {step} before the prompt's last chunk")
            self._check_room(s, n)
            s.next_step = 1 if final else 0
        else:
            # A decode step: its token's row, then any proposals' (speculative decoding).
            if n > 1 + MAX_DRAFT_TOKENS or not final:
                raise BadWork(f"a decode step carries 1 to {1 + MAX_DRAFT_TOKENS} final rows")
            drop = self._check_step(s, step)
            if self.shard.is_last and n > 1 and s.spec is None:
                raise BadWork("a decode step carries one final row: this stage proposed nothing")
            if self.shard.is_last and s.spec is not None and n - 1 > len(s.spec.pending):
                raise BadWork(f"{n - 1} proposals: this stage made fewer")
            self._check_room(s, n - drop)
            s.next_step, s.window = step + 1, n - 1
        # Cast to this stage's dtype: the previous stage may send a narrower wire dtype.
        # (No copy when it already is the stage's dtype on the CPU.)
        hidden = hidden.to(device=self.shard.device, dtype=self.shard.dtype)
        draft = n - 1 if step else 0  # decode steps count from 1
        self.scheduler.add(Work(s, step, hidden, final, draft=draft, drop=drop))

    def _known(self, session: SessionKey) -> SessionState:
        s = self.sessions.get(session)
        if s is None:
            raise BadWork("no such session on this stage")
        return s

    @staticmethod
    def _check_step(s: SessionState, step: int) -> int:
        """A decode step may come up to ``window`` steps late (after a pass that kept
        some of its proposals); returns the rows of that pass to drop (the rejected ones)."""
        late = step - s.next_step
        if not 0 <= late <= s.window:
            more = f" to {s.next_step + s.window}" if s.window else ""
            raise BadWork(f"step {step}, expected {s.next_step}{more}")
        if step >= s.max_tokens:
            raise BadWork(f"step {step} past max_tokens {s.max_tokens}")
        if s.spec is not None and step != s.spec.expect:
            raise BadWork(f"step {step}: this stage's proposals were for step {s.spec.expect}")
        return s.window - late

    def _check_room(self, s: SessionState, n: int) -> None:
        queued = self.scheduler.queued_rows(s)
        if s.cache.length + queued + s.prompt_left.size + n > s.cache.max_len:
            raise BadWork(f"{n} more tokens overflow a cache of {s.cache.max_len}")

    # -- running ---------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def others_pending(self) -> bool:
        """Work is ready, no prompt waits, and some sessions are not ready here."""
        return self.scheduler.others_pending()

    def oldest_ready(self) -> float:
        """When the longest-waiting ready work arrived (inf: none)."""
        return self.scheduler.oldest_ready()

    def coalesce_wait(self, now: float, since: float = 0.0) -> float:
        """Seconds the ready work may still wait for the sessions that are elsewhere
        (see Scheduler.coalesce_wait)."""
        return self.scheduler.coalesce_wait(now, since)

    def note_arrival(self, group: tuple[str, int] | None, now: float | None = None) -> None:
        """A STEP or ACTIVATION of ``group`` came, whether or not it is valid."""
        self.scheduler.note_arrival(group, now)

    def wait(self, now: float) -> float:
        """Seconds the ready work waits for the rest of its micro-batch (0: run now)."""
        return self.scheduler.wait(now)

    def group_wait(self, now: float) -> float:
        """Seconds until every group seen in part here is complete or given up."""
        return self.scheduler.arrivals.wait(now)

    def run(self) -> list[Output]:
        """One batched forward of the ready work (on stage 0, of one micro-batch per
        route). Raises BatchFailed if the forward does (its sessions must fail; the
        others are untouched). A row that cannot be sampled fails its own session (see
        ``failed``)."""
        batch = self.scheduler.take_batch(self.failed)
        if not batch:
            return []
        try:
            return self.runner.run(batch, self.failed)
        finally:
            self.scheduler.last_forward_s = self.stats.last_forward_ms / 1e3

    def warmup(self) -> None:
        """One small forward through the shard, so the first request is not slow."""
        sid = SessionKey("__warmup__", 0)
        prompt = np.asarray([1, 2], np.int32) if self.shard.is_first else None
        self.open(sid, "", 8, 1, SamplingParams(), frozenset(), prompt)
        try:
            if self.shard.is_first:
                x = torch.tensor([1, 2], dtype=torch.long)
            else:
                x = torch.zeros(2, self.shard.args.hidden_size, dtype=self.shard.dtype)
            self.shard(x, [Segment(self.sessions[sid].cache, 2)])
        finally:
            self.close(sid)

    def heartbeat_figures(self) -> dict[str, float | int]:
        """This stage's occupancy and throughput for the worker's heartbeat: sessions
        and KV reserved, the forwards' batch sizes and times, memory, prefix cache."""
        pool = self.pool.stats()
        return {
            "sessions": pool.sessions,
            "kv_tokens_reserved": pool.tokens_reserved,
            "kv_bytes_reserved": pool.bytes_reserved,
            "kv_bytes_used": pool.bytes_used,
            **self.stats.figures(),
            "rss_bytes": rss_bytes(),
            **cuda_memory(self.shard.device),
            **self._prefix_figures(),
            **(self.runner.spec.figures() if self.proposes else {}),
        }

    @property
    def proposes(self) -> bool:
        """This stage makes proposals (the last stage, speculative on)."""
        return self.speculation.proposes

    def _prefix_figures(self) -> dict[str, int]:
        store = self.prefixes
        if store is None:
            return {}
        return {
            "prefix_cached_tokens": store.tokens,
            "prefix_query_tokens": store.stats.query_tokens,
            "prefix_hit_tokens": store.stats.hit_tokens,
        }
