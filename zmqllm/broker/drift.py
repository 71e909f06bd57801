"""Replicas that are not the same build: what each worker said in its REGISTER's
``build`` (versions, kernel, CPU features, quant, dtypes, device), compared per pool (the
workers of one model's layer range), which failover treats as interchangeable.

Quant and dtype decide the numbers outright: a replica that differs there is refused.
Every other difference is drift: shown per pool in STATUS (``zmqllm status --drift``
prints only that, and exits 1 when there is any) for the operator to act on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

__all__ = ["NOT_SENT", "REFUSED_ON", "pool_drift", "pool_refusal"]

# Build fields on which a replica may not differ from its pool.
REFUSED_ON = ("quant", "dtype")
# Drift's "value" of the workers that did not send a field.
NOT_SENT = "(not sent)"


class Member(Protocol):
    worker_id: str
    build: dict[str, Any]


def pool_refusal(build: Mapping[str, Any], members: Iterable[Member]) -> str | None:
    """Why a worker of this ``build`` may not join the pool of ``members`` (None: it may).
    A member that said nothing of a field (an older worker) is not compared on it."""
    for field in REFUSED_ON:
        if field not in build:
            continue
        for m in members:
            theirs = m.build.get(field)
            if theirs is not None and theirs != build[field]:
                return (
                    f"{field} {build[field]!s:.32} differs from its pool's {theirs!s:.32} "
                    f"(worker {m.worker_id}): its tokens would differ, and failover replays "
                    "streams onto either"
                )
    return None


def pool_drift(pools: Mapping[tuple[str, int, int], Iterable[Member]]) -> list[dict[str, Any]]:
    """Per pool of two or more workers, each build field on which they differ, with the
    workers of each value: [{"model", "layers", "field", "values": {value: [ids]}}].

    Every field any replica sent is compared (the union of their builds): the workers
    that left it out (older or tampered ones) are named under NOT_SENT, which no value a
    worker sends can pass for (see ``_values_of``).
    """
    out: list[dict[str, Any]] = []
    for (model, start, end), members in sorted(pools.items()):
        workers = list(members)
        if len(workers) < 2:
            continue
        for field in sorted({k for w in workers for k in w.build}):
            values = _values_of(field, workers)
            if len(values) > 1:
                out.append(
                    {"model": model, "layers": [start, end], "field": field, "values": values}
                )
    return out


def _values_of(field: str, workers: list[Member]) -> dict[str, list[str]]:
    """The workers of each value of ``field``, keyed by the value's text, and NOT_SENT's.

    Values are told apart by type as well as text (2 and "2" are not one build), and a
    text shared by two values, or NOT_SENT's text sent as a value, gets its type after
    it: a worker that sends the string "(not sent)" shows as "(not sent) (str)".
    """
    groups: dict[tuple[str, str], list[str]] = {}
    for w in workers:
        if field in w.build:
            value = w.build[field]
            key = (type(value).__name__, str(value))
        else:
            key = ("", NOT_SENT)
        groups.setdefault(key, []).append(w.worker_id)
    texts = [text for _, text in groups]
    out: dict[str, list[str]] = {}
    for (kind, text), ids in groups.items():
        shown = text
        if kind and (text == NOT_SENT or texts.count(text) > 1):
            shown = f"{text} ({kind})"
        while shown in out:  # a sent text that reads like another one's shown text
            shown += f" ({kind})"
        out[shown] = sorted(ids)
    return out
