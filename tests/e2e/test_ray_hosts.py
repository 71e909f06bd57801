"""`zmqllm ray up` on a real multi-node Ray cluster: three test hosts, each a Ray node.

Host 1 is the head (no CPUs of its own: only the broker and the gateway, which ask for
none, go there); hosts 2 and 3 each have one CPU, and a third worker host is the spare.
Each host has its own ZMQLLM_HOME (its keys: the head's from `zmqllm keys init`, each
worker host a worker key issued to it and copied there, as an operator would). The
driver, `zmqllm ray up`, runs inside host 1. Two stages of the tiny model on two
different nodes (STRICT_SPREAD): greedy text equals HF's; every process of one stage's
node killed (the host dies) -> the stage comes back on the spare node and a stream in
flight completes token-identically through failover by replay; a stage asking for more
memory than any node has -> a clear error naming the resource; `zmqllm ray down` leaves
no actor and no zmqllm process. Ray nodes are stopped by process id only.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed.hosts import NetnsHTTPConnection, zmqllm_command
from testbed.netns import Host, Testbed, unusable_reason
from testbed.raynodes import RayNodes
from tests.e2e.expected import sent_text
from tests.e2e.test_hosts import SseStream

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

PORT = 8080
PROMPTS = ["Why is the sky blue?", "Count to five."]


class Gateway:
    """What SseStream needs: connections to the gateway, made from the head."""

    def __init__(self, host: Host, address: str) -> None:
        self.host, self.address = host, address

    def http(self, timeout: float = 60.0) -> NetnsHTTPConnection:
        return NetnsHTTPConnection(self.host, self.address, PORT, timeout)

    def chat(self, prompt: str, max_tokens: int) -> str:
        conn = self.http()
        try:
            conn.request("POST", f"/chat?max_tokens={max_tokens}", prompt.encode())
            resp = conn.getresponse()
            assert resp.status == 200
            return resp.read().decode()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, e2e_model: Path) -> Iterator[dict[str, Any]]:
    pytest.importorskip("ray")
    reason = unusable_reason()
    if reason is not None:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("ray-hosts")
    bed = Testbed(4)
    home = {h.index: root / f"host{h.index}" for h in bed.hosts}
    for path in home.values():
        path.mkdir()
    config = root / "ray.toml"
    config.write_text(
        f'[model]\npath = "{e2e_model}"\n'
        '[ray]\nstrategy = "STRICT_SPREAD"\nready_timeout = 240\n'
        "[gateway]\nfailover_timeout = 90\n"
        '[[stages]]\nlayers = "0:2"\ncpus = 1\nmemory = "1GiB"\n'
        '[[stages]]\nlayers = "2:4"\ncpus = 1\nmemory = "1GiB"\n'
    )
    nodes = RayNodes(bed.hosts, home)
    head = bed.host(1)

    def zmqllm(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        env = nodes.environment(1)
        return subprocess.run(
            head.command(*zmqllm_command(), *args),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )

    try:
        bed.up()
        keys = home[1] / "keys"
        assert zmqllm("keys", "init", str(keys)).returncode == 0
        for i in (2, 3, 4):
            done = zmqllm("keys", "add", "worker", f"host-{i}", "--keys", str(keys))
            assert done.returncode == 0, done.stderr
            shutil.copytree(keys / "issued" / f"host-{i}", home[i] / "keys")
        nodes.start(head, head=True, cpus=0)
        time.sleep(3)
        for i in (2, 3, 4):
            nodes.start(bed.host(i))
        yield {
            "bed": bed,
            "nodes": nodes,
            "zmqllm": zmqllm,
            "config": config,
            "gateway": Gateway(head, head.address),
            "home": home,
        }
    finally:
        with_logs = [home[i] / "ray-node.log" for i in home]
        for log in with_logs:
            if log.exists():
                print(f"--- {log}\n{log.read_text()[-2000:]}")
        nodes.stop()
        bed.close()


def ray_status(c: dict[str, Any]) -> list[dict[str, Any]]:
    done = c["zmqllm"]("ray", "status", "--json", "--address", c["nodes"].address)
    assert done.returncode == 0, done.stderr
    return [r for r in json.loads(done.stdout) if r.get("state") == "ALIVE"]


def worker_hosts(c: dict[str, Any]) -> dict[str, str]:
    """Live worker actor -> the address of its node."""
    return {r["name"]: r["node_ip"] for r in ray_status(c) if r["name"].startswith("worker-")}


def test_ray_up_serves_restarts_a_dead_host_and_comes_down(
    cluster: dict[str, Any], reference: Any, greedy_ids: Any
) -> None:
    c = cluster
    address = c["nodes"].address
    # Too big for any node: refused at once, naming the resource.
    big = c["config"].parent / "big.toml"
    big.write_text('[[stages]]\nlayers = "0:2"\nmemory = "512GiB"\n')
    done = c["zmqllm"]("ray", "up", "--config", str(big), "--address", address)
    assert done.returncode == 2
    assert "asks for memory 512.0 GiB; the largest node has" in done.stderr, done.stderr

    begun = time.monotonic()
    up = c["zmqllm"]("ray", "up", "--config", str(c["config"]), "--address", address)
    assert up.returncode == 0, up.stdout + up.stderr
    print(f"ray up: ready in {time.monotonic() - begun:.1f} s\n{up.stdout}")
    assert "curl" in up.stdout
    gw: Gateway = c["gateway"]
    for prompt in PROMPTS:
        assert gw.chat(prompt, 24) == reference.body(prompt, 24), prompt
    placed = worker_hosts(c)
    assert sorted(placed) == ["worker-0-2-0", "worker-2-4-0"]
    assert len(set(placed.values())) == 2, placed  # two different nodes
    assert c["bed"].host(1).address not in placed.values()

    # A stream in flight; then the host of its first stage dies.
    stream = SseStream(gw)  # type: ignore[arg-type]
    deadline = time.monotonic() + 60
    while stream.tokens < 5 and stream.thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    victim_ip = placed["worker-0-2-0"]
    victim = next(h for h in c["bed"].hosts if h.address == victim_ip)
    killed = time.monotonic()
    c["nodes"].kill_node(victim)
    stream.thread.join(timeout=240)
    assert not stream.thread.is_alive() and stream.exc is None, stream.exc
    tok = reference.tokenizer
    from tests.e2e.test_hosts import LONG_PROMPT, LONG_TOKENS

    want = greedy_ids(tok.encode(LONG_PROMPT), LONG_TOKENS, stop_at_eos=False)
    assert stream.error is None and stream.done, stream.error
    assert stream.text == sent_text(tok, want)
    moved = worker_hosts(c)
    print(f"stage 0:2 back on {moved.get('worker-0-2-0')} {time.monotonic() - killed:.1f} s after")
    assert moved.get("worker-0-2-0") not in (None, victim_ip), moved
    assert gw.chat(PROMPTS[0], 24) == reference.body(PROMPTS[0], 24)

    down = c["zmqllm"]("ray", "down", "--address", address)
    assert down.returncode == 0, down.stderr
    assert ray_status(c) == []
    left = subprocess.run(
        ["pgrep", "-f", "zmqllm.cli (broker|worker|gateway)"], capture_output=True
    )
    assert left.stdout.strip() == b"", left.stdout
