"""`zmqllm status`'s view of the nodes: each worker's and each host's resources (from the
workers' heartbeats), the build fields on which replicas differ (drift), and the children
of this machine's `zmqllm up`."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from zmqllm.client.status import _rows, _table
from zmqllm.log import printable

__all__ = ["drift_lines", "format_children", "format_drift", "format_resources"]


def _size(n: Any) -> str:
    if type(n) not in (int, float):
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}B"


def _cpu(value: Any) -> str:
    return f"{value:.0f}%" if type(value) in (int, float) else "-"


def _resource_row(w: Any) -> list[str]:
    stats = w.get("stats") or {}
    gpu = "-"
    if "cuda_total_bytes" in stats:
        gpu = f"{_size(stats.get('cuda_used_bytes'))}/{_size(stats['cuda_total_bytes'])}"
    return [
        str(w["id"]),
        str((w.get("info") or {}).get("host", "?")),
        _size(stats.get("rss_bytes")),
        _cpu(w.get("cpu_percent")),
        f"{_size(stats.get('kv_bytes_used'))}/{_size(stats.get('kv_bytes_reserved'))}",
        f"{_size(stats.get('net_rx_bytes'))}/{_size(stats.get('net_tx_bytes'))}",
        gpu,
    ]


def format_resources(st: dict[str, Any]) -> str:
    """Per worker and per host: memory, CPU use, KV bytes holding tokens of those
    reserved, bus bytes in/out since start, GPU memory in use of the device's."""
    headers = ["id", "host", "rss", "cpu", "kv used/reserved", "net in/out", "gpu used/total"]
    workers = st.get("workers")
    rows = _rows(workers, _resource_row, len(headers))
    out = ["resources (from heartbeats)", _table(rows, headers) if rows else "  (none)"]
    hosts: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for w in workers if isinstance(workers, list) else []:
        if not isinstance(w, dict):
            continue
        host = str((w.get("info") or {}).get("host", "?"))
        stats = w.get("stats") or {}
        h = hosts[host]
        h["workers"] += 1
        for key in ("rss_bytes", "kv_bytes_used", "kv_bytes_reserved", "net_rx_bytes"):
            if type(stats.get(key)) in (int, float):
                h[key] += stats[key]
        if type(stats.get("net_tx_bytes")) in (int, float):
            h["net_tx_bytes"] += stats["net_tx_bytes"]
        if type(w.get("cpu_percent")) in (int, float):
            h["cpu"] += w["cpu_percent"]
    if hosts:
        host_rows = [
            [
                name,
                str(int(h["workers"])),
                _size(h["rss_bytes"]),
                _cpu(h["cpu"]),
                f"{_size(h['kv_bytes_used'])}/{_size(h['kv_bytes_reserved'])}",
                f"{_size(h['net_rx_bytes'])}/{_size(h['net_tx_bytes'])}",
            ]
            for name, h in sorted(hosts.items())
        ]
        out += ["", "hosts"]
        out.append(
            _table(host_rows, ["host", "workers", "rss", "cpu", "kv used/reserved", "net in/out"])
        )
    return "\n".join(out)


def drift_lines(st: dict[str, Any]) -> list[str]:
    """One line per pool and field on which its replicas differ, escaped: the fields,
    values and names are what workers sent, and a value may hold terminal escapes."""
    lines = []
    for d in st.get("drift") or []:
        try:
            a, b = d["layers"]
            model = f"model {d['model']} " if d.get("model") else ""
            values = "; ".join(f"{v}: {', '.join(ids)}" for v, ids in d["values"].items())
            lines.append(printable(f"  {model}layers {a}:{b}  {d['field']} differs: {values}"))
        except (KeyError, TypeError, ValueError, AttributeError):
            lines.append("  ? (an entry of another shape)")
    return lines


def format_drift(st: dict[str, Any]) -> str:
    lines = drift_lines(st)
    head = "drift (build fields on which the replicas of a pool differ)"
    return "\n".join([head, *(lines or ["  (none: every pool's replicas agree)"])])


def format_children(state: dict[str, Any]) -> str:
    """The children of the `zmqllm up` of this machine (its up-state.json): each one's
    state, pid, exits within the last minute and last exit; failing ones first."""
    order = {"failing": 0, "restarting": 1, "running": 2}
    rows = []
    for c in sorted(
        (c for c in state.get("children", []) if isinstance(c, dict)),
        key=lambda c: (order.get(str(c.get("state")), 3), str(c.get("name"))),
    ):
        shown = str(c.get("state", "?"))
        rows.append(
            [
                str(c.get("name", "?")),
                str(c.get("role", "?")),
                "FAILING" if shown == "failing" else shown,
                str(c.get("pid") or "-"),
                str(c.get("exits", 0)),
                str(c.get("last_exit") or "-"),
                str(c.get("log", "")),
            ]
        )
    headers = ["name", "role", "state", "pid", "exits/60s", "last exit", "log"]
    return "zmqllm up (this machine)\n" + (_table(rows, headers) if rows else "  (none)")
