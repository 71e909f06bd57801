"""Where a worker started with ``--layers auto`` should serve: the broker's answer to PLACE.

The worker measured itself before loading anything (worker/self_measure.py): ms per layer
at 1 and 16 rows, the memory it may use and what a layer, the embedding and the head take
there. The answer, within that memory (config/weighted_split.fits):

1. the first layers no pool covers: from the start of the first gap, as many of the
   gap's layers as fit (a model no worker serves yet is one gap: all its layers);
2. else the pool whose throughput is least for its load (Petals' rule, with pools for
   blocks): a pool's throughput is the sum of its workers' tokens/s at 16 rows over its
   range (a worker that did not measure counts as one like the asker), its load the
   sessions on it; ties go to the pool with fewer workers, then the earlier range.

A range a key is scoped to (a ticket's ``layers`` claim) is answered as it is. An answer
with ``hold`` counts as a member of its range until that worker registers or
``hold_s`` passes, so workers starting together do not all fill the same gap. No range
that fits: REFUSED, naming how many layers would. Sockets and the registry's tables stay
in loop.py and registry.py; this decides only. Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from zmqllm.broker.registry import ModelPools, Registry, WorkerEntry
from zmqllm.broker.route_search import gaps
from zmqllm.bus.messages import MAX_TEXT, Place, Placed, Refused
from zmqllm.config.settings import ConfigError
from zmqllm.config.weighted_split import ROWS, Figures, fits, max_layers

__all__ = ["DEFAULT_HOLD_S", "Hold", "Placements", "rate"]

# Long enough for a worker to load its range and register (a 7B stage from disk).
DEFAULT_HOLD_S = 300.0


@dataclass
class Hold:
    served: str
    start: int
    end: int
    figures: Figures
    until: float


def rate(f: Figures, start: int, end: int, num_layers: int) -> float:
    """Tokens/s a worker of figures ``f`` makes over [start, end) at 16 rows."""
    ms = f.stage_ms(end - start, end == num_layers)
    return ROWS * 1000.0 / ms if ms > 0 else 0.0


@dataclass
class Placements:
    """Ranges handed out and not yet registered, by the asking peer's routing id (at most
    ``max_holds``: a peer may make up ids, so the table is bounded)."""

    hold_s: float = DEFAULT_HOLD_S
    max_holds: int = 1024
    holds: dict[bytes, Hold] = field(default_factory=dict)

    def place(
        self,
        registry: Registry,
        identity: bytes,
        msg: Place,
        claims: Mapping[str, str] | None = None,
        now: float | None = None,
    ) -> Placed | Refused:
        """The range the worker behind ``msg`` should load (see module doc)."""
        now = time.monotonic() if now is None else now
        self.expire(now)
        try:
            figures = Figures.from_dict(msg.figures)
        except ConfigError as exc:
            return Refused(reason=f"--layers auto: {exc}"[:MAX_TEXT])
        n = msg.num_layers
        model = registry.models.get(msg.served)
        if model is not None and model.num_layers != n:
            return Refused(
                reason=f"model {msg.served!r} has {model.num_layers} layers here, the worker's "
                f"has {n}"
            )
        scoped = (claims or {}).get("layers", "")
        chosen = self._scoped(scoped, n) if scoped else None
        if chosen is None:
            chosen = self._first_gap(model, msg.served, n, figures)
        if chosen is None:
            chosen = self._weakest_pool(model, msg.served, n, figures)
        if chosen is None:
            # A middle start (no embedding, no head) holds the most: O(n), not O(n^2),
            # on a path any peer can reach.
            most = max(max_layers(figures, a, n) for a in {0, min(1, n - 1)})
            return Refused(
                reason=(
                    f"--layers auto: no range of model {msg.served!r} fits this worker's "
                    f"{figures.memory_bytes >> 20} MiB (at most {most} layers would, none "
                    "lining up with the pools served); give it more memory, or --quant"
                )[:MAX_TEXT]
            )
        start, end, why = chosen
        if msg.hold and (identity in self.holds or len(self.holds) < self.max_holds):
            self.holds[identity] = Hold(msg.served, start, end, figures, now + self.hold_s)
        return Placed(request_id=msg.request_id, start=start, end=end, why=why)

    def registered(self, identity: bytes, served: str, start: int, end: int) -> None:
        """A worker registered: its hold (or, from another routing id, the oldest hold of
        that range) is a member now, not a hold."""
        if self.holds.pop(identity, None) is not None:
            return
        same = [
            (h.until, key)
            for key, h in self.holds.items()
            if (h.served, h.start, h.end) == (served, start, end)
        ]
        if same:
            del self.holds[min(same)[1]]

    def expire(self, now: float) -> None:
        for key in [k for k, h in self.holds.items() if h.until <= now]:
            del self.holds[key]

    def _held(self, served: str) -> list[Hold]:
        return [h for h in self.holds.values() if h.served == served]

    @staticmethod
    def _scoped(scoped: str, n: int) -> tuple[int, int, str] | None:
        a, _, b = scoped.partition(":")
        start = int(a) if a.isdigit() else 0
        end = int(b) if b.isdigit() else n
        if not 0 <= start < end <= n:
            return None
        return start, end, "the range the worker's key is scoped to"

    def _first_gap(
        self, model: ModelPools | None, served: str, n: int, f: Figures
    ) -> tuple[int, int, str] | None:
        ranges = list(model.pools) if model is not None else []
        ranges += [(h.start, h.end) for h in self._held(served)]
        for gap in gaps(ranges, n):
            a, b = (int(x) for x in gap.split(":"))
            most = max_layers(f, a, n)
            if most:
                end = min(b, a + most)
                # Cut short by memory, the gap's end may still fit where its middle did not.
                while end > a and not fits(f, a, end, n):
                    end -= 1
                if end > a:
                    return a, end, f"layers {a}:{b} were served by no worker"
        return None

    def _weakest_pool(
        self, model: ModelPools | None, served: str, n: int, f: Figures
    ) -> tuple[int, int, str] | None:
        members: dict[tuple[int, int], list[Figures]] = {}
        load: dict[tuple[int, int], int] = {}
        if model is not None:
            for rng, pool in model.pools.items():
                members[rng] = [_figures_of(w, f) for w in pool.values()]
                load[rng] = sum(len(w.sessions) for w in pool.values())
        for h in self._held(served):
            members.setdefault((h.start, h.end), []).append(h.figures)
        best: tuple[float, int, int, int] | None = None
        for (a, b), figs in members.items():
            if not fits(f, a, b, n):
                continue
            throughput = sum(rate(x, a, b, n) for x in figs)
            score = throughput / (1 + load.get((a, b), 0))
            key = (score, len(figs), a, b)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        score, _count, a, b = best
        return a, b, f"pool {a}:{b} had the least throughput for its load ({score:.1f} tokens/s)"


def _figures_of(w: WorkerEntry, fallback: Figures) -> Figures:
    """What worker ``w`` measured, or ``fallback`` when it did not (started with a range)."""
    if w.measured:
        try:
            return Figures.from_dict(w.measured)
        except ConfigError:
            pass
    return fallback
