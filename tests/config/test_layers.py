"""Layer specs: ranges, stages, the split of equal cost (no torch needed)."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest

from zmqllm.config.layers import check_layer_spec, parse_layers, split_layers
from zmqllm.config.settings import ConfigError
from zmqllm.models.model_args import ModelArgs


@pytest.mark.parametrize(
    ("spec", "num_layers", "expected"),
    [
        ("0:15", 30, (0, 15)),
        ("15:30", 30, (15, 30)),
        ("15:", 30, (15, 30)),
        (":15", 30, (0, 15)),
        (":", 30, (0, 30)),
        (" 3 : 7 ", 30, (3, 7)),
        ("", 30, (0, 30)),
        ("1/2", 30, (0, 15)),
        ("2/2", 30, (15, 30)),
        ("1/1", 30, (0, 30)),
        ("1/4", 30, (0, 8)),
        ("4/4", 30, (23, 30)),
        ("3/3", 3, (2, 3)),
    ],
)
def test_parse_layers(spec: str, num_layers: int, expected: tuple[int, int]) -> None:
    assert parse_layers(spec, num_layers) == expected


def test_stages_of_four_tile_thirty_layers() -> None:
    ranges = [parse_layers(f"{k}/4", 30) for k in range(1, 5)]
    assert [end - start for start, end in ranges] == [8, 8, 7, 7]
    assert ranges[0][0] == 0 and ranges[-1][1] == 30
    assert all(a[1] == b[0] for a, b in pairwise(ranges))


@pytest.mark.parametrize(("num_layers", "stages"), [(30, 1), (30, 7), (32, 4), (5, 5), (1, 1)])
def test_split_layers_tiles(num_layers: int, stages: int) -> None:
    ranges = split_layers(num_layers, stages)
    assert len(ranges) == stages
    covered = [layer for start, end in ranges for layer in range(start, end)]
    assert covered == list(range(num_layers))
    sizes = [end - start for start, end in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_default_model_head_counts_as_eight_layers(tmp_path: Path) -> None:
    """The default model's tied 49,152 x 576 output layer is the work of 8 of its
    layers: "1/2" and "2/2" take 19 and 11 layers, both 19 layers' worth."""
    cfg = {
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "tie_word_embeddings": True,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = ModelArgs.from_dir(tmp_path)
    assert args.head_cost == 8.0
    assert [parse_layers(f"{k}/2", 30, args.head_cost) for k in (1, 2)] == [(0, 19), (19, 30)]


@pytest.mark.parametrize(
    ("num_layers", "stages", "head_cost", "sizes"),
    [
        (30, 4, 8.0, [10, 9, 9, 2]),
        (30, 3, 8.0, [13, 12, 5]),
        (32, 2, 0.5, [16, 16]),  # Mistral-7B: a 32,000 x 4,096 head is half a layer
        (4, 4, 50.0, [1, 1, 1, 1]),  # every stage keeps a layer, however big the head
        (30, 1, 8.0, [30]),
        (3, 2, 1.0, [2, 1]),
    ],
)
def test_split_with_a_head(
    num_layers: int, stages: int, head_cost: float, sizes: list[int]
) -> None:
    ranges = split_layers(num_layers, stages, head_cost)
    assert [end - start for start, end in ranges] == sizes
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in pairwise(ranges))


@pytest.mark.parametrize(
    ("spec", "num_layers"),
    [
        ("15:15", 30),
        ("20:10", 30),
        ("0:31", 30),
        ("30:", 30),
        ("3/2", 30),
        ("0/2", 30),
        ("1/0", 30),
        ("5/5", 4),
        ("-1:5", 30),
        ("1-5", 30),
        ("a:b", 30),
        ("1/2/3", 30),
        ("half", 30),
    ],
)
def test_parse_layers_rejects(spec: str, num_layers: int) -> None:
    with pytest.raises(ConfigError) as info:
        parse_layers(spec, num_layers)
    assert repr(spec) in str(info.value)


def test_split_layers_rejects() -> None:
    with pytest.raises(ConfigError):
        split_layers(3, 4)
    with pytest.raises(ConfigError):
        split_layers(3, 0)
    with pytest.raises(ConfigError):
        split_layers(0, 1)


def test_check_layer_spec_needs_no_model() -> None:
    for spec in ("", "1/2", "4/4", "0:15", "15:", ":", "100:200"):
        check_layer_spec(spec)
    for spec in ("3/2", "0/2", "5:1", "half", "1-5"):
        with pytest.raises(ConfigError, match=repr(spec)):
            check_layer_spec(spec)
