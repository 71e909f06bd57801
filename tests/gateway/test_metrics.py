"""``GET /metrics``: the gateway's figures, and the broker's status asked at most once a second."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.fake_broker_client import FakeBrokerClient
from tests.gateway.support import answer_script, make_app, tiny_tokenizer
from zmqllm.models.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def gauge(text: str, name: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[1])


async def scrape_app(fake: FakeBrokerClient, tok: Tokenizer) -> tuple[Any, FakeClock]:
    # ASGITransport runs no lifespan, so readiness polling (which asks for status too)
    # stays off and every status call counted here is a scrape's.
    app = make_app(fake, tok)
    clock = FakeClock()
    app.state.broker_status.clock = clock
    return app, clock


async def test_concurrent_scrapes_share_one_status_call(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(answer_script(tok))
    fake.status_delay = 0.05  # so the scrapes overlap while the call is under way
    app, _clock = await scrape_app(fake, tok)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        responses = await asyncio.gather(*(c.get("/metrics") for _ in range(20)))
    assert [r.status_code for r in responses] == [200] * 20
    assert all(gauge(r.text, "zmqllm_broker_up") == 1.0 for r in responses)
    assert fake.status_calls == 1


async def test_status_is_asked_again_only_after_a_second(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(answer_script(tok))
    app, clock = await scrape_app(fake, tok)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        for _ in range(5):
            assert (await c.get("/metrics")).status_code == 200
        assert fake.status_calls == 1
        clock.now += 0.9
        await c.get("/metrics")
        assert fake.status_calls == 1
        clock.now += 0.2
        await c.get("/metrics")
        assert fake.status_calls == 2
        # The gateway's own figures are live on every scrape, cached status or not.
        assert (await c.post("/chat", content=b"Hi")).status_code == 200
        text = (await c.get("/metrics")).text
        assert 'zmqllm_requests_total{path="/chat",status="200"} 1.0' in text
        assert fake.status_calls == 2


async def test_a_broker_down_is_reported_and_not_asked_in_a_loop(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(answer_script(tok))
    fake.unreachable = True
    app, clock = await scrape_app(fake, tok)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        for _ in range(3):
            assert gauge((await c.get("/metrics")).text, "zmqllm_broker_up") == 0.0
        assert fake.status_calls == 1
        fake.unreachable = False
        clock.now += 1.0
        assert gauge((await c.get("/metrics")).text, "zmqllm_broker_up") == 1.0
        assert fake.status_calls == 2


async def test_broker_drops_are_exported_by_reason(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(answer_script(tok))
    app, _clock = await scrape_app(fake, tok)
    fake.status_extra = {"dropped": {"frontend:malformed": 3, "backend:unknown_peer": 2}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        text = (await c.get("/metrics")).text
    name = "zmqllm_broker_dropped_messages_by_reason_total"
    assert f'{name}{{reason="frontend:malformed"}} 3.0' in text
    assert f'{name}{{reason="backend:unknown_peer"}} 2.0' in text


async def test_failed_handshakes_are_exported(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(answer_script(tok))
    app, _clock = await scrape_app(fake, tok)
    fake.status_extra = {
        "auth": {
            "handshake_failures": {"frontend:protocol": 5, "backend:denied": 2},
            "refused": {"workers": 2},
        }
    }
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        text = (await c.get("/metrics")).text
    name = "zmqllm_broker_handshake_failures_total"
    assert f'{name}{{kind="protocol",socket="frontend"}} 5.0' in text
    assert f'{name}{{kind="denied",socket="backend"}} 2.0' in text
    assert 'zmqllm_broker_keys_refused_total{domain="workers"} 2.0' in text


async def test_the_gateways_own_drops_are_exported_by_reason(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(answer_script(tok))
    app, _clock = await scrape_app(fake, tok)
    fake.drops["malformed"] += 4
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        text = (await c.get("/metrics")).text
    assert 'zmqllm_client_dropped_messages_by_reason_total{reason="malformed"} 4.0' in text


async def test_worker_faults_are_exported_by_reason(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(answer_script(tok))
    app, _clock = await scrape_app(fake, tok)
    worker = {"id": "w0", "layers": [0, 2], "stats": {"fault_bad_request": 2, "forwards": 9}}
    remote = {"id": "r0", "layers": [0, 1], "model": "api", "stats": {"fault_bad_request": 1}}
    fake.status_extra = {"workers": [worker, remote]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        text = (await c.get("/metrics")).text
    line = 'zmqllm_worker_faults_total{layers="0:2",model="",reason="bad_request",worker="w0"} 2.0'
    assert line in text
    # Each worker is labelled with the model it serves.
    line = (
        'zmqllm_worker_faults_total{layers="0:1",model="api",reason="bad_request",worker="r0"} 1.0'
    )
    assert line in text


async def test_health_ready_and_metrics_are_counted_under_their_own_paths(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(answer_script(tok))
    app, _clock = await scrape_app(fake, tok)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        await c.get("/health")
        await c.get("/ready")
        await c.get("/metrics")
        await c.get("/no-such-page")
        text = (await c.get("/metrics")).text
    assert 'zmqllm_requests_total{path="/health",status="200"} 1.0' in text
    assert 'zmqllm_requests_total{path="/metrics",status="200"} 1.0' in text
    assert 'zmqllm_requests_total{path="/ready",' in text
    # Any path outside the fixed list shares one label: the label set stays bounded.
    assert 'zmqllm_requests_total{path="other",status="404"} 1.0' in text


async def test_node_health_and_builds_are_exported_per_worker_and_host(tok: Tokenizer) -> None:
    fake = FakeBrokerClient(answer_script(tok))
    app, _clock = await scrape_app(fake, tok)
    build = {"zmqllm": "0.2.0", "torch": "2.13.0", "quant": "none", "device": "cpu"}
    stats = {"rss_bytes": 100, "cpu_s": 3.5, "net_rx_bytes": 7, "net_tx_bytes": 9}
    # A last stage that speculates (engine/prompt_lookup.py).
    spec = {"spec_proposed": 40, "spec_accepted": 30, "spec_tokens_per_pass": 2.5}
    workers = [
        {"id": "w0", "layers": [0, 2], "info": {"host": "a"}, "build": build,
         "cpu_percent": 50.0, "stats": {**stats, "kv_bytes_used": 10}},
        {"id": "w1", "layers": [2, 4], "info": {"host": "a"}, "build": build,
         "cpu_percent": 25.0, "stats": {**stats, **spec}},
    ]  # fmt: skip
    fake.status_extra = {"workers": workers}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        text = (await c.get("/metrics")).text
    labels = 'layers="0:2",model="",worker="w0"'
    assert f"zmqllm_worker_cpu_seconds_total{{{labels}}} 3.5" in text
    assert f"zmqllm_worker_network_receive_bytes_total{{{labels}}} 7.0" in text
    assert f"zmqllm_worker_network_transmit_bytes_total{{{labels}}} 9.0" in text
    assert f"zmqllm_worker_kv_bytes_used{{{labels}}} 10.0" in text
    last = 'layers="2:4",model="",worker="w1"'
    assert f"zmqllm_worker_speculative_accepted_tokens_total{{{last}}} 30.0" in text
    assert f"zmqllm_worker_speculative_tokens_per_pass{{{last}}} 2.5" in text
    assert 'zmqllm_host_rss_bytes{host="a"} 200.0' in text
    assert 'zmqllm_host_cpu_percent{host="a"} 75.0' in text
    assert 'zmqllm_host_workers{host="a"} 2.0' in text
    info = [x for x in text.splitlines() if x.startswith("zmqllm_worker_build_info{")]
    assert len(info) == 2 and all('torch="2.13.0"' in x and 'host="a"' in x for x in info)


@pytest.mark.parametrize("shown", [False, True])
async def test_prefix_cache_figures_reach_clients_only_when_asked(
    tok: Tokenizer, shown: bool
) -> None:
    """A guess's hit count says whether another client sent a prompt: off by default in
    /metrics and /cluster/status (the cluster page), on with prefix_stats. So do the
    figures a hit changes (issue 40, item 6): the first stage's tokens (a hit computes
    fewer rows), forwards and the time spent in them."""
    fake = FakeBrokerClient(answer_script(tok))
    app = make_app(fake, tok, prefix_stats=shown)
    stats = {"prefix_query_tokens": 40, "prefix_hit_tokens": 32, "prefix_cached_tokens": 64}
    work = {"tokens": 41, "forwards": 3, "busy_s": 0.5, "mean_forward_ms": 9.0}
    worker = {"id": "w0", "layers": [0, 2], "stats": {**stats, **work, "sessions": 2}}
    fake.status_extra = {"workers": [worker]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        text = (await c.get("/metrics")).text
        page = (await c.get("/cluster/status")).json()
    assert ("zmqllm_worker_prefix_cache_hit_tokens_total{" in text) is shown
    assert ("zmqllm_worker_prefix_cache_tokens{" in text) is shown
    for metric in ("tokens_total", "forwards_total", "busy_seconds_total", "forward_ms_mean"):
        assert (f"zmqllm_worker_{metric}{{" in text) is shown, metric
    assert "zmqllm_worker_sessions{" in text  # the rest is there either way
    (w,) = page["broker"]["workers"]
    assert ("prefix_hit_tokens" in w["stats"]) is shown and w["stats"]["sessions"] == 2
    assert all((key in w["stats"]) is shown for key in work)
