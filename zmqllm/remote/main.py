"""Running a remote worker process: its upstream's URL and key, read from files, the
upstream's model looked up when none is named, and the signals that stop it.

``serve`` is what ``zmqllm worker --remote URL`` runs (as ``broker.main.serve`` is what
``zmqllm broker`` runs); the worker itself, on the worker shell, is ``worker.py``. The
upstream key is read from a file, sent only to the upstream, and never logged nor put
in REGISTER. No torch here.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from zmqllm.config.names import NAME_RULE, is_name
from zmqllm.config.paths import worker_served_name
from zmqllm.config.settings import Config, ConfigError
from zmqllm.log import get_logger
from zmqllm.remote.upstream import Upstream, UpstreamError, UpstreamSettings
from zmqllm.remote.worker import RemoteWorker
from zmqllm.worker.shell import worker_keys

__all__ = ["MAX_KEY_BYTES", "MAX_URL_BYTES", "read_api_key", "read_remote_url", "serve"]

log = get_logger("zmqllm.worker")

MAX_KEY_BYTES = 4096


def read_api_key(path: str) -> str:
    """The upstream's key from its file ("" when none is configured); ConfigError naming
    the file, never the content, when it cannot be used."""
    if not path:
        return ""
    file = Path(path).expanduser()
    key = _one_line(file, "api_key_file", "key", MAX_KEY_BYTES)
    if not key.isascii() or not key.isprintable():
        # An HTTP header carries ASCII only: httpx would fail on it at the first request.
        raise ConfigError(f"api_key_file {file}: the key must be printable ASCII")
    return key


MAX_URL_BYTES = 8192


def read_remote_url(value: str) -> str:
    """``--remote``: the URL itself, or ``@FILE`` holding it (so that `ps` shows no URL,
    which may name an internal host or carry a key). ConfigError naming the file."""
    if not value.startswith("@"):
        return value
    return _one_line(Path(value[1:]).expanduser(), "remote URL file", "URL", MAX_URL_BYTES)


def _one_line(file: Path, what: str, noun: str, limit: int) -> str:
    """The one line ``file`` holds; ConfigError naming the file, never its content."""
    try:
        # Read no more than the value can be: the path may name something huge or endless.
        with file.open("rb") as f:
            raw = f.read(limit + 1)
    except OSError as exc:
        raise ConfigError(f"{what} {file}: cannot read it ({exc.strerror})") from None
    text = raw.decode("utf-8", errors="replace").strip()
    if not text or len(raw) > limit or any(c.isspace() for c in text):
        raise ConfigError(f"{what} {file}: must hold one {noun} on one line")
    return text


def serve(cfg: Config) -> int:
    """Run a remote worker until SIGTERM/SIGINT (its upstream model looked up first)."""
    keys = worker_keys(cfg)
    w = cfg.worker
    settings = UpstreamSettings(
        url=read_remote_url(w.remote),
        model=w.remote_model,
        api_key=read_api_key(w.api_key_file),
        stall_timeout=w.remote_stall_timeout,
        retries=w.remote_retries,
    )
    if not settings.model:
        probe = Upstream(settings)

        async def resolve() -> str:
            try:
                return await probe.resolve_model()
            finally:
                await probe.aclose()

        try:
            model = asyncio.run(resolve())
        except UpstreamError as exc:
            log.error("cannot learn the upstream's model", error=exc.message)
            return 1
        settings = dataclasses.replace(settings, model=model)
    served = worker_served_name(cfg) or settings.model
    if not is_name(served):
        # An upstream's own id (a flag's is checked with the config): REGISTER takes none
        # with spaces or beyond ASCII, and failing there would be a traceback.
        raise ConfigError(
            f"the upstream's model id {served!r:.80} is no usable model name "
            f"({NAME_RULE}); set --served-name"
        )
    worker = RemoteWorker(cfg, settings, served, keys=keys)
    worker.install_signals()
    return worker.run()
