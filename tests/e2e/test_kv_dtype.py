"""Workers keeping bfloat16 KV caches (`--kv-dtype bfloat16`) in a real 2-stage cluster:
each stage says so when it loads; a chat's text is the engine's with the same caches in
one process, token for token (a deterministic prediction: on the tiny random model the
rounding of keys and values breaks near-ties, so HF float32's text is asserted on the
default model instead, tests/engine/test_kv_dtype_default_model.py); chats decoding
together (the compiled batched attention over bfloat16 caches) all complete."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from testbed.cluster import Cluster
from tests.e2e.test_cluster import PROMPTS, post_chat

pytestmark = [pytest.mark.e2e, pytest.mark.torch]


@pytest.fixture(scope="module")
def kv_cluster(tmp_path_factory: pytest.TempPathFactory, e2e_model: Path) -> Iterator[Cluster]:
    flags = ("--kv-dtype", "bfloat16")
    c = Cluster(tmp_path_factory.mktemp("kv"), e2e_model, worker_flags=flags)
    try:
        c.start_all(("0:2", "2:4"))
        yield c
    finally:
        c.stop()


def test_bfloat16_caches_serve_the_engine_s_text(kv_cluster: Cluster, e2e_model: Path) -> None:
    from tests.e2e.expected import sent_text
    from zmqllm.engine.generator import Generator
    from zmqllm.models.tokenizer import Tokenizer

    loaded = [
        line
        for proc in kv_cluster.procs
        for line in kv_cluster.log_lines(proc)
        if line.get("event") == "shard loaded"
    ]
    assert [line["kv_dtype"] for line in loaded] == ["bfloat16", "bfloat16"]
    tok = Tokenizer.from_dir(e2e_model)
    engine = Generator(e2e_model, [(0, 2), (2, 4)], kv_dtype="bfloat16")
    for prompt in PROMPTS[:3]:
        ids = tok.encode_chat([{"role": "user", "content": prompt}])
        want = list(engine.generate(ids, 32, stop_ids=sorted(tok.eos_token_ids)))
        status, chunks, _ = post_chat(kv_cluster, prompt, "max_tokens=32")
        assert status == 200, chunks
        assert b"".join(p for _, p in chunks).decode() == sent_text(tok, want) + "\n", prompt
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: post_chat(kv_cluster, p, "max_tokens=32"), PROMPTS))
    for prompt, (status, chunks, _) in zip(PROMPTS, results, strict=True):
        assert status == 200 and b"".join(p for _, p in chunks).strip(), prompt
