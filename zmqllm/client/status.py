"""`zmqllm status`: ask a running broker what it holds and print it as tables."""

from __future__ import annotations

import time
import uuid
from typing import Any

import zmq

from zmqllm.bus.keys import PeerKeys, as_client
from zmqllm.bus.messages import (
    MAX_STATUS_BYTES,
    Error,
    ErrorCode,
    SessionError,
    Status,
    StatusReply,
)
from zmqllm.bus.protocol import MAX_FRAMES, decode, encode
from zmqllm.bus.sockets import recv_bounded
from zmqllm.bus.wire_types import ProtocolError

__all__ = ["fetch_status", "format_status"]


def fetch_status(
    address: str, timeout: float = 3.0, keys: PeerKeys | None = None
) -> dict[str, Any]:
    """One STATUS round trip over a fresh DEALER (synchronous, for the CLI and tests).

    TimeoutError when no answer comes within ``timeout``; SessionError when the broker
    answers with an ERROR or with a status that cannot be read.
    """
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # A status body is the largest frame a broker sends here; more cuts the peer off.
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_STATUS_BYTES)
    deadline = time.monotonic() + timeout
    sock.setsockopt(zmq.SNDTIMEO, max(1, round(timeout * 1000)))
    if keys is not None:
        as_client(sock, keys)
    try:
        sock.connect(address)
        key = uuid.uuid4().hex
        try:
            sock.send_multipart(encode(Status(request_id=key)))
        except zmq.Again:
            raise TimeoutError(
                f"could not reach a broker at {address} within {timeout:g}s"
            ) from None
        # One deadline for the whole wait: unrelated messages must not extend it.
        while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            frames = recv_bounded(sock, MAX_FRAMES)
            try:
                msg = decode(frames, max_payload_bytes=MAX_STATUS_BYTES) if frames else None
            except ProtocolError:
                continue
            if msg is None or msg.request_id != key:
                continue
            if isinstance(msg, Error):
                raise SessionError(msg.code, msg.message)
            if isinstance(msg, StatusReply):
                try:
                    return msg.status()
                except ProtocolError as exc:
                    raise SessionError(
                        ErrorCode.INTERNAL, f"unreadable status from the broker: {exc}"
                    ) from None
        raise TimeoutError(f"no answer from a broker at {address} within {timeout:g}s")
    finally:
        sock.close(linger=0)


def _table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=False)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def _worker_row(w: Any) -> list[str]:
    a, b = w["layers"]
    stats = w.get("stats") or {}
    return [
        str(w["id"]),
        f"{a}:{b}",
        f"{w['sessions']}/{w['capacity']}",
        f"{w['kv_tokens_reserved']}/{w['max_kv_tokens']}",
        f"{w['load']:.2f}",
        str(stats.get("mean_batch", "-")),
        _prefix_cell(stats),
        _spec_cell(stats),
        f"{w['last_heartbeat_s']:.1f}s",
        "draining" if w.get("draining") else "serving",
        str(w.get("peer") or "-"),
        _measured_cell(w.get("measured")),
    ]


def _measured_cell(m: Any) -> str:
    """What a worker measured of itself before loading (--layers auto), "-" if nothing:
    ms per layer at 1 and 16 rows, the memory it may use, its round trip to the broker."""
    if not isinstance(m, dict) or not {"ms_1", "ms_16", "memory_bytes"} <= set(m):
        return "-"
    return (
        f"{float(m['ms_1']):.3g}/{float(m['ms_16']):.3g} ms, "
        f"{int(m['memory_bytes']) / (1 << 30):.1f} GiB, rtt {float(m.get('rtt_ms', 0)):.2g} ms"
    )


def _spec_cell(stats: dict[str, Any]) -> str:
    """Speculation on a last stage: proposals accepted / made, tokens per pass ("-": off)."""
    if "spec_proposed" not in stats:
        return "-"
    return (
        f"{stats.get('spec_accepted', 0)}/{stats['spec_proposed']}, "
        f"{float(stats.get('spec_tokens_per_pass', 0.0)):.2f} tok/pass"
    )


def _prefix_cell(stats: dict[str, Any]) -> str:
    """Prompt tokens found in the prefix cache / looked up ("-": no prefix cache)."""
    if "prefix_query_tokens" not in stats:
        return "-"
    return f"{stats.get('prefix_hit_tokens', 0)}/{stats['prefix_query_tokens']}"


def _pool_row(p: Any) -> list[str]:
    a, b = p["layers"]
    return [f"{a}:{b}", ", ".join(str(w) for w in p["workers"])]


def _rows(items: Any, make: Any, width: int) -> list[list[str]]:
    """Table rows; an entry of another shape (an older or newer broker) shows as "?"."""
    rows = []
    for item in items if isinstance(items, list) else []:
        try:
            rows.append(make(item))
        except (KeyError, TypeError, ValueError, AttributeError):
            rows.append(["?"] * width)
    return rows


def format_status(st: dict[str, Any]) -> str:
    """The status as tables: one model's workers, pools and routes; with several models,
    each model's workers and routes under its name."""
    models = [m for m in st.get("models") or [] if isinstance(m, dict)]
    first = (
        f"broker {st.get('boot', '?')}  zmqllm {st.get('version', '?')}  "
        f"up {st.get('uptime_s', 0)}s  "
    )
    if len(models) > 1:
        out = [
            first + f"models {len(models)}  sessions {st.get('sessions', 0)}  "
            f"queue {st.get('queue', 0)}"
        ]
        for m in sorted(models, key=lambda m: str(m.get("name"))):
            out += ["", *_model_section(st, m)]
    else:
        named = f"model {models[0].get('name')}  " if models and models[0].get("name") else ""
        out = [
            first + named + f"layers {st.get('num_layers', 0)}  "
            f"complete route: {'yes' if st.get('complete_route') else 'NO'}  "
            f"sessions {st.get('sessions', 0)}  queue {st.get('queue', 0)}",
            "",
            "workers",
            _workers_table(st.get("workers")),
            "",
            "pools",
        ]
        pools = _rows(st.get("pools"), _pool_row, 2)
        out.append(_table(pools, ["layers", "workers"]) if pools else "  (none)")
        out += ["", "routes (chains of pools covering every layer)", *_routes(st.get("routes"))]
    counters = st.get("counters")
    if isinstance(counters, dict) and counters:
        out += ["", "  ".join(f"{k} {v}" for k, v in counters.items())]
    return "\n".join(out)


def _model_section(st: dict[str, Any], m: dict[str, Any]) -> list[str]:
    name = m.get("name")
    kind = "remote (text)" if m.get("text_model") else f"{m.get('num_layers', '?')} layers"
    ready = "yes" if m.get("complete_route") else f"NO (missing {m.get('uncovered') or '?'})"
    workers = [w for w in st.get("workers") or [] if isinstance(w, dict) and w.get("model") == name]
    return [
        f"model {name}  {kind}  complete route: {ready}",
        _workers_table(workers),
        "routes: " + ("; ".join(r.strip() for r in _routes(m.get("routes")))),
    ]


def _workers_table(workers: Any) -> str:
    headers = ["id", "layers", "sessions", "kv tokens", "load", "mean batch", "prefix hit"]
    headers += ["speculation"]  # accepted/proposed, tokens per pass
    # measured: ms per layer at 1/16 rows, memory, round trip (--layers auto)
    headers += ["heartbeat", "state", "peer link", "measured"]
    rows = _rows(workers, _worker_row, len(headers))
    return _table(rows, headers) if rows else "  (none)"


def _routes(routes: Any) -> list[str]:
    rows = _rows(routes, lambda r: [" -> ".join(str(p) for p in r)], 1)
    return [f"  {r[0]}" for r in rows] if rows else ["  (none)"]
