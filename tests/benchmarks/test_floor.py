"""benchmarks/floor.py: the floor a serving figure is read against, worked by hand on a
small geometry, and measured on this machine."""

from __future__ import annotations

import pytest

from benchmarks import floor
from zmqllm.models.model_args import ModelArgs

ARGS = ModelArgs(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
    sliding_window=None,
    tie_word_embeddings=False,
)
# One layer's products: q and o 64x64 each, k and v 64x32 each, gate, up, down 64x128 each.
LAYER = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128
HEAD = 1000 * 64


def test_a_row_does_two_flops_a_weight_and_attends_to_its_context() -> None:
    assert ARGS.layer_params == LAYER
    assert floor.row_flops(ARGS, 0) == 2 * (2 * LAYER + HEAD)
    # q.k and the weighted sum of v: 2 flops each per head dimension, cached token, layer.
    assert floor.row_flops(ARGS, 10) - floor.row_flops(ARGS, 0) == 4 * 2 * 4 * 16 * 10


def test_a_step_reads_each_weight_once_in_the_runtime_s_format() -> None:
    # float32: 4 bytes a weight, head included; the cache in float32.
    step = floor.decode_step(ARGS, "float32", streams=3, context=5)
    kv = 3 * 5 * 2 * 2 * 2 * 16 * 4  # streams x tokens x (k, v) x layers x kv heads x dim x 4
    assert step.bytes_read == 4 * (2 * LAYER + HEAD) + kv
    assert step.flops == 3 * floor.row_flops(ARGS, 5)
    # int4 layers (0.75 bytes a weight with their scales) under an int8 head (1.25).
    assert floor.weight_bytes_read(ARGS, "int4") == 0.75 * 2 * LAYER + 1.25 * HEAD
    # bfloat16 holds its cache in 16 bits too.
    bf16 = floor.decode_step(ARGS, "bfloat16", streams=3, context=5)
    assert bf16.bytes_read == 2 * (2 * LAYER + HEAD) + kv // 2


def test_the_floor_is_bound_by_reading_at_one_stream_and_by_the_units_at_many() -> None:
    m = floor.Machine(read_bytes_per_s=1e9, flops_per_s={"float32": 1e9, "bfloat16": 4e9})
    assert m.best_rate == ("bfloat16", 4e9)
    one = floor.decode_step(ARGS, "float32", 1, 0)
    assert floor.decode_floor(m, ARGS, "float32", 1, 0) == pytest.approx(1e9 / one.bytes_read)
    many = floor.decode_step(ARGS, "float32", 4096, 0)
    assert many.flops / 4e9 > many.bytes_read / 1e9
    assert floor.decode_floor(m, ARGS, "float32", 4096, 0) == pytest.approx(
        4e9 / floor.row_flops(ARGS, 0)
    )
    # A prompt's tokens share their reads: the units alone bound it, each token over half
    # the prompt on average.
    head = 2.0 * ARGS.vocab_size * ARGS.hidden_size  # only the last token's logits
    want = 4e9 / (floor.row_flops(ARGS, 50) - head + head / 100)
    assert floor.prefill_floor(m, ARGS, 100) == pytest.approx(want)


def test_the_figures_a_serving_table_shows() -> None:
    m = floor.Machine(1e9, {"float32": 2e9})
    f = floor.floors(m, ARGS, ("int4", "bfloat16"), [1, 16], context=20, prefill_tokens=64)
    assert set(f["decode_tokens_per_s"]) == {"int4", "bfloat16"}
    int4, bf16 = f["decode_tokens_per_s"]["int4"], f["decode_tokens_per_s"]["bfloat16"]
    assert int4[1] > bf16[1]  # fewer bytes a step: a higher floor where reading bounds it
    assert int4[16] >= int4[1]
    assert f["machine"] == {
        "read_gb_s": 1.0,
        "gflops": {"float32": 2.0},
        "rate_rows": floor.RATE_ROWS,
    }
    text = floor.describe(f)
    assert "read 1.0 GB/s" in text and "int4 weights" in text and "prefill tok/s" in text


@pytest.mark.torch
def test_this_machine_is_measured() -> None:
    pytest.importorskip("torch")
    m = floor.measure(ARGS, threads=1, dtypes=("float32",))
    assert m.read_bytes_per_s > 1e8  # any machine reads faster than 100 MB/s
    assert m.flops_per_s["float32"] > 1e8
    assert floor.decode_floor(m, ARGS, "int4", 16, 32) > 0
