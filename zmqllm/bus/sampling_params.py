"""Sampling parameters: what a request asks of the token picker, as plain data.

The gateway builds them, the wire carries them and the worker's sampler reads them; no
torch here, so the front end can use them without the ML stack. The limits of a request's
sampling fields are declared here once: the gateway checks a request with them, the bus an
OPEN (``validate``) and an ASK's body (``ask_body``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = [
    "LOGPROB_FLOOR",
    "MAX_FIRST_STEP",
    "MAX_GRAMMAR_BYTES",
    "MAX_LOGPROBS",
    "MAX_PENALTY",
    "MAX_SEED",
    "MAX_STOPS",
    "MAX_STOP_CHARS",
    "MAX_TEMPERATURE",
    "MAX_TOP_K",
    "NO_LOGPROBS",
    "SamplingParams",
    "is_int",
]

MAX_SEED = 2**63 - 1
MAX_FIRST_STEP = 2**31 - 1
# Log-probabilities with each token: NO_LOGPROBS, or the chosen token's and this many of
# the most likely (OpenAI's top_logprobs goes to 20).
NO_LOGPROBS = -1
MAX_LOGPROBS = 20
# The lowest log-probability sent; OpenAI writes a token of probability 0 as -9999.
LOGPROB_FLOOR = -9999.0
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
# A grammar travels in the OPEN header, whose strings stop at 16 KiB.
MAX_GRAMMAR_BYTES = 12 * 1024
MAX_STOPS = 4  # OpenAI's limit on stop strings
MAX_STOP_CHARS = 256  # one stop string an ASK body forwards to an upstream
# OpenAI's temperature range, forwarded to an upstream; our own sampler takes any >= 0.
MAX_TEMPERATURE = 2.0
MAX_TOP_K = 1 << 20  # a top_k forwarded to an upstream


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. temperature 0 means greedy; top_k 0 means no limit."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    # The generation step of this session's first token. A replay (zmqllm.client.failover) reopens
    # a lost session with its tokens so far in the prompt and continues at the step it
    # reached, so step t still draws from (seed, t) and the replay repeats the lost tokens.
    first_step: int = 0
    # The model's log-softmax with each token: NO_LOGPROBS (none), or the chosen token's
    # and the ``logprobs`` most likely tokens'.
    logprobs: int = NO_LOGPROBS
    # OpenAI's penalties on the tokens generated so far: each logit minus
    # presence_penalty if the token appeared, minus frequency_penalty times its count.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Constrained decoding (response_format): an llguidance grammar, as JSON text; only
    # tokens it allows are sampled. "" = free text.
    grammar: str = ""

    @property
    def needs_history(self) -> bool:
        """Sampling depends on the tokens generated before (penalties, a grammar)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.grammar)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the first bad parameter."""
        if not _is_real(self.temperature) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be an integer in [0, 2**63 - 1], got {self.seed!r}")
        if not is_int(self.logprobs) or not NO_LOGPROBS <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"logprobs must be an integer in [{NO_LOGPROBS}, {MAX_LOGPROBS}], "
                f"got {self.logprobs!r}"
            )
        if not is_int(self.first_step) or not 0 <= self.first_step <= MAX_FIRST_STEP:
            raise ValueError(
                f"first_step must be an integer in [0, {MAX_FIRST_STEP}], got {self.first_step!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(
                    f"{name} must be a number in [{-MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}"
                )
        if not isinstance(self.grammar, str) or len(self.grammar.encode()) > MAX_GRAMMAR_BYTES:
            raise ValueError(f"grammar must be a string of at most {MAX_GRAMMAR_BYTES} bytes")

    def to_dict(self) -> dict[str, Any]:
        """Plain types only: this travels in msgpack headers (first_step, logprobs,
        the penalties and the grammar only when set)."""
        data = asdict(self)
        for name in ("first_step", "presence_penalty", "frequency_penalty", "grammar"):
            if not data[name]:
                del data[name]
        if self.logprobs == NO_LOGPROBS:
            del data["logprobs"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Build and validate from a header dict; missing keys take their defaults."""
        if not isinstance(data, Mapping):
            raise ValueError(f"sampling params must be a map, got {type(data).__name__}")
        unknown = sorted(str(key) for key in data if key not in _FIELD_KINDS)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for name, value in data.items():
            if _FIELD_KINDS[name] is float:
                if not _is_real(value):
                    raise ValueError(f"{name} must be a number, got {type(value).__name__}")
                values[name] = float(value)
            elif _FIELD_KINDS[name] is str:
                if not isinstance(value, str):
                    raise ValueError(f"{name} must be a string, got {type(value).__name__}")
                values[name] = value
            else:
                if not is_int(value):
                    raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
                values[name] = int(value)
        params = cls(**values)
        params.validate()
        return params


_FIELD_KINDS: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "seed": int,
    "first_step": int,
    "logprobs": int,
    "presence_penalty": float,
    "frequency_penalty": float,
    "grammar": str,
}


def is_int(value: Any) -> bool:
    # bool is an int subclass, but `top_k: true` is a client bug, not 1.
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
