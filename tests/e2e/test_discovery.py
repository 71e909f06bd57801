"""mDNS discovery across test hosts (network namespaces on one bridge, testbed/netns.py).

The broker on host 1 runs with ``--announce``; a worker on host 2 given ``--discover``
and its key folder, and no ``--broker``, finds it across the bridge and registers. On
host 3 a fake announcement (testbed/fake_announce.py) claims a broker with another key:
the worker skips it and says so. A worker holding another cluster's broker key finds
nothing it may use and exits 2 naming what it saw, registering nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.hosts import BACKEND_PORT, HostCluster, zmqllm_command
from testbed.netns import Testbed, unusable_reason
from zmqllm.launch.child_process import ChildProcess

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

pytest.importorskip("zeroconf")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory, e2e_model: Path) -> Iterator[HostCluster]:
    """Host 1: the broker, announced; hosts 2 and 3 have worker keys."""
    reason = unusable_reason()
    if reason is not None:
        pytest.skip(reason)
    bed = Testbed(3)
    c = HostCluster(
        bed,
        tmp_path_factory.mktemp("discovery-hosts"),
        e2e_model,
        {"0:4": 2, "x": 3},
        broker_flags=("--announce",),
    )
    try:
        bed.up()
        c.make_keys()
        c.start_broker()
        yield c
    finally:
        c.stop()
        bed.close()


def discovering(c: HostCluster, index: int, keys: Path, wait_s: int) -> list[str]:
    """`zmqllm worker` on host ``index`` with --discover and no --broker."""
    args = ["worker", "--discover", "--discover-timeout", str(wait_s)]
    args += ["--model", str(c.model_dir), "--layers", "0:4"]
    args += ["--threads", "1", "--name", f"host-{index}", *c.beats()]
    return [*zmqllm_command(), *args, "--keys", str(keys), "--log-format", "json"]


def test_a_worker_finds_the_announced_broker_and_skips_another_key(c: HostCluster) -> None:
    fake_backend = f"tcp://{c.bed.host(3).address}:{BACKEND_PORT}"
    fake: ChildProcess = c._start(
        c.bed.host(3),
        "fake-announce",
        [sys.executable, "-m", "testbed.fake_announce", "--backend", fake_backend],
    )
    c.wait_for(lambda: "announced" in fake.text(), 30, "the fake announcement")
    # 40 s: under CI's load the default 10 s once passed before the broker's answer came.
    worker = c._start(c.bed.host(2), "worker-discover", discovering(c, 2, c.folder(2) / "keys", 40))
    c.wait_for(lambda: len(c.status()["workers"]) == 1, 120, "the discovering worker")
    text = worker.text()
    assert "broker discovered" in text and c.backend in text  # host 1's backend
    # The fake's key is not the broker key this worker holds: skipped, and said.
    assert "announced broker ignored" in text


def test_a_worker_holding_another_broker_key_finds_none(c: HostCluster) -> None:
    other = c.folder(3) / "other-cluster"
    c._cli(c.head, "keys", "init", str(other))
    c._cli(c.head, "keys", "add", "worker", "stray", "--keys", str(other))
    before = len(c.status()["workers"])
    done = c.bed.host(3).run(*discovering(c, 3, other / "issued" / "stray", 20), timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "no broker with this worker's broker key" in done.stderr
    assert "announced another public key, ignored" in done.stderr
    assert len(c.status()["workers"]) == before  # nothing registered


@pytest.fixture
def c(hosts: HostCluster) -> HostCluster:
    return hosts
