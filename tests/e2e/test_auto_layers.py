"""Layers placed by measured figures, across test hosts (network namespaces on one bridge).

- `zmqllm worker --layers auto` on another host measures itself, asks the broker, and
  loads the first range no pool covers; the next one goes to the pool with the least
  throughput; `zmqllm status` shows what each measured.
- A host whose processes get half a core (a cgroup CPU quota) measures slower, and
  `zmqllm plan` gives it fewer layers than the equal split does. That the weighted split
  then makes more tokens/s is measured, not asserted: benchmarks/weighted_split.py.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.cpu_limit import CpuLimit, cpu_limit_unusable
from testbed.hosts import HostCluster, zmqllm_command
from testbed.netns import Testbed, unusable_reason

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

DEEP_LAYERS = 16  # the split of a deeper model of the test model's shape


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory, e2e_model: Path) -> Iterator[HostCluster]:
    """Host 1: the broker; hosts 2 and 3 have worker keys (copied there by hand)."""
    reason = unusable_reason()
    if reason is not None:
        pytest.skip(reason)
    bed = Testbed(3)
    c = HostCluster(bed, tmp_path_factory.mktemp("auto-hosts"), e2e_model, {"0:2": 2, "x": 3})
    try:
        bed.up()
        c.make_keys()
        c.start_broker()
        yield c
    finally:
        c.stop()
        bed.close()


def workers(c: HostCluster) -> list[dict]:
    return list(c.status()["workers"])


def test_auto_fills_the_missing_range_then_the_weakest_pool(hosts: HostCluster) -> None:
    c = hosts
    c.start_worker("0:2", 2, c.backend)
    c.wait_for(lambda: len(workers(c)) == 1, 120, "the worker of 0:2")
    auto = c.start_worker("auto", 3, c.backend)
    c.wait_for(lambda: len(workers(c)) == 2, 120, "the --layers auto worker")
    (placed,) = [w for w in workers(c) if w["info"]["pid"] == auto.popen.pid]
    assert placed["layers"] == [2, 4]  # what no pool covered
    measured = placed["measured"]
    assert measured["ms_1"] > 0 and measured["ms_16"] > 0 and measured["memory_bytes"] > 0
    assert measured["rtt_ms"] > 0  # its round trip to the broker, across the bridge
    assert "layers placed by the broker" in auto.text()
    shown = c.head.run(
        *zmqllm_command(), "status", "--broker", c.frontend, "--keys", str(c.keys)
    ).stdout
    assert "measured" in shown and "rtt" in shown

    # Now 2:4 has two workers and 0:2 one (neither of those two measured: each counts as
    # one like the asker), so 0:2 has the least throughput for its load.
    c.start_worker("2:4", 2, c.backend)
    c.wait_for(lambda: len(workers(c)) == 3, 120, "a second worker of 2:4")
    second = c.start_worker("auto", 3, c.backend)
    c.wait_for(lambda: len(workers(c)) == 4, 120, "the second --layers auto worker")
    (placed,) = [w for w in workers(c) if w["info"]["pid"] == second.popen.pid]
    assert placed["layers"] == [0, 2]
    assert "least throughput" in second.text()


def deep_model(model: Path, folder: Path) -> Path:
    """The test model's config with more layers: a probe reads only the config (shapes),
    and a deeper model shows a split's shares better than the test model's 4 layers."""
    deep = folder / "deep-model"
    deep.mkdir(exist_ok=True)
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] = DEEP_LAYERS
    (deep / "config.json").write_text(json.dumps(config))
    return deep


def test_a_half_core_host_gets_fewer_layers(hosts: HostCluster, tmp_path: Path) -> None:
    reason = cpu_limit_unusable()
    if reason is not None:
        pytest.skip(reason)
    c = hosts
    model = deep_model(c.model_dir, tmp_path)
    measure = [*zmqllm_command(), "measure", "--json", "--model", str(model), "--threads", "1"]
    full = c.bed.host(2).run(*measure, timeout=300)
    assert full.returncode == 0, full.stderr[-2000:]
    limit = CpuLimit(f"{c.bed.tag}-half", cores=0.5)
    try:
        # Joined before `ip netns exec`, which mounts a sysfs of its own (no cgroups there).
        cmd = limit.command(*c.bed.host(3).command(*measure))
        slow = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    finally:
        limit.close()
    assert slow.returncode == 0, slow.stderr[-2000:]
    (tmp_path / "slow.json").write_text(slow.stdout)
    (tmp_path / "full.json").write_text(full.stdout)
    config = tmp_path / "pair.toml"
    stage = '\n[[stages]]\nlayers = "auto"\n'
    config.write_text(f'[model]\npath = "{model}"\n' + stage + stage)
    figures = ["--figures", str(tmp_path / "slow.json"), str(tmp_path / "full.json")]
    done = c.head.run(*zmqllm_command(), "plan", "--config", str(config), *figures, "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    plan = json.loads(done.stdout)
    (a, b), _ = plan["weighted"]["split"]
    (ea, eb), _ = plan["equal"]["split"]
    # The half-core host (stage 1) measured slower and gets fewer layers than the equal split
    # gives it, and fewer than the full host beside it.
    assert plan["figures"][0]["ms_16"] > plan["figures"][1]["ms_16"]
    assert b - a < eb - ea
    assert b - a < DEEP_LAYERS - (b - a)
    assert plan["weighted"]["tokens_per_s"] > plan["equal"]["tokens_per_s"]
    shown = c.head.run(*zmqllm_command(), "plan", "--config", str(config), *figures).stdout
    assert "equal" in shown and "weighted" in shown and "tokens/s" in shown
