"""A burst past the gateway's limits: queued and served, or 429 only past the queue bound.

Real broker, workers (layers 0:2 and 2:4 of the tiny model) and gateway processes on
127.0.0.1; every answer must equal HF greedy generate on the same weights.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.test_cluster import open_long_stream
from zmqllm.local_cluster import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

STREAMS = 200  # over three times the default max_concurrent (64)
MAX_TOKENS = 12
PROMPTS = [
    "Hello there!",
    "What is the capital of France?",
    "List three colours.",
    "Count to five.",
    "Why is the sky blue?",
]
# Generous: a queued request waits for the ones ahead of it on a shared 2-core machine.
HTTP_TIMEOUT = 120.0


def chat(c: Cluster, prompt: str, max_tokens: int = MAX_TOKENS) -> tuple[int, str, dict[str, str]]:
    """POST /chat; (status, whole body, headers with lower-case names)."""
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=HTTP_TIMEOUT)
    try:
        conn.request("POST", f"/chat?max_tokens={max_tokens}", body=prompt.encode())
        resp = conn.getresponse()
        body = resp.read().decode()
        return resp.status, body, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def gauge(c: Cluster, name: str) -> float:
    _, text = c.get("/metrics")
    for line in text.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_burst_of_200_streams_is_queued_not_refused(cluster: Cluster, reference) -> None:
    """Default settings: 200 concurrent /chat streams, 64 at a time, the rest queued in
    the gateway; every one gets its own exact greedy answer."""
    expected = {p: reference(p, MAX_TOKENS) for p in PROMPTS}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(STREAMS)]
    most_queued = 0.0
    done = threading.Event()

    def watch_queue() -> None:
        nonlocal most_queued
        while not done.is_set():
            most_queued = max(most_queued, gauge(cluster, "zmqllm_requests_queued"))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_queue, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(STREAMS) as pool:
            results = list(pool.map(lambda p: chat(cluster, p), prompts))
    finally:
        done.set()
        watcher.join(timeout=10)
    statuses = [status for status, _, _ in results]
    assert statuses == [200] * STREAMS, {s: statuses.count(s) for s in set(statuses)}
    for prompt, (_, text, _) in zip(prompts, results, strict=True):
        assert text == expected[prompt], prompt
    assert most_queued > 0  # the burst really went past max_concurrent
    assert gauge(cluster, "zmqllm_requests_queued") == 0
    assert gauge(cluster, "zmqllm_requests_in_flight") == 0


def test_past_a_small_queue_bound_429_then_normal_service(
    tmp_path: Path, e2e_model: Path, reference
) -> None:
    c = Cluster(tmp_path / "cluster", e2e_model)
    try:
        c.start_broker()
        c.start_worker("0:2")
        c.start_worker("2:4")
        c.start_gateway("--max-concurrent", "2", "--max-queued", "3")
        c.wait_ready()
        long_streams = []
        for _ in range(2):  # two long streams hold both slots
            conn, resp = open_long_stream(c, timeout=HTTP_TIMEOUT, model=None)
            assert resp.status == 200
            resp.read1(64)
            long_streams.append(conn)
        # Three requests fill the queue ...
        with ThreadPoolExecutor(3) as waiting:
            queued = [waiting.submit(chat, c, prompt) for prompt in PROMPTS[:3]]
            c.wait_for(lambda: gauge(c, "zmqllm_requests_queued") == 3, what="3 queued")
            # ... and every request past them gets 429 with Retry-After, nothing else.
            with ThreadPoolExecutor(10) as burst:
                refused = list(burst.map(lambda p: chat(c, p), PROMPTS * 2))
            for status, body, headers in refused:
                assert status == 429, (status, body)
                assert headers["retry-after"] == "1"
                error = json.loads(body)["error"]
                assert error["code"] == "too_many_requests"
                assert error["type"] == "rate_limit_error"
            assert gauge(c, "zmqllm_requests_queued") == 3
            # The long streams' clients leave: their sessions are cancelled, the queued
            # requests get the slots and their exact answers.
            for conn in long_streams:
                conn.close()
            for prompt, future in zip(PROMPTS[:3], queued, strict=True):
                status, text, _ = future.result(timeout=HTTP_TIMEOUT)
                assert status == 200 and text == reference(prompt, MAX_TOKENS), prompt
        # Afterwards the cluster serves normally.
        status, text, _ = chat(c, "Hello there!", 16)
        assert status == 200 and text == reference("Hello there!", 16)
    finally:
        c.stop()
