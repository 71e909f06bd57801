"""The broker's status and its no-route reasons, built from a registry and a session
table alone: no sockets, no broker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.broker.test_registry import add
from tests.broker.test_session_table import open_msg
from zmqllm.broker.drift import NOT_SENT, pool_drift
from zmqllm.broker.registry import Registry
from zmqllm.broker.session_table import SessionTable
from zmqllm.broker.status import MAX_MODELS_NAMED, broker_status, no_route_reason, shown_drift
from zmqllm.bus.messages import StatusReply
from zmqllm.version import __version__


def status_of(reg: Registry, table: SessionTable, **kw: object) -> dict[str, object]:
    args: dict[str, object] = {
        "boot": "boot1",
        "uptime_s": 12.345,
        "now": 100.0,
        "dropped": {},
        "curve": False,
        "auth_refused": {},
        "handshake_failures": {},
    }
    return broker_status(reg, table, **{**args, **kw})  # type: ignore[arg-type]


def test_an_empty_broker() -> None:
    reg = Registry()
    st = status_of(reg, SessionTable(reg, "boot1"))
    assert st["boot"] == "boot1" and st["version"] == __version__
    assert st["uptime_s"] == 12.3
    assert st["workers"] == [] and st["models"] == [] and st["routes"] == []
    assert st["complete_route"] is False
    assert st["queue"] == 0 and st["sessions"] == 0
    assert st["counters"] == {
        "sessions_opened": 0,
        "sessions_finished": 0,
        "sessions_failed": 0,
        "tokens": 0,
        "relayed": 0,
        "dropped_messages": 0,
    }
    assert st["auth"] == {"refused": {}, "handshake_failures": {}}
    StatusReply.of(st).status()  # fits a STATUS reply as it is


def test_workers_sessions_and_counts() -> None:
    reg = Registry()
    add(reg, "a", 0, 2)
    add(reg, "b", 2, 4)
    table = SessionTable(reg, "boot1")
    table.open(b"client", open_msg("s1"), 100.0)
    st = status_of(
        reg,
        table,
        dropped={"frontend:malformed": 2, "backend:frames": 1},
        curve=True,
        auth_refused={"no key": 3},
        handshake_failures={"frontend": 1},
    )
    assert [w["id"] for w in st["workers"]] == ["a", "b"]  # type: ignore[index]
    assert st["complete_route"] is True and st["num_layers"] == 4
    assert st["sessions"] == 1 and st["queue"] == 0
    assert st["counters"]["sessions_opened"] == 1  # type: ignore[index]
    assert st["counters"]["dropped_messages"] == 3  # type: ignore[index]
    assert st["dropped"] == {"frontend:malformed": 2, "backend:frames": 1}
    assert st["curve"] is True
    assert st["auth"] == {"refused": {"no key": 3}, "handshake_failures": {"frontend": 1}}
    StatusReply.of(st).status()


def test_no_route_reasons() -> None:
    reg = Registry()
    assert no_route_reason(reg, 5.0) == "no capacity: no worker registered after 5s"
    add(reg, "a", 0, 2)
    assert "layers" in no_route_reason(reg, 5.0) and "have no worker" in no_route_reason(reg, 5.0)
    add(reg, "b", 2, 4)
    assert no_route_reason(reg, 2.5) == "no capacity: no route with room after 2.5s"
    why = no_route_reason(reg, 1.0, "other")
    assert why.startswith("no capacity: no worker serves model 'other' (served: ")
    assert MAX_MODELS_NAMED >= 1


@dataclass
class Replica:
    worker_id: str
    build: dict[str, Any]


def drift_of(*replicas: Replica) -> list[dict[str, Any]]:
    return pool_drift({("", 0, 4): list(replicas)})


def test_drift_compares_every_field_any_replica_sent_and_names_who_left_it_out() -> None:
    drift = drift_of(
        Replica("w0", {"torch": "2.13.0", "quant": "none"}),
        Replica("w1", {"torch": "2.13.0"}),  # an older worker: no quant
        Replica("w2", {"quant": "none"}),
    )
    assert drift == [
        {
            "model": "",
            "layers": [0, 4],
            "field": "quant",
            "values": {"none": ["w0", "w2"], NOT_SENT: ["w1"]},
        },
        {
            "model": "",
            "layers": [0, 4],
            "field": "torch",
            "values": {"2.13.0": ["w0", "w1"], NOT_SENT: ["w2"]},
        },
    ]
    # A field no replica sent, or every replica sent alike, is no drift.
    assert drift_of(Replica("w0", {"cpu": "avx2"}), Replica("w1", {"cpu": "avx2"})) == []


def test_a_sent_value_never_passes_for_another_or_for_a_missing_one() -> None:
    # A worker that sends the marker's text itself does not hide among those that sent none.
    values = drift_of(
        Replica("w0", {"kernel": "abc"}),
        Replica("w1", {"kernel": NOT_SENT}),
        Replica("w2", {}),
    )[0]["values"]
    assert values == {"abc": ["w0"], f"{NOT_SENT} (str)": ["w1"], NOT_SENT: ["w2"]}
    # Nor when no worker left the field out, nor by sending what another value shows as.
    values = drift_of(Replica("w0", {"k": "abc"}), Replica("w1", {"k": NOT_SENT}))[0]["values"]
    assert values == {"abc": ["w0"], f"{NOT_SENT} (str)": ["w1"]}
    values = drift_of(
        Replica("w0", {"k": f"{NOT_SENT} (str)"}), Replica("w1", {"k": NOT_SENT}), Replica("w2", {})
    )[0]["values"]
    assert sorted(values.values()) == [["w0"], ["w1"], ["w2"]] and values[NOT_SENT] == ["w2"]
    # 2 and "2" print alike, 1 and True compare equal: neither pair is one build.
    values = drift_of(Replica("w0", {"protocol": 2}), Replica("w1", {"protocol": "2"}))[0]["values"]
    assert values == {"2 (int)": ["w0"], "2 (str)": ["w1"]}
    values = drift_of(Replica("w0", {"x": 1}), Replica("w1", {"x": True}))[0]["values"]
    assert values == {"1": ["w0"], "True": ["w1"]}
    # The summary STATUS carries keeps every value apart and counts every worker.
    shown, left_out = shown_drift(drift_of(Replica("a", {"k": NOT_SENT}), Replica("b", {})))
    assert left_out == 0 and shown[0]["workers"] == 2 and len(shown[0]["values"]) == 2
