"""Where models, logs and compiled kernels live, and the model name a path gives.

Everything sits under one folder, ``$ZMQLLM_HOME`` (``~/.cache/zmqllm`` by default): the
prepared models (``models/``), the launcher's logs (``logs/``), the CURVE keys (``keys/``)
and the kernels built on first use (``kernels/``). The settings schema (settings.py) names
models by path or by the aliases "default" and "tiny"; this module turns those into
folders and into the name the OpenAI API serves.

This module runs in the broker and the gateway, so it must not import torch.
"""

from __future__ import annotations

import os
from pathlib import Path

from zmqllm.config.names import NAME_RULE, is_name
from zmqllm.config.settings import (
    DEFAULT_MODEL,
    TINY_MODEL,
    Config,
    ConfigError,
    LogSettings,
    ModelSettings,
)

__all__ = [
    "checked_model_name",
    "default_model_dir",
    "log_dir",
    "resolve_model_path",
    "served_model_name",
    "tiny_model_dir",
    "worker_served_name",
    "zmqllm_home",
]


def zmqllm_home() -> Path:
    """Where models and logs live: ``$ZMQLLM_HOME`` or ``~/.cache/zmqllm``."""
    env = os.environ.get("ZMQLLM_HOME", "")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "zmqllm"


def default_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct checkpoint (``path = "default"``)."""
    return zmqllm_home() / "models" / "smollm2-135m-instruct"


def tiny_model_dir() -> Path:
    """The tiny random test checkpoint (``path = "tiny"``)."""
    return zmqllm_home() / "models" / "tiny"


def resolve_model_path(path: str) -> str:
    """Turn the aliases "default" and "tiny" into directories; keep anything else as is."""
    if path == DEFAULT_MODEL:
        return str(default_model_dir())
    if path == TINY_MODEL:
        return str(tiny_model_dir())
    return path


def log_dir(settings: LogSettings) -> Path:
    """The launcher's log folder."""
    return Path(settings.dir).expanduser() if settings.dir else zmqllm_home() / "logs"


# --- the served model's name ------------------------------------------------------------


def worker_served_name(cfg: Config) -> str:
    """The model name a worker registers under ("" for a remote worker that takes the
    upstream's id once it knows it)."""
    if cfg.worker.served_name:
        return cfg.worker.served_name
    if cfg.worker.remote:
        return cfg.worker.remote_model
    return checked_model_name(served_model_name(cfg.model))


def checked_model_name(name: str) -> str:
    """A model name as the bus carries it (``is_name``); ConfigError otherwise, pointing
    at the setting that names it."""
    if not is_name(name):
        raise ConfigError(
            f"model name {name[:80]!r} must be {NAME_RULE}: set one with --model-name "
            "(or --served-name on a worker)"
        )
    return name


def served_model_name(model: ModelSettings) -> str:
    """The model id the OpenAI API reports: ``name`` if set, else derived from ``path``."""
    if model.name:
        return model.name
    if model.path in (DEFAULT_MODEL, TINY_MODEL):
        return Path(resolve_model_path(model.path)).name
    local = Path(model.path).expanduser()
    # A repo id keeps its owner ("mistralai/...") as vLLM does; a directory is named by its
    # last component so absolute paths don't leak into API responses.
    return local.resolve().name if local.is_dir() else model.path
