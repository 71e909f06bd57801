"""Searches over one model's layer ranges, without state: the best chain of workers
(``best_chain``), the chains of ranges that cover the model (``route_shapes``) and the
ranges nothing covers (``gaps``). Each is polynomial in the number of ranges: routes are
found by dynamic programming over layer boundaries, never by trying every chain.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol, TypeVar

__all__ = ["Edge", "Hop", "best_chain", "gaps", "route_shapes"]


class Hop(Protocol):
    """What a route search needs of a worker: where its layers end."""

    @property
    def end(self) -> int: ...


W = TypeVar("W", bound=Hop)

# One candidate hop of a route: (end, occupancy, worker id, worker). Generic in the worker, so
# this module needs nothing of the registry that calls it.
Edge = tuple[int, float, str, W]


def best_chain(edges: dict[int, list[Edge[W]]], num_layers: int) -> list[W] | None:
    """The chain 0 -> num_layers over ``edges`` (by start) with the least maximum occupancy,
    then the fewest hops, then the lowest worker ids, in O(edges log edges)."""
    starts = sorted(edges, reverse=True)  # every edge goes forward: later boundaries first
    # The least possible maximum occupancy of a chain from each boundary to the end.
    neck: dict[int, float] = {num_layers: -math.inf}
    for a in starts:
        options = [max(occupancy, neck[b]) for b, occupancy, _, _ in edges[a] if b in neck]
        if options:
            neck[a] = min(options)
    if 0 not in neck:
        return None
    bound = neck[0]
    # Fewest hops to the end using only hops within that bound.
    hops: dict[int, int] = {num_layers: 0}
    for a in starts:
        counts = [
            hops[b] + 1 for b, occupancy, _, _ in edges[a] if occupancy <= bound and b in hops
        ]
        if counts:
            hops[a] = min(counts)
    route: list[W] = []
    pos = 0
    while pos != num_layers:
        _, _, _, w = min(
            (e for e in edges[pos] if e[1] <= bound and hops.get(e[0]) == hops[pos] - 1),
            key=lambda e: e[2],
        )
        route.append(w)
        pos = w.end
    return route


def gaps(ranges: Iterable[tuple[int, int]], num_layers: int) -> list[str]:
    """Layer ranges of [0, num_layers) that none of ``ranges`` covers, as "a:b"."""
    out: list[str] = []
    pos = 0
    for start, end in sorted(ranges):
        if start > pos:
            out.append(f"{pos}:{start}")
        pos = max(pos, end)
    if pos < num_layers:
        out.append(f"{pos}:{num_layers}")
    return out


def route_shapes(
    ranges: Iterable[tuple[int, int]], num_layers: int, limit: int = 32
) -> list[list[str]]:
    """Chains of ``ranges`` covering [0, num_layers), e.g. [["0:15", "15:30"]]; at most
    ``limit`` of them, in order of their ranges."""
    L = num_layers
    if not L or limit < 1:
        return []
    # Keep only ranges from which L can be reached: then every step of the search below
    # leads to a chain, and the work is bounded by limit x hops.
    by_start: dict[int, list[int]] = {}
    for start, end in ranges:
        by_start.setdefault(start, []).append(end)
    reaches = {L}
    useful: dict[int, list[int]] = {}
    for start in sorted(by_start, reverse=True):
        ends = sorted(e for e in by_start[start] if e in reaches)
        if ends:
            useful[start] = ends
            reaches.add(start)
    out: list[list[str]] = []
    path: list[tuple[int, int]] = []
    stack = [iter(useful.get(0, []))]
    while stack and len(out) < limit:
        nxt = next(stack[-1], None)
        if nxt is None:
            stack.pop()
            if path:
                path.pop()
            continue
        path.append((path[-1][1] if path else 0, nxt))
        if nxt == L:
            out.append([f"{a}:{b}" for a, b in path])
            path.pop()
        else:
            stack.append(iter(useful[nxt]))
    return out
