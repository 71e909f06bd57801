"""A worker started with --layers auto asks a real broker loop (in a thread, over TCP on
loopback) which layers to load (worker/placement_client.py): the round trip it measured
travels with its figures, a held answer keeps the next worker off the same gap, a
worker whose memory holds no layer is refused (exit 3) and no broker at all is a
timeout (exit 1). The probe itself (self_measure.py) runs on the test model's shape."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import zmq

from zmqllm.broker.loop import Broker
from zmqllm.config.loading import with_overrides
from zmqllm.config.settings import BrokerSettings, Config
from zmqllm.config.weighted_split import Figures

pytestmark = pytest.mark.torch

torch = pytest.importorskip("torch")

from zmqllm.worker.broker_link import WorkerRefused  # noqa: E402
from zmqllm.worker.placement_client import ask_placement, placement_failed  # noqa: E402
from zmqllm.worker.self_measure import measure  # noqa: E402

GIB = 1 << 30
FIG = Figures(0.5, 2.0, 64 * GIB, 100 << 20, 200 << 20, 200 << 20, 1 << 30, 0.0)


@pytest.fixture
def broker() -> Iterator[str]:
    ctx = zmq.Context()
    settings = BrokerSettings(frontend="tcp://127.0.0.1:0", backend="tcp://127.0.0.1:0")
    b = Broker(settings, context=ctx)
    thread = threading.Thread(target=b.run, name="broker", daemon=True)
    thread.start()
    try:
        yield b.endpoints[1]
    finally:
        b.stop()
        thread.join(timeout=10)
        assert not thread.is_alive()
        ctx.term()


def test_placed_with_the_round_trip_and_held_apart(broker: str) -> None:
    half = replace(FIG, memory_bytes=(1 << 30) + (200 << 20) + 15 * (100 << 20))
    first, measured = ask_placement(broker, None, "m", 30, half, timeout=10)
    assert (first.start, first.end) == (0, 15) and "served by no worker" in first.why
    assert measured.rtt_ms > 0 and replace(measured, rtt_ms=0.0) == half
    second, _ = ask_placement(broker, None, "m", 30, half, timeout=10)
    assert (second.start, second.end) == (15, 30)  # the first one's range is held


def test_refused_and_unanswered_are_told_with_their_exit_status(
    broker: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(WorkerRefused, match="at most 0 layers") as refused:
        ask_placement(broker, None, "m", 30, replace(FIG, memory_bytes=1 << 20), timeout=10)
    assert placement_failed(refused.value) == 3
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as silent:
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        with pytest.raises(TimeoutError) as unanswered:
            ask_placement(f"tcp://127.0.0.1:{port}", None, "m", 30, FIG, timeout=0.3)
        silent.close(linger=0)
    assert placement_failed(unanswered.value) == 1
    err = capsys.readouterr().err
    assert "refused by the broker" in err and "no answer to --layers auto" in err


def test_the_probe_measures_the_models_shape(tiny_model_dir: Path) -> None:
    cfg = with_overrides(Config(), "model", {"path": str(tiny_model_dir)})
    cfg = with_overrides(cfg, "worker", {"threads": 1, "max_memory_mb": 2048})
    f = measure(cfg, tiny_model_dir)
    assert f.ms_1 > 0 and f.ms_16 > 0
    assert f.memory_bytes == 2048 << 20 and f.layer_bytes > 0 and f.runtime_bytes > 0
    assert f.last_bytes > 0 and f.head_cost > 0
    assert f.head_ms_1 > 0 and f.head_ms_16 > 0  # the head timed on its own
