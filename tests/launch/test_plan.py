"""What `zmqllm up` plans without starting anything: the config it runs, each child's
command line, where children connect, the ports it checks, and the log names."""

from __future__ import annotations

import argparse
import re
import textwrap
from pathlib import Path

import pytest

from testbed.cluster import free_port
from zmqllm.cli import _load as cli_load
from zmqllm.cli import build_parser
from zmqllm.config.paths import log_dir
from zmqllm.config.settings import Config, ConfigError
from zmqllm.launch import plan as launch_plan
from zmqllm.launch.plan import (
    FRONT_END_BYTES,
    Child,
    connect_address,
    cpu_lock_path,
    layer_flags,
    log_path,
    plan,
    port_errors,
    port_problem,
    stage_slug,
    up_config,
)

CONFIGS = Path(__file__).parents[2] / "configs"
PY = "/usr/bin/python-for-test"
CLI = (PY, "-m", "zmqllm.cli")
JSON = ("--log-format", "json")


def ns(**kw: object) -> argparse.Namespace:
    """The Namespace `zmqllm up` gets from argparse, flags not given left at None."""
    fields: dict[str, object] = dict(
        config=None, log_level=None, log_format=None, port=None, model=None, log_dir=None
    )
    fields["ready_timeout"] = 600.0
    return argparse.Namespace(**{**fields, **kw})


def write_config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return path


# --- command lines ----------------------------------------------------------------------


# What the tests' machine has free: the front end's GiB and 9 GiB for two workers.
FREE = FRONT_END_BYTES + (9 << 30)


@pytest.fixture(autouse=True)
def fixed_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch_plan, "memory_available", lambda: (FREE, "MemAvailable"))


# Workers on this machine take turns on its cores, and share its memory.
SHARE = ("--cpu-lock", str(cpu_lock_path()), "--max-memory-mb", "4608")


def test_local_toml_plan() -> None:
    path = (CONFIGS / "local.toml").resolve()
    cfg, used = up_config(ns(config=str(CONFIGS / "local.toml")))
    assert used == path
    head = ("--config", str(path))
    assert [(c.name, c.role, c.argv) for c in plan(cfg, used, python=PY)] == [
        ("broker", "broker", (*CLI, "broker", *head, *JSON)),
        (
            "worker-1of2-0",
            "worker",
            (*CLI, "worker", *head, "--stage", "1/2", "--name", "worker-1of2-0", *SHARE, *JSON),
        ),
        (
            "worker-2of2-0",
            "worker",
            (*CLI, "worker", *head, "--stage", "2/2", "--name", "worker-2of2-0", *SHARE, *JSON),
        ),
        ("gateway", "gateway", (*CLI, "gateway", *head, *JSON)),
    ]


def test_tiny_toml_plan_with_overrides(tmp_path: Path) -> None:
    flags = ns(config=str(CONFIGS / "tiny.toml"), port=9123, model="/m", log_level="debug")
    cfg, used = up_config(flags)
    children = plan(cfg, used, python=PY)
    assert [c.name for c in children] == ["broker", "worker-1of2-0", "worker-2of2-0", "gateway"]
    level = ("--log-level", "debug")
    assert children[0].argv[-4:] == (*JSON, *level)
    assert children[1].argv[-11:] == ("worker-1of2-0", "--model", "/m", *SHARE, *JSON, *level)
    # The gateway needs the model too: its tokenizer and chat template come from there.
    gateway = children[-1].argv
    assert gateway[4:] == ("--config", str(used), "--model", "/m", "--port", "9123", *JSON, *level)


def test_workers_take_turns_on_the_cores_unless_the_config_says_how(tmp_path: Path) -> None:
    def worker_flags(body: str) -> list[tuple[str, ...]]:
        cfg, used = up_config(ns(config=str(write_config(tmp_path, body))))
        return [c.argv for c in plan(cfg, used, python=PY) if c.role == "worker"]

    two = '[[stages]]\nlayers = "0:2"\n[[stages]]\nlayers = "2:"\n'
    assert all("--cpu-lock" in argv for argv in worker_flags(two))
    # The config chose: threads per stage, or its own lock file (read by the workers).
    for setting in ("batch_threads = 1", 'cpu_lock = "/tmp/x.lock"'):
        for argv in worker_flags(f"[worker]\n{setting}\n{two}"):
            assert "--cpu-lock" not in argv and "--batch-threads" not in argv
    # One worker has no one to take turns with.
    (alone,) = worker_flags('[[stages]]\nlayers = ":"\n')
    assert "--cpu-lock" not in alone


def test_workers_share_the_free_memory_unless_the_config_sizes_them(tmp_path: Path) -> None:
    def worker_flags(body: str) -> list[tuple[str, ...]]:
        cfg, used = up_config(ns(config=str(write_config(tmp_path, body))))
        return [c.argv for c in plan(cfg, used, python=PY) if c.role == "worker"]

    three = '[[stages]]\nlayers = "0:2"\ncount = 2\n[[stages]]\nlayers = "2:"\n'
    for argv in worker_flags(three):  # 9 GiB among three
        assert argv[argv.index("--max-memory-mb") + 1] == "3072"
    for setting in ("max_memory_mb = 2000", "max_kv_tokens = 4096"):
        assert all(
            "--max-memory-mb" not in a for a in worker_flags(f"[worker]\n{setting}\n{three}")
        )
    (alone,) = worker_flags('[[stages]]\nlayers = ":"\n')
    assert "--max-memory-mb" not in alone


def test_unchanged_values_are_left_to_the_config_file() -> None:
    # Same values as tiny.toml: nothing to override, so no flags.
    cfg, used = up_config(ns(config=str(CONFIGS / "tiny.toml"), port=8081, model="tiny"))
    for child in plan(cfg, used, python=PY):
        assert "--port" not in child.argv and "--model" not in child.argv


def up_flags(*argv: str) -> argparse.Namespace:
    """The Namespace of `zmqllm up ARGV`, parsed by the real command line."""
    return build_parser().parse_args(["up", *argv])


def child_config(child: Child) -> Config:
    """What a child runs: its command line parsed and applied the way `zmqllm ROLE` does."""
    return cli_load(build_parser().parse_args(list(child.argv[3:])))


def test_up_passes_security_and_gateway_files_to_the_children_that_take_them() -> None:
    flags = up_flags(
        *("--config", str(CONFIGS / "tiny.toml"), "--keys", "/k", "--insecure"),
        *("--api-key-file", "/a", "--ssl-certfile", "/c", "--ssl-keyfile", "/p"),
    )
    cfg, used = up_config(flags)
    assert cfg.security.keys == "/k" and cfg.security.insecure
    children = plan(cfg, used, python=PY)
    for child in children:
        assert child.argv.count("--keys") == 1 and "--insecure" in child.argv
        assert child_config(child).security == cfg.security
        files = {"--api-key-file", "--ssl-certfile", "--ssl-keyfile"} & set(child.argv)
        assert bool(files) == (child.role == "gateway"), child.argv
    gateway = child_config(children[-1]).gateway
    assert (gateway.api_keys_file, gateway.ssl_certfile, gateway.ssl_keyfile) == ("/a", "/c", "/p")
    # Nothing else changes: each child still runs the launcher's config.
    for child in children:
        own = child_config(child)
        assert own.model == cfg.model and own.log.level == cfg.log.level


def test_up_passes_a_bool_turned_off_as_its_no_flag(tmp_path: Path) -> None:
    path = write_config(tmp_path, "[security]\ninsecure = true\n")
    cfg, used = up_config(up_flags("--config", str(path), "--no-insecure"))
    for child in plan(cfg, used, python=PY):
        assert "--no-insecure" in child.argv and not child_config(child).security.insecure


def test_up_flags_equal_to_the_file_are_not_passed(tmp_path: Path) -> None:
    path = write_config(tmp_path, '[security]\nkeys = "/k"\n[gateway]\napi_keys_file = "/a"\n')
    flags = up_flags("--config", str(path), "--keys", "/k", "--api-key-file", "/a")
    cfg, used = up_config(flags)
    for child in plan(cfg, used, python=PY):
        assert "--keys" not in child.argv and "--api-key-file" not in child.argv
        assert child_config(child).security.keys == "/k"


def test_replicas_and_layer_ranges(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        """
        [[stages]]
        layers = "0:2"
        count = 2

        [[stages]]
        layers = "2:"
        """,
    )
    cfg, used = up_config(ns(config=str(path)))
    workers = [c for c in plan(cfg, used, python=PY) if c.role == "worker"]
    assert [c.name for c in workers] == ["worker-0-2-0", "worker-0-2-1", "worker-2-end-0"]
    assert [c.argv[6:8] for c in workers] == [("--layers", "0:2")] * 2 + [("--layers", "2:")]


def test_remote_models_start_remote_workers_beside_the_stages(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        """
        [[remotes]]
        url = "https://api.example.com/v1"
        model = "gpt-4o-mini"
        served_name = "mini"
        api_key_file = "/keys/upstream"
        count = 2

        [[remotes]]
        url = "http://198.18.0.9:8080/v1"
        """,
    )
    cfg, used = up_config(ns(config=str(path)))
    children = plan(cfg, used, python=PY)
    names = [c.name for c in children]
    assert names == [
        "broker",
        "worker-1of2-0",
        "worker-2of2-0",
        "remote-0-0",
        "remote-0-1",
        "remote-1-0",
        "gateway",
    ]
    first, _, last = (c for c in children if c.name.startswith("remote-"))
    argv = " ".join(first.argv)
    # The URL by a private file, not on the command line (`ps` shows that to anyone).
    url_file = str(log_dir(cfg.log) / "remote-0-0.url")
    assert f"--remote @{url_file} --name remote-0-0" in argv
    assert "api.example.com" not in argv
    assert first.files == ((url_file, "https://api.example.com/v1\n"),)
    assert "--remote-model gpt-4o-mini --served-name mini --api-key-file /keys/upstream" in argv
    assert "--cpu-lock" not in argv and "--layers" not in argv  # no layers to take turns on
    assert "--served-name" not in last.argv and first.role == "worker"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[remotes]]\nmodel = "m"\n', "url in [[remotes]] #1"),
        ('[[remotes]]\nurl = "ftp://x"\n', "http(s) URL"),
        ('[[remotes]]\nurl = "http://u:secret@h/v1 x"\n', "http(s) URL"),
        ('[[remotes]]\nurl = "http://h/v1"\nserved_name = "a b"\n', "served_name"),
        ('[[remotes]]\nurl = "http://h/v1"\ncount = 0\n', "count"),
        ('[[remotes]]\nurl = "http://h/v1"\nkey = "k"\n', "unknown key 'key'"),
    ],
)
def test_a_bad_remotes_table_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        up_config(ns(config=str(write_config(tmp_path, text))))
    assert "secret" not in str(info.value)


def test_no_config_file_gives_two_stages_and_no_config_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(launch_plan, "repo_config", lambda: None)
    cfg, used = up_config(ns())
    assert used is None
    children = plan(cfg, used, python=PY)
    assert [c.name for c in children] == ["broker", "worker-1of2-0", "worker-2of2-0", "gateway"]
    assert all("--config" not in c.argv for c in children)
    assert cfg.gateway.port == 8080


def test_default_config_is_the_checkouts_local_toml() -> None:
    assert launch_plan.repo_config() == (CONFIGS / "local.toml").resolve()


def test_broker_bind_addresses_decide_where_children_connect(tmp_path: Path) -> None:
    # Only [broker] was edited: the gateway and workers must follow it, not the defaults.
    path = write_config(
        tmp_path,
        """
        [broker]
        frontend = "tcp://*:7001"
        backend = "tcp://0.0.0.0:7002"
        """,
    )
    cfg, used = up_config(ns(config=str(path)))
    children = plan(cfg, used, python=PY)
    for child in children[1:-1]:
        assert child.argv[-4:-2] == ("--broker", "tcp://127.0.0.1:7002")
    assert children[-1].argv[-4:-2] == ("--broker", "tcp://127.0.0.1:7001")


def test_log_dir_override(tmp_path: Path) -> None:
    cfg, _ = up_config(ns(config=str(CONFIGS / "tiny.toml"), log_dir=str(tmp_path / "logs")))
    assert cfg.log.dir == str(tmp_path / "logs")


@pytest.mark.parametrize(
    ("layers", "slug", "flags"),
    [
        ("1/2", "1of2", ["--stage", "1/2"]),
        ("0:15", "0-15", ["--layers", "0:15"]),
        (":15", "0-15", ["--layers", ":15"]),
        ("15:", "15-end", ["--layers", "15:"]),
        ("", "all", ["--layers", ":"]),
        (":", "all", ["--layers", ":"]),
    ],
)
def test_stage_slug_and_flags(layers: str, slug: str, flags: list[str]) -> None:
    assert stage_slug(layers) == slug
    assert layer_flags(layers) == flags


def test_log_names(tmp_path: Path) -> None:
    cfg, used = up_config(ns(config=str(CONFIGS / "local.toml")))
    names = [log_path(tmp_path, c).name for c in plan(cfg, used)]
    assert names == ["broker.log", "worker-1of2-0.log", "worker-2of2-0.log", "gateway.log"]


def test_connect_address() -> None:
    assert connect_address("tcp://*:5555") == "tcp://127.0.0.1:5555"
    assert connect_address("tcp://0.0.0.0:5555") == "tcp://127.0.0.1:5555"
    assert connect_address("tcp://198.18.0.3:5555") == "tcp://198.18.0.3:5555"
    assert connect_address("ipc:///tmp/broker") == "ipc:///tmp/broker"


# --- ports ------------------------------------------------------------------------------


def test_port_problem(listening: int) -> None:
    assert port_problem("127.0.0.1", listening)
    assert port_problem("127.0.0.1", free_port()) is None


def test_busy_gateway_port_names_the_flag_and_key(tmp_path: Path, listening: int) -> None:
    cfg, used = up_config(ns(config=str(CONFIGS / "tiny.toml"), port=listening))
    errors = [e for e in port_errors(cfg, used) if str(listening) in e]
    assert len(errors) == 1
    assert "gateway" in errors[0] and "--port" in errors[0] and "[gateway] port" in errors[0]


def test_busy_broker_port_names_the_config_key(tmp_path: Path, listening: int) -> None:
    path = write_config(tmp_path, f'[broker]\nbackend = "tcp://127.0.0.1:{listening}"\n')
    cfg, used = up_config(ns(config=str(path), port=free_port()))
    (error,) = [e for e in port_errors(cfg, used) if str(listening) in e]
    assert "[broker] backend" in error and str(path) in error


def test_free_ports_give_no_errors(tmp_path: Path) -> None:
    a, b, c = free_port(), free_port(), free_port()
    path = write_config(
        tmp_path,
        f"""
        [broker]
        frontend = "tcp://127.0.0.1:{a}"
        backend = "tcp://127.0.0.1:{b}"
        [gateway]
        port = {c}
        """,
    )
    assert port_errors(*up_config(ns(config=str(path)))) == []


def test_one_port_for_two_roles_is_an_error(tmp_path: Path) -> None:
    port = free_port()
    path = write_config(tmp_path, f'[broker]\nfrontend = "tcp://127.0.0.1:{port}"\n')
    cfg, used = up_config(ns(config=str(path), port=port))
    assert any("both" in e and str(port) in e for e in port_errors(cfg, used))
