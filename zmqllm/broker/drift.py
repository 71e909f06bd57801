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

__all__ = ["REFUSED_ON", "pool_drift", "pool_refusal"]

# Build fields on which a replica may not differ from its pool.
REFUSED_ON = ("quant", "dtype")


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
    """Per pool of two or more workers, each build field whose values differ, with the
    workers of each value: [{"model", "layers", "field", "values": {value: [ids]}}]."""
    out: list[dict[str, Any]] = []
    for (model, start, end), members in sorted(pools.items()):
        workers = list(members)
        if len(workers) < 2:
            continue
        fields = sorted({k for w in workers for k in w.build})
        for field in fields:
            values: dict[str, list[str]] = {}
            for w in workers:
                shown = "(not said)" if field not in w.build else str(w.build[field])
                values.setdefault(shown, []).append(w.worker_id)
            if len(values) > 1:
                for ids in values.values():
                    ids.sort()
                out.append(
                    {"model": model, "layers": [start, end], "field": field, "values": values}
                )
    return out
