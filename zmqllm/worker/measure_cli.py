"""`zmqllm measure`: what a worker of this config measures of this machine (ms per layer at
1 and 16 rows, the memory it may use, what its layers take: self_measure.py), printed as a
line or as the JSON `zmqllm plan --figures` reads from each stage's machine.

Only config and the model's preparation are imported here: torch loads when the command
runs, not when the ``zmqllm`` parser is built.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from zmqllm.config.flags import apply_flags
from zmqllm.config.loading import load_config
from zmqllm.config.paths import default_model_dir, resolve_model_path

__all__ = ["add_measure_command", "cmd_measure"]


def cmd_measure(ns: argparse.Namespace) -> int:
    cfg = apply_flags(load_config(ns.config), "measure", ns)
    for key, value in ns.thread_env.items():
        os.environ.setdefault(key, value)  # as a worker runs, before torch loads
    if resolve_model_path(cfg.model.path) == str(default_model_dir()):
        from zmqllm.models.prepare import is_prepared, prepare_default_model

        if not is_prepared(default_model_dir()):  # converted on first use, as a worker does
            prepare_default_model(default_model_dir())
    from zmqllm.models.model_args import ModelArgs
    from zmqllm.worker.self_measure import measure, measure_dir

    directory = measure_dir(cfg)
    figures = measure(cfg, directory)
    out = {**figures.to_dict(), "num_layers": ModelArgs.from_dir(directory).num_layers}
    if ns.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        print(
            f"{out['num_layers']} layers; one layer: {figures.ms_1:.3f} ms at 1 row, "
            f"{figures.ms_16:.3f} ms at 16; the head: {figures.head_ms_1:.3f} / "
            f"{figures.head_ms_16:.3f} ms; memory {figures.memory_bytes >> 20} MiB"
        )
    return 0


def add_measure_command(
    sub: Any, add_flags: Callable[..., None], thread_env: Mapping[str, str]
) -> None:
    """Add ``measure`` to the ``zmqllm`` parser's sub-parsers; ``thread_env``: the OpenMP
    settings a worker process runs with (cli.WORKER_THREAD_ENV)."""
    p = sub.add_parser(
        "measure", help="time this machine as a worker would (ms per layer, memory): for plan"
    )
    p.add_argument("--config", metavar="FILE", help="TOML config file (see configs/)")
    add_flags(p, "measure")
    p.add_argument("--json", action="store_true", help="print JSON (zmqllm plan --figures)")
    p.set_defaults(func=cmd_measure, thread_env=dict(thread_env))
