"""One pipeline stage's sessions and its batching, with no sockets.

Each call of :meth:`Stage.run` takes the work that is ready (decode steps of
every session, and prefill chunks up to a token budget) and runs it as ONE
batched forward over the shard. Sessions join and leave between calls.

Sessions are keyed by an opaque string (the worker uses ``"<session>/<attempt>"``).
Work is validated when it arrives, before any tensor op sees it: a token id outside the
vocabulary, a hidden state of the wrong shape or dtype, a step out of order or for an
unknown session raises :class:`BadWork`, which costs that session alone. A forward that
raises anyway raises :class:`BatchFailed` naming the sessions that were in it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from zmqllm.bus.messages import Finish
from zmqllm.bus.prefix import PREFIX_BLOCK, prefix_blocks
from zmqllm.bus.sampling_params import NO_LOGPROBS
from zmqllm.engine.cache import (
    CacheFullError,
    CachePool,
    KVCache,
    cuda_memory,
    memory_in_use,
    rss_bytes,
)
from zmqllm.engine.frames import ACTIVATION_DTYPES
from zmqllm.engine.model import MistralShard, Segment
from zmqllm.engine.prefix_cache import PrefixStore
from zmqllm.engine.rules import GrammarTokenizer, SessionRules
from zmqllm.engine.sampling import SamplingParams, logprobs_of, sample

# How long ready work may wait for more sessions while the cores are free (see
# Stage.coalesce_wait; time another stage spends computing does not count, up to
# the worker's LOCK_WAIT_MAX_S): a safety net, far above one forward of a shard.
COALESCE_MAX_S = 0.25


class BadWork(ValueError):
    """A step or activation this stage cannot run; the session it names must fail."""


class BatchFailed(RuntimeError):
    """A forward raised; ``keys`` are the sessions that were in its batch."""

    def __init__(self, keys: list[str], cause: BaseException) -> None:
        super().__init__(f"forward of {len(keys)} sessions failed: {type(cause).__name__}")
        self.keys = keys


@dataclass
class SessionState:
    id: str
    request_id: str
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    cache: KVCache
    # Stage 0 only: prompt tokens not yet run (chunked prefill).
    prompt_left: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    prompt_step: int = 0
    opened: float = field(default_factory=time.monotonic)
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


@dataclass
class Work:
    session: SessionState
    step: int
    inputs: torch.Tensor  # stage 0: token ids [n]; later stages: hidden [n, hidden]
    final: bool  # the last chunk of the prompt, or a decode step: the last stage samples
    ready_at: float = field(default_factory=time.monotonic)
    prefix: int = 0  # the first prompt chunk: the prompt tokens before it, not computed


@dataclass
class Output:
    session: str
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
    ) -> None:
        self.shard = shard
        self.pool = CachePool(
            shard.args,
            shard.num_local_layers,
            shard.dtype,
            shard.device,
            max_sessions,
            max_kv_tokens,
        )
        self.prefill_chunk = prefill_chunk
        self.max_memory = max_memory_mb << 20
        self.prefixes = PrefixStore() if prefix_cache else None
        self.grammar_tokenizer = grammar_tokenizer
        self.sessions: dict[str, SessionState] = {}
        self._ready: deque[Work] = deque()
        self.stats = StageStats()
        # (session, request id, reason) of work refused before a forward; the socket
        # side reports and closes them. One bad session must not fail a whole batch.
        self.failed: list[tuple[str, str, str]] = []

    # -- session control ------------------------------------------------------
    def open(
        self,
        session: str,
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
    ) -> SessionState:
        """Reserve the session's cache. Raises CacheFullError when there is no room and
        ValueError for a request this stage cannot serve (stage 0 needs the prompt's
        token ids, each in [0, vocab_size); later stages take none).

        ``chain``: the prompt's prefix keys; what this stage holds of them is copied into
        the new cache (``held``). Stage 0 of a route of ``stages`` then waits for the
        later stages' word (:meth:`cached`) before it starts the prompt.

        ``generated``: a replayed stream's tokens so far (the end of its prompt), for the
        last stage's penalties and grammar."""
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
        cache = self.pool.allocate(session, max_len)
        s = SessionState(session, request_id, max_tokens, sampling, stop_ids, cache)
        s.rules = rules
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
        itemsize = torch.empty((), dtype=self.shard.dtype).element_size()
        need = max_len * self.shard.args.kv_bytes_per_token(self.shard.num_local_layers, itemsize)
        used = memory_in_use(self.shard.device)
        if used + need > self.max_memory and self.prefixes is not None and len(self.prefixes):
            self.prefixes.clear()  # what it held is freed before any session is refused
            used = memory_in_use(self.shard.device)
        if used + need > self.max_memory:
            raise CacheFullError(
                f"stage memory: {used >> 20} MiB in use + {need >> 20} MiB for this "
                f"session > max_memory_mb {self.max_memory >> 20}"
            )

    def cached(self, session: str, tokens: int) -> None:
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

    def close(self, session: str) -> bool:
        s = self.sessions.pop(session, None)
        self.pool.free(session)
        if s is not None:
            self._ready = deque(w for w in self._ready if w.session is not s)
        return s is not None

    def reset(self) -> None:
        for sid in list(self.sessions):
            self.close(sid)

    def step(self, session: str, step: int, token: int) -> None:
        """Stage 0: the next decode step of a session (its previous token)."""
        s = self._known(session)
        if not self.shard.is_first:
            raise BadWork("only stage 0 takes decode steps")
        if not 0 <= token < self.shard.args.vocab_size:
            raise BadWork(f"token id {token} is not in [0, {self.shard.args.vocab_size})")
        if s.next_step == 0:
            raise BadWork("a decode step for a session still in prefill")
        self._check_step(s, step)
        self._check_room(s, 1)
        s.next_step += 1
        self._ready.append(Work(s, step, torch.tensor([token], dtype=torch.long), True))

    def activation(
        self, session: str, step: int, hidden: torch.Tensor, final: bool, prefix: int = 0
    ) -> None:
        """Later stages: hidden states from the previous stage ([n, hidden] on the CPU, a
        view on the received frame: only read, and moved to the shard's device and dtype
        here). ``prefix``, on the first prompt chunk: the tokens before it, which this
        stage must hold from its prefix cache."""
        s = self._known(session)
        if self.shard.is_first:
            raise BadWork("stage 0 takes token ids, not activations")
        if prefix:
            started = s.cache.length or s.next_step or any(w.session is s for w in self._ready)
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
        if s.next_step == 0:  # prompt chunks: all step 0, the last one final
            if step != 0:
                raise BadWork(f"step {step} before the prompt's last chunk")
        else:
            if n != 1 or not final:
                raise BadWork("a decode step carries one final row")
            self._check_step(s, step)
        self._check_room(s, n)
        if s.next_step or final:
            s.next_step += 1
        # Cast to this stage's dtype: the previous stage may send a narrower wire dtype.
        # (No copy when it already is the stage's dtype on the CPU.)
        hidden = hidden.to(device=self.shard.device, dtype=self.shard.dtype)
        self._ready.append(Work(s, step, hidden, final))

    def _known(self, session: str) -> SessionState:
        s = self.sessions.get(session)
        if s is None:
            raise BadWork("no such session on this stage")
        return s

    @staticmethod
    def _check_step(s: SessionState, step: int) -> None:
        if step != s.next_step:
            raise BadWork(f"step {step}, expected {s.next_step}")
        if step >= s.max_tokens:
            raise BadWork(f"step {step} past max_tokens {s.max_tokens}")

    def _check_room(self, s: SessionState, n: int) -> None:
        queued = sum(w.inputs.shape[0] for w in self._ready if w.session is s)
        if s.cache.length + queued + s.prompt_left.size + n > s.cache.max_len:
            raise BadWork(f"{n} more tokens overflow a cache of {s.cache.max_len}")

    # -- running ---------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._ready) or any(
            s.prompt_left.size and not s.acks for s in self.sessions.values()
        )

    def others_pending(self) -> bool:
        """Work is ready, no prompt waits, and some sessions are not ready here."""
        if not self._ready or any(
            s.prompt_left.size and not s.acks for s in self.sessions.values()
        ):
            return False
        return len({w.session.id for w in self._ready}) < len(self.sessions)

    def oldest_ready(self) -> float:
        """When the longest-waiting ready work arrived (inf: none)."""
        return min((w.ready_at for w in self._ready), default=math.inf)

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
        start = max(min(w.ready_at for w in self._ready), since)
        return max(0.0, start + COALESCE_MAX_S - now)

    def _take_batch(self) -> list[Work]:
        """Decode work first, then prefill chunks within the token budget; at
        most one segment per session (a cache advances once per forward)."""
        batch: list[Work] = []
        seen: set[str] = set()
        later: deque[Work] = deque()
        budget = self.prefill_chunk
        while self._ready:
            w = self._ready.popleft()
            n = w.inputs.shape[0]
            cache = w.session.cache
            if cache.length + n > cache.max_len:
                reason = f"{n} more tokens after {cache.length} overflow a cache of {cache.max_len}"
                self.failed.append((w.session.id, w.session.request_id, reason))
                continue
            if w.session.id in seen or (n > 1 and n > budget and batch):
                later.append(w)
                continue
            batch.append(w)
            seen.add(w.session.id)
            if n > 1:
                budget -= n
        self._ready = later
        for s in self.sessions.values():
            if budget <= 0:
                break
            if s.prompt_left.size and s.id not in seen and not s.acks:
                n = min(budget, s.prompt_left.size)
                chunk, s.prompt_left = s.prompt_left[:n], s.prompt_left[n:]
                final = s.prompt_left.size == 0
                if final:
                    s.next_step = 1  # its first token comes from this forward
                prefix = 0 if s.told else s.reused
                s.told = True
                batch.append(Work(s, 0, torch.from_numpy(chunk), final, prefix=prefix))
                seen.add(s.id)
                budget -= n
        return batch

    def run(self) -> list[Output]:
        """One batched forward of the ready work. Raises BatchFailed if the forward
        does (its sessions must fail; the others are untouched). A row that cannot be
        sampled fails its own session (see ``failed``)."""
        batch = self._take_batch()
        if not batch:
            return []
        segs = [Segment(w.session.cache, w.inputs.shape[0]) for w in batch]
        t0 = time.perf_counter()
        try:
            x = torch.cat([w.inputs for w in batch]) if len(batch) > 1 else batch[0].inputs
            out = self.shard(x, segs)
        except Exception as exc:
            raise BatchFailed([w.session.id for w in batch], exc) from exc
        dt = time.perf_counter() - t0
        st = self.stats
        st.forwards += 1
        st.tokens += int(x.shape[0])
        st.last_batch = len(batch)
        st.max_batch = max(st.max_batch, len(batch))
        st.batch_sum += len(batch)
        st.forward_s += dt
        st.last_forward_ms = dt * 1e3
        self._keep_prefixes(batch)
        outputs = []
        if not self.shard.is_last:
            off = 0
            for w, seg in zip(batch, segs, strict=True):
                s = w.session
                hidden = out[off : off + seg.n]
                outputs.append(Output(s.id, s.request_id, w.step, w.final, hidden, w.prefix))
                off += seg.n
            return outputs
        logits = out.numpy()  # [B, vocab] float32
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
                self.failed.append((s.id, s.request_id, f"sampling failed: {exc}"))
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

    def warmup(self) -> None:
        """One small forward through the shard, so the first request is not slow."""
        sid = "__warmup__"
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

    def load(self) -> dict[str, float | int]:
        st, pool = self.stats, self.pool.stats()
        return {
            "sessions": pool.sessions,
            "kv_tokens_reserved": pool.tokens_reserved,
            "kv_bytes_reserved": pool.bytes_reserved,
            "forwards": st.forwards,
            "tokens": st.tokens,
            "last_batch": st.last_batch,
            "max_batch": st.max_batch,
            "mean_batch": round(st.batch_sum / st.forwards, 3) if st.forwards else 0.0,
            "mean_forward_ms": round(st.forward_s / st.forwards * 1e3, 3) if st.forwards else 0.0,
            "last_forward_ms": round(st.last_forward_ms, 3),
            "busy_s": round(st.forward_s, 4),  # total time in forwards: utilisation
            "rss_bytes": rss_bytes(),
            **cuda_memory(self.shard.device),
            **self._prefix_load(),
        }

    def _prefix_load(self) -> dict[str, int]:
        store = self.prefixes
        if store is None:
            return {}
        return {
            "prefix_cached_tokens": store.tokens,
            "prefix_query_tokens": store.stats.query_tokens,
            "prefix_hit_tokens": store.stats.hit_tokens,
        }
