"""The broker's worker registry, without sockets: workers, pools, routes.

A pool is the set of workers serving one layer range. A route is one worker per hop,
chained to cover [0, L); ranges may differ between routes (a worker holding the whole
model beside a two-stage pipeline).

Every table here is keyed by what peers send, so each is bounded (``max_workers``,
``max_ranges``, ``MAX_LAYERS``), and every search is polynomial in those bounds: routes
are found by dynamic programming over layer boundaries, never by trying every chain.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zmqllm.messages import LOAD_KEYS, MAX_CONTEXT, MAX_LAYERS, MAX_TEXT, Register
from zmqllm.wire_types import ProtocolError

if TYPE_CHECKING:
    from zmqllm.config import BrokerSettings

__all__ = [
    "DEFAULT_MAX_RANGES",
    "DEFAULT_MAX_WORKERS",
    "MAX_GAPS",
    "Registry",
    "RegistryError",
    "WorkerEntry",
    "fingerprint_differences",
]

DEFAULT_MAX_WORKERS = 1024
DEFAULT_MAX_RANGES = 512
MAX_GAPS = 32  # gaps uncovered() names; it counts the rest
MAX_DIFFERENCES = 16  # fingerprint keys a refusal names

# One candidate hop of a route: (end, load, worker id, worker).
_Edge = tuple[int, float, str, "WorkerEntry"]


class RegistryError(ValueError):
    """A REGISTER the registry cannot take; the message is the reason for REFUSED."""


def _short(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def fingerprint_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Readable differences between two model fingerprints ("num_layers: 30 != 4")."""
    out: list[str] = []
    for k in sorted((set(a) | set(b)) - {"digest"}, key=str):
        if a.get(k) != b.get(k):
            out.append(f"{k}: {_short(a.get(k))} != {_short(b.get(k))}")
            if len(out) == MAX_DIFFERENCES:
                break
    return out


def _is_routing_name(identity: bytes) -> bool:
    # The worker id is the routing id as text, sent back in REGISTERED: printable ASCII
    # keeps it one-to-one with the identity (no two identities decode to the same id).
    return 1 <= len(identity) <= 255 and all(0x21 <= c <= 0x7E for c in identity)


@dataclass(eq=False)
class WorkerEntry:
    identity: bytes
    worker_id: str
    start: int
    end: int
    capacity: int  # most sessions at once
    max_kv_tokens: int
    host: str = "unknown"
    pid: int = 0
    dtype: str = ""
    device: str = ""
    model: dict[str, Any] = field(default_factory=dict)  # its fingerprint summary
    last_seen: float = field(default_factory=time.monotonic)
    registered_at: float = field(default_factory=time.monotonic)
    # Session key -> KV tokens reserved for it here, so a release frees exactly that.
    sessions: dict[Hashable, int] = field(default_factory=dict)
    reserved_tokens: int = 0
    load: dict[str, Any] = field(default_factory=dict)  # the worker's last HEARTBEAT load
    draining: bool = False
    full_until: float = 0.0  # refused a session lately: skip it until then
    # The CURVE public key (z85) it registered with: only that key may speak as it.
    key: str = ""

    def has_room(self, max_len: int, now: float) -> bool:
        return (
            not self.draining
            and now >= self.full_until
            and len(self.sessions) < self.capacity
            and self.reserved_tokens + max_len <= self.max_kv_tokens
        )

    def load_score(self) -> float:
        """Fraction of this worker in use: the larger of sessions and KV tokens."""
        return max(
            len(self.sessions) / max(1, self.capacity),
            self.reserved_tokens / max(1, self.max_kv_tokens),
        )

    def describe(self, now: float) -> dict[str, Any]:
        """This worker in STATUS: a fixed set of fields, each of bounded size."""
        stats = {
            k: v
            for k, v in self.load.items()
            if k in LOAD_KEYS
            and type(v) in (int, float, bool)
            and (type(v) is not float or math.isfinite(v))
        }
        return {
            "id": self.worker_id,
            "layers": [self.start, self.end],
            "sessions": len(self.sessions),
            "capacity": self.capacity,
            "kv_tokens_reserved": self.reserved_tokens,
            "max_kv_tokens": self.max_kv_tokens,
            "load": round(self.load_score(), 3),
            "last_heartbeat_s": round(now - self.last_seen, 2),
            "draining": self.draining,
            "info": dict(host=self.host, pid=self.pid, dtype=self.dtype, device=self.device),
            "stats": stats,
        }


class Registry:
    """Registered workers of one model; refuses a worker of another model.

    The model (fingerprint digest, num_layers, context) is defined by the first worker
    and forgotten when the last one leaves, unless ``model_fingerprint`` pins the digest.
    """

    def __init__(
        self,
        *,
        max_workers: int = DEFAULT_MAX_WORKERS,
        max_ranges: int = DEFAULT_MAX_RANGES,
        model_fingerprint: str = "",
        affinity_slack: int = 4,
    ) -> None:
        if max_workers < 1 or max_ranges < 1:
            raise ValueError("max_workers and max_ranges must be at least 1")
        self.max_workers = max_workers
        self.max_ranges = max_ranges
        self.affinity_slack = affinity_slack
        self.pinned = model_fingerprint
        self.workers: dict[str, WorkerEntry] = {}
        self.by_identity: dict[bytes, WorkerEntry] = {}
        self._pools: dict[tuple[int, int], dict[str, WorkerEntry]] = {}
        self.fingerprint = self.pinned
        self.model: dict[str, Any] = {}  # the defining worker's fingerprint summary
        self.num_layers = 0
        self.context = 0
        self.prefill_chunk = 0

    @classmethod
    def from_settings(cls, s: BrokerSettings) -> Registry:
        return cls(
            max_workers=s.max_workers,
            max_ranges=s.max_ranges,
            model_fingerprint=s.model_fingerprint,
            affinity_slack=s.affinity_slack,
        )

    # -- admission -----------------------------------------------------------------------

    def refusal(self, reg: Register, our_version: str, identity: bytes | None = None) -> str | None:
        """Why this REGISTER cannot join, or None. Changes nothing.

        Pass the peer's routing ``identity``: a worker registering again replaces its old
        entry, so it does not count against the caps or the model of the others.
        """
        reason = self._reason(reg, identity)
        if reason is None and reg.version != our_version:
            reason = f"zmqllm version {reg.version} differs from the broker's {our_version}"
        return None if reason is None else reason[:MAX_TEXT]

    def _reason(self, reg: Register, identity: bytes | None) -> str | None:
        n = reg.num_layers
        # The registry's own bounds, whoever built the message.
        if type(n) is not int or not 1 <= n <= MAX_LAYERS:
            return f"num_layers must be an int in [1, {MAX_LAYERS}], got {_short(n)}"
        if type(reg.context) is not int or not 1 <= reg.context <= MAX_CONTEXT:
            return f"context must be an int in [1, {MAX_CONTEXT}], got {_short(reg.context)}"
        try:
            for fname, spec in Register.wire_fields():
                spec.check(fname, getattr(reg, fname))
        except ProtocolError as exc:
            return f"invalid register: {exc}"
        if not 0 <= reg.start < reg.end <= n:
            return f"layer range {reg.start}:{reg.end} is not inside [0, {n})"
        if identity is not None and not _is_routing_name(identity):
            return "the routing id must be 1 to 255 printable ASCII characters"

        old = self.by_identity.get(identity) if identity is not None else None
        others = len(self.workers) - (old is not None)
        if self.pinned and reg.fingerprint != self.pinned:
            return f"model digest {reg.fingerprint} is not {self.pinned}, the one served here"
        if others:
            if reg.fingerprint != self.fingerprint:
                diffs = fingerprint_differences(self.model, reg.model)
                if not diffs:
                    diffs = [f"digest {reg.fingerprint} != {self.fingerprint}"]
                what = "; ".join(diffs)
                return f"model fingerprint differs from the cluster's: {what}"
            if n != self.num_layers:
                return f"model has {n} layers, the cluster's has {self.num_layers}"
            if reg.context != self.context:
                return f"model context is {reg.context} tokens, the cluster's is {self.context}"
            if reg.prefill_chunk != self.prefill_chunk:
                # A larger chunk upstream sends activations this worker refuses.
                return (
                    f"prefill_chunk is {reg.prefill_chunk}, the cluster's is {self.prefill_chunk}"
                )

        if others >= self.max_workers:
            return f"the broker takes at most {self.max_workers} workers"
        rng = (reg.start, reg.end)
        pool = self._pools.get(rng, {})
        if not pool or (len(pool) == 1 and old is not None and old.worker_id in pool):
            ranges = len(self._pools)
            if old is not None and len(self._pools[(old.start, old.end)]) == 1:
                ranges -= 1  # its old range leaves with it
            if ranges >= self.max_ranges:
                return (
                    f"the broker takes at most {self.max_ranges} distinct layer ranges; "
                    f"{reg.start}:{reg.end} would be one more"
                )
        return None

    def add(self, identity: bytes, reg: Register) -> WorkerEntry:
        """Admit a worker, replacing its entry under the same identity. RegistryError,
        changing nothing, for any reason refusal() names but the version."""
        reason = self._reason(reg, identity)
        if reason is not None:
            raise RegistryError(reason[:MAX_TEXT])
        old = self.by_identity.get(identity)
        if old is not None:
            self.remove(old)
        if not self.workers:
            self.fingerprint = reg.fingerprint
            self.model = dict(reg.model)
            self.num_layers = reg.num_layers
            self.context = reg.context
            self.prefill_chunk = reg.prefill_chunk
        w = WorkerEntry(
            identity=identity,
            worker_id=identity.decode("ascii"),
            start=reg.start,
            end=reg.end,
            capacity=reg.capacity,
            max_kv_tokens=reg.max_kv_tokens,
            host=reg.host,
            pid=reg.pid,
            dtype=reg.dtype,
            device=reg.device,
            model=dict(reg.model),
        )
        self.workers[w.worker_id] = w
        self.by_identity[identity] = w
        self._pools.setdefault((w.start, w.end), {})[w.worker_id] = w
        return w

    def remove(self, w: WorkerEntry) -> None:
        """Forget a worker (a stale entry, or one already removed, is ignored)."""
        if self.workers.get(w.worker_id) is not w:
            return
        del self.workers[w.worker_id]
        del self.by_identity[w.identity]
        pool = self._pools[(w.start, w.end)]
        del pool[w.worker_id]
        if not pool:
            del self._pools[(w.start, w.end)]
        if not self.workers:
            # An empty cluster may take another model, unless config pins one.
            self.fingerprint = self.pinned
            self.model = {}
            self.num_layers = self.context = self.prefill_chunk = 0

    # -- sessions ------------------------------------------------------------------------

    def reserve(self, route: list[WorkerEntry], key: Hashable, max_len: int) -> None:
        """Hold a session's place and ``max_len`` KV tokens on every worker of its route."""
        for w in route:
            if key not in w.sessions:
                w.sessions[key] = max_len
                w.reserved_tokens += max_len

    def release(self, route_ids: list[str], key: Hashable, max_len: int | None = None) -> None:
        """Free what reserve() held; idempotent, unknown workers ignored. The amount
        freed is the one reserved (``max_len`` is accepted for symmetry only)."""
        for wid in route_ids:
            w = self.workers.get(wid)
            if w is not None and key in w.sessions:
                w.reserved_tokens = max(0, w.reserved_tokens - w.sessions.pop(key))

    # -- routes --------------------------------------------------------------------------

    def find_route(
        self,
        max_len: int,
        ignore_room: bool = False,
        held: Callable[[WorkerEntry], int] | None = None,
    ) -> list[WorkerEntry] | None:
        """The chain of workers covering [0, L) with room for ``max_len`` tokens whose
        busiest member is least loaded; then fewest hops; then lowest worker ids.

        ``held`` (prefix affinity): how much of the session's prompt a worker is thought
        to hold cached. Of the replicas of a range with room and at most
        ``affinity_slack`` sessions more than the least busy one, the one holding the
        most is chosen; the least loaded among equals, and past the slack."""
        if not self.num_layers:
            return None
        now = time.monotonic()
        edges: dict[int, list[_Edge]] = {}
        for (start, end), pool in self._pools.items():
            room = [w for w in pool.values() if ignore_room or w.has_room(max_len, now)]
            if not room:
                continue
            # Per range only one replica can be on the best route.
            w = min(room, key=self._ranking(room, held))
            edges.setdefault(start, []).append((end, w.load_score(), w.worker_id, w))
        return _best_chain(edges, self.num_layers)

    def _ranking(
        self, room: list[WorkerEntry], held: Callable[[WorkerEntry], int] | None
    ) -> Callable[[WorkerEntry], tuple[int, float, str]]:
        """The order in which find_route prefers replicas of one range: the most of the
        prefix held (within the slack), then the least load, then the lowest id."""
        near = min(len(w.sessions) for w in room) + self.affinity_slack

        def rank(w: WorkerEntry) -> tuple[int, float, str]:
            cached = held(w) if held is not None and len(w.sessions) <= near else 0
            return (-cached, w.load_score(), w.worker_id)

        return rank

    def uncovered(self) -> str:
        """Layer ranges no worker serves, as "a:b, c:d" ("" when covered)."""
        gaps: list[str] = []
        pos = 0
        for start, end in sorted(self._pools):
            if start > pos:
                gaps.append(f"{pos}:{start}")
            pos = max(pos, end)
        if pos < self.num_layers:
            gaps.append(f"{pos}:{self.num_layers}")
        if len(gaps) > MAX_GAPS:
            gaps[MAX_GAPS:] = [f"and {len(gaps) - MAX_GAPS} more"]
        return ", ".join(gaps)

    def route_shapes(self, limit: int = 32) -> list[list[str]]:
        """Chains of layer ranges (pools) covering [0, L), e.g. [["0:15", "15:30"]]; at
        most ``limit`` of them, in order of their ranges."""
        L = self.num_layers
        if not L or limit < 1:
            return []
        # Keep only ranges from which L can be reached: then every step of the search
        # below leads to a chain, and the work is bounded by limit x hops.
        by_start: dict[int, list[int]] = {}
        for start, end in self._pools:
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

    def pools(self) -> list[dict[str, Any]]:
        return [
            {"layers": [a, b], "workers": sorted(pool)}
            for (a, b), pool in sorted(self._pools.items())
        ]


def _best_chain(edges: dict[int, list[_Edge]], num_layers: int) -> list[WorkerEntry] | None:
    """The chain 0 -> num_layers over ``edges`` (by start) with the least maximum load,
    then the fewest hops, then the lowest worker ids, in O(edges log edges)."""
    starts = sorted(edges, reverse=True)  # every edge goes forward: later boundaries first
    # The least possible maximum load of a chain from each boundary to the end.
    neck: dict[int, float] = {num_layers: -math.inf}
    for a in starts:
        options = [max(load, neck[b]) for b, load, _, _ in edges[a] if b in neck]
        if options:
            neck[a] = min(options)
    if 0 not in neck:
        return None
    bound = neck[0]
    # Fewest hops to the end using only hops within that bound.
    hops: dict[int, int] = {num_layers: 0}
    for a in starts:
        counts = [hops[b] + 1 for b, load, _, _ in edges[a] if load <= bound and b in hops]
        if counts:
            hops[a] = min(counts)
    route: list[WorkerEntry] = []
    pos = 0
    while pos != num_layers:
        _, _, _, w = min(
            (e for e in edges[pos] if e[1] <= bound and hops.get(e[0]) == hops[pos] - 1),
            key=lambda e: e[2],
        )
        route.append(w)
        pos = w.end
    return route
