"""Running a pipeline worker process: its keys, its stage loaded, and the signals that
stop or drain it.

``serve`` is what ``zmqllm worker`` runs (as ``broker.main.serve`` is what ``zmqllm
broker`` runs, and ``remote.main.serve`` a remote worker): the keys are checked before
the model loads, so a key problem is told before minutes of loading. The worker itself
is ``pipeline.py`` on the shell (``shell.py``); its shard is loaded by
``shard_loader.py``; with ``--layers auto`` the range is the broker's answer to what
``placement_client.py`` measured.
"""

from __future__ import annotations

from zmqllm.config.layers import AUTO
from zmqllm.config.settings import Config
from zmqllm.worker.broker_link import WorkerRefused
from zmqllm.worker.pipeline import Worker
from zmqllm.worker.placement_client import placed_config, placement_failed
from zmqllm.worker.shard_loader import load_stage
from zmqllm.worker.shell import worker_keys

__all__ = ["serve"]


def serve(cfg: Config) -> int:
    """Run a pipeline worker until SIGTERM/SIGINT (drained) or its link ends; the
    process's exit status."""
    keys = worker_keys(cfg)  # a key problem is told before the model loads
    measured: dict[str, float | int] = {}
    if cfg.worker.layers.strip() == AUTO:  # measured, then placed by the broker
        try:
            cfg, figures = placed_config(cfg, keys)
        except (WorkerRefused, TimeoutError) as exc:  # placed nowhere, or no answer
            return placement_failed(exc)
        measured = figures.to_dict()
    loaded = load_stage(cfg)
    loaded.measured = measured
    worker = Worker(cfg, loaded, keys=keys)
    worker.install_signals()
    return worker.run()
