"""Broker bookkeeping without sockets: registry, routes, room, refusals, caps, pools.

No torch here: the broker runs without the ML stack.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest

from zmqllm.broker.registry import (
    MAX_GAPS,
    MAX_MODELS,
    Registry,
    RegistryError,
    WorkerEntry,
    fingerprint_differences,
)
from zmqllm.bus.figure_keys import FIGURE_KEYS
from zmqllm.bus.messages import (
    MAX_LAYERS,
    MAX_STATUS_BYTES,
    MAX_TEXT,
    Register,
    StatusReply,
)
from zmqllm.bus.protocol import decode, encode
from zmqllm.config.settings import BrokerSettings

VERSION = "1.2.3"
SUMMARY: dict[str, Any] = {"num_layers": 4, "hidden_size": 64, "sliding_window": 8, "digest": "d1"}


def register(
    start: int,
    end: int,
    *,
    num_layers: int = 4,
    capacity: int = 4,
    max_kv_tokens: int = 1000,
    digest: str = "d1",
    summary: dict[str, Any] | None = None,
    context: int = 512,
    version: str = VERSION,
    served: str = "m",  # every worker names its model (the broker refuses "")
    text_model: bool = False,
) -> Register:
    return Register(
        start=start,
        end=end,
        num_layers=num_layers,
        capacity=capacity,
        max_kv_tokens=max_kv_tokens,
        context=context,
        version=version,
        fingerprint=digest,
        model=summary if summary is not None else SUMMARY,
        served=served,
        text_model=text_model,
        host="node-1",
        pid=4242,
        dtype="float32",
        device="cpu",
    )


def add(reg: Registry, wid: str, start: int, end: int, **kw: Any) -> WorkerEntry:
    return reg.add(wid.encode(), register(start, end, **kw))


def ids(route: list[WorkerEntry] | None) -> list[str] | None:
    return None if route is None else [w.worker_id for w in route]


def entry(**overrides: Any) -> WorkerEntry:
    values: dict[str, Any] = dict(
        identity=b"w", worker_id="w", start=0, end=4, capacity=2, max_kv_tokens=100
    )
    values.update(overrides)
    return WorkerEntry(**values)


def snapshot(reg: Registry) -> tuple[Any, ...]:
    """Everything a refused REGISTER must leave as it was."""
    return (
        dict(reg.workers),
        dict(reg.by_identity),
        reg.num_layers,
        reg.context,
        reg.fingerprint,
        {name: m.describe() for name, m in reg.models.items()},
        reg.pools(),
        reg.uncovered(),
        reg.route_shapes(),
    )


# -- routes ------------------------------------------------------------------------------


def test_first_worker_defines_the_model() -> None:
    reg = Registry()
    assert reg.find_route(10) is None  # no model yet: nothing to route to
    a = add(reg, "a", 0, 4)
    assert reg.num_layers == 4
    assert reg.context == 512
    assert reg.fingerprint == "d1"
    assert reg.resolve() is not None and reg.resolve().summary == SUMMARY
    assert ids(reg.find_route(10)) == ["a"]
    assert (a.host, a.pid, a.dtype, a.device) == ("node-1", 4242, "float32", "cpu")
    assert a.max_kv_tokens == 1000 and a.capacity == 4


def test_equal_pools_pick_the_least_loaded_replica() -> None:
    reg = Registry()
    for wid, start, end in [("a0", 0, 2), ("a1", 0, 2), ("b0", 2, 4), ("b1", 2, 4)]:
        add(reg, wid, start, end)

    first = reg.find_route(10)
    assert first is not None
    # Equal occupancy: ties go to the lowest id, so the choice is deterministic.
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
    assert not reg.workers["a0"].sessions
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
    assert not a.sessions


def test_release_frees_what_was_reserved() -> None:
    reg = Registry()
    a = add(reg, "a", 0, 4)
    reg.reserve([a], "s", 30)
    reg.reserve([a], "s", 30)  # twice for one key holds it once
    assert a.reserved_tokens == 30
    reg.reserve([a], ("t", 1), 5)  # any hashable key
    reg.release(["a"], "s", 999)  # a caller's wrong amount cannot leak or go negative
    assert a.reserved_tokens == 5
    reg.release(["a"], ("t", 1))
    assert a.reserved_tokens == 0


def test_mixed_ranges_prefer_fewer_hops_then_load() -> None:
    reg = Registry()
    whole = add(reg, "whole", 0, 4, capacity=1)
    add(reg, "p0", 0, 2, capacity=1)
    add(reg, "p1", 2, 4, capacity=1)

    # Both are complete routes; at equal occupancy the single hop wins.
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
    # The least loaded busiest member comes before fewer hops.
    assert ids(reg.find_route(10)) == ["p0", "p1"]


def test_hops_decide_between_routes_with_the_same_busiest_member() -> None:
    reg = Registry()
    busy = add(reg, "busy", 0, 1, num_layers=3, capacity=2)
    reg.reserve([busy], "s", 1)  # occupancy 0.5 on the only way into layer 0
    add(reg, "b1", 1, 2, num_layers=3)
    add(reg, "b2", 2, 3, num_layers=3)
    tail = add(reg, "tail", 1, 3, num_layers=3, capacity=4)
    reg.reserve([tail], "t", 1)  # 0.25: busier than b1 and b2 but under the bottleneck
    # Both chains peak at 0.5; the shorter one wins although its suffix is busier.
    assert ids(reg.find_route(1)) == ["busy", "tail"]


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
    assert Registry().uncovered() == ""


def test_uncovered_counts_gaps_past_its_limit() -> None:
    reg = Registry()
    n = 2 * MAX_GAPS + 10
    for i in range(n):
        add(reg, f"w{i}", 2 * i + 1, 2 * i + 2, num_layers=2 * n)
    gaps = reg.uncovered().split(", ")
    assert gaps[:2] == ["0:1", "2:3"]
    assert len(gaps) == MAX_GAPS + 1
    assert gaps[-1] == f"and {n - MAX_GAPS} more"


def test_ranges_that_do_not_chain_give_no_route() -> None:
    reg = Registry()
    # Every layer is covered, but 0:3 ends where no worker starts.
    add(reg, "a", 0, 3)
    add(reg, "b", 2, 4)
    assert reg.uncovered() == ""
    assert reg.find_route(10) is None
    assert reg.route_shapes() == []


def test_find_route_skips_workers_without_kv_room() -> None:
    reg = Registry()
    # "a-small" wins ties by id, so choosing "b-large" below is about room alone.
    add(reg, "a-small", 0, 4, max_kv_tokens=50)
    add(reg, "b-large", 0, 4, max_kv_tokens=500)
    assert ids(reg.find_route(40)) == ["a-small"]
    assert ids(reg.find_route(100)) == ["b-large"]
    assert reg.find_route(1000) is None


def test_find_route_skips_draining_and_backed_off_workers() -> None:
    reg = Registry()
    a = add(reg, "a", 0, 4)
    add(reg, "b", 0, 4)
    a.draining = True
    assert ids(reg.find_route(1)) == ["b"]
    a.draining = False
    reg.workers["b"].full_until = time.monotonic() + 60
    a.full_until = time.monotonic() + 60
    assert reg.find_route(1) is None
    assert reg.find_route(1, ignore_room=True) is not None


def best_by_trying_every_chain(reg: Registry, max_len: int) -> list[str] | None:
    """The route rule applied by brute force: least-loaded replica with room per range;
    then the least busiest member, fewest hops, lowest ids."""
    now = time.monotonic()
    best_of: dict[tuple[int, int], WorkerEntry] = {}
    for w in reg.workers.values():
        cur = best_of.get((w.start, w.end))
        if w.has_room(max_len, now) and (
            cur is None or (w.occupancy(), w.worker_id) < (cur.occupancy(), cur.worker_id)
        ):
            best_of[(w.start, w.end)] = w
    chains: list[list[WorkerEntry]] = []

    def walk(pos: int, chain: list[WorkerEntry]) -> None:
        if pos == reg.num_layers:
            chains.append(list(chain))
        for (a, _), w in best_of.items():
            if a == pos:
                walk(w.end, [*chain, w])

    walk(0, [])
    if not chains:
        return None
    best = min(
        chains, key=lambda c: (max(w.occupancy() for w in c), len(c), [w.worker_id for w in c])
    )
    return [w.worker_id for w in best]


@pytest.mark.parametrize("seed", range(100))
def test_find_route_matches_trying_every_chain(seed: int) -> None:
    rnd = random.Random(seed)
    layers = rnd.randint(1, 7)
    reg = Registry()
    for i in range(rnd.randint(1, 14)):
        start = rnd.randrange(layers)
        w = add(reg, f"w{i:02}", start, rnd.randint(start + 1, layers), num_layers=layers)
        w.capacity = rnd.randint(1, 4)
        for s in range(rnd.randint(0, w.capacity)):
            reg.reserve([w], f"s{s}", rnd.choice([1, 50, 400]))
    for max_len in (1, 100, 700):
        assert ids(reg.find_route(max_len)) == best_by_trying_every_chain(reg, max_len)


# -- room and occupancy ------------------------------------------------------------------


def test_has_room_respects_capacity() -> None:
    now = time.monotonic()
    w = entry(capacity=2)
    assert w.has_room(10, now)
    w.sessions = {"s1": 1, "s2": 1}
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


def test_occupancy_is_the_larger_of_sessions_and_tokens() -> None:
    w = entry(capacity=4, max_kv_tokens=100)
    assert w.occupancy() == 0.0
    w.sessions = {"s1": 0}
    assert w.occupancy() == pytest.approx(0.25)
    w.reserved_tokens = 50
    assert w.occupancy() == pytest.approx(0.5)


def test_describe_reports_what_status_prints() -> None:
    w = entry(worker_id="w-1", start=2, end=4, capacity=4, max_kv_tokens=100, host="h", pid=7)
    w.sessions = {"s1": 10}
    w.reserved_tokens = 10
    d = w.describe(w.last_seen + 1.5)
    assert d["id"] == "w-1"
    assert d["layers"] == [2, 4]
    assert d["sessions"] == 1
    assert d["capacity"] == 4
    assert d["kv_tokens_reserved"] == 10
    assert d["max_kv_tokens"] == 100
    assert d["load"] == 0.25
    assert d["last_heartbeat_s"] == 1.5
    assert d["draining"] is False
    assert d["info"] == {"host": "h", "pid": 7, "dtype": "", "device": ""}


def test_describe_carries_only_whitelisted_fields_and_stats() -> None:
    w = entry(model={"big": "x" * 200})
    w.figures = {
        "forwards": 3,
        "mean_forward_ms": 1.5,
        "secret": 1,  # not a figure key
        "tokens": "many",  # not a number
        "busy_s": float("nan"),
    }
    d = w.describe(w.last_seen)
    assert set(d) == {
        "id",
        "model",
        "text_model",
        "layers",
        "sessions",
        "capacity",
        "kv_tokens_reserved",
        "max_kv_tokens",
        "load",
        "last_heartbeat_s",
        "draining",
        "peer",
        "info",
        "stats",
        "cpu_percent",
        "build",
        "build_key",
        "measured",
    }
    assert d["stats"] == {"forwards": 3, "mean_forward_ms": 1.5}
    assert set(d["stats"]) <= FIGURE_KEYS


# -- refusals ----------------------------------------------------------------------------


def test_refusal_names_a_version_mismatch() -> None:
    reason = Registry().refusal(register(0, 4, version="0.9"), VERSION, b"a")
    assert reason is not None
    assert "0.9" in reason and VERSION in reason
    assert Registry().refusal(register(0, 4), VERSION, b"a") is None


@pytest.mark.parametrize(("start", "end"), [(0, 5), (3, 3), (3, 2)])
def test_refusal_names_a_range_outside_the_model(start: int, end: int) -> None:
    reason = Registry().refusal(register(start, end), VERSION)
    assert reason is not None
    assert f"{start}:{end}" in reason


def test_refusal_names_the_fingerprint_difference() -> None:
    reg = Registry()
    add(reg, "a", 0, 2)
    other = dict(SUMMARY, sliding_window=4, digest="d2")
    reason = reg.refusal(register(2, 4, digest="d2", summary=other), VERSION, b"b")
    assert reason is not None
    assert "sliding_window: 8 != 4" in reason
    # The digest itself differs by construction; naming it would be noise.
    assert "digest" not in reason
    # The same model is welcome.
    assert reg.refusal(register(2, 4), VERSION, b"b") is None


def test_refusal_falls_back_to_the_digest_without_a_summary() -> None:
    reg = Registry()
    add(reg, "a", 0, 2, summary={})
    reason = reg.refusal(register(2, 4, digest="d2", summary={}), VERSION, b"b")
    assert reason is not None
    assert "d2" in reason and "d1" in reason


def test_refusal_of_a_long_fingerprint_difference_fits_a_refused_message() -> None:
    reg = Registry()
    mine = {f"k{i:02}": "a" * 256 for i in range(64)}
    theirs = {f"k{i:02}": "b" * 256 for i in range(64)}
    add(reg, "a", 0, 4, summary=mine)
    reason = reg.refusal(register(0, 4, digest="d2", summary=theirs), VERSION, b"b")
    assert reason is not None
    assert len(reason) <= MAX_TEXT
    assert reason.startswith("model fingerprint differs")


def test_fingerprint_differences_lists_each_key() -> None:
    a = {"x": 1, "y": "same", "digest": "1"}
    b = {"x": 2, "y": "same", "z": True, "digest": "2"}
    assert fingerprint_differences(a, b) == ["x: 1 != 2", "z: None != True"]


def _bad_registers() -> dict[str, tuple[bytes, Register]]:
    ok = register(2, 4)
    bad: dict[str, tuple[bytes, Register]] = {
        "other digest": (b"x", register(2, 4, digest="d2")),
        "other num_layers": (b"x", register(2, 4, num_layers=8)),
        "other context": (b"x", register(2, 4, context=1024)),
        "range past the model": (b"x", register(2, 5)),
        "empty range": (b"x", register(2, 2)),
        "huge num_layers": (b"x", dataclasses.replace(ok, num_layers=2**40, end=2**40)),
        "negative start": (b"x", dataclasses.replace(ok, start=-1)),
        "bool capacity": (b"x", dataclasses.replace(ok, capacity=True)),
        "zero capacity": (b"x", dataclasses.replace(ok, capacity=0)),
        "float max_kv_tokens": (b"x", dataclasses.replace(ok, max_kv_tokens=1.5)),  # type: ignore[arg-type]
        "huge context": (b"x", dataclasses.replace(ok, context=2**40)),
        "str layers": (b"x", dataclasses.replace(ok, num_layers="4")),  # type: ignore[arg-type]
        "long version": (b"x", dataclasses.replace(ok, version="v" * 100)),
        "host with spaces": (b"x", dataclasses.replace(ok, host="a b")),
        "model not a map": (b"x", dataclasses.replace(ok, model=[1, 2])),  # type: ignore[arg-type]
        "binary routing id": (b"\xff\xfe", ok),
        "empty routing id": (b"", ok),
        "routing id with a space": (b"a b", ok),
    }
    return bad


@pytest.mark.parametrize("variant", sorted(_bad_registers()))
def test_a_refused_register_changes_nothing(variant: str) -> None:
    reg = Registry()
    add(reg, "a", 0, 2)
    add(reg, "b", 2, 4)
    before = snapshot(reg)
    identity, bad = _bad_registers()[variant]
    reason = reg.refusal(bad, VERSION, identity)
    assert reason, variant
    assert len(reason) <= MAX_TEXT
    assert snapshot(reg) == before
    with pytest.raises(RegistryError):
        reg.add(identity, bad)
    assert snapshot(reg) == before


def test_num_layers_past_the_cap_cannot_define_the_model() -> None:
    reg = Registry()
    huge = dataclasses.replace(register(0, 1), num_layers=2**40)
    reason = reg.refusal(huge, VERSION, b"a")
    assert reason is not None and str(MAX_LAYERS) in reason
    with pytest.raises(RegistryError):
        reg.add(b"a", huge)
    assert reg.num_layers == 0 and not reg.workers
    # The largest allowed model is fine.
    assert reg.refusal(register(0, 1, num_layers=MAX_LAYERS), VERSION, b"a") is None


# -- caps --------------------------------------------------------------------------------


def test_workers_past_the_cap_are_refused() -> None:
    reg = Registry(max_workers=3)
    for i in range(3):
        add(reg, f"w{i}", 0, 4)
    reason = reg.refusal(register(0, 4), VERSION, b"w3")
    assert reason is not None and "at most 3 workers" in reason
    with pytest.raises(RegistryError):
        add(reg, "w3", 0, 4)
    # Registering again under a known identity replaces, so it still fits.
    assert reg.refusal(register(0, 4), VERSION, b"w0") is None
    again = add(reg, "w0", 0, 4)
    assert reg.workers["w0"] is again and len(reg.workers) == 3
    # A leaving worker makes room.
    reg.remove(reg.workers["w1"])
    add(reg, "w3", 0, 4)
    assert sorted(reg.workers) == ["w0", "w2", "w3"]


def test_distinct_ranges_past_the_cap_are_refused() -> None:
    reg = Registry(max_ranges=2)
    add(reg, "a", 0, 2)
    add(reg, "b", 2, 4)
    reason = reg.refusal(register(0, 4), VERSION, b"c")
    assert reason is not None and "2 distinct layer ranges" in reason and "0:4" in reason
    # Another replica of a known range is no new range.
    add(reg, "a2", 0, 2)
    # A worker that moves from a range it alone serves frees that range first.
    assert reg.refusal(register(0, 4), VERSION, b"b") is None
    add(reg, "b", 0, 4)
    assert [p["layers"] for p in reg.pools()] == [[0, 2], [0, 4]]
    # But not when a replica keeps the old range.
    reason = reg.refusal(register(1, 4), VERSION, b"a")
    assert reason is not None and "distinct layer ranges" in reason


def test_settings_carry_the_caps_and_the_pinned_model() -> None:
    reg = Registry.from_settings(
        BrokerSettings(max_workers=7, max_ranges=3, model_fingerprint="d1")
    )
    assert (reg.max_workers, reg.max_ranges, reg.fingerprint) == (7, 3, "d1")
    defaults = Registry.from_settings(BrokerSettings())
    assert (defaults.max_workers, defaults.max_ranges, defaults.fingerprint) == (1024, 512, "")
    with pytest.raises(ValueError):
        Registry(max_workers=0)


# -- the model definition ----------------------------------------------------------------


def test_an_empty_registry_accepts_another_model() -> None:
    reg = Registry()
    a = add(reg, "a", 0, 2)
    b = add(reg, "b", 2, 4)
    other = dict(SUMMARY, num_layers=8, digest="d2")
    new = register(0, 8, num_layers=8, digest="d2", summary=other, context=2048)
    assert reg.refusal(new, VERSION, b"c") is not None

    reg.remove(a)
    assert reg.refusal(new, VERSION, b"c") is not None  # b still there
    reg.remove(b)
    assert reg.workers == {} and reg.by_identity == {}
    assert (reg.num_layers, reg.context, reg.fingerprint, reg.models) == (0, 0, "", {})
    assert reg.refusal(new, VERSION, b"c") is None

    reg.add(b"c", new)
    assert reg.num_layers == 8
    assert reg.context == 2048
    assert reg.fingerprint == "d2"
    assert ids(reg.find_route(10)) == ["c"]


def test_the_only_worker_may_register_again_with_another_model() -> None:
    reg = Registry()
    add(reg, "a", 0, 4)
    new = register(0, 8, num_layers=8, digest="d2")
    assert reg.refusal(new, VERSION, b"a") is None
    assert reg.refusal(new, VERSION, b"b") is not None
    reg.add(b"a", new)
    assert (reg.num_layers, reg.fingerprint, list(reg.workers)) == (8, "d2", ["a"])


def test_a_pinned_model_admits_only_its_digest_and_stays() -> None:
    reg = Registry(model_fingerprint="d1")
    reason = reg.refusal(register(0, 4, digest="d2"), VERSION, b"a")
    assert reason is not None and "d2" in reason and "d1" in reason
    a = add(reg, "a", 0, 4)
    reg.remove(a)
    assert reg.fingerprint == "d1"  # not forgotten with the last worker
    assert reg.num_layers == 0
    assert reg.refusal(register(0, 4, digest="d2"), VERSION, b"a") is not None
    add(reg, "a", 0, 8, num_layers=8)  # the digest is the model; its first worker says L
    assert reg.num_layers == 8


def test_remove_forgets_the_identity() -> None:
    reg = Registry()
    a = add(reg, "a", 0, 4)
    add(reg, "b", 0, 4)
    reg.remove(a)
    assert b"a" not in reg.by_identity
    assert "a" not in reg.workers
    assert reg.num_layers == 4  # b keeps the model defined
    reg.remove(a)  # twice is harmless
    assert reg.pools() == [{"layers": [0, 4], "workers": ["b"]}]


def test_a_stale_entry_does_not_remove_its_replacement() -> None:
    reg = Registry()
    old = add(reg, "a", 0, 4)
    new = add(reg, "a", 0, 4)  # registered again
    assert reg.workers["a"] is new and reg.by_identity[b"a"] is new
    reg.remove(old)
    assert reg.workers["a"] is new


# -- pools and route shapes --------------------------------------------------------------


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
    for wid, (a, b) in {"p0": (0, 15), "p1": (15, 30), "whole": (0, 30), "p0b": (0, 15)}.items():
        add(reg, wid, a, b, num_layers=30)
    assert sorted(reg.route_shapes()) == [["0:15", "15:30"], ["0:30"]]
    reg.remove(reg.workers["p1"])
    assert reg.route_shapes() == [["0:30"]]
    assert Registry().route_shapes() == []


def test_route_shapes_stop_at_the_limit() -> None:
    reg = Registry()
    for i in range(4):  # 0:1 or 0:2, 1:2 ... : 5 chains over 4 layers
        add(reg, f"a{i}", i, i + 1)
        if i + 2 <= 4:
            add(reg, f"b{i}", i, i + 2)
    assert len(reg.route_shapes()) == 5
    assert len(reg.route_shapes(limit=3)) == 3
    assert reg.route_shapes(limit=0) == []
    assert reg.route_shapes()[0] == ["0:1", "1:2", "2:3", "3:4"]


# -- scale -------------------------------------------------------------------------------


class OverBudget(AssertionError):
    """Raised inside the work once it has run more lines than allowed."""


def steps(work: Callable[[], object], budget: int) -> int:
    """Lines of Python that ``work`` runs: its cost in steps, the same on any machine and
    under any load (seconds are not). Past ``budget`` the work is stopped with OverBudget,
    so a search that grows exponentially fails at once instead of running for ever."""
    count = 0

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal count
        if event == "line":
            count += 1
            if count > budget:
                raise OverBudget(f"more than {budget} lines of Python")
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        work()
    finally:
        sys.settrace(previous)
    return count


# Lines of Python per worker that any one of the registry's answers to STATUS may take:
# linear in the workers (about 40 each today), never in the chains their ranges make
# (Fibonacci-many in the tests below).
STEPS_PER_WORKER = 200


def assert_fast(reg: Registry) -> None:
    """Everything the broker's STATUS asks of the registry, each in at most
    STEPS_PER_WORKER lines of Python per worker."""
    now = time.monotonic()
    budget = STEPS_PER_WORKER * len(reg.workers)
    for work in (
        lambda: reg.find_route(1),
        lambda: reg.find_route(1, ignore_room=True),
        reg.route_shapes,
        reg.uncovered,
        reg.pools,
        lambda: [w.describe(now) for w in reg.workers.values()],
    ):
        assert steps(work, budget) <= budget


def test_300_ranges_that_never_reach_the_end_stay_fast() -> None:
    # Ranges of 1 and 2 layers from every boundary below 150 of 200 layers: far more
    # partial chains than could ever be tried, none reaching layer 200.
    reg = Registry()
    for i in range(150):
        add(reg, f"a{i:03}", i, i + 1, num_layers=200)
        add(reg, f"b{i:03}", i, i + 2, num_layers=200)
    assert len(reg.workers) == 300
    assert reg.find_route(1) is None
    assert reg.route_shapes() == []
    assert reg.uncovered() == "151:200"
    assert_fast(reg)


def test_300_ranges_with_countless_complete_chains_stay_fast() -> None:
    reg = Registry()
    for i in range(150):
        add(reg, f"a{i:03}", i, i + 1, num_layers=151)
        add(reg, f"b{i:03}", i, i + 2, num_layers=151)
    reg.reserve([reg.workers["a000"]], "s", 1)  # 0:1 is busy: the route starts 0:2
    route = reg.find_route(1)
    assert route is not None
    assert route[0].worker_id == "b000"
    # Fewest hops: two-layer ranges all the way, one single layer to end on 151.
    assert len(route) == 76
    assert [route[0].start, route[-1].end] == [0, 151]
    assert all(x.end == y.start for x, y in itertools.pairwise(route))
    shapes = reg.route_shapes()
    assert len(shapes) == 32
    assert all(s[0].startswith("0:") and s[-1].endswith(":151") for s in shapes)
    assert_fast(reg)


def test_the_caps_at_their_defaults_stay_fast() -> None:
    # 1024 workers over 512 ranges, two replicas of each: one or two layers from every
    # boundary, and the whole model.
    reg = Registry()
    ranges = [(i, i + 1) for i in range(256)] + [(i, i + 2) for i in range(255)] + [(0, 256)]
    for n, (a, b) in enumerate(ranges):
        for r in range(2):
            add(reg, f"w{n:03}-{r}", a, b, num_layers=256)
    assert len(reg.workers) == 1024 and len(reg.pools()) == 512
    assert reg.refusal(register(0, 256, num_layers=256), VERSION, b"one-more") is not None
    route = reg.find_route(1)
    assert ids(route) == ["w511-0"]  # the whole model in one hop
    assert_fast(reg)


def test_the_status_of_500_workers_fits_one_reply() -> None:
    reg = Registry()
    for i in range(500):
        w = reg.add(
            f"w{i:03}-{'x' * 240}".encode(),
            dataclasses.replace(register(i % 250, i % 250 + 1, num_layers=250), host="h" * 255),
        )
        w.figures = {k: 2**62 for k in FIGURE_KEYS}  # every statistic, each as long as it gets
    now = time.monotonic()
    status = {
        "workers": [w.describe(now) for w in reg.workers.values()],
        "pools": reg.pools(),
        "routes": reg.route_shapes(),
        "uncovered": reg.uncovered(),
    }
    reply = decode(encode(StatusReply.of(status)))
    assert isinstance(reply, StatusReply)
    assert reply.body.array.nbytes < MAX_STATUS_BYTES
    back = reply.status()
    assert len(back["workers"]) == 500
    assert back["workers"][0]["info"]["host"] == "h" * 255
    assert len(back["routes"]) == 1


def test_a_worker_with_another_prefill_chunk_is_refused() -> None:
    reg = Registry()
    reg.add(b"a", dataclasses.replace(register(0, 2), prefill_chunk=2048))
    other = dataclasses.replace(register(2, 4), prefill_chunk=512)
    reason = reg.refusal(other, VERSION, b"b")
    assert reason is not None and "prefill_chunk is 512, the cluster's is 2048" in reason
    assert reg.refusal(dataclasses.replace(other, prefill_chunk=2048), VERSION, b"b") is None


# -- many models -------------------------------------------------------------------------


def text_worker(reg: Registry, wid: str, served: str = "remote", **kw: Any) -> WorkerEntry:
    return add(reg, wid, 0, 1, num_layers=1, served=served, text_model=True, digest="r", **kw)


def test_models_are_served_side_by_side_each_by_its_name() -> None:
    reg = Registry()
    add(reg, "a", 0, 2, served="tiny")
    add(reg, "b", 2, 4, served="tiny")
    text_worker(reg, "r1")
    text_worker(reg, "r2")
    assert sorted(reg.models) == ["remote", "tiny"]
    assert ids(reg.find_route(10, model="tiny")) == ["a", "b"]
    assert ids(reg.find_route(10, model="remote")) == ["r1"]
    assert reg.find_route(10, model="nope") is None
    # Unnamed is the only model; with two there is none to pick.
    assert reg.find_route(10) is None and reg.resolve() is None
    assert reg.models["remote"].describe()["complete_route"]
    assert reg.uncovered("tiny") == "" and reg.pools("remote")[0]["workers"] == ["r1", "r2"]


def test_a_model_of_another_digest_under_another_name_is_taken() -> None:
    reg = Registry()
    add(reg, "a", 0, 4, served="one")
    other = register(0, 8, num_layers=8, digest="d2", served="two", context=2048)
    assert reg.refusal(other, VERSION, b"b") is None
    reg.add(b"b", other)
    assert reg.models["two"].num_layers == 8 and reg.models["one"].num_layers == 4
    # The same name with another digest is still refused, naming the model.
    clash = register(0, 8, num_layers=8, digest="d3", served="two", context=2048)
    reason = reg.refusal(clash, VERSION, b"c")
    assert reason is not None and "'two'" in reason


def test_a_text_worker_cannot_join_a_model_of_layers_nor_the_reverse() -> None:
    reg = Registry()
    add(reg, "a", 0, 1, num_layers=1, served="m")
    reason = reg.refusal(register(0, 1, num_layers=1, served="m", text_model=True), VERSION, b"t")
    assert reason is not None and "other kind" in reason
    text_worker(reg, "t", served="r")
    reason = reg.refusal(register(0, 1, num_layers=1, digest="r", served="r"), VERSION, b"u")
    assert reason is not None and "remote (text) model" in reason
    # A text model is one layer long: anything else is refused.
    bad = register(0, 2, num_layers=2, served="x", text_model=True)
    assert "0:1 of 1" in (reg.refusal(bad, VERSION, b"v") or "")


def test_the_number_of_models_is_bounded_and_a_model_leaves_with_its_last_worker() -> None:
    reg = Registry()
    for i in range(MAX_MODELS):
        text_worker(reg, f"w{i}", served=f"m{i}")
    reason = reg.refusal(register(0, 4, served="one-more"), VERSION, b"x")
    assert reason is not None and f"at most {MAX_MODELS} models" in reason
    # A worker moving to a new model leaves its old one empty: that one is not counted.
    assert reg.refusal(register(0, 4, served="moved"), VERSION, b"w0") is None
    reg.remove(reg.workers["w1"])
    assert "m1" not in reg.models
    assert reg.refusal(register(0, 4, served="one-more"), VERSION, b"x") is None


def test_the_pinned_digest_binds_models_of_layers_only() -> None:
    reg = Registry(model_fingerprint="d1")
    assert reg.refusal(register(0, 4, digest="d2", served="b"), VERSION, b"a") is not None
    assert text_worker(reg, "t").served == "remote"
