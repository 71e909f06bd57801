"""Prefix caching with real processes: a multi-turn chat with a long system prompt on two
replicas per stage. Each turn's greedy reply equals HF's for the whole conversation, the
broker keeps the conversation on the replicas that hold it, and each later turn starts
after the part of its prompt the turn before computed (the workers' counters say so, and
/metrics shows them).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed.cluster import Cluster
from tests.e2e.conftest import ConfiguredCluster
from zmqllm.bus.prefix import PREFIX_BLOCK, prefix_blocks

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

SYSTEM = " ".join(
    f"Rule {i}: answer briefly, cite the {w} source, and keep the tone {t}."
    for i, (w, t) in enumerate(
        zip(
            ["first", "second", "best", "oldest", "newest", "local", "public", "main", "last"],
            ["calm", "plain", "warm", "dry", "kind", "neutral", "clear", "brief", "exact"],
            strict=True,
        )
    )
)
QUESTIONS = ["What is a cache?", "And a prefix?", "Why does it help a chat?"]
TOKENS = 12


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory, e2e_model: Path) -> Iterator[Cluster]:
    # The prefix figures in /metrics too (off by default: they tell tenants apart).
    c = ConfiguredCluster(
        tmp_path_factory.mktemp("prefix"), e2e_model, config="[gateway]\nprefix_stats = true\n"
    )
    try:
        c.start_all(("0:2", "2:4", "0:2", "2:4"))
        c.wait_for(lambda: len(c.status()["workers"]) == 4, timeout=60, what="4 workers")
        yield c
    finally:
        c.stop()


def chat(c: Cluster, messages: list[dict[str, str]]) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=60)
    try:
        body = {"messages": messages, "max_tokens": TOKENS, "temperature": 0}
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        out = json.loads(resp.read())
        assert resp.status == 200, out
        return out
    finally:
        conn.close()


def stage0_counters(c: Cluster) -> dict[str, tuple[int, int]]:
    """(query, hit) prefix tokens of each stage-0 worker, as its heartbeat last said."""
    return {
        w["id"]: (w["stats"].get("prefix_query_tokens", 0), w["stats"].get("prefix_hit_tokens", 0))
        for w in c.status()["workers"]
        if w["layers"][0] == 0
    }


def test_each_turn_is_exact_and_starts_after_the_last_turns_prompt(
    replicas: Cluster, reference
) -> None:
    c = replicas
    tok = reference.tokenizer
    messages = [{"role": "system", "content": SYSTEM}]
    asked = 0
    prompts: list[int] = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        want = reference.turns(messages, TOKENS)
        out = chat(c, messages)
        reply = out["choices"][0]["message"]["content"]
        assert reply == want  # HF greedy on the whole conversation, computed cold
        prompts.append(out["usage"]["prompt_tokens"])
        asked += prompts[-1]
        messages.append({"role": "assistant", "content": reply})
    assert prompts[0] > 300 and prompts[0] == len(tok.encode_chat(messages[:2]))
    # Turns 2 and 3 each reuse at least the whole blocks of the turn before's prompt.
    least = sum(prefix_blocks(n) * PREFIX_BLOCK for n in prompts[:-1])
    # Heartbeats carry the counters: wait for the one after the last turn.
    counters = c.wait_for(
        lambda: (
            (v := stage0_counters(c))
            and sum(q for q, _ in v.values()) >= asked
            and sum(h for _, h in v.values()) >= least
            and v
        ),
        timeout=15,
        what=f"the stage-0 workers' counters to show {asked} tokens asked, {least} found",
    )
    assert sum(h for _, h in counters.values()) < asked
    # One replica served the whole conversation: the other never saw it.
    assert sorted(q for q, _ in counters.values())[0] < prompts[0]
    status, raw = c.get("/metrics")
    assert status == 200
    text = raw.decode()
    for name in (
        "zmqllm_worker_prefix_cache_hit_tokens_total",
        "zmqllm_worker_prefix_cache_query_tokens_total",
        "zmqllm_worker_prefix_cache_tokens",
    ):
        assert name in text, name


def test_without_the_prefix_cache_the_answer_is_the_same(
    tmp_path: Path, e2e_model: Path, reference
) -> None:
    c = Cluster(tmp_path / "cold", e2e_model)
    try:
        c.start_broker()
        for layers in ("0:2", "2:4"):
            c.start_worker(layers, flags=("--no-prefix-cache",))
        c.start_gateway()
        c.wait_ready()
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
        for _ in range(2):
            out = chat(c, messages)
            assert out["choices"][0]["message"]["content"] == reference.turns(messages, TOKENS)
        assert all("prefix_hit_tokens" not in w["stats"] for w in c.status()["workers"])
    finally:
        c.stop()
