"""The weighted split: each stage's share of the compute follows its measured rate, memory
is a hard limit, and the head's cost counts on the last stage."""

from __future__ import annotations

import pytest

from zmqllm.config.layers import check_layer_spec, parse_layers, split_layers
from zmqllm.config.settings import ConfigError
from zmqllm.config.weighted_split import Figures, expected, fits, max_layers, weighted_split

GIB = 1 << 30


def figures(ms_16: float = 1.0, memory: int = 64 * GIB, head: float = 0.0, **kw: float) -> Figures:
    return Figures(
        ms_1=kw.get("ms_1", ms_16 / 4),
        ms_16=ms_16,
        memory_bytes=memory,
        layer_bytes=int(kw.get("layer", 100 << 20)),
        first_bytes=int(kw.get("first", 200 << 20)),
        last_bytes=int(kw.get("last", 200 << 20)),
        runtime_bytes=int(kw.get("runtime", 1 << 30)),
        head_cost=head,
        rtt_ms=kw.get("rtt", 0.0),
        head_ms_1=kw.get("head_1", 0.0),
        head_ms_16=kw.get("head_16", 0.0),
    )


def test_equal_machines_split_as_the_equal_cost_split() -> None:
    for layers, k, head in [(30, 2, 8.0), (30, 3, 0.0), (32, 4, 1.0), (4, 2, 0.8)]:
        got = weighted_split(layers, [figures(head=head)] * k)
        want = split_layers(layers, k, head)
        slowest = max(b - a + (head if b == layers else 0) for a, b in got)
        assert slowest <= max(b - a + (head if b == layers else 0) for a, b in want)


def test_a_machine_half_as_fast_gets_about_half_the_layers() -> None:
    split = weighted_split(30, [figures(1.0), figures(2.0)])
    assert split == [(0, 20), (20, 30)]
    # The head counts on the last stage: a fast last stage takes it and fewer layers.
    split = weighted_split(30, [figures(2.0), figures(1.0, head=8.0)])
    (a, b), (c, d) = split
    assert (b - a) * 2.0 == pytest.approx((d - c + 8.0) * 1.0, abs=2.0)


def test_memory_is_a_hard_limit() -> None:
    small = figures(0.1, memory=(1 << 30) + 5 * (100 << 20) + (200 << 20))  # 5 layers + embedding
    split = weighted_split(30, [small, figures(10.0)])
    assert split == [(0, 5), (5, 30)]
    assert fits(small, 0, 5, 30) and not fits(small, 0, 6, 30)
    assert max_layers(small, 0, 30) == 5 and max_layers(small, 10, 30) == 7
    with pytest.raises(ConfigError, match="fits every stage's memory"):
        weighted_split(30, [small, small])


def test_expected_figures_compare_the_splits() -> None:
    fast, slow = figures(1.0, rtt=0.5), figures(2.0, rtt=0.5)
    equal = expected([(0, 15), (15, 30)], [fast, slow], 30)
    weighted = expected([(0, 20), (20, 30)], [fast, slow], 30)
    assert equal.bottleneck_ms == 30.0 and weighted.bottleneck_ms == 20.0
    assert weighted.tokens_per_s / equal.tokens_per_s == pytest.approx(1.5)
    assert equal.ms_per_token == pytest.approx(15 * 0.25 + 15 * 0.5 + 1.0)


def test_a_measured_head_replaces_the_weights_estimate() -> None:
    # Not measured (figures of an older worker): head_cost layers at each row count.
    assert figures(2.0, head=8.0).stage_ms(10, last=True) == pytest.approx(2.0 * 18)
    assert figures(2.0, head=8.0).stage_ms(10, last=True, rows=1) == pytest.approx(0.5 * 18)
    # Measured: the 16-row head of 4 layers' time moves 2 layers from stage 0 to the last
    # stage of an equal-speed pair (19:30 by weights, 17:30 with the head as measured).
    measured = figures(2.0, head=8.0, head_1=4.0, head_16=8.0)
    assert measured.stage_ms(10, last=True) == pytest.approx(2.0 * 10 + 8.0)
    assert measured.stage_ms(10, last=True, rows=1) == pytest.approx(0.5 * 10 + 4.0)
    assert measured.stage_ms(10, last=False) == pytest.approx(2.0 * 10)
    assert weighted_split(30, [figures(2.0, head=8.0)] * 2) == [(0, 19), (19, 30)]
    assert weighted_split(30, [measured] * 2) == [(0, 17), (17, 30)]
    e = expected([(0, 17), (17, 30)], [measured] * 2, 30)
    assert e.bottleneck_ms == pytest.approx(34.0)
    assert e.ms_per_token == pytest.approx(0.5 * 30 + 4.0)


def test_figures_from_json_are_checked() -> None:
    raw = figures().to_dict()
    assert Figures.from_dict({**raw, "num_layers": 30}) == figures()
    for bad in ({"ms_16": 0}, {"ms_1": -1.0}, {"memory_bytes": "lots"}, {"ms_1": float("nan")}):
        with pytest.raises(ConfigError):
            Figures.from_dict({**raw, **bad})
    # An older worker's figures have no head times: estimated from head_cost then.
    older = {k: v for k, v in raw.items() if not k.startswith("head_ms")}
    assert Figures.from_dict(older).head_ms_16 == 0.0
    with pytest.raises(ConfigError):
        Figures.from_dict({**raw, "head_ms_16": -1.0})
    with pytest.raises(ConfigError, match="lack 'layer_bytes'"):
        Figures.from_dict({k: v for k, v in raw.items() if k != "layer_bytes"})


def test_auto_is_a_layer_spec_resolved_before_loading() -> None:
    check_layer_spec("auto")
    with pytest.raises(ConfigError, match="resolved from measured figures"):
        parse_layers("auto", 30)
