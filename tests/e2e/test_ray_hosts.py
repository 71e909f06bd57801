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
no actor and no zmqllm process. A stage that cannot start (its memory cannot hold it) is
started again with `zmqllm up`'s backoff and shown failing by `zmqllm ray status`, its
actor never restarted by Ray; a config with [[remotes]] is refused. Ray nodes are
stopped by process id only.
"""

from __future__ import annotations

import json
import re
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
from tests.e2e.test_hosts import SseStream, chat

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
        return chat(self, prompt, max_tokens)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, e2e_model: Path) -> Iterator[dict[str, Any]]:
    pytest.importorskip("ray")
    reason = unusable_reason()
    if reason is not None:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("ray-hosts")
    bed = Testbed(4)
    home = {h.index: root / f"host{h.index}" for h in bed.hosts}
    from zmqllm.config.paths import zmqllm_home

    for path in home.values():
        path.mkdir()
        # The compiled kernels e2e_model built, as a node's image would carry them (each
        # node builds its own otherwise, which takes minutes: docs/operations.md).
        if (zmqllm_home() / "kernels").is_dir():
            shutil.copytree(zmqllm_home() / "kernels", path / "kernels")
    config = root / "ray.toml"
    config.write_text(
        f'[model]\npath = "{e2e_model}"\n'
        '[ray]\nstrategy = "STRICT_SPREAD"\nready_timeout = 240\n'
        # The gateway binds the head's address, and the test's clients have no API keys.
        "[gateway]\nfailover_timeout = 90\nopen_api = true\n"
        '[[stages]]\nlayers = "0:2"\ncpus = 1\nmemory = "2GiB"\n'
        '[[stages]]\nlayers = "2:4"\ncpus = 1\nmemory = "2GiB"\n'
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
        nodes.wait_alive(1)
        for i in (2, 3, 4):  # one at a time: nodes joining at once can time out on 2 cores
            nodes.start(bed.host(i))
            nodes.wait_alive(i)
        for h in bed.hosts:  # what Ray itself costs a node, idle (nothing of ours yet)
            print(f"idle Ray node on host {h.index}: {rss_mib(h.pids()):.0f} MiB RSS")
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


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def children(pid: int) -> list[int]:
    done = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()]


def is_role(pid: int) -> bool:
    """Whether ``pid`` is a zmqllm broker, worker or gateway."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:  # gone meanwhile
        return False
    return re.search(r"zmqllm\.cli\x00(broker|worker|gateway)\b", argv) is not None


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def wait_until(check: Any, timeout: float, what: str) -> float:
    """Seconds until ``check()`` is true."""
    begun = time.monotonic()
    while not check():
        if time.monotonic() - begun > timeout:
            raise AssertionError(f"not {what} after {timeout:g} s")
        time.sleep(0.25)
    return time.monotonic() - begun


def actor(c: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((r for r in ray_status(c) if r["name"] == name), None)


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

    # The worker's own process killed: its actor starts it again after `zmqllm up`'s
    # first backoff (0.5 s), in place (Ray does not restart the actor); it registers
    # again and serves exactly.
    before = actor(c, "worker-2-4-0")
    assert before is not None
    (role_pid,) = children(before["pid"])
    killed = time.monotonic()
    subprocess.run(["kill", "-9", str(role_pid)], check=True)

    def role_restarted(old: dict[str, Any]) -> bool:
        now = actor(c, old["name"])
        return now is not None and now["starts"] > old["starts"] and now["role_state"] == "running"

    wait_until(lambda: role_restarted(before), 120, "its role restarted")
    # A request waits in the gateway's queue for a complete route: served once the
    # restarted worker has registered.
    assert gw.chat(PROMPTS[1], 24) == reference.body(PROMPTS[1], 24)
    print(f"worker SIGKILL -> served again in {time.monotonic() - killed:.1f} s")
    after = actor(c, "worker-2-4-0")
    assert after["node_ip"] == before["node_ip"] and after["pid"] == before["pid"]
    assert after["restarts"] == before["restarts"] and after["last_exit"] == "killed by SIGKILL"
    # The actor's process killed instead: its role process goes with it (no orphan), and
    # Ray starts the actor again (and with it the role).
    before = actor(c, "worker-2-4-0")
    (role_pid,) = children(before["pid"])
    subprocess.run(["kill", "-9", str(before["pid"])], check=True)
    wait_until(lambda: not alive(role_pid), 30, "the orphaned worker gone")

    def restarted(old: dict[str, Any]) -> bool:
        now = actor(c, old["name"])
        return now is not None and now["restarts"] > old["restarts"] and now["state"] == "ALIVE"

    wait_until(lambda: restarted(before), 120, "restarted")
    assert gw.chat(PROMPTS[0], 24) == reference.body(PROMPTS[0], 24)

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
    # Of the test's own hosts: other runs may serve from this machine meanwhile.
    left = [pid for h in c["bed"].hosts for pid in h.pids() if is_role(pid)]
    assert left == [], left


def test_a_stage_that_cannot_start_backs_off_and_ray_status_shows_it_failing(
    cluster: dict[str, Any], e2e_model: Path
) -> None:
    """A stage whose memory cannot hold it exits at once, every time. Its actor starts it
    again with `zmqllm up`'s backoff (0.5 s doubling; failing at the 5th exit within a
    minute) instead of ending itself for Ray to restart at once, for ever; `zmqllm ray
    status` says so. And a config with [[remotes]] is refused, naming them."""
    c = cluster
    address = c["nodes"].address
    c["zmqllm"]("ray", "down", "--address", address)  # whatever an earlier test left
    remotes = c["config"].parent / "remotes.toml"
    remotes.write_text(
        f'[model]\npath = "{e2e_model}"\n[[stages]]\nlayers = "0:4"\n'
        '[[remotes]]\nurl = "http://198.18.0.9:8000/v1"\nserved_name = "elsewhere"\n'
    )
    done = c["zmqllm"]("ray", "up", "--config", str(remotes), "--address", address)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "[[remotes]] #1 (served_name elsewhere" in done.stderr and ray_status(c) == []

    # 256 MiB: Ray places it (a node has 3 GiB), the worker's own plan refuses it (its
    # runtime alone takes 0.75 GiB): "stage 0:4 does not fit", exit, every time.
    tight = c["config"].parent / "tight.toml"
    tight.write_text(
        f'[model]\npath = "{e2e_model}"\n[ray]\nready_timeout = 20\n'
        '[gateway]\nopen_api = true\n[[stages]]\nlayers = "0:4"\ncpus = 1\nmemory = "256MiB"\n'
    )
    up = c["zmqllm"]("ray", "up", "--config", str(tight), "--address", address)
    assert up.returncode == 1 and "not ready after 20s" in up.stderr, up.stdout + up.stderr
    name = "worker-0-4-0"

    def role() -> dict[str, Any]:
        row = actor(c, name)
        assert row is not None, ray_status(c)
        return row

    waited = wait_until(lambda: role()["role_state"] == "failing", 150, "failing")
    first = role()
    print(f"a stage that does not fit: failing {waited:.0f} s after `ray up` returned: {first}")
    assert first["exits"] >= 5 and first["last_exit"].startswith("exited with code")
    time.sleep(30)
    later = role()
    table = c["zmqllm"]("ray", "status", "--address", address)
    print(table.stdout)
    # Ray never restarted the actor (it used to, once per exit); the role was started
    # again at most twice in those 30 s (backoffs of 8, 16, then 32 s).
    assert later["restarts"] == first["restarts"] == 0, later
    assert later["starts"] - first["starts"] <= 2, (first, later)
    assert later["role_state"] == "failing"
    line = next(x for x in table.stdout.splitlines() if x.startswith(name))
    assert "FAILING" in line and "exited with code" in line, table.stdout
    assert table.stdout.splitlines()[1].startswith(name)  # failing roles first
    logs = c["home"]
    log_text = "".join(
        p.read_text(errors="replace") for i in logs for p in logs[i].glob(f"logs/ray/{name}.log")
    )
    assert "does not fit" in log_text and "it is failing; restarting it in" in log_text

    down = c["zmqllm"]("ray", "down", "--address", address)
    assert down.returncode == 0, down.stderr
    assert ray_status(c) == []
    left = [pid for h in c["bed"].hosts for pid in h.pids() if is_role(pid)]
    assert left == [], left
