"""Tickets between real processes: `zmqllm ticket` on the broker's side, `zmqllm worker
--join` with a $ZMQLLM_HOME of its own standing in for another machine: on this host
(the endpoint loopback), and across test hosts (network namespaces, testbed/netns.py).

Proven: a worker given nothing but the ticket (from a file) serves the layers the broker
lacked and the cluster's greedy text equals HF's, also through a second gateway that
joined by a client ticket; the tickets' secrets show in no log line, no `ps` output, no
status and no metrics; `zmqllm keys revoke` drops that worker at once. A forged, an
expired and a revoked ticket (the last read from stdin) are each refused with their
message, before any model loads, and leave nothing stored and nothing registered. On
another test host, a ticket issued for the broker's address does the same as on this one.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.cluster import Cluster, free_port
from testbed.hosts import REPO, HostCluster, zmqllm_command
from testbed.netns import Testbed, unusable_reason
from zmqllm.bus.keys import init_keys
from zmqllm.bus.tickets import decode_ticket
from zmqllm.config.paths import zmqllm_home
from zmqllm.launch.child_process import ChildProcess, spawn

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

PROMPT = "Tell me a story about a robot."
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def ticketed(tmp_path_factory: pytest.TempPathFactory, e2e_model: Path) -> Iterator[Cluster]:
    """Broker (CURVE), a worker of layers 0:2 with the cluster's own key, the gateway:
    layers 2:4 are missing until a ticket brings them."""
    root = tmp_path_factory.mktemp("tickets")
    c = Cluster(root / "cluster", e2e_model, keys=init_keys(root / "keys"))
    try:
        c.start_broker()
        c.start_worker("0:2")
        c.start_gateway()
        c.wait_for(lambda: len(c.status()["workers"]) == 1, 120, "the first stage")
        yield c
    finally:
        c.stop()


def zmqllm(*args: str, home: Path | None = None, stdin: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if home is not None:
        env["ZMQLLM_HOME"] = str(home)
    cmd = [sys.executable, "-m", "zmqllm.cli", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=env, timeout=120)


def issue(c: Cluster, *flags: str, keys: Path | None = None) -> str:
    """`zmqllm ticket` on the broker's side: its one line of stdout."""
    done = zmqllm(
        "ticket",
        *("--frontend", c.frontend, "--backend", c.backend, "--model", str(c.model_dir)),
        *("--keys", str(keys or c.keys), "--timeout", "2", *flags),
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("zmqllm-ticket-1."), done.stdout
    return lines[0]


def other_machine(c: Cluster, name: str) -> Path:
    """A $ZMQLLM_HOME for a joining worker: empty but for the compiled kernels (built
    once per test run, whatever home asks)."""
    home = c.root / "homes" / name
    home.mkdir(parents=True)
    (home / "kernels").symlink_to(zmqllm_home() / "kernels", target_is_directory=True)
    return home


def saved(c: Cluster, name: str, line: str) -> Path:
    path = c.root / f"{name}.ticket"
    path.write_text(line + "\n")
    path.chmod(0o600)
    return path


def post_chat(c: Cluster, prompt: str, max_tokens: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=120)
    try:
        conn.request("POST", f"/chat?max_tokens={max_tokens}", body=prompt.encode())
        resp = conn.getresponse()
        assert resp.status == 200
        return resp.read().decode()
    finally:
        conn.close()


def shown_anywhere(c: Cluster, secret: str, ours: Cluster | None = None) -> list[str]:
    """Where ``secret`` shows: the processes' logs (``ours``' when ``c`` is only another
    gateway's address), `ps`, the broker's status, the gateway's metrics and pages,
    `zmqllm status`."""
    keyed = ours or c
    where = [p.name for p in keyed.procs if secret in p.text()]
    ps = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout
    where += ["ps"] if secret in ps else []
    where += ["status"] if secret in json.dumps(keyed.status()) else []
    for path in ("/metrics", "/cluster/status", "/ready", "/health"):
        where += [path] if secret in c.get(path)[1].decode(errors="replace") else []
    shown = zmqllm("status", "--broker", keyed.frontend, "--keys", str(keyed.keys), "--json")
    where += ["zmqllm status"] if secret in shown.stdout + shown.stderr else []
    return where


def test_a_worker_joins_by_ticket_alone_and_serves(ticketed: Cluster, reference) -> None:
    c = ticketed
    line = issue(c, "--name", "joiner")  # --layers auto: what the broker lacks
    ticket = decode_ticket(line)
    assert ticket.layers == "2:4" and ticket.endpoint == c.backend
    home = other_machine(c, "joiner")
    argv = [sys.executable, "-m", "zmqllm.cli", "worker", "--join", f"@{saved(c, 'joiner', line)}"]
    argv += [*c.beats(), "--threads", "1", "--log-format", "json"]
    env = {**os.environ, "ZMQLLM_HOME": str(home)}
    worker: ChildProcess = spawn("worker-joined", argv, c.root / "worker-joined.log", env=env)
    c.procs.append(worker)
    c.wait_ready(timeout=120)
    assert post_chat(c, PROMPT, MAX_TOKENS) == reference.body(PROMPT, MAX_TOKENS)
    layers = sorted(w["layers"] for w in c.status()["workers"])
    assert layers == [[0, 2], [2, 4]]
    stored = home / "tickets" / "joiner"
    assert (stored / "worker.key_secret").stat().st_mode & 0o777 == 0o600
    assert ticket.secret.decode() in (stored / "worker.key_secret").read_text()
    # A gateway on another machine, by a client ticket: the same answer through it.
    app_line = issue(c, "--client", "--name", "app")
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "zmqllm.cli",
        "gateway",
        "--join",
        f"@{saved(c, 'app', app_line)}",
    ]
    argv += ["--port", str(port), *c.beats(), "--log-format", "json"]
    env = {**os.environ, "ZMQLLM_HOME": str(other_machine(c, "app"))}
    c.procs.append(spawn("gateway-joined", argv, c.root / "gateway-joined.log", env=env))
    there = Cluster(c.root / "there", c.model_dir)  # only that gateway's address: no processes
    there.http_port, there.url = port, f"http://127.0.0.1:{port}"
    there.wait_ready(timeout=120)
    assert post_chat(there, PROMPT, MAX_TOKENS) == reference.body(PROMPT, MAX_TOKENS)
    for secret in (ticket.secret.decode(), line, decode_ticket(app_line).secret.decode()):
        assert shown_anywhere(c, secret) == []
        assert shown_anywhere(there, secret, ours=c) == []
    # Revoked: the worker is dropped at once, and says why as it leaves.
    revoked_at = time.monotonic()
    done = zmqllm("keys", "revoke", "joiner", "--keys", str(c.keys))
    assert done.returncode == 0, done.stderr
    assert worker.wait(timeout=30) == 3
    assert time.monotonic() - revoked_at < 5.0
    assert "the key 'joiner' was revoked" in worker.text()
    assert [w["layers"] for w in c.status()["workers"]] == [[0, 2]]


def refused(c: Cluster, name: str, line: str, via_stdin: bool = False) -> str:
    """`zmqllm worker --join` on a machine of its own: refused, nothing stored or
    registered; its stderr."""
    home = other_machine(c, name)
    before = sorted(w["id"] for w in c.status()["workers"])
    started = time.monotonic()
    if via_stdin:
        done = zmqllm("worker", "--join", "-", home=home, stdin=line + "\n")
    else:
        done = zmqllm("worker", "--join", f"@{saved(c, name, line)}", home=home)
    assert done.returncode == 2, done.stdout + done.stderr
    assert time.monotonic() - started < 60  # before any model would load
    assert not (home / "tickets").exists()
    assert sorted(w["id"] for w in c.status()["workers"]) == before
    assert decode_ticket(line).secret.decode() not in done.stdout + done.stderr
    return done.stderr


def test_forged_expired_and_revoked_tickets_are_refused(ticketed: Cluster) -> None:
    c = ticketed
    # Forged: made with a key folder of its own that copied this broker's public key.
    other = init_keys(c.root / "forger-keys")
    (other / "broker.key").write_bytes((c.keys / "broker.key").read_bytes())  # type: ignore[operator]
    forged = issue(c, "--layers", "2:4", "--name", "forged", keys=other)
    assert "not made by that broker (forged)" in refused(c, "forged", forged)
    late = issue(c, "--layers", "2:4", "--name", "late", "--expires", "1s")
    time.sleep(1.5)
    assert "ticket 'late' expired at" in refused(c, "late", late)
    gone = issue(c, "--layers", "2:4", "--name", "gone")
    assert zmqllm("keys", "revoke", "gone", "--keys", str(c.keys)).returncode == 0
    assert "the key 'gone' was revoked" in refused(c, "gone", gone, via_stdin=True)
    broker = next(p for p in c.procs if p.name == "broker")
    for line in (forged, late, gone):
        assert decode_ticket(line).secret.decode() not in broker.text()


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory, e2e_model: Path) -> Iterator[HostCluster]:
    """Host 1: broker and gateway; host 2: layers 0:2 (a key copied there by hand, as
    before tickets); host 3 joins by ticket in the test."""
    reason = unusable_reason()
    if reason is not None:
        pytest.skip(reason)
    bed = Testbed(3)
    c = HostCluster(bed, tmp_path_factory.mktemp("ticket-hosts"), e2e_model, {"0:2": 2})
    try:
        bed.up()
        c.make_keys()
        c.start_broker()
        c.start_worker("0:2", 2, c.backend)
        c.start_gateway()
        c.wait_for(lambda: len(c.status()["workers"]) == 1, 120, "the first stage")
        yield c
    finally:
        c.stop()
        bed.close()


def test_a_worker_on_another_host_joins_by_ticket(hosts: HostCluster, reference) -> None:
    c = hosts
    args = ["ticket", "--keys", str(c.keys), "--frontend", c.frontend, "--backend", c.backend]
    done = c.head.run(*zmqllm_command(), *args, "--model", str(c.model_dir))
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert decode_ticket(line).endpoint == f"tcp://{c.head.address}:5556"
    third = c.bed.host(3)
    home = c.folder(3) / "home"
    home.mkdir()
    (home / "kernels").symlink_to(zmqllm_home() / "kernels", target_is_directory=True)
    path = c.folder(3) / "ticket"
    path.write_text(line + "\n")
    argv = [*zmqllm_command(), "worker", "--join", f"@{path}", *c.beats(), "--log-format", "json"]
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "ZMQLLM_HOME": str(home), "PYTHONPATH": pythonpath}
    c.procs.append(spawn("worker-joined", third.command(*argv), c.folder(3) / "w.log", env=env))
    c.wait_ready(timeout=120)
    conn = c.http()
    try:
        conn.request("POST", f"/chat?max_tokens={MAX_TOKENS}", PROMPT.encode())
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.read().decode() == reference.body(PROMPT, MAX_TOKENS)
    finally:
        conn.close()
    assert sorted(w["layers"] for w in c.status()["workers"]) == [[0, 2], [2, 4]]
