"""Out of memory is "full" or one session's failure, never everyone's (issue 29, item 2):
a KV cache the device will not allocate is refused as FULL, with a log line naming the
bytes; a forward out of memory is run again in halves, so only a session that cannot run
even alone fails and the others' tokens are exactly what they would have been."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from structlog.testing import capture_logs  # noqa: E402

from zmqllm.bus.sampling_params import SamplingParams  # noqa: E402
from zmqllm.engine import cache as cache_module  # noqa: E402
from zmqllm.engine.cache import CacheFullError, KVAllocationFailed  # noqa: E402
from zmqllm.engine.generator import load_shard  # noqa: E402
from zmqllm.engine.stage import Stage  # noqa: E402

pytestmark = pytest.mark.torch

PROMPTS = {f"s{i}": np.arange(3 + i, 9 + 2 * i, dtype=np.int32) for i in range(4)}


def open_all(stage: Stage) -> None:
    for sid, prompt in PROMPTS.items():
        stage.open(sid, f"req-{sid}", 32, 6, SamplingParams(), frozenset(), prompt)


def tokens(stage: Stage, failed: list[tuple[str, str]], steps: int = 6) -> dict[str, list[int]]:
    """Run the whole-model stage ``steps`` times, feeding each token back; a session the
    stage fails is closed (as the worker does) and noted in ``failed``."""
    out: dict[str, list[int]] = {sid: [] for sid in PROMPTS}
    for _ in range(steps):
        for o in stage.run():
            out[o.session].append(int(o.token))
            if o.finish is None:
                stage.step(o.session, o.step + 1, int(o.token))
        for key, _, why in stage.failed:
            failed.append((key, why))
            stage.close(key)
        stage.failed.clear()
    return out


def test_a_kv_cache_the_device_refuses_is_full_and_logged(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stage = Stage(load_shard(tiny_model_dir, 0, 4))
    stage.model = "tiny"

    def no_memory(*args: Any, **kwargs: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    monkeypatch.setattr(cache_module, "KVCache", no_memory)
    with capture_logs() as lines, pytest.raises(CacheFullError) as refused:
        stage.open("s", "req-kv", 64, 4, SamplingParams(), frozenset(), PROMPTS["s0"])
    assert isinstance(refused.value, KVAllocationFailed)
    assert refused.value.bytes_asked == 64 * stage.shard.args.kv_bytes_per_token(4, 4)
    assert "could not be allocated" in str(refused.value)
    assert "s" not in stage.sessions and stage.pool.reserved == 0
    (event,) = [x for x in lines if x["event"].startswith("KV cache allocation failed")]
    assert event["request_id"] == "req-kv" and event["model"] == "tiny"
    assert event["bytes_asked"] == refused.value.bytes_asked and "bytes_free" in event
    assert "batch_size" in event


def test_a_forward_out_of_memory_fails_only_the_session_that_cannot_run(
    tiny_model_dir: Path,
) -> None:
    clean = Stage(load_shard(tiny_model_dir, 0, 4))
    open_all(clean)
    expected = tokens(clean, [])

    stage = Stage(load_shard(tiny_model_dir, 0, 4))
    open_all(stage)
    shard = stage.shard
    hog = stage.sessions["s2"].cache  # any forward holding this session runs out
    forward = shard.__class__.__call__
    calls: list[int] = []

    def tight(x: Any, segments: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(segments))
        if any(seg.cache is hog for seg in segments):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return forward(shard, x, segments, *args, **kwargs)

    stage.runner.shard = _Calling(shard, tight)
    failed: list[tuple[str, str]] = []
    with capture_logs() as lines:
        got = tokens(stage, failed)
    assert got["s2"] == []  # failed on its first forward, alone
    assert [key for key, why in failed] == ["s2"] and "out of memory" in failed[0][1]
    for sid in ("s0", "s1", "s3"):
        assert got[sid] == expected[sid], sid
    # 4 rows fail; halves: s0+s1 run, s2+s3 fail; alone: s2 fails, s3 runs; then 3 rows.
    assert calls[:6] == [4, 2, 2, 1, 1, 3]
    oom = [x for x in lines if x["event"] == "forward out of memory"]
    assert oom[0]["batch_size"] == 4 and oom[0]["bytes_asked"] == 20 << 20
    assert set(oom[0]["request_ids"]) == {f"req-{sid}" for sid in PROMPTS}


class _Calling:
    """A shard whose call is ``call``, everything else the shard's."""

    def __init__(self, shard: Any, call: Any) -> None:
        self._shard, self._call = shard, call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shard, name)
