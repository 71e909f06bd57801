"""Many streams at once: batching changes no output, scale-out, drain, metrics."""

from __future__ import annotations

import http.client
import json
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from testbed.cluster import Cluster
from tests.e2e.test_cluster import PROMPTS, post_chat

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

# 16 prompts of different lengths, answers of different lengths.
BURST = [(p * (1 + i % 3), 12 + 5 * (i % 4)) for i, p in enumerate(PROMPTS * 2)]


def _chat_text(c: Cluster, prompt: str, max_tokens: int) -> tuple[int, str]:
    status, chunks, _ = post_chat(c, prompt, f"max_tokens={max_tokens}")
    return status, b"".join(p for _, p in chunks).decode()


def test_sixteen_concurrent_streams_each_exact_and_batched(cluster: Cluster, reference) -> None:
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda pm: _chat_text(cluster, *pm), BURST))
    for (prompt, n), (status, text) in zip(BURST, results, strict=True):
        assert status == 200
        assert text == reference.body(prompt, n), prompt
    # The workers really ran several sessions in one forward.
    stats = cluster.wait_for(
        lambda: [w["stats"] for w in cluster.status()["workers"] if w["stats"].get("forwards")],
        what="worker stats",
    )
    assert max(s["max_batch"] for s in stats) > 1


def _scrape(c: Cluster) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    status, body = c.get("/metrics")
    assert status == 200
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            key = s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else "")
            out[key] = s.value
    return out


def test_metrics_parse_and_move_with_traffic(cluster: Cluster) -> None:
    pytest.importorskip("prometheus_client")
    before = _scrape(cluster)
    status, _ = _chat_text(cluster, "Count to five.", 10)
    assert status == 200
    after = _scrape(cluster)
    assert (
        after["zmqllm_generated_tokens_total"] >= before.get("zmqllm_generated_tokens_total", 0) + 1
    )
    key = 'zmqllm_requests_total{"path": "/chat", "status": "200"}'
    assert after[key] == before.get(key, 0) + 1
    assert after["zmqllm_time_to_first_token_seconds_count"] > before.get(
        "zmqllm_time_to_first_token_seconds_count", 0
    )
    assert after["zmqllm_broker_up"] == 1 and after["zmqllm_broker_workers"] == 2
    assert "zmqllm_broker_queue_depth" in after and "zmqllm_requests_in_flight" in after
    worker_keys = [k for k in after if k.startswith("zmqllm_worker_rss_bytes")]
    assert len(worker_keys) == 2 and all(after[k] > 0 for k in worker_keys)


def _burst_in_threads(c: Cluster, n: int, max_tokens: int, results: list) -> list[threading.Thread]:
    def one(i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        results[i] = (prompt, *_chat_text(c, prompt, max_tokens))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_scale_out_and_drain_lose_no_request(fresh_cluster: Cluster, reference) -> None:
    c = fresh_cluster
    c.start_all()
    results: list = [None] * 12
    threads = _burst_in_threads(c, 12, 60, results)
    # A second worker for layers 2:4 joins mid-burst ...
    newcomer = c.start_worker("2:4", name="late")
    c.wait_for(lambda: len(c.status()["workers"]) == 3, timeout=60, what="newcomer registered")
    more: list = [None] * 8
    threads += _burst_in_threads(c, 8, 60, more)
    c.wait_for(
        lambda: any(
            w["id"].startswith("w-late") and w["sessions"] > 0 for w in c.status()["workers"]
        ),
        timeout=60,
        what="the newcomer takes sessions",
    )
    # ... and the original 2:4 worker is drained: it finishes its streams, then exits.
    original = next(p for p in c.procs if p.name == "worker-2-4" and p is not newcomer)
    original.popen.send_signal(signal.SIGTERM)
    c.wait_for(
        lambda: any(w.get("draining") for w in c.status()["workers"]) or not original.alive(),
        timeout=30,
        what="draining shown in status",
    )
    for t in threads:
        t.join(timeout=120)
    original.popen.wait(timeout=60)
    assert original.popen.returncode == 0
    for r in results + more:
        assert r is not None and r[1] == 200, r
        assert r[2] == reference.body(r[0], 60)
    # The newcomer alone now serves layers 2:4.
    status, text = _chat_text(c, "Hello there!", 16)
    assert status == 200 and text == reference.body("Hello there!", 16)


def test_whole_model_worker_beside_a_two_stage_pipeline(fresh_cluster: Cluster, reference) -> None:
    c = fresh_cluster
    c.start_broker()
    for layers in ("0:2", "2:4", "0:4"):
        c.start_worker(layers)
    c.start_gateway()
    c.wait_ready()
    c.wait_for(lambda: len(c.status()["workers"]) == 3, timeout=60, what="three workers")
    routes: set[tuple[str, ...]] = set()
    lock = threading.Lock()

    def one(prompt: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=60)
        conn.request(
            "POST",
            "/chat?max_tokens=40",
            body=prompt.encode(),
            headers={"X-Request-ID": f"mixed-{abs(hash(prompt))}"},
        )
        resp = conn.getresponse()
        text = resp.read().decode()
        conn.close()
        return resp.status, text

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, PROMPTS))
    for prompt, (status, text) in zip(PROMPTS, results, strict=True):
        assert status == 200 and text == reference.body(prompt, 40), prompt
    # Both kinds of route served sessions: one hop and two hops.
    gateway = c.by_name("gateway")[0]
    for line in c.log_lines(gateway):
        if line.get("event") == "request finished" and line.get("route"):
            with lock:
                routes.add(tuple(line["route"]))
    assert {len(r) for r in routes} == {1, 2}, routes


def test_workers_taking_turns_on_shared_cores_stay_exact(
    tmp_path: Path, e2e_model: Path, reference
) -> None:
    c = Cluster(tmp_path / "cluster", e2e_model, cpu_lock=True, threads=2)
    try:
        c.start_all()
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda pm: _chat_text(c, *pm), BURST[:8]))
        for (prompt, n), (status, text) in zip(BURST[:8], results, strict=True):
            assert status == 200 and text == reference.body(prompt, n), prompt
        assert (c.root / "cpu.lock").exists()
    finally:
        c.stop()


def _stage_batches(c: Cluster) -> dict[int, dict]:
    """Each stage's forward figures, by its first layer."""
    return {w["layers"][0]: w["stats"] for w in c.status()["workers"]}


@pytest.mark.parametrize(("micro_batches", "groups"), [(0, 2), (1, 1)])
def test_sixteen_streams_travel_in_one_group_per_stage(
    tmp_path: Path, e2e_model: Path, reference, micro_batches: int, groups: int
) -> None:
    """Two stages, 16 streams: with micro-batches (0, the default: one group per stage)
    stage 0 forwards about half the sessions at a time, so that each stage can compute
    one group while the other has the other; with one group (1) the whole route moves
    at once. Exact either way."""
    c = Cluster(
        tmp_path / "cluster",
        e2e_model,
        heartbeat=0.5,
        worker_flags=("--micro-batches", str(micro_batches), "--batch-threads", "1"),
    )
    try:
        c.start_all()
        burst = [(PROMPTS[i % len(PROMPTS)], 48) for i in range(16)]
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda pm: _chat_text(c, *pm), burst))
        for (prompt, n), (status, text) in zip(burst, results, strict=True):
            assert status == 200 and text == reference.body(prompt, n), prompt
        stats = c.wait_for(
            lambda: (s := _stage_batches(c)) and all(v.get("forwards") for v in s.values()) and s,
            what="both stages' forward figures",
        )
        first = stats[min(stats)]
        if groups == 2:
            # Stage 0 forwards at most half the route's sessions at a time, and about
            # half on average (groups are not fragmented). A later stage that falls
            # behind may merge two groups queued for it (it never idles with work
            # queued), so only stage 0's batches are bounded.
            assert first["max_batch"] <= 8, stats
            assert 4 <= first["mean_batch"] <= 8, stats
        else:
            assert first["max_batch"] > 8, stats
    finally:
        c.stop()
