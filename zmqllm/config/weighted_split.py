"""Splitting a model's layers by what each stage's machine measured, not by equal cost.

A worker's probe (worker/self_measure.py) gives, for the machine and settings it runs
with, the milliseconds one decoder layer takes at 1 and at 16 rows, the memory it may use
and the bytes a layer, the embedding and the head need there (``Figures``). Given such
figures for each stage of a pipeline, ``weighted_split`` chooses the contiguous ranges
that make the slowest stage as fast as it can be: each stage's share of the compute is
proportional to its rate, the output layer's cost (measured by the probe, else
ModelArgs.head_cost layers' worth) counts on the last stage, and memory is a hard limit
(``max_layers``). ``expected`` says what a split should give: ms per token for one
stream, and tokens/s at 16 streams when the stages overlap (the slowest stage's forward
of 16 rows bounds it).

Torch-free: the launcher, `zmqllm plan`, the broker's placement and `ray up` use it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from zmqllm.config.settings import ConfigError

__all__ = [
    "FIGURE_FIELDS",
    "ROWS",
    "Expected",
    "Figures",
    "expected",
    "fits",
    "max_layers",
    "weighted_split",
]

ROWS = 16  # the load the split is made for: 16 streams in flight


@dataclass(frozen=True)
class Figures:
    """What one stage's machine measured (worker/self_measure.py)."""

    ms_1: float  # one decoder layer's decode forward at 1 row
    ms_16: float  # ... at 16 rows
    memory_bytes: int  # what the stage may use: max_memory_mb, else what is free
    layer_bytes: int  # one layer's weights as held, plus its KV of a minimal budget
    first_bytes: int  # the embedding (stage 0)
    last_bytes: int  # the final norm and the head (the last stage)
    runtime_bytes: int  # the process itself: interpreter, torch, activations
    head_cost: float = 0.0  # the head's matmul work in layers (ModelArgs.head_cost)
    rtt_ms: float = 0.0  # to the broker, where it was measured
    # The final norm and head at 1 and 16 rows (0: not measured, as in figures of older
    # versions: head_cost layers' worth then).
    head_ms_1: float = 0.0
    head_ms_16: float = 0.0

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Figures:
        """Figures from JSON or a message; ConfigError naming what is missing or wrong."""
        values: dict[str, Any] = {}
        for name in FIGURE_FIELDS:
            if name not in raw:
                if name in OPTIONAL_FIELDS:
                    continue
                raise ConfigError(f"measured figures lack {name!r}")
            value = raw[name]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"measured figure {name!r} must be a number, not {value!r:.40}")
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"measured figure {name!r} must be finite and >= 0")
            values[name] = value
        if values["ms_1"] <= 0 or values["ms_16"] <= 0:
            raise ConfigError("measured figures: ms_1 and ms_16 must be above 0")
        for name in ("memory_bytes", "layer_bytes", "first_bytes", "last_bytes", "runtime_bytes"):
            values[name] = int(values[name])
        return cls(**values)

    def stage_ms(self, layers: int, last: bool, rows: int = ROWS) -> float:
        """A forward of ``rows`` rows through ``layers`` layers (and the head if last)."""
        per = self.ms_1 if rows == 1 else self.ms_16
        return per * layers + (self.head_ms(rows) if last else 0.0)

    def head_ms(self, rows: int = ROWS) -> float:
        """The final norm and head at 1 row or at ``ROWS``: measured, else estimated."""
        measured = self.head_ms_1 if rows == 1 else self.head_ms_16
        if measured > 0:
            return measured
        return (self.ms_1 if rows == 1 else self.ms_16) * self.head_cost


FIGURE_FIELDS = tuple(Figures.__dataclass_fields__)
OPTIONAL_FIELDS = ("head_cost", "rtt_ms", "head_ms_1", "head_ms_16")


def fits(f: Figures, start: int, end: int, num_layers: int) -> bool:
    """Whether layers [start, end) of a ``num_layers`` model fit the stage's memory."""
    need = f.runtime_bytes + (end - start) * f.layer_bytes
    need += f.first_bytes if start == 0 else 0
    need += f.last_bytes if end == num_layers else 0
    return need <= f.memory_bytes


def max_layers(f: Figures, start: int, num_layers: int) -> int:
    """The most layers from ``start`` that fit (0: not even one)."""
    best = 0
    for end in range(start + 1, num_layers + 1):
        if fits(f, start, end, num_layers):
            best = end - start
    return best


def weighted_split(num_layers: int, figures: Sequence[Figures]) -> list[tuple[int, int]]:
    """Contiguous ranges covering [0, num_layers), one per stage in order, that minimize
    the slowest stage's forward of 16 rows within each stage's memory; among splits of
    the same bottleneck, the one whose stage times are most even (least sum of squares).
    ConfigError when no split fits."""
    k = len(figures)
    if not 1 <= k <= num_layers:
        raise ConfigError(f"cannot split {num_layers} layers into {k} stages")
    # best[i][s]: (bottleneck, sum of squares, ends) of stages i.. taking layers s..
    inf: tuple[float, float, tuple[int, ...]] = (math.inf, math.inf, ())
    best: list[dict[int, tuple[float, float, tuple[int, ...]]]] = [{} for _ in range(k + 1)]
    best[k][num_layers] = (0.0, 0.0, ())
    for i in range(k - 1, -1, -1):
        f, last = figures[i], i == k - 1
        for s in range(num_layers - (k - i) + 1):
            found = inf
            ends = [num_layers] if last else range(s + 1, num_layers - (k - i - 1) + 1)
            for e in ends:
                rest = best[i + 1].get(e)
                if rest is None or rest[0] == math.inf or not fits(f, s, e, num_layers):
                    continue
                t = f.stage_ms(e - s, e == num_layers)
                cand = (max(t, rest[0]), t * t + rest[1], (e, *rest[2]))
                if cand[:2] < found[:2]:
                    found = cand
            best[i][s] = found
    top = best[0].get(0, inf)
    if top[0] == math.inf:
        raise ConfigError(
            f"no split of {num_layers} layers into {k} stages fits every stage's memory"
        )
    starts = [0, *top[2][:-1]]
    return list(zip(starts, top[2], strict=True))


@dataclass(frozen=True)
class Expected:
    ms_per_token: float  # one stream: every stage's 1-row forward plus the crossings
    tokens_per_s: float  # 16 streams, stages overlapping: bounded by the slowest stage
    bottleneck_ms: float  # the slowest stage's forward of 16 rows


def expected(
    split: Sequence[tuple[int, int]], figures: Sequence[Figures], num_layers: int
) -> Expected:
    """What ``split`` should give on machines of these ``figures`` (each stage's round
    trip to the broker stands for one crossing)."""
    one = sum(
        f.stage_ms(b - a, b == num_layers, 1) + f.rtt_ms
        for (a, b), f in zip(split, figures, strict=True)
    )
    slowest = max(
        f.stage_ms(b - a, b == num_layers) for (a, b), f in zip(split, figures, strict=True)
    )
    return Expected(one, ROWS * 1000.0 / slowest if slowest > 0 else 0.0, slowest)
