"""`zmqllm status`: ask a running broker what it holds and print it as tables."""

from __future__ import annotations

import time
import uuid
from typing import Any

import zmq

from zmqllm.protocol import Header, MsgType, ProtocolError, decode, encode


def fetch_status(address: str, timeout: float = 3.0) -> dict[str, Any]:
    """One STATUS round trip over a fresh DEALER (synchronous, for the CLI and tests)."""
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        key = uuid.uuid4().hex
        sock.send_multipart(encode(Header(MsgType.STATUS, request_id=key)))
        deadline = time.monotonic() + timeout
        # One deadline for the whole wait: unrelated messages must not extend it.
        while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            try:
                h, _ = decode(sock.recv_multipart())
            except ProtocolError:
                continue
            if h.type is MsgType.STATUS_REPLY and h.request_id == key:
                status: dict[str, Any] = h.fields["status"]
                return status
        raise TimeoutError(f"no answer from a broker at {address} within {timeout:g}s")
    finally:
        sock.close(linger=0)


def _table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=False)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def format_status(st: dict[str, Any]) -> str:
    out = [
        f"broker {st.get('boot', '?')}  zmqllm {st.get('version', '?')}  "
        f"up {st.get('uptime_s', 0)}s  layers {st.get('num_layers', 0)}  "
        f"complete route: {'yes' if st.get('complete_route') else 'NO'}  "
        f"sessions {st.get('sessions', 0)}  queue {st.get('queue', 0)}",
        "",
        "workers",
    ]
    rows = []
    for w in st.get("workers", []):
        a, b = w["layers"]
        stats = w.get("stats", {})
        rows.append(
            [
                w["id"],
                f"{a}:{b}",
                f"{w['sessions']}/{w['capacity']}",
                f"{w['kv_tokens_reserved']}/{w['max_kv_tokens']}",
                f"{w['load']:.2f}",
                str(stats.get("mean_batch", "-")),
                f"{w['last_heartbeat_s']:.1f}s",
                "draining" if w.get("draining") else "serving",
            ]
        )
    headers = ["id", "layers", "sessions", "kv tokens", "load", "mean batch", "heartbeat", "state"]
    out.append(_table(rows, headers) if rows else "  (none)")
    out += ["", "pools"]
    pools = [
        [f"{p['layers'][0]}:{p['layers'][1]}", ", ".join(p["workers"])] for p in st.get("pools", [])
    ]
    out.append(_table(pools, ["layers", "workers"]) if pools else "  (none)")
    routes = [" -> ".join(r) for r in st.get("routes", [])]
    out += ["", "routes (chains of pools covering every layer)"]
    out += [f"  {r}" for r in routes] if routes else ["  (none)"]
    counters = st.get("counters", {})
    if counters:
        out += ["", "  ".join(f"{k} {v}" for k, v in counters.items())]
    return "\n".join(out)
