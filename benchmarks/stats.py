"""The statistics every benchmark reports: percentiles, medians with their run-to-run
range, tokens per second.

One unit convention: a function returns its figures in the unit of the values it was
given (seconds in, seconds out); a script scales to milliseconds where it prints or
writes ``*_ms`` figures (``ms``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["median", "ms", "pct", "spread", "spread_text", "tokens_per_s"]


def pct(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100, linear between the two nearest values, as
    numpy's default) in the unit of ``xs``; nan when there are none."""
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else float("nan")


def median(xs: Iterable[float]) -> float:
    return float(statistics.median(xs))


def ms(seconds: float) -> float:
    return seconds * 1e3


def spread(xs: Sequence[float]) -> dict[str, float]:
    """The median of runs and their range: what a shared machine's drift leaves."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def spread_text(xs: Sequence[float], digits: int = 3) -> str:
    """``median (min-max)``."""
    s = spread(xs)
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def tokens_per_s(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds else float("nan")
