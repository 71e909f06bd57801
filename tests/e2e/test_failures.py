"""Failures heal or fail clearly: a killed worker, a restarted broker, a wrong model."""

from __future__ import annotations

import http.client
import signal
import time
from pathlib import Path

import pytest

from testbed.cluster import Cluster
from tests.e2e.test_cluster import _stream_in_thread, post_chat

pytestmark = [pytest.mark.e2e, pytest.mark.torch]


def test_ready_is_503_until_workers_are_up(fresh_cluster: Cluster) -> None:
    c = fresh_cluster
    c.start_broker()
    c.start_gateway()
    c.wait_for(lambda: _get(c, "/health") == 200, timeout=60, what="gateway up")
    assert _get(c, "/ready") == 503
    c.start_worker("0:2")
    time.sleep(1.0)
    assert _get(c, "/ready") == 503  # half a route is no route
    c.start_worker("2:4")
    c.wait_ready()
    assert _get(c, "/ready") == 200


def _get(c: Cluster, path: str) -> int:
    try:
        return c.get(path)[0]
    except OSError:
        return 0


def test_killed_worker_ends_stream_with_error_and_cluster_heals(
    fresh_cluster: Cluster, reference
) -> None:
    """With failover off, a lost worker ends its streams at once, with the error (with it
    on, tests/e2e/test_failover.py)."""
    c = fresh_cluster
    c.start_broker()
    for layers in ("0:2", "2:4"):
        c.start_worker(layers)
    c.start_gateway("--failover-retries", "0")
    c.wait_ready()
    out: dict = {}
    t = _stream_in_thread(c, out)
    c.wait_for(lambda: "first" in out, timeout=30, what="first chunk")
    victim = c.by_name("worker-2-4")[0]
    killed = time.monotonic()
    c.kill(victim, signal.SIGKILL)
    t.join(timeout=30)
    assert "exc" not in out, out.get("exc")
    bound = c.heartbeat * c.liveness + 2.0  # detection bound plus scheduling slack
    assert out["end"] - killed < bound
    assert '"error"' in out["body"] and "worker_lost" in out["body"]
    assert "layers 2:4" in out["body"]
    assert "[DONE]" not in out["body"]  # a stream cut by an error ends at its error event
    # The broker and the other worker keep serving once a new worker takes the range.
    assert c.by_name("broker") and c.by_name("worker-0-2")
    c.start_worker("2:4")
    c.wait_for(lambda: c.status()["complete_route"], timeout=60, what="route again")
    status, chunks, _ = post_chat(c, "Hello there!", "max_tokens=16")
    assert status == 200
    assert b"".join(p for _, p in chunks).decode() == reference.body("Hello there!", 16)


@pytest.mark.parametrize(
    "failover",
    [("--failover-retries", "0"), ("--failover-timeout", "2")],
    ids=["failover-off", "retries-spent"],
)
def test_a_plain_chat_cut_by_a_killed_worker_looks_cut(
    fresh_cluster: Cluster, failover: tuple[str, str]
) -> None:
    """Issue 40, item 14: /chat cut mid-answer by a SIGKILLed stage, with failover off or
    no replica to fail over to, must not end its chunked body cleanly: http.client raises
    IncompleteRead (curl exits 18), after the error line."""
    c = fresh_cluster
    c.start_broker()
    for layers in ("0:2", "2:4"):
        c.start_worker(layers)
    c.start_gateway(*failover)
    c.wait_ready()
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=60)
    conn.request("POST", "/chat?max_tokens=900", body=b"Once upon a time")
    response = conn.getresponse()
    assert response.status == 200
    received = response.read1(65536)
    c.kill(c.by_name("worker-2-4")[0], signal.SIGKILL)
    with pytest.raises(http.client.IncompleteRead):
        while piece := response.read1(65536):
            received += piece
    conn.close()
    assert b"[error: " in received
    request_id = response.getheader("x-request-id")
    gateway = c.log_lines(c.by_name("gateway")[0])
    cut = [line for line in gateway if "mid-stream" in line.get("event", "")]
    assert cut and all(line.get("request_id") == request_id for line in cut), cut


def test_broker_restart_workers_reregister(fresh_cluster: Cluster, reference) -> None:
    c = fresh_cluster
    c.start_all()
    broker = c.by_name("broker")[0]
    workers = c.by_name("worker")
    c.kill(broker, signal.SIGKILL)
    c.start_broker()
    c.wait_for(lambda: len(c.status()["workers"]) == 2, timeout=30, what="re-registration")
    assert all(w.alive() for w in workers)  # the same processes, not restarted
    c.wait_ready(60)
    status, chunks, _ = post_chat(c, "Why is the sky blue?", "max_tokens=16")
    assert status == 200
    assert b"".join(p for _, p in chunks).decode() == reference.body("Why is the sky blue?", 16)


def test_worker_of_another_model_is_refused(
    fresh_cluster: Cluster, tmp_path: Path, reference
) -> None:
    """Under the cluster's model name, another model is refused, naming the difference;
    under a name of its own it is a second model (test_remote_models.py serves two)."""
    from zmqllm.models.prepare import prepare_tiny_model

    other = prepare_tiny_model(tmp_path / "other", sliding_window=4)
    c = fresh_cluster
    c.start_all()
    name = c.model_dir.resolve().name
    intruder = c.start_worker("2:4", model=other, flags=("--served-name", name))
    intruder.popen.wait(timeout=60)
    assert intruder.popen.returncode != 0
    log = intruder.text()
    assert "refused" in log and "sliding_window: 8 != 4" in log
    assert len(c.status()["workers"]) == 2
    status, chunks, _ = post_chat(c, "Count to five.", "max_tokens=16")
    assert status == 200
    assert b"".join(p for _, p in chunks).decode() == reference.body("Count to five.", 16)


def test_no_route_waits_then_fails_with_no_capacity(fresh_cluster: Cluster) -> None:
    c = fresh_cluster
    c.queue_timeout = 1.5
    c.start_broker()
    c.start_gateway()
    c.wait_for(lambda: _get(c, "/health") == 200, timeout=60, what="gateway up")
    status, chunks, headers = post_chat(c, "Hello there!", "max_tokens=8")
    body = b"".join(p for _, p in chunks)
    assert status == 503, body
    assert "no capacity" in body.decode()
    assert "retry-after" in {k.lower() for k in headers}
    # The request waited in the queue: it was not refused at once.
    assert c.status()["queue"] == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_every_role_shuts_down_cleanly(fresh_cluster: Cluster, sig: int) -> None:
    c = fresh_cluster
    c.start_all()
    for name in ("gateway", "worker", "broker"):
        for proc in c.by_name(name):
            c.kill(proc, sig)
            assert proc.popen.returncode == 0, (name, proc.text()[-2000:])
            assert "Traceback" not in proc.text(), proc.text()[-2000:]
