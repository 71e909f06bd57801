"""`zmqllm ray status` and `zmqllm ray up` without a cluster: a fake Ray whose actors
answer info() from keepers driven by a fake clock, and a config with [[remotes]], which
`ray up` refuses before it connects to anything."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from zmqllm.cli import build_parser
from zmqllm.onray import commands


def run(*argv: str) -> int:
    """`zmqllm ray ...` past its check that Ray is installed: these tests need none."""
    ns = build_parser().parse_args(["ray", *argv])
    return {"up": commands.ray_up, "status": commands.ray_status}[ns.ray_command](ns)


class Ref:
    def __init__(self, value: dict[str, Any] | None) -> None:
        self.value = value


class FakeActor:
    """An actor handle: ``info.remote()`` answers what ``answer()`` says, or never (None)."""

    def __init__(self, answer: Any) -> None:
        self.info = self
        self._answer = answer

    def remote(self) -> Ref:
        return Ref(self._answer())


class FakeRay:
    def wait(self, refs: list[Ref], num_returns: int, timeout: float) -> tuple[list[Ref], list]:
        done = [r for r in refs if r.value is not None]
        return done, [r for r in refs if r.value is None]

    def get(self, ref: Ref) -> dict[str, Any] | None:
        return ref.value


def keeper_in_state(name: str, exits: int, run_s: float = 0.1) -> Any:
    """A RoleKeeper whose role exited ``exits`` times, each after ``run_s``, and waits
    out its last backoff; or, with exits 0, runs."""
    from tests.onray.test_role_keeper import Clock, QuickExit
    from zmqllm.onray.role_keeper import RoleKeeper

    clock = Clock()
    count = {"slept": 0}

    def sleep(delay: float) -> bool:
        count["slept"] += 1
        if count["slept"] == exits:  # status looks 0.5 s into the last backoff
            clock.now += 0.5
            return True
        clock.now += delay
        return False

    keeper = RoleKeeper(name, lambda: QuickExit(clock, run_s, 1), None, clock, sleep)
    if exits:
        keeper.run()
    else:
        keeper.proc = QuickExit(clock, run_s, 1)  # started, not exited
        keeper.starts = 1
    return keeper


def actor_row(name: str, state: str, keeper: Any, restarts: int = 0) -> dict[str, Any]:
    """A row of Ray's actor table whose actor answers as RoleActor.info() does (None:
    it does not answer, as while Ray restarts it)."""

    def info() -> dict[str, Any] | None:
        if keeper is None:
            return None
        return {**keeper.state(), "log": f"/home/zmqllm/logs/ray/{name}.log"}

    return {
        "name": name,
        "state": state,
        "node_ip": "198.18.0.2",
        "pid": 100 + len(name),
        "restarts": restarts,
        "handle": FakeActor(info),
    }


@pytest.fixture
def fake_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    failing = keeper_in_state("worker-2of2-0", 7)  # the 7th exit: 32 s of backoff
    restarting = keeper_in_state("gateway", 2)  # the 2nd: 1 s
    running = keeper_in_state("broker", 0)
    rows = [
        actor_row("broker", "ALIVE", running),
        actor_row("gateway", "ALIVE", restarting),
        actor_row("worker-1of2-0", "RESTARTING", None, restarts=1),
        actor_row("worker-2of2-0", "ALIVE", failing),
    ]
    monkeypatch.setattr(commands, "_connect", lambda cfg: FakeRay())
    monkeypatch.setattr(commands, "_actors", lambda ray, namespace: rows)


def test_ray_status_shows_each_role_backing_off_or_failing(
    fake_cluster: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run("status") == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split()
    assert header[:6] == ["actor", "state", "node", "pid", "restarts", "role"]
    assert "exits/60s" in header and lines[0].endswith("last exit")
    # Failing roles first, then restarting, running, and the actor Ray is restarting.
    assert [line.split()[0] for line in lines[1:]] == [
        "worker-2of2-0",
        "gateway",
        "broker",
        "worker-1of2-0",
    ]
    failing, restarting, running, unknown = lines[1:]
    assert "FAILING, restarting in 31.5 s" in failing and " 7  exited with code 1" in failing
    assert "restarting in 0.5 s" in restarting and " 2  exited with code 1" in restarting
    assert running.split()[5] == "running" and running.endswith(" 0  -")
    assert "RESTARTING" in unknown and unknown.split()[5:] == ["?", "?", "-"]


def test_ray_status_json_has_the_role_fields(
    fake_cluster: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run("status", "--json") == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    worker = rows["worker-2of2-0"]
    assert worker["state"] == "ALIVE"  # Ray's, as before
    assert worker["role_state"] == "failing" and worker["exits"] == 7
    assert worker["next_start_in"] == 31.5 and worker["starts"] == 7
    assert worker["last_exit"] == "exited with code 1"
    assert rows["broker"]["role_state"] == "running" and rows["broker"]["exits"] == 0
    assert rows["worker-1of2-0"]["role_state"] is None  # no answer while Ray restarts it
    assert "handle" not in worker


def test_ray_up_not_ready_names_the_roles_that_keep_exiting(
    fake_cluster: None, capsys: pytest.CaptureFixture[str]
) -> None:
    commands._say_troubled(commands._connect(None), "zmqllm")  # type: ignore[arg-type]
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "  worker-2of2-0: FAILING, restarting in 31.5 s, 7 exits within 60 s, the last "
        "exited with code 1; its log on 198.18.0.2: /home/zmqllm/logs/ray/worker-2of2-0.log",
        "  gateway: restarting in 0.5 s, 2 exits within 60 s, the last exited with code 1; "
        "its log on 198.18.0.2: /home/zmqllm/logs/ray/gateway.log",
    ]


def test_ray_up_refuses_remotes_by_name_before_connecting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def connect(cfg: Any) -> None:
        raise AssertionError("ray up connected to a cluster with [[remotes]] in its config")

    monkeypatch.setattr(commands, "_connect", connect)
    config = tmp_path / "ray.toml"
    config.write_text(
        '[[stages]]\nlayers = "1/1"\n'
        '[[remotes]]\nurl = "https://user:secret@api.example.com/v1"\nmodel = "gpt-x"\n'
        '[[remotes]]\nurl = "http://198.18.0.9:8000/v1"\nserved_name = "local-llama"\ncount = 2\n'
    )
    assert run("up", "--config", str(config)) == 2
    err = capsys.readouterr().err
    assert err.startswith("zmqllm ray up: [[remotes]] #1 (served_name -, model gpt-x, count 1)")
    assert "#2 (served_name local-llama, model -, count 2)" in err
    assert "not served on Ray" in err and "zmqllm worker --remote" in err
    assert "tcp://BROKER_NODE:5556" in err
    assert "secret" not in err and "198.18.0.9" not in err  # a URL may hold a key
