"""The broker's worker registry, without sockets: workers, pools, routes.

A pool is the set of workers serving one layer range. A route is one worker
per hop, chained to cover [0, L); ranges may differ between routes (a worker
holding the whole model beside a two-stage pipeline), so routes are found by
a search over the ranges that start where the previous one ended.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

def fingerprint_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Readable differences between two model fingerprints ("num_layers: 30 != 4")."""
    keys = sorted((set(a) | set(b)) - {"digest"})
    return [f"{k}: {a.get(k)!r} != {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


@dataclass
class WorkerEntry:
    identity: bytes
    worker_id: str
    start: int
    end: int
    capacity: int  # most sessions at once
    max_kv_tokens: int
    info: dict[str, Any]
    last_seen: float = field(default_factory=time.monotonic)
    registered_at: float = field(default_factory=time.monotonic)
    sessions: set[str] = field(default_factory=set)
    reserved_tokens: int = 0
    load: dict[str, Any] = field(default_factory=dict)
    draining: bool = False
    full_until: float = 0.0  # refused a session lately: skip it until then

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
            "info": self.info,
            "stats": self.load,
        }


class Registry:
    """Registered workers of one model; refuses a worker of another model."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerEntry] = {}
        self.by_identity: dict[bytes, WorkerEntry] = {}
        self.num_layers = 0
        self.context = 0
        self.fingerprint = ""
        self.fingerprint_summary: dict[str, Any] = {}

    def refusal(
        self,
        version: str,
        our_version: str,
        digest: str,
        summary: dict[str, Any],
        start: int,
        end: int,
        num_layers: int,
    ) -> str | None:
        """Why a registering worker cannot join, or None."""
        if version != our_version:
            return f"zmqllm version {version} differs from the broker's {our_version}"
        if not 0 <= start < end <= num_layers:
            return f"layer range {start}:{end} is not inside [0, {num_layers})"
        if self.workers and digest != self.fingerprint:
            diffs = fingerprint_differences(self.fingerprint_summary, summary)
            what = "; ".join(diffs) if diffs else f"digest {digest} != {self.fingerprint}"
            return f"model fingerprint differs from the cluster's: {what}"
        return None

    def add(self, identity: bytes, fields: dict[str, Any], info: dict[str, Any]) -> WorkerEntry:
        if not self.workers:
            # The first worker defines the cluster's model.
            self.fingerprint = fields["fingerprint"]
            summary = info.get("fingerprint")
            self.fingerprint_summary = summary if isinstance(summary, dict) else {}
            self.num_layers = fields["num_layers"]
            self.context = int(info.get("context", 0)) or 1 << 30
        w = WorkerEntry(
            identity=identity,
            worker_id=identity.decode(errors="replace"),
            start=fields["start"],
            end=fields["end"],
            capacity=fields["capacity"],
            max_kv_tokens=int(info.get("max_kv_tokens", 1 << 30)),
            info=info,
        )
        self.workers[w.worker_id] = w
        self.by_identity[identity] = w
        return w

    def remove(self, w: WorkerEntry) -> None:
        self.workers.pop(w.worker_id, None)
        self.by_identity.pop(w.identity, None)
        if not self.workers:
            # An empty cluster may take another model.
            self.fingerprint, self.fingerprint_summary = "", {}
            self.num_layers = self.context = 0

    def find_route(self, max_len: int, ignore_room: bool = False) -> list[WorkerEntry] | None:
        """The least-loaded chain of workers covering [0, L) with room for max_len tokens."""
        if not self.num_layers:
            return None
        now = time.monotonic()
        by_start: dict[int, list[WorkerEntry]] = {}
        for w in self.workers.values():
            if ignore_room or w.has_room(max_len, now):
                by_start.setdefault(w.start, []).append(w)
        best: tuple[float, list[WorkerEntry]] | None = None

        def walk(pos: int, chain: list[WorkerEntry], score: float) -> None:
            nonlocal best
            if pos == self.num_layers:
                # Fewer hops first, then the least loaded busiest member.
                key = score + 0.001 * len(chain)
                if best is None or key < best[0]:
                    best = (key, list(chain))
                return
            # Per range, only the least-loaded replica matters.
            per_range: dict[int, WorkerEntry] = {}
            for w in by_start.get(pos, []):
                cur = per_range.get(w.end)
                if cur is None or (w.load_score(), w.worker_id) < (cur.load_score(), cur.worker_id):
                    per_range[w.end] = w
            for w in per_range.values():
                chain.append(w)
                walk(w.end, chain, max(score, w.load_score()))
                chain.pop()

        walk(0, [], 0.0)
        return best[1] if best else None

    def reserve(self, route: list[WorkerEntry], session: str, max_len: int) -> None:
        for w in route:
            w.sessions.add(session)
            w.reserved_tokens += max_len

    def release(self, route: list[str], session: str, max_len: int) -> None:
        for wid in route:
            w = self.workers.get(wid)
            if w is not None and session in w.sessions:
                w.sessions.discard(session)
                w.reserved_tokens -= max_len

    def uncovered(self) -> str:
        """Layer ranges no worker serves, as "a:b, c:d" ("" when covered)."""
        covered = [False] * self.num_layers
        for w in self.workers.values():
            for i in range(w.start, min(w.end, self.num_layers)):
                covered[i] = True
        gaps: list[str] = []
        i = 0
        while i < self.num_layers:
            if not covered[i]:
                j = i
                while j < self.num_layers and not covered[j]:
                    j += 1
                gaps.append(f"{i}:{j}")
                i = j
            else:
                i += 1
        return ", ".join(gaps)

    def route_shapes(self, limit: int = 32) -> list[list[str]]:
        """Every chain of layer ranges (pools) covering [0, L), e.g. [["0:15", "15:30"]];
        at most ``limit`` of them."""
        ranges = sorted({(w.start, w.end) for w in self.workers.values()})
        out: list[list[str]] = []

        def walk(pos: int, chain: list[str]) -> None:
            if len(out) >= limit:
                return
            if pos == self.num_layers and chain:
                out.append(list(chain))
                return
            for a, b in ranges:
                if a == pos:
                    chain.append(f"{a}:{b}")
                    walk(b, chain)
                    chain.pop()

        if self.num_layers:
            walk(0, [])
        return out

    def pools(self) -> list[dict[str, Any]]:
        by_range: dict[tuple[int, int], list[str]] = {}
        for w in self.workers.values():
            by_range.setdefault((w.start, w.end), []).append(w.worker_id)
        return [
            {"layers": [a, b], "workers": sorted(ws)} for (a, b), ws in sorted(by_range.items())
        ]
