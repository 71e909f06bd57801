"""The broker's status, built from its state alone: no sockets, no clock of its own.

``broker_status`` is the body of a STATUS reply (what ``zmqllm status`` and the gateway's
/health show); ``no_route_reason`` is the text a queued request fails with when no route
took it in time. Both are pure functions of the registry and the session table, so a test
builds a state and reads them directly.

Most of a status is what workers said of themselves, so its size is bounded here, not
trusted: one worker's entry shows at most MAX_SHOWN_BUILD build fields of at most
MAX_SHOWN_TEXT characters (ids, names and addresses are bounded by the wire); drift is
summarised (MAX_DRIFT_ENTRIES entries, MAX_DRIFT_VALUES values each, MAX_DRIFT_IDS worker
ids per value, the rest counted); and ``fitted`` leaves out the workers that would take
the reply past MAX_STATUS_BYTES, counting them in ``truncated``. Past that limit a client
cannot read the reply at all (its socket drops it): `zmqllm status` fails and the
gateway takes the broker for unreachable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack

from zmqllm.broker.registry import Registry
from zmqllm.broker.session_table import SessionTable
from zmqllm.bus.messages import MAX_STATUS_BYTES
from zmqllm.version import __version__

__all__ = [
    "MAX_DRIFT_ENTRIES",
    "MAX_DRIFT_IDS",
    "MAX_DRIFT_VALUES",
    "MAX_MODELS_NAMED",
    "MAX_SHOWN_BUILD",
    "MAX_SHOWN_TEXT",
    "broker_status",
    "fitted",
    "no_route_reason",
    "shown_drift",
    "shown_worker",
]

# Models listed in a "no worker serves model" reason.
MAX_MODELS_NAMED = 8
# What one worker's build adds to STATUS: a worker sends up to 32 fields of 256
# characters (Register.build), a real one about 12 of under 100.
MAX_SHOWN_BUILD = 16
MAX_SHOWN_TEXT = 128
# Drift: pools x fields, values per field, worker ids per value.
MAX_DRIFT_ENTRIES = 32
MAX_DRIFT_VALUES = 8
MAX_DRIFT_IDS = 4
# Bytes kept free for what fitting itself adds: longer array headers, the counts.
_SLACK = 64
# What a status that cannot fit even without its workers is left without.
_BULKY = ("workers", "pools", "routes", "models", "drift")


def broker_status(
    registry: Registry,
    table: SessionTable,
    *,
    boot: str,
    uptime_s: float,
    now: float,
    dropped: Mapping[str, int],
    curve: bool,
    auth_refused: Mapping[str, int],
    handshake_failures: Mapping[str, int],
) -> dict[str, Any]:
    """The status of a broker whose registry and session table these are; ``now`` on the
    clock the workers' last_seen are on, ``dropped`` its drop counts by reason."""
    st = table.stats
    drift, drift_left_out = shown_drift(registry.drift())
    status = {
        "boot": boot,
        "version": __version__,
        "uptime_s": round(uptime_s, 1),
        "num_layers": registry.num_layers,
        "complete_route": registry.find_route(1, ignore_room=True) is not None,
        "queue": len(table.queue),
        "sessions": len(table.sessions),
        "workers": [shown_worker(w.describe(now)) for w in registry.workers.values()],
        "pools": registry.pools(),
        "routes": registry.route_shapes(),
        "models": [m.describe() for m in registry.models.values()],
        # Build fields on which the replicas of a pool differ (broker/drift.py).
        "drift": drift,
        "counters": {
            "sessions_opened": st.opened,
            "sessions_finished": st.finished,
            "sessions_failed": st.failed,
            "tokens": st.tokens,
            "relayed": st.relayed,
            "dropped_messages": sum(dropped.values()),
        },
        "dropped": dict(dropped),
        "curve": curve,
        "auth": {
            "refused": dict(auth_refused),
            "handshake_failures": dict(handshake_failures),
        },
        # What was left out to fit: workers, and drift entries.
        "truncated": {"workers": 0, "drift": drift_left_out},
    }
    return fitted(status)


def _cut(value: Any) -> Any:
    if type(value) is str and len(value) > MAX_SHOWN_TEXT:
        return value[: MAX_SHOWN_TEXT - 3] + "..."
    return value


def shown_worker(entry: dict[str, Any]) -> dict[str, Any]:
    """A worker's STATUS entry (WorkerEntry.describe) with its build cut to what one
    worker may add: MAX_SHOWN_BUILD fields, in the order it sent them, each value cut."""
    build = entry.get("build") or {}
    shown = {k: _cut(v) for k, v in list(build.items())[:MAX_SHOWN_BUILD]}
    return {**entry, "build": shown}


def _few(ids: list[str]) -> list[str]:
    more = len(ids) - MAX_DRIFT_IDS
    return ids[:MAX_DRIFT_IDS] + ([f"(and {more} more)"] if more > 0 else [])


def shown_drift(entries: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Drift (drift.pool_drift) summarised, and how many entries were left out. Each
    entry keeps its shape ({"values": {value: [ids]}}, what `zmqllm status --drift`
    prints) with its most common values first, each cut, at most MAX_DRIFT_IDS ids per
    value and a "(N more)" after them, the other values in one "(N other values)" line,
    and "workers": how many workers the entry covers."""
    out: list[dict[str, Any]] = []
    for entry in entries[:MAX_DRIFT_ENTRIES]:
        ranked = sorted(entry["values"].items(), key=lambda kv: (-len(kv[1]), kv[0]))
        merged: dict[str, list[str]] = {}
        for value, ids in ranked[:MAX_DRIFT_VALUES]:
            merged.setdefault(_cut(value), []).extend(ids)  # two values may cut alike
        values = {value: _few(ids) for value, ids in merged.items()}
        rest = ranked[MAX_DRIFT_VALUES:]
        if rest:
            values[f"({len(rest)} other values)"] = [f"({sum(len(i) for _, i in rest)} workers)"]
        total = sum(len(ids) for _, ids in ranked)
        out.append({**entry, "values": values, "workers": total})
    return out, len(entries) - len(out)


def _packed_size(value: Any) -> int:
    return len(msgpack.packb(value, use_bin_type=True))


def fitted(status: dict[str, Any], limit: int = MAX_STATUS_BYTES) -> dict[str, Any]:
    """``status`` within ``limit`` bytes packed: the workers that do not fit are left
    out (a later, smaller one may still fit) and counted in ``truncated``. Should the
    rest alone not fit (it is bounded well below the limit), only the counts remain."""
    workers = status["workers"]
    out = {**status, "workers": [], "truncated": dict(status["truncated"])}
    room = limit - _SLACK - _packed_size(out)
    kept = []
    for w in workers:
        size = _packed_size(w)
        if size <= room:
            kept.append(w)
            room -= size
    out["workers"] = kept
    out["truncated"]["workers"] = len(workers) - len(kept)
    if room < 0:
        out.update({k: [] for k in _BULKY})
        out["truncated"]["all"] = True
    return out


def no_route_reason(registry: Registry, queue_timeout: float, model: str = "") -> str:
    """Why a request for ``model`` ("" for the default) found no route in
    ``queue_timeout`` seconds."""
    t = queue_timeout
    if not registry.workers:
        return f"no capacity: no worker registered after {t:g}s"
    m = registry.resolve(model)
    if m is None:
        served = ", ".join(sorted(registry.models)[:MAX_MODELS_NAMED])
        what = f"no worker serves model {model!r}" if model else "no model named"
        return f"no capacity: {what} (served: {served}) after {t:g}s"
    missing = registry.uncovered(m.name)
    if missing:
        return f"no capacity: no complete route (layers {missing} have no worker) after {t:g}s"
    return f"no capacity: no route with room after {t:g}s"
