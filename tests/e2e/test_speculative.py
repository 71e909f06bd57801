"""Speculative decoding on a real cluster: broker, two workers of the tiny sliding-window
model (the last one with ``--speculative lookup``, or ``draft``) and the gateway, as
separate processes on 127.0.0.1. The text must be HF greedy's token for token, with and
without speculation, beside requests that turn it off, whatever ends it (stop strings,
max_tokens inside a pass that proposed past them); the workers' figures show it worked.
"""

from __future__ import annotations

import functools
import http.client
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from testbed.cluster import Cluster
from tests.e2e.expected import sent_text
from zmqllm.client.status import format_status

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

# Texts that repeat themselves and ones that do not.
PROMPTS = [
    "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat.",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n",
    "Once upon a time",
    "Why is the sky blue?",
]
# The answers of a random model do not repeat its prompt: prompts whose answer does are
# made (``echo``) from these, long enough (60+ tokens) to fill the model's view.
ECHOED = [
    "the quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat by the fire.",
    "In the beginning the river ran north past three mills and a church, then east to the sea.",
]


def echo(text: str, tok: Any, greedy_ids: Callable[..., list[int]]) -> str:
    """``text``, the model's greedy answer to it, then ``text`` again: its answer to the
    second one is (nearly) the first, since the tiny model sees 28 tokens back at most
    (window 8, 4 layers) and its positions are rotary. Prompt lookup then proposes it."""
    answer = sent_text(tok, greedy_ids(tok.encode(text), 24, stop_at_eos=False))
    return text + answer + text


@pytest.fixture(scope="module")
def spec_cluster(tmp_path_factory: pytest.TempPathFactory, e2e_model: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("spec"), e2e_model)
    try:
        c.start_broker()
        c.start_worker("0:2")
        c.start_worker("2:4", flags=("--speculative", "lookup", "--max-draft-tokens", "6"))
        c.start_gateway()
        c.wait_ready()
        yield c
    finally:
        c.stop()


def complete(c: Cluster, prompt: str, **fields: Any) -> tuple[str, str | None]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "ignore_eos": True, **fields}
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=120)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        data = json.loads(resp.read())
        assert resp.status == 200, data
        choice = data["choices"][0]
        return choice["text"], choice["finish_reason"]
    finally:
        conn.close()


def last_stage_stats(c: Cluster) -> dict[str, Any]:
    """The last stage's figures as the broker last heard them (they lag its work by a
    heartbeat: wait for the figure asserted on, not for any)."""
    (w,) = [w for w in c.status()["workers"] if w["layers"][1] == 4]
    return w.get("stats") or {}


def test_greedy_text_is_hf_greedy_beside_requests_without_speculation(
    spec_cluster: Cluster, reference: Any, greedy_ids: Callable[..., list[int]]
) -> None:
    tok = reference.tokenizer
    prompts = [echo(t, tok, greedy_ids) for t in ECHOED] + PROMPTS
    jobs = [(p, True) for p in prompts] + [(p, False) for p in prompts]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: complete(spec_cluster, j[0], speculative=j[1]), jobs))
    for (prompt, speculative), (text, finish) in zip(jobs, got, strict=True):
        want = sent_text(tok, greedy_ids(tok.encode(prompt), 40, stop_at_eos=False))
        assert text == want, (prompt, speculative)
        assert finish == "length"
    stats = spec_cluster.wait_for(
        lambda: (s := last_stage_stats(spec_cluster)).get("spec_accepted") and s,
        what="speculation figures",
    )
    assert stats["spec_proposed"] >= stats["spec_accepted"] > 0
    assert stats["spec_tokens_per_pass"] > 1.0
    assert "tok/pass" in format_status(spec_cluster.status())
    code, metrics = spec_cluster.get("/metrics")
    assert code == 200
    assert b"zmqllm_worker_speculative_accepted_tokens" in metrics


def test_stop_strings_and_max_tokens_inside_a_pass(
    spec_cluster: Cluster, reference: Any, greedy_ids: Callable[..., list[int]]
) -> None:
    tok = reference.tokenizer
    prompt = echo(ECHOED[0], tok, greedy_ids)
    full = sent_text(tok, greedy_ids(tok.encode(prompt), 40, stop_at_eos=False))
    # Stop strings at several places of the answer: most fall inside a pass.
    stops = sorted({full[i : i + 3] for i in range(4, len(full) - 3, max(1, len(full) // 6))})
    stops = [s for s in stops if s.strip()][:6]
    with ThreadPoolExecutor(8) as pool:
        stopped = list(pool.map(lambda s: complete(spec_cluster, prompt, stop=[s]), stops))
        budgets = list(range(1, 13))
        cut = list(pool.map(lambda m: complete(spec_cluster, prompt, max_tokens=m), budgets))
    for stop, (text, finish) in zip(stops, stopped, strict=True):
        assert text == full[: full.index(stop)], stop
        assert finish == "stop"
    for m, (text, finish) in zip(budgets, cut, strict=True):
        assert text == sent_text(tok, greedy_ids(tok.encode(prompt), m, stop_at_eos=False)), m
        assert finish == "length"
    spec_cluster.wait_for(lambda: spec_cluster.status()["sessions"] == 0, what="sessions end")


def test_one_stage_route_steps_itself_with_proposals(
    fresh_cluster: Cluster, reference: Any, greedy_ids: Callable[..., list[int]]
) -> None:
    c = fresh_cluster
    c.start_broker()
    c.start_worker("0:4", flags=("--speculative", "lookup"))
    c.start_gateway()
    c.wait_ready()
    tok = reference.tokenizer
    prompts = [echo(t, tok, greedy_ids) for t in ECHOED] + PROMPTS[:2]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: complete(c, p, max_tokens=32), prompts))
    for prompt, (text, _) in zip(prompts, got, strict=True):
        assert text == sent_text(tok, greedy_ids(tok.encode(prompt), 32, stop_at_eos=False))
    stats = c.wait_for(lambda: (s := last_stage_stats(c)).get("spec_accepted") and s)
    assert stats["spec_accepted"] > 0


def test_a_request_can_turn_speculation_off(
    spec_cluster: Cluster, reference: Any, greedy_ids: Callable[..., list[int]]
) -> None:
    prompt = echo(ECHOED[1], reference.tokenizer, greedy_ids)

    def passes() -> int:
        return int(last_stage_stats(spec_cluster).get("spec_passes", 0))

    spec_cluster.wait_for(lambda: spec_cluster.status()["sessions"] == 0, what="idle")
    time.sleep(1.0)  # the figures of anything before are in
    before = passes()
    complete(spec_cluster, prompt, max_tokens=16, speculative=False)
    time.sleep(1.0)  # two heartbeats
    assert passes() == before
    complete(spec_cluster, prompt, max_tokens=16)
    spec_cluster.wait_for(lambda: passes() > before, what="speculating passes")


def test_a_stream_survives_its_proposing_worker_mid_window(
    fresh_cluster: Cluster, greedy_ids: Callable[..., list[int]], reference: Any
) -> None:
    """SIGKILL the last stage (the one that proposes) of a speculating stream: the replay
    on its replica gives the same text, greedy as HF's and sampled as undisturbed."""
    from tests.e2e import test_failover as failover

    c = fresh_cluster
    c.start_broker()
    for layers in ("0:2", "2:4") * 2:
        flags = ("--speculative", "lookup") if layers == "2:4" else ()
        c.start_worker(layers, flags=flags)
    c.start_gateway()
    c.wait_ready()
    c.wait_for(lambda: len(c.status()["workers"]) == 4, timeout=60, what="4 workers")
    tok = reference.tokenizer
    prompt = echo(ECHOED[0], tok, greedy_ids)
    want = sent_text(tok, greedy_ids(tok.encode(prompt), failover.TOKENS, stop_at_eos=False))
    for fields, expected in (({}, want), (failover.SAMPLED, None)):
        fields = {**fields, "prompt": prompt}
        if expected is None:
            expected, _, _ = failover.completion(c, fields)
        failover.wait_idle(c)
        killed: list[dict[str, Any]] = []
        kill = functools.partial(lambda out: out.append(failover.kill_serving(c, "2:4")), killed)
        text, finish, _ = failover.completion(c, fields, kill)
        assert killed and finish == "length"
        assert text == expected
        c.start_worker("2:4", flags=("--speculative", "lookup"))
        c.wait_for(lambda: len(c.status()["workers"]) == 4, timeout=60, what="4 workers")


def test_a_draft_model_on_the_last_stage_gives_hf_greedy_text(
    fresh_cluster: Cluster, reference: Any, greedy_ids: Callable[..., list[int]], e2e_model: Path
) -> None:
    """``--speculative draft``: the last stage's draft model (the served model itself, so
    that every proposal is its choice) proposes; the text is HF greedy's. A draft asked of
    a stage that does not sample is refused at start, the worker saying why."""
    c = fresh_cluster
    draft = ("--speculative", "draft", "--draft-model", str(e2e_model))
    first = [
        "worker",
        "--model",
        str(e2e_model),
        "--layers",
        "0:2",
        "--broker",
        "tcp://127.0.0.1:1",
    ]
    refused = subprocess.run(
        [sys.executable, "-m", "zmqllm.cli", *first, *draft],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "not the last" in refused.stderr, refused.stderr[-2000:]
    c.start_broker()
    c.start_worker("0:2")
    c.start_worker("2:4", flags=(*draft, "--max-draft-tokens", "6"))
    c.start_gateway()
    c.wait_ready()
    tok = reference.tokenizer
    prompts = [echo(ECHOED[0], tok, greedy_ids), *PROMPTS]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: complete(c, p), prompts))
    for prompt, (text, finish) in zip(prompts, got, strict=True):
        assert text == sent_text(tok, greedy_ids(tok.encode(prompt), 40, stop_at_eos=False))
        assert finish == "length"
    stats = c.wait_for(lambda: (s := last_stage_stats(c)).get("spec_accepted") and s)
    # The draft is the served model: what it proposes is the served model's choice, so
    # every proposal is accepted. How many passes carry proposals depends on timing (a
    # forward of more than 4 sessions decoding drafts nothing), so not tokens per pass.
    assert stats["spec_proposed"] == stats["spec_accepted"] > 0
    assert stats["spec_tokens_per_pass"] > 1.0
