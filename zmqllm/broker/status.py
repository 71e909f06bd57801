"""The broker's status, built from its state alone: no sockets, no clock of its own.

``broker_status`` is the body of a STATUS reply (what ``zmqllm status`` and the gateway's
/health show); ``no_route_reason`` is the text a queued request fails with when no route
took it in time. Both are pure functions of the registry and the session table, so a test
builds a state and reads them directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zmqllm.broker.registry import Registry
from zmqllm.broker.session_table import SessionTable
from zmqllm.version import __version__

__all__ = ["MAX_MODELS_NAMED", "broker_status", "no_route_reason"]

# Models listed in a "no worker serves model" reason.
MAX_MODELS_NAMED = 8


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
    return {
        "boot": boot,
        "version": __version__,
        "uptime_s": round(uptime_s, 1),
        "num_layers": registry.num_layers,
        "complete_route": registry.find_route(1, ignore_room=True) is not None,
        "queue": len(table.queue),
        "sessions": len(table.sessions),
        "workers": [w.describe(now) for w in registry.workers.values()],
        "pools": registry.pools(),
        "routes": registry.route_shapes(),
        "models": [m.describe() for m in registry.models.values()],
        # Build fields on which the replicas of a pool differ (broker/drift.py).
        "drift": registry.drift(),
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
    }


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
