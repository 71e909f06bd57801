"""STATUS stays within its limit whatever workers say of themselves (broker/status.py):
one registration adds a bounded entry, drift is summarised, and the workers that would
take the reply past MAX_STATUS_BYTES are left out and counted. Pure tests on a registry,
then one broker flooded over real sockets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import msgpack

from tests.broker.test_loop import Harness, open_msg, register_msg
from tests.broker.test_loop import cluster as cluster  # the fixture
from tests.broker.test_registry import register
from tests.broker.test_status import status_of
from zmqllm.broker.registry import Registry
from zmqllm.broker.session_table import SessionTable
from zmqllm.broker.status import (
    MAX_DRIFT_ENTRIES,
    MAX_DRIFT_IDS,
    MAX_DRIFT_VALUES,
    MAX_SHOWN_BUILD,
    MAX_SHOWN_TEXT,
    fitted,
    shown_drift,
    shown_worker,
)
from zmqllm.bus.messages import (
    MAX_STATUS_BYTES,
    Open,
    Refused,
    Register,
    Registered,
    StatusReply,
)
from zmqllm.client.node_view import drift_lines

FLOOD = 160
# The most one worker's STATUS entry may take: its names and addresses (255 characters
# each, as the wire allows), MAX_SHOWN_BUILD build fields, its figures.
WORKER_ENTRY_BYTES = 6 * 1024


def hostile_id(i: int) -> str:
    return f"h{i:04d}" + "x" * 250  # 255 characters, the longest routing id taken


def hostile(reg: Register, i: int) -> Register:
    """``reg`` saying as much of itself as the wire lets it: the longest host and peer
    address, and 32 build fields of 64-character names and 256-character values, each
    value its own (so every field differs across the pool: drift)."""
    build = {f"{k:02d}" + "k" * 62: f"{i:04d}" + "v" * 252 for k in range(32)}
    return replace(reg, host="H" * 255, peer="tcp://" + "a" * 253 + ":5555", build=build)


def flooded(n: int) -> Registry:
    reg = Registry()
    reg.add(b"w0", register(0, 4))
    for i in range(n):
        reg.add(hostile_id(i).encode(), hostile(register(0, 4), i))
    return reg


def packed(value: object) -> int:
    return len(msgpack.packb(value, use_bin_type=True))


def test_one_registration_adds_a_bounded_entry() -> None:
    reg = flooded(1)
    w = reg.workers[hostile_id(0)]
    entry = shown_worker(w.describe(100.0))
    assert packed(entry) <= WORKER_ENTRY_BYTES
    assert len(entry["build"]) == MAX_SHOWN_BUILD
    assert all(len(v) <= MAX_SHOWN_TEXT for v in entry["build"].values())
    assert len(w.build) == 32  # what it said is kept whole: the pool checks compare it


def test_status_of_a_flood_of_registrations_fits_its_limit() -> None:
    """160 registrations of 255-character ids, hosts and peers and 32 long build fields
    (11 KB of STATUS each, the drift section listing every differing value, before):
    STATUS still fits, shows every worker, and summarises drift."""
    reg = flooded(FLOOD)
    st = status_of(reg, SessionTable(reg, "boot1"))
    body = StatusReply.of(st)
    assert body.body.array.size <= MAX_STATUS_BYTES
    assert body.status()["num_layers"] == 4
    assert len(st["workers"]) == FLOOD + 1  # type: ignore[arg-type]
    assert st["truncated"] == {"workers": 0, "drift": 32 - MAX_DRIFT_ENTRIES}
    drift = st["drift"]
    assert len(drift) == MAX_DRIFT_ENTRIES  # type: ignore[arg-type]
    for entry in drift:  # type: ignore[attr-defined]
        assert entry["workers"] == FLOOD + 1
        assert len(entry["values"]) == MAX_DRIFT_VALUES + 1
        assert f"({FLOOD + 1 - MAX_DRIFT_VALUES} other values)" in entry["values"]
        assert all(len(ids) <= MAX_DRIFT_IDS + 1 for ids in entry["values"].values())
    # `zmqllm status --drift` still reads it.
    assert len(drift_lines(st)) == MAX_DRIFT_ENTRIES
    assert "?" not in "".join(drift_lines(st))


def test_status_fits_at_the_most_workers_a_broker_takes() -> None:
    """max_workers of the largest registrations: the workers that do not fit are left
    out and counted; the smaller ones are kept."""
    reg = flooded(1023)
    st = status_of(reg, SessionTable(reg, "boot1"))
    assert packed(st) <= MAX_STATUS_BYTES
    shown = [w["id"] for w in st["workers"]]  # type: ignore[attr-defined]
    assert "w0" in shown
    assert st["truncated"]["workers"] > 0  # type: ignore[index]
    assert len(shown) + st["truncated"]["workers"] == 1024  # type: ignore[index]
    StatusReply.of(st).status()


def test_a_status_that_cannot_fit_keeps_only_its_counts() -> None:
    reg = flooded(3)
    st = status_of(reg, SessionTable(reg, "boot1"))
    small = fitted(st, limit=packed(st) - 1)
    assert len(small["workers"]) < 4 and small["truncated"]["workers"] >= 1
    assert packed(small) <= packed(st) - 1
    bare = fitted(st, limit=600)
    assert bare["truncated"]["all"] is True and bare["truncated"]["workers"] == 4
    assert bare["workers"] == bare["models"] == bare["drift"] == []
    assert bare["boot"] == "boot1" and packed(bare) <= 600


def test_drift_keeps_its_shape_and_counts_the_rest() -> None:
    ids = [f"w{i}" for i in range(10)]
    entry = {
        "model": "m",
        "layers": [0, 4],
        "field": "torch",
        "values": {"2.1": ids[:7], "2.2": ids[7:9], "x" * 300: ids[9:]},
    }
    (shown,), left_out = shown_drift([entry])
    assert left_out == 0 and shown["workers"] == 10
    assert list(shown["values"]) == ["2.1", "2.2", "x" * (MAX_SHOWN_TEXT - 3) + "..."]
    assert shown["values"]["2.1"] == [*ids[:MAX_DRIFT_IDS], f"(and {7 - MAX_DRIFT_IDS} more)"]
    assert shown["values"]["2.2"] == ids[7:9]
    many, left_out = shown_drift([entry] * (MAX_DRIFT_ENTRIES + 5))
    assert len(many) == MAX_DRIFT_ENTRIES and left_out == 5


def test_a_register_naming_no_model_leaves_the_only_model_the_default(
    cluster: Callable[..., Harness],
) -> None:
    """Over real sockets: `served: ""` is refused, not a second model named "" after
    which an OPEN naming no model would be `bad_request` "several models are served"."""
    h = cluster()
    w0 = h.register("w0", 0, 4)
    nameless = h.worker("nameless")
    nameless.send(replace(register_msg(0, 4), served=""))
    assert "names no model" in h.expect(nameless, Refused).reason
    st = h.status()
    assert [m["name"] for m in st["models"]] == ["m"] and st["num_layers"] == 4
    h.client("c").send(open_msg("unnamed"))
    assert h.expect(w0, Open).request_id == "req-unnamed"


def test_a_flooded_broker_still_answers_status_and_open(cluster: Callable[..., Harness]) -> None:
    """Over real sockets, after 160 hostile registrations STATUS still fits (`zmqllm
    status` and the gateway's /ready read it) and an OPEN that names no model is routed."""
    h = cluster(heartbeat_liveness=1000)  # the flood needs no heartbeats to stay
    h.register("w0", 0, 4)
    for i in range(FLOOD):
        w = h.worker(hostile_id(i))
        w.send(hostile(register_msg(0, 4), i))
        h.expect(w, Registered)
    st = h.status()  # raises past MAX_STATUS_BYTES, as every client does
    assert len(st["workers"]) == FLOOD + 1 and st["num_layers"] == 4
    assert [m["name"] for m in st["models"]] == ["m"]
    client = h.client("c")
    client.send(open_msg("after-flood"))
    h.wait_status(lambda st: st["sessions"] == 1, "the OPEN was not routed")
    assert h.pending(client) == []  # no error came back
