"""Prometheus metrics at ``GET /metrics``: the gateway's own and the cluster's.

The gateway counts requests and tokens and keeps latency histograms. The
broker's and workers' figures (queue, sessions, batch sizes, step times, KV
use, RSS, GPU memory) are collected through the broker at scrape time: the
broker already gathers every worker's figures from its heartbeats, so one
scrape target sees the whole cluster.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from zmqllm.client.failover import FailoverEvent
    from zmqllm.gateway.request_context import RequestRecord

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Paths counted under their own label; anything else is "other" (bounded label set).
GENERATION_PATHS = ("/chat", "/v1/chat/completions", "/v1/completions")
LABELLED_PATHS = (*GENERATION_PATHS, "/v1/models", "/health", "/ready", "/metrics")
# Seconds, spanning the inter-token latencies and first-token times docs/benchmarks.md
# measures on a CPU.
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Seconds a stream stood still for a failover: detection (a heartbeat horizon) + prefill.
FAILOVER_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0)
# Seconds a broker status is reused: scrapers (several Prometheus replicas, a dashboard,
# an attacker on an open port) cannot make the gateway ask the broker more often than this.
STATUS_MAX_AGE = 1.0

# Per-worker figures the workers report in their heartbeats: (stats key, metric, help).
_WORKER_GAUGES = (
    ("sessions", "zmqllm_worker_sessions", "Sessions holding a KV cache on the worker"),
    ("kv_tokens_reserved", "zmqllm_worker_kv_tokens_reserved", "KV cache tokens reserved"),
    ("kv_bytes_reserved", "zmqllm_worker_kv_bytes_reserved", "KV cache bytes reserved"),
    ("last_batch", "zmqllm_worker_last_batch_size", "Sessions in the latest forward"),
    ("max_batch", "zmqllm_worker_max_batch_size", "Most sessions in one forward so far"),
    ("mean_batch", "zmqllm_worker_mean_batch_size", "Mean sessions per forward"),
    ("mean_forward_ms", "zmqllm_worker_forward_ms_mean", "Mean forward (step) time, ms"),
    ("last_forward_ms", "zmqllm_worker_forward_ms_last", "Latest forward (step) time, ms"),
    ("rss_bytes", "zmqllm_worker_rss_bytes", "Resident memory of the worker process"),
    ("cuda_allocated_bytes", "zmqllm_worker_cuda_memory_allocated_bytes", "GPU memory allocated"),
    ("cuda_reserved_bytes", "zmqllm_worker_cuda_memory_reserved_bytes", "GPU memory reserved"),
    (
        "cuda_used_bytes",
        "zmqllm_worker_cuda_device_used_bytes",
        "GPU memory in use (all processes)",
    ),
    ("cuda_total_bytes", "zmqllm_worker_cuda_device_total_bytes", "GPU memory of the device"),
    ("kv_bytes_used", "zmqllm_worker_kv_bytes_used", "KV cache bytes holding tokens"),
    (
        "prefix_cached_tokens",
        "zmqllm_worker_prefix_cache_tokens",
        "Prompt tokens held in the prefix cache",
    ),
    (
        "spec_tokens_per_pass",
        "zmqllm_worker_speculative_tokens_per_pass",
        "Tokens per pass of the sessions the worker speculates for (last stage)",
    ),
)
_WORKER_COUNTERS = (
    ("forwards", "zmqllm_worker_forwards", "Forward calls run"),
    ("tokens", "zmqllm_worker_tokens", "Tokens run through the worker's layers"),
    ("busy_s", "zmqllm_worker_busy_seconds", "Seconds spent in forwards"),
    ("cpu_s", "zmqllm_worker_cpu_seconds", "CPU seconds of the worker process"),
    ("net_rx_bytes", "zmqllm_worker_network_receive_bytes", "Bytes the worker received on the bus"),
    ("net_tx_bytes", "zmqllm_worker_network_transmit_bytes", "Bytes the worker sent on the bus"),
    (
        "prefix_query_tokens",
        "zmqllm_worker_prefix_cache_query_tokens",
        "Prompt tokens of the sessions opened, looked up in the prefix cache",
    ),
    (
        "prefix_hit_tokens",
        "zmqllm_worker_prefix_cache_hit_tokens",
        "Prompt tokens taken from the prefix cache instead of computed",
    ),
    ("spec_proposed", "zmqllm_worker_speculative_proposed_tokens", "Tokens proposed"),
    ("spec_accepted", "zmqllm_worker_speculative_accepted_tokens", "Proposed tokens accepted"),
    ("spec_passes", "zmqllm_worker_speculative_passes", "Passes of speculating sessions"),
    ("spec_tokens", "zmqllm_worker_speculative_tokens", "Tokens those passes gave"),
)


# A worker's figures that tell whether another tenant sent a prompt: the prefix cache's
# own, and what a hit changes, the rows the first stage computes (a hit skips the cached
# prompt's tokens) and the time its forwards take. Shown to clients only with
# prefix_stats; `zmqllm status` always shows them.
_WORK_STATS = frozenset({"tokens", "forwards", "busy_s", "mean_forward_ms", "last_forward_ms"})


def reveals_prompts(key: str) -> bool:
    """Whether a worker's stats ``key`` is one only prefix_stats shows clients."""
    return key.startswith("prefix_") or key in _WORK_STATS


def without_prefix_stats(status: dict[str, Any] | None) -> dict[str, Any] | None:
    """``status`` without any worker's figures that reveal prompts (prefix_stats off)."""
    if not status or not isinstance(status.get("workers"), list):
        return status
    workers = []
    for w in status["workers"]:
        if isinstance(w, dict) and isinstance(w.get("stats"), dict):
            stats = {k: v for k, v in w["stats"].items() if not reveals_prompts(k)}
            w = {**w, "stats": stats}
        workers.append(w)
    return {**status, "workers": workers}


class ClusterCollector(Collector):
    """Turns the broker's latest status into metric families."""

    def __init__(self, prefix_stats: bool = False) -> None:
        self.status: dict[str, Any] | None = None
        self.client_dropped: Mapping[str, int] = {}  # the gateway's own broker client
        self.prefix_stats = prefix_stats  # [gateway] prefix_stats

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("zmqllm_broker_up", "1 if the broker answered the last scrape")
        up.add_metric([], 0.0 if self.status is None else 1.0)
        yield up
        mine = CounterMetricFamily(
            "zmqllm_client_dropped_messages_by_reason",
            "Messages from the broker this gateway dropped and handler errors, by reason",
            labels=["reason"],
        )
        for reason, value in sorted(self.client_dropped.items()):
            mine.add_metric([str(reason)], float(value))
        yield mine
        st = self.status
        if st is None:
            return
        for key, name, text in (
            ("queue", "zmqllm_broker_queue_depth", "Requests waiting for a route"),
            ("sessions", "zmqllm_broker_sessions", "Sessions open on a route"),
        ):
            g = GaugeMetricFamily(name, text)
            g.add_metric([], float(st.get(key, 0)))
            yield g
        workers = GaugeMetricFamily("zmqllm_broker_workers", "Registered workers")
        workers.add_metric([], float(len(st.get("workers", []))))
        yield workers
        route = GaugeMetricFamily("zmqllm_broker_complete_route", "1 if layers are covered")
        route.add_metric([], 1.0 if st.get("complete_route") else 0.0)
        yield route
        per_model = GaugeMetricFamily(
            "zmqllm_model_complete_route",
            "1 if a model's layers are covered (a remote model: it has a worker)",
            labels=["model"],
        )
        for m in st.get("models", []):
            if isinstance(m, dict):
                per_model.add_metric(
                    [str(m.get("name", ""))], 1.0 if m.get("complete_route") else 0.0
                )
        yield per_model
        for key, value in sorted(st.get("counters", {}).items()):
            c = CounterMetricFamily(f"zmqllm_broker_{key}", f"Broker counter {key}")
            c.add_metric([], float(value))
            yield c
        dropped = CounterMetricFamily(
            "zmqllm_broker_dropped_messages_by_reason",
            "Messages the broker dropped and handler errors, by reason (side:what)",
            labels=["reason"],
        )
        for reason, value in sorted(st.get("dropped", {}).items()):
            if isinstance(value, int | float):
                dropped.add_metric([str(reason)], float(value))
        yield dropped
        yield from _auth_metrics(st.get("auth", {}))
        labels = ["worker", "layers", "model"]
        shown = [g for g in _WORKER_GAUGES if self.prefix_stats or not reveals_prompts(g[0])]
        gauges = {k: GaugeMetricFamily(n, t, labels=labels) for k, n, t in shown}
        counted = [c for c in _WORKER_COUNTERS if self.prefix_stats or not reveals_prompts(c[0])]
        counters = {k: CounterMetricFamily(n, t, labels=labels) for k, n, t in counted}
        draining = GaugeMetricFamily("zmqllm_worker_draining", "1 while draining", labels=labels)
        faults = CounterMetricFamily(
            "zmqllm_worker_faults",
            "Messages a worker dropped or failed a session on, by reason",
            labels=[*labels, "reason"],
        )
        for w in st.get("workers", []):
            lv = [str(w["id"]), f"{w['layers'][0]}:{w['layers'][1]}", str(w.get("model", ""))]
            stats = w.get("stats", {})
            for key, fam in gauges.items():
                if isinstance(stats.get(key), (int, float)):
                    fam.add_metric(lv, float(stats[key]))
            for key, cfam in counters.items():
                if isinstance(stats.get(key), (int, float)):
                    cfam.add_metric(lv, float(stats[key]))
            draining.add_metric(lv, 1.0 if w.get("draining") else 0.0)
            for key, value in sorted(stats.items()):
                if key.startswith("fault_") and isinstance(value, int | float):
                    faults.add_metric([*lv, key.removeprefix("fault_")], float(value))
        yield from gauges.values()
        yield from counters.values()
        yield draining
        yield faults
        yield from _node_metrics(st.get("workers", []))


# Build fields a worker's info metric carries as labels (broker/drift.py compares them all).
_BUILD_LABELS = ("zmqllm", "python", "torch", "numpy", "kernel", "quant", "dtype", "device")


def _node_metrics(workers: Any) -> Iterator[Metric]:
    """Per worker its host and build (an info metric, 1), and per host the sum of its
    workers' memory and CPU use."""
    info = GaugeMetricFamily(
        "zmqllm_worker_build_info",
        "1 per worker, labelled with its host and what it runs on",
        labels=["worker", "host", *_BUILD_LABELS],
    )
    rss = GaugeMetricFamily(
        "zmqllm_host_rss_bytes", "Resident memory of a host's workers", labels=["host"]
    )
    cpu = GaugeMetricFamily(
        "zmqllm_host_cpu_percent",
        "CPU use of a host's workers between their last heartbeats (100 = one core)",
        labels=["host"],
    )
    count = GaugeMetricFamily("zmqllm_host_workers", "Workers on a host", labels=["host"])
    per_host: dict[str, list[float]] = {}
    for w in workers if isinstance(workers, list) else []:
        if not isinstance(w, dict):
            continue
        host = str((w.get("info") or {}).get("host", ""))
        given = w.get("build")
        build: dict[str, Any] = given if isinstance(given, dict) else {}
        info.add_metric(
            [str(w.get("id", "")), host, *(str(build.get(k, "")) for k in _BUILD_LABELS)], 1.0
        )
        stats = w.get("stats") or {}
        totals = per_host.setdefault(host, [0.0, 0.0, 0.0])
        totals[0] += 1
        if isinstance(stats.get("rss_bytes"), int | float):
            totals[1] += float(stats["rss_bytes"])
        if isinstance(w.get("cpu_percent"), int | float):
            totals[2] += float(w["cpu_percent"])
    for host, (n, memory, use) in sorted(per_host.items()):
        count.add_metric([host], n)
        rss.add_metric([host], memory)
        cpu.add_metric([host], use)
    yield from (info, count, rss, cpu)


def _auth_metrics(auth: Any) -> Iterator[Metric]:
    """The broker's CURVE handshakes that failed: by socket and kind (protocol: no
    CURVE or a wrong server key; denied: a key not allowed there), and ZAP refusals by
    domain (clients, workers)."""
    failed = CounterMetricFamily(
        "zmqllm_broker_handshake_failures",
        "CURVE handshakes the broker's sockets failed, by socket and kind",
        labels=["socket", "kind"],
    )
    refused = CounterMetricFamily(
        "zmqllm_broker_keys_refused",
        "Handshakes the broker's ZAP handler refused, by domain (clients, workers)",
        labels=["domain"],
    )
    if isinstance(auth, dict):
        for name, value in sorted(auth.get("handshake_failures", {}).items()):
            sock, _, kind = str(name).partition(":")
            if isinstance(value, int | float):
                failed.add_metric([sock, kind], float(value))
        for domain, value in sorted(auth.get("refused", {}).items()):
            if isinstance(value, int | float):
                refused.add_metric([str(domain)], float(value))
    yield failed
    yield refused


class StatusCache:
    """The broker's status, fetched at most once per ``max_age`` seconds.

    Scrapes that arrive while a fetch is under way wait for that one; a failed fetch is
    remembered as None (broker down) for as long as a good one would be.
    """

    def __init__(
        self,
        fetch: Callable[[], Awaitable[dict[str, Any]]],
        max_age: float = STATUS_MAX_AGE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetch = fetch
        self.max_age = max_age
        self.clock = clock
        self._value: dict[str, Any] | None = None
        self._fetched_at = -math.inf
        self._pending: asyncio.Future[dict[str, Any] | None] | None = None

    @property
    def fetched_at(self) -> float:
        """When the value ``get`` returns was fetched (``clock`` seconds)."""
        return self._fetched_at

    async def get(self) -> dict[str, Any] | None:
        if self.clock() - self._fetched_at < self.max_age:
            return self._value
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._refresh())
        # Shielded: a scraper that hangs up must not cancel the fetch the others await.
        return await asyncio.shield(self._pending)

    async def _refresh(self) -> dict[str, Any] | None:
        try:
            value: dict[str, Any] | None = await self._fetch()
        except Exception:  # the broker down is itself a figure (zmqllm_broker_up 0)
            value = None
        self._value, self._fetched_at, self._pending = value, self.clock(), None
        return value


class GatewayMetrics:
    """One per app (no module-level registry), so tests can build many apps."""

    def __init__(self, prefix_stats: bool = False) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "zmqllm_requests", "HTTP requests by path and status", ["path", "status"], registry=r
        )
        self.ttft = Histogram(
            "zmqllm_time_to_first_token_seconds",
            "Time to first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "zmqllm_inter_token_latency_seconds",
            "Time between streamed tokens",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.generated = Counter("zmqllm_generated_tokens", "Tokens generated", registry=r)
        self.prompt = Counter("zmqllm_prompt_tokens", "Prompt tokens received", registry=r)
        self.in_flight = Gauge(
            "zmqllm_requests_in_flight", "Generation requests being answered", registry=r
        )
        self.queued = Gauge(
            "zmqllm_requests_queued", "Generation requests waiting for a slot", registry=r
        )
        # Requests refused for a missing, malformed or wrong API key (reason: which).
        self.unauthorized = Counter(
            "zmqllm_http_unauthorized",
            "Requests refused with 401 for want of a valid API key, by reason",
            ["reason"],
            registry=r,
        )
        for reason in ("missing", "malformed", "invalid"):  # at 0 from the start, not absent
            self.unauthorized.labels(reason)
        self.failovers = Counter(
            "zmqllm_failovers",
            "Streams whose route failed, by cause (worker_lost, broker_unreachable, timeout) "
            "and outcome (recovered: continued by replay on another route; failed)",
            ["cause", "outcome"],
            registry=r,
        )
        self.failover_pause = Histogram(
            "zmqllm_failover_pause_seconds",
            "From a recovered stream's last token before its route failed to its next token",
            buckets=FAILOVER_BUCKETS,
            registry=r,
        )
        self.history = Gauge(
            "zmqllm_failover_history_tokens",
            "Token ids held to replay live streams (their prompts and tokens so far)",
            registry=r,
        )
        self.cluster = ClusterCollector(prefix_stats)
        r.register(self.cluster)

    def failover(self, event: FailoverEvent) -> None:
        outcome = "recovered" if event.recovered else "failed"
        self.failovers.labels(event.cause, outcome).inc()
        if event.recovered:
            self.failover_pause.observe(event.pause)

    def observe(self, record: RequestRecord) -> None:
        path = record.path if record.path in LABELLED_PATHS else "other"
        self.requests.labels(path, str(record.status or 0)).inc()
        if record.prompt_tokens:
            self.prompt.inc(record.prompt_tokens)
        gen = record.generation
        if gen is None:
            return
        self.generated.inc(record.generated_tokens)
        if gen.first_token_at is not None:
            self.ttft.observe(max(0.0, gen.first_token_at - record.started_at))
        for gap in gen.token_gaps:
            self.itl.observe(gap)

    def render(
        self,
        status: dict[str, Any] | None,
        in_flight: int,
        queued: int = 0,
        client_dropped: Mapping[str, int] | None = None,
        history_tokens: int = 0,
    ) -> bytes:
        self.cluster.status = status
        self.history.set(history_tokens)
        self.cluster.client_dropped = client_dropped or {}
        self.in_flight.set(in_flight)
        self.queued.set(queued)
        return generate_latest(self.registry)
