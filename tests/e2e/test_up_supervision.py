"""`zmqllm up` keeps its cluster serving: a SIGKILLed broker or worker is started again and
answers are exact again (a stream running through a killed broker too, replayed by the
gateway); a child that cannot stay up stops everything with its last words. Real `up`
processes on the tiny model (see up_runner.py)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from tests.e2e.expected import sent_text
from tests.e2e.up_runner import UpRun, alive

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.torch,
    pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc"),
]

PROMPT = "Why is the sky blue?"


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, e2e_model: Path) -> Iterator[UpRun]:
    """One `zmqllm up` (broker, workers 1/2 and 2/2, gateway) for the module's tests: each
    kills a child and leaves the cluster healed again, which is what it checks."""
    run = UpRun(tmp_path_factory.mktemp("up"), e2e_model).start()
    try:
        run.wait_up()
        yield run
    finally:
        code = run.stop()
    assert code == 0, run.stderr()


def killed_and_restarted(up: UpRun, name: str) -> int:
    """SIGKILL child ``name`` of `up` and wait for `up` to start it again: the new pid."""
    old = up.pids()[name]
    os.killpg(old, signal.SIGKILL)
    up.wait_for(
        lambda: f"{name} killed by SIGKILL; restarting it in 0.5 s" in up.stderr(),
        f"the restart of {name} announced",
    )
    up.wait_for(lambda: up.pids().get(name, old) != old, f"a new {name} process")
    new = up.pids()[name]
    assert f"{name} started again (pid {new})" in up.stderr()
    return new


def test_a_killed_broker_comes_back_on_its_ports_and_the_workers_register_again(
    up: UpRun, reference
) -> None:
    before = up.pids()
    workers = sorted(pid for name, pid in before.items() if name.startswith("worker-"))
    assert len(workers) == 2 and sorted(up.worker_pids()) == workers
    killed_and_restarted(up, "broker")
    # The new broker answers on the same frontend, and the same two worker processes
    # (not restarted: they found it on the same backend) are registered with it.
    up.wait_for(lambda: up.worker_pids() == workers, "both workers registered again")
    assert {name: pid for name, pid in up.pids().items() if name != "broker"} == {
        name: pid for name, pid in before.items() if name != "broker"
    }
    up.wait_for(up.ready, "/ready 200 again")
    assert up.chat(PROMPT, 16) == (200, reference.body(PROMPT, 16))


def test_a_killed_worker_is_started_again_and_the_route_comes_back(up: UpRun, reference) -> None:
    other = up.pids()["worker-1of2-0"]
    new = killed_and_restarted(up, "worker-2of2-0")
    # The broker forgets the dead worker (heartbeats) and registers its successor.
    up.wait_for(lambda: up.worker_pids() == sorted([other, new]), "the new worker registered")
    up.wait_for(up.ready, "/ready 200 again")
    assert up.chat(PROMPT, 16) == (200, reference.body(PROMPT, 16))
    # Its log goes on after the killed run's lines instead of starting over.
    log = (up.logs / "worker-2of2-0.log").read_text()
    assert log.count('"shard loaded"') == 2


def recovered_failovers(up: UpRun) -> float:
    """Streams the gateway carried on through a fresh route after losing the broker."""
    name = 'zmqllm_failovers_total{cause="broker_unreachable",outcome="recovered"}'
    with urllib.request.urlopen(f"{up.url}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def test_a_stream_survives_a_broker_killed_mid_way(up: UpRun, greedy_ids) -> None:
    """The broker dies under a running stream; `up` starts it again, the gateway replays
    the session on a route through the new broker, and the text is HF's all the same."""
    from zmqllm.models.tokenizer import Tokenizer

    up.wait_for(up.ready, "/ready 200")
    tok = Tokenizer.from_dir(up.model)
    expected = sent_text(tok, greedy_ids(tok.encode(PROMPT), 400, stop_at_eos=False))
    before = recovered_failovers(up)
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", up.port, timeout=120)
    killed, events, text = False, 0, []
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        assert resp.status == 200
        while line := resp.readline():
            if line.startswith(b"data: {"):
                event = json.loads(line[len(b"data: ") :])
                assert "error" not in event, event
                text.append(event["choices"][0].get("text") or "")
                events += 1
                if events == 8:  # mid-stream: most of the 400 tokens are still to come
                    os.killpg(up.pids()["broker"], signal.SIGKILL)
                    killed = True
    finally:
        conn.close()
        # Whatever the outcome, the cluster heals before the module's `up` is stopped.
        up.wait_for(lambda: len(up.worker_pids()) == 2 and up.ready(), "the cluster healed")
    assert killed, "the stream ended before the kill"
    assert "".join(text) == expected
    assert recovered_failovers(up) == before + 1  # replayed, not undisturbed


def test_a_child_that_never_stays_up_stops_everything(tmp_path: Path, e2e_model: Path) -> None:
    # A typo in the config: the gateway refuses to start without its API key file, at
    # once, every time (and fast: it stops before loading anything).
    missing = tmp_path / "api-keys-typo"
    run = UpRun(
        tmp_path / "up", e2e_model, stages=("1/1",), gateway=f'api_keys_file = "{missing}"'
    ).start()
    started: set[int] = set()  # every child `up` started, to check none is left
    try:
        # Five starts with 7.5 s of backoff between them: the deadline is a generous bound.
        deadline = time.monotonic() + 180
        while run.running().poll() is None:
            started.update(run.pids().values())
            assert time.monotonic() < deadline, f"up still running:\n{run.stderr()}"
            time.sleep(0.2)
        err = run.stderr()
        assert run.running().returncode == 1, err
        assert "zmqllm is up" not in run.stdout()
        for n, delay in enumerate(["0.5", "1", "2", "4"], start=1):
            assert f"gateway exited with code 2; restarting it in {delay} s ({n}" in err, err
        log = run.logs / "gateway.log"
        assert (
            "gateway exited with code 2, its 5th exit within 60 s: it does not stay up, "
            f"so `zmqllm up` stops everything\nlast lines of {log}:\n"
        ) in err
        why = f"zmqllm gateway: API key file {missing}: cannot read it"
        assert why in err.split(f"last lines of {log}:")[1]  # from its log
        assert log.read_text().count(why) == 5  # one log, every run in it
        assert [pid for pid in started if alive(pid)] == []
    finally:
        run.stop()


def test_a_remote_model_whose_upstream_is_down_stops_nothing_else(
    tmp_path: Path, e2e_model: Path, reference
) -> None:
    """A [[remotes]] entry whose upstream answers nothing: its worker exits at every start.
    It is marked failing and backed off; the local model goes on serving, `/ready` and
    `zmqllm status` name the failing child, and `up` keeps running."""
    from testbed.cluster import free_port

    down = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    run = UpRun(tmp_path / "up", e2e_model, stages=("1/1",), extra=f'[[remotes]]\nurl = "{down}"\n')
    run.start()
    try:
        run.wait_up()
        # Its 5th exit within a minute: 0.5 + 1 + 2 + 4 s of backoff and five starts.
        run.wait_for(
            lambda: "remote-0-0 exited with code 1, its 5th exit" in run.stderr(),
            "the remote worker marked failing",
            timeout=180,
        )
        assert "it is failing; restarting it in 8 s" in run.stderr()
        assert "stops everything" not in run.stderr().split("its 5th exit")[1]
        with urllib.request.urlopen(f"{run.url}/ready", timeout=10) as resp:
            ready = json.loads(resp.read())
        assert ready["status"] == "ready"
        (failing,) = ready["failing"]
        assert failing["name"] == "remote-0-0" and failing["exits"] >= 5
        assert failing["last_exit"] == "exited with code 1"
        assert run.chat(PROMPT, 24) == (200, reference.body(PROMPT, 24))
        shown = subprocess.run(
            [
                sys.executable,
                "-m",
                "zmqllm.cli",
                "status",
                "--config",
                str(run.root / "up.toml"),
                "--broker",
                run.frontend,
            ],
            capture_output=True,
            text=True,
            env=run.env,
            timeout=60,
            check=False,
        )
        assert shown.returncode == 0, shown.stderr
        line = next(x for x in shown.stdout.splitlines() if x.strip().startswith("remote-0-0"))
        assert "FAILING" in line and "exited with code 1" in line
        assert run.running().poll() is None
    finally:
        code = run.stop()
    assert code == 0, run.stderr()
