"""Broker bookkeeping without sockets: registry, routes, room, refusals, pools.

No torch here: the broker runs without the ML stack.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from zmqllm.registry import Registry, WorkerEntry, fingerprint_differences

VERSION = "1.2.3"
SUMMARY: dict[str, Any] = {"num_layers": 4, "hidden_size": 64, "sliding_window": 8, "digest": "d1"}


def add(
    reg: Registry,
    wid: str,
    start: int,
    end: int,
    *,
    num_layers: int = 4,
    capacity: int = 4,
    max_kv_tokens: int = 1000,
    digest: str = "d1",
    summary: dict[str, Any] | None = None,
) -> WorkerEntry:
    fields = {
        "start": start,
        "end": end,
        "num_layers": num_layers,
        "capacity": capacity,
        "fingerprint": digest,
    }
    info = {
        "fingerprint": summary if summary is not None else SUMMARY,
        "max_kv_tokens": max_kv_tokens,
        "context": 512,
    }
    return reg.add(wid.encode(), fields, info)


def ids(route: list[WorkerEntry] | None) -> list[str] | None:
    return None if route is None else [w.worker_id for w in route]


def entry(**overrides: Any) -> WorkerEntry:
    values: dict[str, Any] = dict(
        identity=b"w", worker_id="w", start=0, end=4, capacity=2, max_kv_tokens=100, info={}
    )
    values.update(overrides)
    return WorkerEntry(**values)


# -- routes ------------------------------------------------------------------------------


def test_first_worker_defines_the_model() -> None:
    reg = Registry()
    assert reg.find_route(10) is None  # no model yet: nothing to route to
    add(reg, "a", 0, 4)
    assert reg.num_layers == 4
    assert reg.context == 512
    assert reg.fingerprint == "d1"
    assert ids(reg.find_route(10)) == ["a"]


def test_equal_pools_pick_the_least_loaded_replica() -> None:
    reg = Registry()
    for wid, start, end in [("a0", 0, 2), ("a1", 0, 2), ("b0", 2, 4), ("b1", 2, 4)]:
        add(reg, wid, start, end)

    first = reg.find_route(10)
    assert first is not None
    # Equal load: ties go to the lowest id, so the choice is deterministic.
    assert ids(first) == ["a0", "b0"]
    reg.reserve(first, "s1", 10)
    assert [len(w.sessions) for w in first] == [1, 1]
    assert [w.reserved_tokens for w in first] == [10, 10]

    # The busy replicas now lose to the idle ones.
    second = reg.find_route(10)
    assert ids(second) == ["a1", "b1"]
    assert second is not None
    reg.reserve(second, "s2", 10)

    # Releasing s1 makes a0/b0 the least loaded again.
    reg.release(["a0", "b0"], "s1", 10)
    assert reg.workers["a0"].sessions == set()
    assert reg.workers["a0"].reserved_tokens == 0
    assert ids(reg.find_route(10)) == ["a0", "b0"]


def test_release_is_idempotent_and_ignores_unknown_workers() -> None:
    reg = Registry()
    a = add(reg, "a", 0, 4)
    reg.reserve([a], "s", 30)
    reg.release(["a", "gone"], "s", 30)
    # A second release (e.g. CLOSE after the session already ended) must not
    # drive the reservation negative.
    reg.release(["a"], "s", 30)
    assert a.reserved_tokens == 0
    assert a.sessions == set()


def test_mixed_ranges_prefer_fewer_hops_then_load() -> None:
    reg = Registry()
    whole = add(reg, "whole", 0, 4, capacity=1)
    add(reg, "p0", 0, 2, capacity=1)
    add(reg, "p1", 2, 4, capacity=1)

    # Both are complete routes; at equal load the single hop wins.
    assert ids(reg.find_route(10)) == ["whole"]
    reg.reserve([whole], "s1", 10)

    # The whole-model worker is full: the pipeline serves the next session.
    pipeline = reg.find_route(10)
    assert ids(pipeline) == ["p0", "p1"]
    assert pipeline is not None
    reg.reserve(pipeline, "s2", 10)

    # Everything full: no route, though one exists ignoring room (status uses that).
    assert reg.find_route(10) is None
    assert reg.find_route(10, ignore_room=True) is not None

    # The whole-model worker frees up while the pipeline stays full.
    reg.release(["whole"], "s1", 10)
    assert ids(reg.find_route(10)) == ["whole"]


def test_mixed_ranges_use_the_pipeline_when_the_whole_model_is_busier() -> None:
    reg = Registry()
    whole = add(reg, "whole", 0, 4, capacity=4)
    add(reg, "p0", 0, 2, capacity=4)
    add(reg, "p1", 2, 4, capacity=4)
    reg.reserve([whole], "s1", 10)
    # One hop more is worth less than a quarter of a worker's load.
    assert ids(reg.find_route(10)) == ["p0", "p1"]


def test_no_route_when_a_range_is_uncovered() -> None:
    reg = Registry()
    add(reg, "a", 0, 15, num_layers=30)
    assert reg.find_route(10) is None
    assert reg.find_route(10, ignore_room=True) is None
    assert reg.uncovered() == "15:30"

    add(reg, "b", 20, 30, num_layers=30)
    assert reg.find_route(10) is None
    assert reg.uncovered() == "15:20"

    add(reg, "c", 15, 20, num_layers=30)
    assert reg.uncovered() == ""
    assert ids(reg.find_route(10)) == ["a", "c", "b"]


def test_uncovered_names_every_gap() -> None:
    reg = Registry()
    add(reg, "mid", 10, 20, num_layers=30)
    assert reg.uncovered() == "0:10, 20:30"


def test_ranges_that_do_not_chain_give_no_route() -> None:
    reg = Registry()
    # Every layer is covered, but 0:3 ends where no worker starts.
    add(reg, "a", 0, 3)
    add(reg, "b", 2, 4)
    assert reg.uncovered() == ""
    assert reg.find_route(10) is None


def test_find_route_skips_workers_without_kv_room() -> None:
    reg = Registry()
    # "a-small" wins ties by id, so choosing "b-large" below is about room alone.
    add(reg, "a-small", 0, 4, max_kv_tokens=50)
    add(reg, "b-large", 0, 4, max_kv_tokens=500)
    assert ids(reg.find_route(40)) == ["a-small"]
    assert ids(reg.find_route(100)) == ["b-large"]
    assert reg.find_route(1000) is None


# -- room and load -----------------------------------------------------------------------


def test_has_room_respects_capacity() -> None:
    now = time.monotonic()
    w = entry(capacity=2)
    assert w.has_room(10, now)
    w.sessions = {"s1", "s2"}
    assert not w.has_room(10, now)


def test_has_room_respects_max_kv_tokens() -> None:
    now = time.monotonic()
    w = entry(max_kv_tokens=100)
    assert w.has_room(100, now)  # exactly the limit fits
    assert not w.has_room(101, now)
    w.reserved_tokens = 60
    assert w.has_room(40, now)
    assert not w.has_room(41, now)


def test_has_room_respects_draining_and_full_until() -> None:
    now = time.monotonic()
    w = entry(draining=True)
    assert not w.has_room(1, now)
    w = entry(full_until=now + 5.0)
    assert not w.has_room(1, now)
    assert w.has_room(1, now + 5.0)  # the back-off ends


def test_load_score_is_the_larger_of_sessions_and_tokens() -> None:
    w = entry(capacity=4, max_kv_tokens=100)
    assert w.load_score() == 0.0
    w.sessions = {"s1"}
    assert w.load_score() == pytest.approx(0.25)
    w.reserved_tokens = 50
    assert w.load_score() == pytest.approx(0.5)


def test_describe_reports_what_status_prints() -> None:
    w = entry(worker_id="w-1", start=2, end=4, capacity=4, max_kv_tokens=100)
    w.sessions = {"s1"}
    w.reserved_tokens = 10
    d = w.describe(w.last_seen + 1.5)
    assert d["id"] == "w-1"
    assert d["layers"] == [2, 4]
    assert d["sessions"] == 1
    assert d["capacity"] == 4
    assert d["kv_tokens_reserved"] == 10
    assert d["load"] == 0.25
    assert d["last_heartbeat_s"] == 1.5
    assert d["draining"] is False


# -- refusals ----------------------------------------------------------------------------


def test_refusal_names_a_version_mismatch() -> None:
    reason = Registry().refusal("0.9", VERSION, "d1", SUMMARY, 0, 4, 4)
    assert reason is not None
    assert "0.9" in reason and VERSION in reason


@pytest.mark.parametrize(("start", "end"), [(0, 5), (-1, 2), (3, 3), (3, 2)])
def test_refusal_names_a_range_outside_the_model(start: int, end: int) -> None:
    reason = Registry().refusal(VERSION, VERSION, "d1", SUMMARY, start, end, 4)
    assert reason is not None
    assert f"{start}:{end}" in reason


def test_refusal_names_the_fingerprint_difference() -> None:
    reg = Registry()
    add(reg, "a", 0, 2)
    other = dict(SUMMARY, sliding_window=4, digest="d2")
    reason = reg.refusal(VERSION, VERSION, "d2", other, 2, 4, 4)
    assert reason is not None
    assert "sliding_window: 8 != 4" in reason
    # The digest itself differs by construction; naming it would be noise.
    assert "digest" not in reason
    # The same model is welcome.
    assert reg.refusal(VERSION, VERSION, "d1", SUMMARY, 2, 4, 4) is None


def test_refusal_falls_back_to_the_digest_without_a_summary() -> None:
    reg = Registry()
    add(reg, "a", 0, 2, summary={})
    reason = reg.refusal(VERSION, VERSION, "d2", {}, 2, 4, 4)
    assert reason is not None
    assert "d2" in reason and "d1" in reason


def test_fingerprint_differences_lists_each_key() -> None:
    a = {"x": 1, "y": "same", "digest": "1"}
    b = {"x": 2, "y": "same", "z": True, "digest": "2"}
    assert fingerprint_differences(a, b) == ["x: 1 != 2", "z: None != True"]


def test_an_empty_registry_accepts_another_model() -> None:
    reg = Registry()
    a = add(reg, "a", 0, 2)
    b = add(reg, "b", 2, 4)
    other = dict(SUMMARY, num_layers=8, digest="d2")
    assert reg.refusal(VERSION, VERSION, "d2", other, 0, 8, 8) is not None

    reg.remove(a)
    assert reg.refusal(VERSION, VERSION, "d2", other, 0, 8, 8) is not None  # b still there
    reg.remove(b)
    assert reg.workers == {} and reg.by_identity == {}
    assert reg.num_layers == 0
    assert reg.refusal(VERSION, VERSION, "d2", other, 0, 8, 8) is None

    add(reg, "c", 0, 8, num_layers=8, digest="d2", summary=other)
    assert reg.num_layers == 8
    assert reg.fingerprint == "d2"
    assert ids(reg.find_route(10)) == ["c"]


def test_remove_forgets_the_identity() -> None:
    reg = Registry()
    a = add(reg, "a", 0, 4)
    add(reg, "b", 0, 4)
    reg.remove(a)
    assert b"a" not in reg.by_identity
    assert "a" not in reg.workers
    assert reg.num_layers == 4  # b keeps the model defined
    reg.remove(a)  # twice is harmless


def test_pools_group_workers_by_range() -> None:
    reg = Registry()
    for wid, start, end in [("b1", 2, 4), ("a1", 0, 2), ("whole", 0, 4), ("a0", 0, 2)]:
        add(reg, wid, start, end)
    assert reg.pools() == [
        {"layers": [0, 2], "workers": ["a0", "a1"]},
        {"layers": [0, 4], "workers": ["whole"]},
        {"layers": [2, 4], "workers": ["b1"]},
    ]
    assert Registry().pools() == []


def test_route_shapes_list_every_chain_of_pools() -> None:
    reg = Registry()
    for ident, (a, b) in {"p0": (0, 15), "p1": (15, 30), "whole": (0, 30), "p0b": (0, 15)}.items():
        reg.add(
            ident.encode(),
            {"start": a, "end": b, "capacity": 4, "num_layers": 30, "fingerprint": "x"},
            {},
        )
    assert sorted(reg.route_shapes()) == [["0:15", "15:30"], ["0:30"]]
    reg.remove(reg.workers["p1"])
    assert reg.route_shapes() == [["0:30"]]
