"""Issue 29 ("Operations"), end to end: what one client, one node or one page can do to
a live cluster, and what the operator sees.

Real processes on 127.0.0.1 (broker, workers for layers 0:2 and 2:4 of the tiny model,
gateway) with short deadlines so the tests are quick.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import platform
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from tests.e2e.conftest import ConfiguredCluster
from tests.e2e.stalled_readers import ended_by_server, non_reader
from tests.e2e.test_cluster import post_chat
from tests.e2e.test_hardening import leftovers
from zmqllm.bus.messages import Refused, Register
from zmqllm.bus.protocol import PROTOCOL_VERSION, decode, encode

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

WRITE_TIMEOUT = 3.0
# How long past a deadline a test waits to see its effect: generous, the machine is shared.
SLACK = 30.0


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, e2e_model: Path
) -> Iterator[ConfiguredCluster]:
    config = (
        "[gateway]\n"
        f"write_timeout = {WRITE_TIMEOUT}\n"
        # Longer than the test waits: a request held in the queue shows as a failure, not 503.
        "queue_timeout = 120\n"
    )
    c = ConfiguredCluster(tmp_path_factory.mktemp("operations"), e2e_model, config=config)
    try:
        c.start_all()
        yield c
    finally:
        c.stop()


def wait_clean(c: ConfiguredCluster, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = c.status()
        if not leftovers(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.2)


def gateway_state(c: ConfiguredCluster) -> dict[str, int]:
    with urllib.request.urlopen(f"{c.url}/cluster/status", timeout=10) as resp:
        state: dict[str, int] = json.loads(resp.read())["gateway"]
        return state


def test_clients_that_stop_reading_free_their_slots(cluster: ConfiguredCluster, reference) -> None:
    """Eight streams of n=8 hold all 64 generation slots; their clients read nothing. Each
    is cut off at write_timeout, its sessions cancelled, and a normal /chat is served."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "n": 8,
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
        # ~2 KB an event: more than the kernel buffers of a connection hold (up to 4 MB
        # for the server's end), so the writes do stop.
        "logprobs": True,
        "top_logprobs": 20,
    }
    stalled = [non_reader(cluster.http_port, body) for _ in range(8)]
    try:
        # Every slot taken before the normal request comes (else it would simply go first).
        deadline = time.monotonic() + SLACK
        while gateway_state(cluster)["in_flight"] < 64:
            assert time.monotonic() < deadline, gateway_state(cluster)
            time.sleep(0.1)
        status, chunks, _ = post_chat(cluster, "Why is the sky blue?", "max_tokens=24")
        assert status == 200
        assert b"".join(c for _, c in chunks).decode() == reference.body("Why is the sky blue?", 24)
        # All eight cut before their sockets are read: reading one not yet cut (the normal
        # request goes once the first is) would make it a client that keeps up.
        deadline = time.monotonic() + SLACK
        while gateway_state(cluster)["in_flight"]:
            assert time.monotonic() < deadline, gateway_state(cluster)
            time.sleep(0.1)
        for sock in stalled:
            assert ended_by_server(sock, SLACK), "a stalled stream's connection stayed open"
        st = wait_clean(cluster, SLACK)
        assert leftovers(st) == {}
    finally:
        for sock in stalled:
            with contextlib.suppress(OSError):
                sock.close()
    (path,) = cluster.root.glob("*-gateway.log")
    log = path.read_text()
    # "read nothing" or "read too slowly", as tests/e2e/test_slow_clients.py counts them:
    # what is asserted is that each took less than required and was cut.
    aborted = [
        json.loads(line)
        for line in log.splitlines()
        if "for write_timeout: connection aborted" in line
    ]
    assert len(aborted) == 8 and all(x["request_id"] for x in aborted)
    assert all(x["delivered_bytes"] < x["required_bytes"] for x in aborted)
    finished = [
        json.loads(line)
        for line in log.splitlines()
        if '"request finished"' in line and '"write_timeout"' in line
    ]
    assert len(finished) == 8 and all(x["status"] == 200 for x in finished)


def raw_request(
    c: ConfiguredCluster, method: str, path: str, headers: dict[str, str], body: bytes = b""
) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=30)
    try:
        # skip_host: the Host header is the test's to give.
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            conn.putheader(name, value)
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def test_pages_elsewhere_cannot_use_a_local_gateway(cluster: ConfiguredCluster) -> None:
    """DNS rebinding (a foreign Host), a cross-site POST (a foreign Origin) and a JSON body
    sent as text/plain: 400, 403, 415, and no session reaches the broker."""
    before = cluster.status()["counters"]
    chat = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).encode()
    rebound = {"Host": f"attacker.example:{cluster.http_port}"}
    for path in ("/cluster/status", "/metrics", "/v1/models"):
        status, body = raw_request(cluster, "GET", path, rebound)
        assert (status, body["error"]["code"]) == (400, "host_not_allowed"), path
    own = {"Host": f"127.0.0.1:{cluster.http_port}"}
    cross = {**own, "Origin": "https://evil.example", "Content-Type": "text/plain"}
    status, body = raw_request(cluster, "POST", "/chat", cross, b"Hi")
    assert (status, body["error"]["code"]) == (403, "origin_not_allowed")
    as_text = {**own, "Content-Type": "text/plain"}
    status, body = raw_request(cluster, "POST", "/v1/chat/completions", as_text, chat)
    assert (status, body["error"]["code"]) == (415, "unsupported_media_type")
    assert cluster.status()["counters"]["sessions_opened"] == before["sessions_opened"]
    # The gateway's own host is served as before.
    status, body = raw_request(
        cluster, "POST", "/v1/chat/completions", {**own, "Content-Type": "application/json"}, chat
    )
    assert status == 200 and body["choices"][0]["message"]["content"]


def test_megabyte_prompts_do_not_stall_a_live_stream(cluster: ConfiguredCluster) -> None:
    """Eight 1 MB prompts while a stream runs: each is refused by its size (400) without
    being tokenized, and the stream's tokens keep coming meanwhile. Tokenizing one on the
    event loop (what the gateway did) would stop every stream for as long as it takes."""
    text = "The quick brown fox jumps over the lazy dog. " * 22_000  # ~0.97 MB
    arrivals: list[float] = []
    outcome: dict[str, Any] = {}

    def stream() -> None:
        body = {"prompt": "Once", "max_tokens": 300, "ignore_eos": True, "stream": True}
        conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=120)
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        while line := resp.readline():
            if line.startswith(b"data: {"):
                arrivals.append(time.perf_counter())
                choice = json.loads(line[6:])["choices"][0]
                outcome["finish"] = choice.get("finish_reason") or outcome.get("finish")
        conn.close()

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + SLACK
    while len(arrivals) < 10:
        assert time.monotonic() < deadline and reader.is_alive(), "the stream did not start"
        time.sleep(0.01)
    sent_at = time.perf_counter()
    big = [("/chat", text.encode(), "text/plain")]
    big.append(("/v1/completions", json.dumps({"prompt": text}).encode(), "application/json"))
    for path, body, kind in big * 4:
        conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=60)
        conn.request("POST", path, body, {"Content-Type": kind})
        resp = conn.getresponse()
        error = json.loads(resp.read())["error"]
        conn.close()
        assert (resp.status, error["code"]) == (400, "context_length_exceeded"), path
        # Refused by its size in bytes: the refusal after tokenizing counts tokens.
        assert f"the prompt is {len(text.encode())} bytes" in error["message"], error
    done_at = time.perf_counter()
    reader.join(timeout=120)
    assert outcome.get("finish") == "length"
    # Tokens came while the big requests were in flight (at least one: not a rate).
    assert any(sent_at <= t <= done_at for t in arrivals), (sent_at, done_at, arrivals[-1])


def zmqllm_status(c: ConfiguredCluster, *flags: str) -> subprocess.CompletedProcess[str]:
    base = [sys.executable, "-m", "zmqllm.cli", "status", "--broker", c.frontend, "--insecure"]
    return subprocess.run(
        [*base, *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_status_shows_each_nodes_build_and_resources(cluster: ConfiguredCluster) -> None:
    import numpy
    import torch

    st = json.loads(zmqllm_status(cluster, "--json").stdout)
    for w in st["workers"]:
        build, stats = w["build"], w["stats"]
        assert build["torch"] == torch.__version__ and build["numpy"] == numpy.__version__
        assert build["protocol"] == PROTOCOL_VERSION and build["quant"] == "none"
        assert build["python"] == platform.python_version()
        assert len(build["kernel"]) == 16 or build["kernel"] == "none"
        for key in ("rss_bytes", "cpu_s", "net_rx_bytes", "net_tx_bytes", "kv_bytes_used"):
            assert key in stats, key
        assert stats["net_rx_bytes"] > 0 and stats["net_tx_bytes"] > 0
    text = zmqllm_status(cluster).stdout
    assert "resources (from heartbeats)" in text and "hosts" in text
    assert "(none: every pool's replicas agree)" in text
    drift = zmqllm_status(cluster, "--drift")
    assert drift.returncode == 0, drift.stdout


def test_drift_is_shown_and_another_quant_or_protocol_is_refused(
    cluster: ConfiguredCluster,
) -> None:
    """A second replica of layers 0:2 that sends bfloat16 activations joins and shows as
    drift (status --drift exits 1 naming it); one in int8 is refused, naming the quant;
    a REGISTER of another protocol version gets a REFUSED naming both versions."""
    drifting = cluster.start_worker("0:2", name="w-drift", flags=("--wire-dtype", "bfloat16"))
    refused = cluster.start_worker("0:2", name="w-int8", flags=("--quant", "int8"))
    try:
        cluster.wait_for(
            lambda: any("w-drift" in w["id"] for w in cluster.status()["workers"]),
            timeout=120,
            what="the bfloat16 replica registered",
        )
        shown = zmqllm_status(cluster, "--drift")
        assert shown.returncode == 1, shown.stdout
        assert "layers 0:2  wire_dtype differs: auto: " in shown.stdout
        assert "bfloat16: w-w-drift-0-2-" in shown.stdout
        assert refused.wait(timeout=120) == 3  # the worker's exit status when refused
        assert "quant int8 differs from its pool's none" in refused.text()
        assert not any("w-int8" in w["id"] for w in cluster.status()["workers"])
    finally:
        for proc in (drifting, refused):
            if proc.alive():
                cluster.kill(proc)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(cluster.backend)
        register = Register(
            start=0, end=2, num_layers=4, capacity=1, max_kv_tokens=64, context=64,
            version="x", fingerprint="x",
        )  # fmt: skip
        head, *rest = encode(register)
        sock.send_multipart([msgpack.packb({**msgpack.unpackb(head), "v": 99}), *rest])
        assert sock.poll(10_000), "no answer to a REGISTER of another protocol version"
        answer = decode(sock.recv_multipart())
        assert isinstance(answer, Refused)
        assert f"protocol version 99 differs from the broker's {PROTOCOL_VERSION}" in answer.reason
    finally:
        sock.close()
    cluster.wait_for(lambda: len(cluster.status()["workers"]) == 2, timeout=30, what="cleanup")


def test_one_api_key_cannot_hold_more_than_its_share(tmp_path: Path, e2e_model: Path) -> None:
    """Two API keys, a share of two slots each: key A's stream of n=2 holds its share, so
    its next request gets 429 with Retry-After at once, while key B is served."""
    keys = tmp_path / "api-keys.txt"
    keys.write_text("sk-share-a-1\nsk-share-b-2\n")
    c = ConfiguredCluster(
        tmp_path / "shares",
        e2e_model,
        config=f'[gateway]\napi_keys_file = "{keys}"\nkey_max_concurrent = 2\n',
    )
    try:
        c.start_all()

        def post(key: str, body: dict[str, Any]) -> http.client.HTTPResponse:
            conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=60)
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
            conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
            return conn.getresponse()

        long = {"messages": [{"role": "user", "content": "Go on."}], "n": 2,
                "max_tokens": 900, "ignore_eos": True, "stream": True}  # fmt: skip
        short = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        held = post("sk-share-a-1", long)
        assert held.status == 200 and held.readline()  # streaming: both slots held
        over = post("sk-share-a-1", short)
        error = json.loads(over.read())["error"]
        assert over.status == 429 and over.getheader("Retry-After")
        assert error["code"] == "key_share_exceeded"
        other = post("sk-share-b-2", short)
        assert other.status == 200 and json.loads(other.read())["choices"]
        held.close()
    finally:
        c.stop()
