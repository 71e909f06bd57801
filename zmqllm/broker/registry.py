"""The broker's worker registry, without sockets: models, workers, pools, routes.

Every worker serves one model, by name. A model's pool is the set of its workers serving
one layer range; a route is one worker per hop, chained to cover [0, L); ranges may
differ between routes (a worker holding the whole model beside a two-stage pipeline). A
text model (a remote API behind a worker) is one layer long: each route is one worker.

Every table here is keyed by what peers send, so each is bounded (``max_workers``,
``max_ranges`` per model, ``MAX_MODELS``, ``MAX_LAYERS``), and every search is
polynomial in those bounds (route_search.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zmqllm.broker.drift import pool_drift, pool_refusal
from zmqllm.broker.route_build import build_key
from zmqllm.broker.route_search import Edge, best_chain, gaps, route_shapes
from zmqllm.bus.figure_keys import FIGURE_KEYS
from zmqllm.bus.messages import (
    MAX_CONTEXT,
    MAX_LAYERS,
    MAX_TEXT,
    Register,
)
from zmqllm.bus.wire_types import ProtocolError
from zmqllm.config.names import NAME_RULE, is_name

if TYPE_CHECKING:
    from zmqllm.config.settings import BrokerSettings

__all__ = [
    "DEFAULT_MAX_RANGES",
    "DEFAULT_MAX_WORKERS",
    "MAX_GAPS",
    "MAX_MODELS",
    "ModelPools",
    "Registry",
    "RegistryError",
    "WorkerEntry",
    "fingerprint_differences",
]

DEFAULT_MAX_WORKERS = 1024
DEFAULT_MAX_RANGES = 512
MAX_GAPS = 32  # gaps uncovered() names; it counts the rest
MAX_DIFFERENCES = 16  # fingerprint keys a refusal names
MAX_MODELS = 64  # models one broker serves at once


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
    # Session key -> KV tokens reserved for it here, so a release frees exactly that.
    sessions: dict[Hashable, int] = field(default_factory=dict)
    reserved_tokens: int = 0
    figures: dict[str, Any] = field(default_factory=dict)  # what its last HEARTBEAT reported
    draining: bool = False
    full_until: float = 0.0  # refused a session lately: skip it until then
    # The CURVE public key (z85) it registered with: only that key may speak as it.
    key: str = ""
    served: str = ""  # the model's name
    text_model: bool = False
    peer: str = ""  # its peer link's endpoint ("": it takes work only through the broker)
    build: dict[str, Any] = field(default_factory=dict)  # what it runs on (drift.py)
    # A digest of the build fields that decide its numbers: a replay goes only onto
    # workers of its stream's keys (route_build.py).
    build_key: str = ""
    # What it measured of itself before loading (--layers auto; {}: it did not).
    measured: dict[str, Any] = field(default_factory=dict)
    proposes: bool = False  # a last stage that speculates: OPEN gives it the prompt too
    # Its CPU use between its last two heartbeats (percent of one core; None: not yet).
    cpu_percent: float | None = None
    _cpu_at: tuple[float, float] | None = None  # (cpu_s, when) of the last heartbeat

    def has_room(self, max_len: int, now: float) -> bool:
        return (
            not self.draining
            and now >= self.full_until
            and len(self.sessions) < self.capacity
            and self.reserved_tokens + max_len <= self.max_kv_tokens
        )

    def occupancy(self) -> float:
        """Fraction of this worker in use: the larger of sessions and KV tokens."""
        return max(
            len(self.sessions) / max(1, self.capacity),
            self.reserved_tokens / max(1, self.max_kv_tokens),
        )

    def describe(self, now: float) -> dict[str, Any]:
        """This worker in STATUS: a fixed set of fields, each of bounded size."""
        stats = {
            k: v
            for k, v in self.figures.items()
            if k in FIGURE_KEYS
            and type(v) in (int, float, bool)
            and (type(v) is not float or math.isfinite(v))
        }
        return {
            "id": self.worker_id,
            "model": self.served,
            "text_model": self.text_model,
            "layers": [self.start, self.end],
            "sessions": len(self.sessions),
            "capacity": self.capacity,
            "kv_tokens_reserved": self.reserved_tokens,
            "max_kv_tokens": self.max_kv_tokens,
            "load": round(self.occupancy(), 3),  # "load" in STATUS replies and /cluster/status
            "last_heartbeat_s": round(now - self.last_seen, 2),
            "draining": self.draining,
            "peer": self.peer,
            "info": dict(host=self.host, pid=self.pid, dtype=self.dtype, device=self.device),
            "stats": stats,
            "cpu_percent": self.cpu_percent,
            "build": dict(self.build),
            "build_key": self.build_key,  # what a replay's "no route of the build" names
            "measured": dict(self.measured),
        }

    def heard(self, figures: dict[str, Any], now: float) -> None:
        """A heartbeat's figures; the CPU use since the last one from its ``cpu_s``."""
        self.figures = figures
        cpu = figures.get("cpu_s")
        if not isinstance(cpu, int | float) or not math.isfinite(cpu):
            return
        if self._cpu_at is not None and now > self._cpu_at[1] and cpu >= self._cpu_at[0]:
            self.cpu_percent = round(100 * (cpu - self._cpu_at[0]) / (now - self._cpu_at[1]), 1)
        self._cpu_at = (float(cpu), now)


@dataclass(eq=False)
class ModelPools:
    """One served model: what its first worker defined, and its workers by layer range."""

    name: str
    text_model: bool
    fingerprint: str
    summary: dict[str, Any]  # the defining worker's fingerprint summary
    num_layers: int
    context: int
    prefill_chunk: int
    pools: dict[tuple[int, int], dict[str, WorkerEntry]] = field(default_factory=dict)

    def workers(self) -> Iterator[WorkerEntry]:
        for pool in self.pools.values():
            yield from pool.values()

    def size(self) -> int:
        return sum(len(pool) for pool in self.pools.values())

    def describe(self) -> dict[str, Any]:
        """This model in STATUS."""
        ranges = list(self.pools)
        return {
            "name": self.name,
            "text_model": self.text_model,
            # What an operator pins a worker key to (`zmqllm keys add ... --digest`).
            "digest": self.fingerprint,
            "num_layers": self.num_layers,
            "context": self.context,
            "workers": self.size(),
            "complete_route": not gaps(ranges, self.num_layers),
            "uncovered": ", ".join(gaps(ranges, self.num_layers)[:MAX_GAPS]),
            "routes": route_shapes(ranges, self.num_layers, limit=8),
        }


class Registry:
    """Registered workers, by model. A model is defined by its first worker (fingerprint
    digest, num_layers, context) and forgotten when its last one leaves; a worker of the
    same name but another model is refused. ``model_fingerprint`` pins the digest of
    every model of layers (not text models)."""

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
        self.models: dict[str, ModelPools] = {}

    @classmethod
    def from_settings(cls, s: BrokerSettings) -> Registry:
        return cls(
            max_workers=s.max_workers,
            max_ranges=s.max_ranges,
            model_fingerprint=s.model_fingerprint,
            affinity_slack=s.affinity_slack,
        )

    # -- models --------------------------------------------------------------------------

    def resolve(self, name: str | None = None) -> ModelPools | None:
        """The model a request names; unnamed ("" or None), the only one served."""
        if name:
            return self.models.get(name)
        if len(self.models) == 1:
            return next(iter(self.models.values()))
        return None

    # What the one model of a single-model broker defined (0 / "" when none or several).
    @property
    def num_layers(self) -> int:
        m = self.resolve()
        return m.num_layers if m is not None else 0

    @property
    def context(self) -> int:
        m = self.resolve()
        return m.context if m is not None else 0

    @property
    def fingerprint(self) -> str:
        m = self.resolve()
        return m.fingerprint if m is not None else self.pinned

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
            reg._validate()
        except ProtocolError as exc:
            return f"invalid register: {exc}"
        if not 0 <= reg.start < reg.end <= n:
            return f"layer range {reg.start}:{reg.end} is not inside [0, {n})"
        if not reg.served:
            # On the wire "" once meant "the broker's only model"; as a model of its own it
            # made every OPEN that names no model ambiguous. Every worker names its model.
            return 'the REGISTER names no model (served ""): a worker names the model it serves'
        # The worker id is the routing id as text, sent back in REGISTERED: the name rule
        # keeps it one-to-one with the identity (no two identities decode to the same id).
        if identity is not None and not is_name(identity):
            return f"the routing id must be {NAME_RULE}"

        old = self.by_identity.get(identity) if identity is not None else None
        m = self.models.get(reg.served)
        others = m.size() - (old is not None and old.served == reg.served) if m else 0
        if self.pinned and not reg.text_model and reg.fingerprint != self.pinned:
            return f"model digest {reg.fingerprint} is not {self.pinned}, the one served here"
        named = f"model {reg.served!r}" if reg.served else "the model"
        of = f" (model {reg.served!r})" if reg.served else ""
        if m is not None and others:
            if reg.text_model != m.text_model:
                kind = "a remote (text) model" if m.text_model else "a model of layers"
                return f"{named} is {kind} here; this worker serves the other kind"
            if reg.fingerprint != m.fingerprint:
                diffs = fingerprint_differences(m.summary, reg.model)
                if not diffs:
                    diffs = [f"digest {reg.fingerprint} != {m.fingerprint}"]
                what = "; ".join(diffs)
                return f"model fingerprint differs from the cluster's{of}: {what}"
            if n != m.num_layers:
                return f"model has {n} layers, the cluster's has {m.num_layers}{of}"
            if reg.context != m.context:
                return f"model context is {reg.context} tokens, the cluster's is {m.context}{of}"
            if reg.prefill_chunk != m.prefill_chunk:
                # A larger chunk upstream sends activations this worker refuses.
                return f"prefill_chunk is {reg.prefill_chunk}, the cluster's is {m.prefill_chunk}"
        elif len(self.models) - self._leaves_a_model(old) >= MAX_MODELS:
            return (
                f"the broker serves at most {MAX_MODELS} models; {reg.served!r} would be one more"
            )

        if len(self.workers) - (old is not None) >= self.max_workers:
            return f"the broker takes at most {self.max_workers} workers"
        rng = (reg.start, reg.end)
        pools = m.pools if m is not None else {}
        pool = pools.get(rng, {})
        replicas = [w for w in pool.values() if old is None or w is not old]
        if (differs := pool_refusal(reg.build, replicas)) is not None:
            return differs
        if not pool or (len(pool) == 1 and old is not None and old.worker_id in pool):
            ranges = len(pools)
            if old is not None and old.served == reg.served and len(pools[old.start, old.end]) == 1:
                ranges -= 1  # its old range leaves with it
            if ranges >= self.max_ranges:
                return (
                    f"the broker takes at most {self.max_ranges} distinct layer ranges per "
                    f"model; {reg.start}:{reg.end} would be one more"
                )
        return None

    def _leaves_a_model(self, old: WorkerEntry | None) -> int:
        """1 if ``old`` (replaced) is the last worker of its model."""
        if old is None:
            return 0
        m = self.models.get(old.served)
        return int(m is not None and m.size() == 1)

    def defines(self, reg: Register, identity: bytes | None = None) -> bool:
        """Whether admitting ``reg`` would define its model: no other worker serves it."""
        m = self.models.get(reg.served)
        if m is None:
            return True
        old = self.by_identity.get(identity) if identity is not None else None
        return m.size() - (old is not None and old.served == reg.served) == 0

    def add(self, identity: bytes, reg: Register, key: str = "") -> WorkerEntry:
        """Admit a worker, replacing its entry under the same identity. RegistryError,
        changing nothing, for any reason refusal() names but the version. ``key``: the
        CURVE public key it registered with."""
        reason = self._reason(reg, identity)
        if reason is not None:
            raise RegistryError(reason[:MAX_TEXT])
        old = self.by_identity.get(identity)
        if old is not None:
            self.remove(old)
        m = self.models.get(reg.served)
        if m is None:
            m = self.models[reg.served] = ModelPools(
                name=reg.served,
                text_model=reg.text_model,
                fingerprint=reg.fingerprint,
                summary=dict(reg.model),
                num_layers=reg.num_layers,
                context=reg.context,
                prefill_chunk=reg.prefill_chunk,
            )
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
            served=reg.served,
            text_model=reg.text_model,
            peer=reg.peer,
            build=dict(reg.build),
            build_key=build_key(reg.build, last_stage=reg.end == reg.num_layers),
            measured=dict(reg.measured),
            proposes=reg.proposes,
            key=key,
        )
        self.workers[w.worker_id] = w
        self.by_identity[identity] = w
        m.pools.setdefault((w.start, w.end), {})[w.worker_id] = w
        return w

    def drift(self) -> list[dict[str, Any]]:
        """The build fields on which the replicas of a pool differ (drift.py)."""
        pools = {
            (m.name, a, b): list(pool.values())
            for m in self.models.values()
            for (a, b), pool in m.pools.items()
        }
        return pool_drift(pools)

    def remove(self, w: WorkerEntry) -> None:
        """Forget a worker (a stale entry, or one already removed, is ignored)."""
        if self.workers.get(w.worker_id) is not w:
            return
        del self.workers[w.worker_id]
        del self.by_identity[w.identity]
        m = self.models[w.served]
        pool = m.pools[(w.start, w.end)]
        del pool[w.worker_id]
        if not pool:
            del m.pools[(w.start, w.end)]
        if not m.pools:
            # A model without workers is forgotten: its name may serve another model.
            del self.models[w.served]

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
        model: str | None = None,
        admit: Callable[[WorkerEntry], bool] | None = None,
    ) -> list[WorkerEntry] | None:
        """The chain of ``model``'s workers covering [0, L) with room for ``max_len``
        tokens whose busiest member is least loaded; then fewest hops; then lowest ids.
        ``admit``: only workers it admits (a replay's, those of its stream's build).

        ``held`` (prefix affinity): how much of the session's prompt a worker is thought
        to hold cached. Of the replicas of a range with room and at most
        ``affinity_slack`` sessions more than the least busy one, the one holding the
        most is chosen; the least loaded among equals, and past the slack."""
        m = self.resolve(model)
        if m is None:
            return None
        now = time.monotonic()
        edges: dict[int, list[Edge[WorkerEntry]]] = {}
        for (start, end), pool in m.pools.items():
            room = [
                w
                for w in pool.values()
                if (ignore_room or w.has_room(max_len, now)) and (admit is None or admit(w))
            ]
            if not room:
                continue
            # Per range only one replica can be on the best route.
            w = min(room, key=self._ranking(room, held))
            edges.setdefault(start, []).append((end, w.occupancy(), w.worker_id, w))
        return best_chain(edges, m.num_layers)

    def _ranking(
        self, room: list[WorkerEntry], held: Callable[[WorkerEntry], int] | None
    ) -> Callable[[WorkerEntry], tuple[int, float, str]]:
        """The order in which find_route prefers replicas of one range: the most of the
        prefix held (within the slack), then the least occupancy, then the lowest id."""
        near = min(len(w.sessions) for w in room) + self.affinity_slack

        def rank(w: WorkerEntry) -> tuple[int, float, str]:
            cached = held(w) if held is not None and len(w.sessions) <= near else 0
            return (-cached, w.occupancy(), w.worker_id)

        return rank

    def uncovered(self, model: str | None = None) -> str:
        """Layer ranges no worker of ``model`` serves, as "a:b, c:d" ("" when covered)."""
        m = self.resolve(model)
        if m is None:
            return ""
        found = gaps(m.pools, m.num_layers)
        if len(found) > MAX_GAPS:
            found[MAX_GAPS:] = [f"and {len(found) - MAX_GAPS} more"]
        return ", ".join(found)

    def route_shapes(self, limit: int = 32, model: str | None = None) -> list[list[str]]:
        """Chains of ``model``'s layer ranges (pools) covering [0, L), e.g.
        [["0:15", "15:30"]]; at most ``limit`` of them, in order of their ranges."""
        m = self.resolve(model)
        return route_shapes(m.pools, m.num_layers, limit) if m is not None else []

    def pools(self, model: str | None = None) -> list[dict[str, Any]]:
        m = self.resolve(model)
        if m is None:
            return []
        return [
            {"layers": [a, b], "workers": sorted(pool)} for (a, b), pool in sorted(m.pools.items())
        ]
