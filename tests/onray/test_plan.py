"""`zmqllm ray up`'s plan, without Ray: the actors, what each asks for, and the errors for
a request no node can meet."""

from __future__ import annotations

from pathlib import Path

import pytest

from zmqllm.config.loading import load_config, parse_size
from zmqllm.config.settings import ConfigError
from zmqllm.onray.plan import (
    BROKER_IP,
    DISK,
    NODE_IP,
    Unplaceable,
    check_fits,
    plan_actors,
    with_broker,
)

GIB = 2**30


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ray.toml"
    path.write_text(text)
    return path


def test_sizes_read_as_people_write_them() -> None:
    assert parse_size("16GiB") == 16 * GIB
    assert parse_size("512 MiB") == 512 * 2**20
    assert parse_size("32GB") == 32 * 10**9
    assert parse_size("4096") == 4096
    for bad in ("", "lots", "16 GiBs", "-1G"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_every_stage_replica_is_an_actor_with_its_bundle(tmp_path: Path) -> None:
    path = _config(
        tmp_path,
        '[ray]\nstrategy = "strict_spread"\n'
        '[[stages]]\nlayers = "1/2"\ncpus = 4\nmemory = "16GiB"\ndisk = "32GiB"\ncount = 2\n'
        '[[stages]]\nlayers = "2/2"\ncpus = 2\n',
    )
    cfg = load_config(path)
    assert cfg.ray.strategy == "STRICT_SPREAD"  # upper-cased once, where it is read
    specs = plan_actors(cfg, path)
    assert [s.name for s in specs] == [
        "broker",
        "worker-1of2-0",
        "worker-1of2-1",
        "worker-2of2-0",
        "gateway",
    ]
    assert [s.bundle for s in specs] == [None, 0, 1, 2, None]
    first = specs[1]
    assert first.resources == {"CPU": 4.0, "memory": 16 * GIB, DISK: 32 * GIB}
    assert specs[3].resources == {"CPU": 2.0}
    # Every worker runs its stage with the threads its CPUs allow, connects to the
    # broker's address and reads the same config file.
    args = " ".join(first.args)
    assert "--stage 1/2" in args and "--threads 4" in args and str(path) in args
    assert f"--broker tcp://{BROKER_IP}:5556" in args
    # The broker and the gateway bind on the node they land on.
    assert f"tcp://{NODE_IP}:5555" in specs[0].args and NODE_IP in specs[-1].args
    filled = with_broker(first.args, "198.18.0.1")
    assert "tcp://198.18.0.1:5556" in filled and BROKER_IP not in " ".join(filled)


def test_a_bundle_no_node_can_hold_names_the_resource() -> None:
    cfg = load_config(None)
    cfg.stages = []
    specs = plan_actors(cfg, None)
    nodes = [{"CPU": 2.0, "memory": 8.0 * GIB}, {"CPU": 1.0, "memory": 4.0 * GIB}]
    check_fits(specs, nodes)  # the default stages ask for one CPU each

    from zmqllm.config.settings import StageSpec

    cfg.stages = [StageSpec("1/2", memory="64GiB"), StageSpec("2/2")]
    with pytest.raises(
        Unplaceable, match=r"worker-1of2-0 asks for memory 64.0 GiB; the largest node has 8.0 GiB"
    ):
        check_fits(plan_actors(cfg, None), nodes)
    cfg.stages = [StageSpec("1/2", cpus=3)]
    with pytest.raises(Unplaceable, match="CPU 3; the largest node has 2"):
        check_fits(plan_actors(cfg, None), nodes)
    cfg.stages = [StageSpec("1/2", disk="1GiB")]
    with pytest.raises(Unplaceable, match=f"no node declares it.*{DISK}"):
        check_fits(plan_actors(cfg, None), nodes)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('[ray]\nstrategy = "ANYWHERE"\n', "strategy in \\[ray\\].*one of PACK"),
        ('[ray]\naddress = "not an address"\n', "address in \\[ray\\]"),
        ("[ray]\nready_timeout = 0\n", "ready_timeout"),
        ('[[stages]]\nlayers = "1/2"\nmemory = "lots"\n', "memory in \\[\\[stages\\]\\] #1.*16GiB"),
        ('[[stages]]\nlayers = "1/2"\ncpus = 0\n', "cpus in \\[\\[stages\\]\\] #1"),
        ('[[stages]]\nlayers = "1/2"\ngpus = 1\n', "unknown key 'gpus'"),
    ],
)
def test_bad_ray_settings_are_errors_naming_the_key(tmp_path: Path, text: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        load_config(_config(tmp_path, text))
