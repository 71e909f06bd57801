"""Where the broker places a worker started with --layers auto (broker/placement.py): the
first layers no pool covers, then the pool with the least throughput for its load, within
the worker's memory; holds keep workers starting together apart."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from zmqllm.broker.placement import Placements
from zmqllm.broker.registry import Registry
from zmqllm.bus.messages import Place, Placed, Refused, Register
from zmqllm.config.weighted_split import Figures
from zmqllm.version import __version__

GIB = 1 << 30
FIG = Figures(
    ms_1=0.5,
    ms_16=2.0,
    memory_bytes=64 * GIB,
    layer_bytes=100 << 20,
    first_bytes=200 << 20,
    last_bytes=200 << 20,
    runtime_bytes=1 << 30,
)


def place(figures: Figures = FIG, hold: bool = True, num_layers: int = 30) -> Place:
    return Place(served="m", num_layers=num_layers, figures=figures.to_dict(), hold=hold)


def join(reg: Registry, name: str, start: int, end: int, measured: dict[str, Any]) -> None:
    msg = Register(
        start=start,
        end=end,
        num_layers=30,
        capacity=8,
        max_kv_tokens=1000,
        context=512,
        version=__version__,
        fingerprint="d",
        served="m",
        measured=measured,
    )
    reg.add(name.encode(), msg)


def test_a_model_no_worker_serves_is_placed_whole_or_as_much_as_fits() -> None:
    got = Placements().place(Registry(), b"p1", place())
    assert isinstance(got, Placed) and (got.start, got.end) == (0, 30)
    small = replace(FIG, memory_bytes=(1 << 30) + (200 << 20) + 10 * (100 << 20))
    got = Placements().place(Registry(), b"p1", place(small))
    assert isinstance(got, Placed) and (got.start, got.end) == (0, 10)


def test_the_first_uncovered_range_comes_first_then_the_weakest_pool() -> None:
    reg, places = Registry(), Placements()
    join(reg, "w-a", 0, 15, FIG.to_dict())
    got = places.place(reg, b"p1", place())
    assert (got.start, got.end) == (15, 30) and "served by no worker" in got.why
    join(reg, "w-b", 15, 30, FIG.to_dict())
    places.registered(b"p1", "m", 15, 30)
    # Both pools covered: 15:30 also runs the head (cost 8 layers) but this model's is 0;
    # a slow worker on 0:15 makes it the pool with less throughput.
    reg2 = Registry()
    join(reg2, "w-a", 0, 15, replace(FIG, ms_16=8.0).to_dict())
    join(reg2, "w-b", 15, 30, FIG.to_dict())
    got = places.place(reg2, b"p2", place())
    assert (got.start, got.end) == (0, 15) and "least throughput" in got.why
    # ... unless it carries no load while the other one is busy.
    for i in range(5):
        reg2.workers["w-b"].sessions[i] = 1
    assert (places.place(reg2, b"p3", place(hold=False)).start) == 15


def test_a_worker_that_did_not_measure_counts_as_one_like_the_asker() -> None:
    reg = Registry()
    join(reg, "w-a", 0, 15, {})
    join(reg, "w-b", 15, 30, {})
    join(reg, "w-c", 15, 30, {})
    got = Placements().place(reg, b"p1", place(hold=False))
    assert (got.start, got.end) == (0, 15)  # fewer workers: less throughput


def test_holds_keep_workers_starting_together_apart_until_they_register() -> None:
    reg, places = Registry(), Placements(hold_s=60.0)
    half = replace(FIG, memory_bytes=(1 << 30) + (200 << 20) + 15 * (100 << 20))
    first = places.place(reg, b"p1", place(half), now=0.0)
    second = places.place(reg, b"p2", place(half), now=1.0)
    assert [(first.start, first.end), (second.start, second.end)] == [(0, 15), (15, 30)]
    # A look (no hold) reserves nothing; a hold lapses after hold_s.
    places.place(reg, b"p3", place(half, hold=False), now=2.0)
    assert set(places.holds) == {b"p1", b"p2"}
    places.expire(60.5)
    assert set(places.holds) == {b"p2"}
    join(reg, "w-x", 15, 30, FIG.to_dict())
    places.registered(b"w-x", "m", 15, 30)  # another routing id: the oldest hold of it
    assert places.holds == {}


def test_refusals_name_why() -> None:
    reg = Registry()
    tiny = replace(FIG, memory_bytes=1 << 20)
    got = Placements().place(reg, b"p1", place(tiny))
    assert isinstance(got, Refused) and "at most 0 layers" in got.reason
    bad = Place(served="m", num_layers=30, figures={"ms_1": 1.0})
    got = Placements().place(reg, b"p1", bad)
    assert isinstance(got, Refused) and "lack" in got.reason
    join(reg, "w-a", 0, 15, {})
    got = Placements().place(reg, b"p1", place(num_layers=32))
    assert isinstance(got, Refused) and "has 30 layers here" in got.reason


def test_a_scoped_key_gets_its_range_and_the_table_is_bounded() -> None:
    got = Placements().place(Registry(), b"p1", place(), claims={"layers": "10:20"})
    assert (got.start, got.end) == (10, 20)
    places = Placements(max_holds=2)
    for i in range(5):
        places.place(Registry(), f"p{i}".encode(), place())
    assert len(places.holds) == 2
