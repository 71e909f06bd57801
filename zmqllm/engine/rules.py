"""What the last stage applies to a session's logits before it samples: OpenAI's
presence/frequency penalties over the tokens generated so far, and a grammar
(response_format) that only lets through the tokens it allows.

Grammars are llguidance's (chosen by measuring, see the README): one matcher per session,
advanced by each sampled token; its bitmask of allowed tokens is filled before each
sample. The tokenizer llguidance needs is built once per worker, in the background when
the last stage loads (it takes seconds for a vocabulary of tens of thousands).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zmqllm.bus.sampling_params import SamplingParams
from zmqllm.log import get_logger

__all__ = ["GrammarTokenizer", "SessionRules"]

log = get_logger("zmqllm.engine")


class GrammarTokenizer:
    """The model's vocabulary as llguidance sees it, built on first use."""

    def __init__(self, model_dir: Path, vocab_size: int) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._tok: Any = None

    def get(self) -> Any:
        with self._lock:
            if self._tok is None:
                self._tok = self._build()
            return self._tok

    def prepare(self) -> None:
        """Build it in a thread of its own now, so that the first constrained session
        does not wait for it (a failure is left for that session to report)."""

        def build() -> None:
            try:
                self.get()
            except Exception as exc:
                log.warning("cannot build the grammar tokenizer", error=str(exc)[:200])

        threading.Thread(target=build, name="grammar-tokenizer", daemon=True).start()

    def _build(self) -> Any:
        try:
            import llguidance.hf
            from transformers import PreTrainedTokenizerFast
        except ImportError as exc:  # pragma: no cover - a dependency of the package
            raise ValueError(f"constrained decoding needs llguidance: {exc}") from None
        from zmqllm.models.tokenizer import Tokenizer

        log.info("building the grammar tokenizer (once per worker)")
        hf = PreTrainedTokenizerFast(tokenizer_file=str(self.model_dir / "tokenizer.json"))
        eos = sorted(Tokenizer.from_dir(self.model_dir).eos_token_ids)
        return llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)


class SessionRules:
    """Penalties and a grammar for one session, at the last stage."""

    def __init__(
        self,
        sampling: SamplingParams,
        vocab_size: int,
        grammar_tokenizer: GrammarTokenizer | None,
        generated: Sequence[int] = (),
    ) -> None:
        self.presence = sampling.presence_penalty
        self.frequency = sampling.frequency_penalty
        self.vocab_size = vocab_size
        self.counts: Counter[int] = Counter()
        self.matcher: Any = None
        if sampling.grammar:
            if grammar_tokenizer is None:
                raise ValueError("this worker cannot constrain its output (no tokenizer)")
            import llguidance
            import llguidance.numpy

            self.matcher = llguidance.LLMatcher(grammar_tokenizer.get(), sampling.grammar)
            if self.matcher.is_error():
                raise ValueError(f"grammar: {self.matcher.get_error()}")
            self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
            self._fill = llguidance.numpy.fill_next_token_bitmask
            self._apply = llguidance.numpy.apply_token_bitmask_inplace
        for token in generated:  # a replay: the stream's tokens so far, in order
            self.accept(int(token))

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A copy of one row of logits ([vocab], float32) with the penalties subtracted
        and the tokens the grammar forbids at -inf."""
        out = np.array(logits, dtype=np.float32, copy=True)
        if self.counts and (self.presence or self.frequency):
            ids = np.fromiter(self.counts.keys(), np.int64, len(self.counts))
            n = np.fromiter(self.counts.values(), np.float32, len(self.counts))
            out[ids] -= self.frequency * n + self.presence
        if self.matcher is not None:
            self._fill(self.matcher, self._bitmask, 0)
            self._apply(out, self._bitmask[0])  # forbidden tokens to -inf, in place
            if not np.isfinite(out).any():
                raise ValueError("the grammar allows no token here")
        return out

    def accept(self, token: int) -> None:
        """The sampled token: counted, and the grammar advanced over it."""
        self.counts[token] += 1
        if self.matcher is not None and not self.matcher.consume_token(token):
            raise ValueError(f"grammar: token {token} refused: {self.matcher.get_error()}")

    def done(self) -> bool:
        """The grammar is complete: nothing may follow."""
        return self.matcher is not None and bool(self.matcher.is_stopped())
