"""A 2-stage cluster across testbed hosts, for the benchmarks that measure links.

Host 1 runs the broker and the gateway, host 2 the first stage, host 3 the second (see
testbed/hosts.py); every link is rate limited when asked, and the worker hosts' links are
delayed (netem, or the testbed's relay where the kernel has none). The delay changes
while the cluster runs (``HostCluster.set_delay``), so rounds at different delays need
no restart. Needs root. A request reaches the gateway over
``http_client.netns_socket(cluster.http())``.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from testbed.hosts import HostCluster
from testbed.netns import Testbed, unusable_reason

__all__ = ["CROSSINGS", "across_hosts"]

# One-way link crossings per token at 2 stages, the broker on its own host: STEP to
# stage 0, its ACTIVATION back, on to stage 1, its TOKEN back.
CROSSINGS = 4


@contextlib.contextmanager
def across_hosts(
    model_dir: Path,
    layers: tuple[str, str],
    *,
    delay_ms: float = 0.0,
    rate: str | None = None,
    threads: int = 2,
    worker_flags: tuple[str, ...] = (),
) -> Iterator[HostCluster]:
    """A ready cluster across three hosts; everything removed on the way out."""
    reason = unusable_reason()
    if reason is not None:
        raise SystemExit(f"cannot make test hosts: {reason}")
    root = Path(tempfile.mkdtemp(prefix="zmqllm-links-"))
    bed = Testbed(3)
    c = HostCluster(
        bed,
        root,
        model_dir,
        {layers[0]: 2, layers[1]: 3},
        delay_ms=delay_ms,
        rate=rate,
        relay=True,  # the same path at every delay, 0 included
        heartbeat=1.0,
        threads=threads,
        worker_flags=worker_flags,
    )
    try:
        bed.up()
        c.start()
        how = "netem" if c.netem else "relays on host 1"
        print(f"cluster across 3 hosts ready: delay by {how}, link rate {rate or 'unlimited'}")
        yield c
    finally:
        c.stop()
        bed.close()
        shutil.rmtree(root, ignore_errors=True)
