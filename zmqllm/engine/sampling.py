"""Token sampling on numpy logits: greedy, temperature, top-k, top-p.

The random draw for step t comes from a generator seeded by (seed, t) alone, t counted from
the session's ``first_step``: so a session replayed on a fresh route (docs/failover.md)
reproduces the same tokens, and which other sessions share the batch never changes them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from zmqllm.bus.sampling_params import LOGPROB_FLOOR, SamplingParams, is_int

__all__ = ["logprobs_of", "sample", "sample_batch"]

# top-p first sorts only this many of the most likely tokens, growing ×8 until the nucleus
# fits: a full sort of a 32k–150k vocabulary costs milliseconds per token.
_NUCLEUS_BLOCK = 64


def sample(logits: np.ndarray, params: SamplingParams, step: int) -> int:
    """Pick the token for decode step ``step`` from ``logits`` [vocab]."""
    params.validate()
    if not is_int(step) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    x = np.asarray(logits)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"logits must be a non-empty 1-D array, got shape {x.shape}")
    if np.isnan(x).any():
        raise ValueError("logits contain NaN")
    if not (x > -np.inf).any():
        raise ValueError("logits are all -inf: no token can be sampled")
    if params.greedy:
        # Ties go to the lowest id, as with torch.argmax.
        return int(np.argmax(x))

    x = x.astype(np.float64)
    positive_inf = np.isposinf(x)
    if positive_inf.any():
        # +inf tokens hold all the probability, shared equally.
        x = np.where(positive_inf, 0.0, -np.inf)
    # Subtracting the max first keeps a tiny temperature from overflowing to +inf; what
    # overflows to -inf had negligible probability anyway.
    with np.errstate(over="ignore"):
        x = (x - x.max()) / params.temperature

    # Walk the inverse CDF in id order: the pick then depends only on the kept set, its
    # probabilities and u, never on how the set was found.
    kept = np.sort(_kept_tokens(x, params.top_k, params.top_p))
    cdf = np.cumsum(np.exp(x[kept]))
    u = np.random.default_rng([params.seed, params.first_step + step]).random()
    pick = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return int(kept[min(pick, kept.size - 1)])


def logprobs_of(
    logits: np.ndarray, token: int, top: int
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The model's log-softmax (of the logits as they are, before temperature or top-k/p)
    at ``token``, then at the ``top`` most likely tokens, most likely first (equal ones by
    id); none below LOGPROB_FLOOR."""
    x = np.asarray(logits, dtype=np.float64)
    peak = x.max()
    log_total = peak + np.log(np.exp(x - peak).sum())
    ids = [int(token)]
    if top > 0:
        best = np.argpartition(-x, top - 1)[:top]
        ids += best[np.lexsort((best, -x[best]))].tolist()
    values = np.maximum(x[ids] - log_total, LOGPROB_FLOOR)
    return tuple(ids), tuple(float(v) for v in values)


def sample_batch(
    logits: np.ndarray, params: Sequence[SamplingParams], steps: Sequence[int]
) -> list[int]:
    """Pick one token per row of ``logits`` [batch, vocab]; row i uses params[i], steps[i]."""
    rows = np.asarray(logits)
    if rows.ndim != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {rows.shape}")
    if not len(params) == len(steps) == rows.shape[0]:
        raise ValueError(
            f"batch of {rows.shape[0]} rows but {len(params)} params and {len(steps)} steps"
        )
    return [sample(rows[i], params[i], steps[i]) for i in range(rows.shape[0])]


def _kept_tokens(x: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Ids (in no particular order) of the tokens left after top-k, then top-p.

    ``x`` is float64 [vocab] with max 0. Among equal values the lower ids are kept, so the
    set is well defined even with ties at the boundary.
    """
    if top_k == 0 and top_p >= 1.0:
        return np.arange(x.size)  # -inf tokens stay but weigh 0: never picked
    live = int(np.count_nonzero(x > -np.inf))
    k = live if top_k == 0 else min(top_k, live)
    if top_p >= 1.0:
        return _largest_unordered(x, k)
    if k == x.size:
        total = float(np.exp(x).sum())
    else:
        total = float(np.exp(x[_largest_unordered(x, k)]).sum())
    m = min(k, _NUCLEUS_BLOCK)
    while True:
        candidates = _largest(x, m)
        # cumsum is sequential, so this prefix sum is the same whatever m is.
        mass = np.cumsum(np.exp(x[candidates])) / total
        if mass[-1] >= top_p or m == k:
            # Smallest prefix whose mass reaches top_p; all m if rounding never gets there.
            cut = int(np.searchsorted(mass, top_p, side="left")) + 1
            return candidates[: min(cut, m)]
        m = min(k, m * 8)


def _largest_unordered(x: np.ndarray, m: int) -> np.ndarray:
    """Ids of the m largest values, ties at the boundary resolved to the lowest ids."""
    if m >= x.size:
        return np.arange(x.size)
    threshold = np.partition(x, x.size - m)[x.size - m]
    above = np.flatnonzero(x > threshold)
    ties = np.flatnonzero(x == threshold)
    return np.concatenate([above, ties[: m - above.size]])


def _largest(x: np.ndarray, m: int) -> np.ndarray:
    """Ids of the m largest values, ordered by value descending then id ascending."""
    ids = _largest_unordered(x, m)
    # A stable sort keeps equal values in id order (ids within each value group ascend).
    return ids[np.argsort(-x[ids], kind="stable")]
