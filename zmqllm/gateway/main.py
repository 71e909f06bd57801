"""``serve``: run the gateway process (what ``zmqllm gateway`` calls).

The gateway needs only the model's small files (config, tokenizer, chat template): from
the Hub it downloads just those, never the weights, and it never imports torch. A gateway
with ``local_model`` off serves only remote (text) models and reads no model files.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Generator
from pathlib import Path

import uvicorn

from zmqllm.config.machine import is_loopback_host
from zmqllm.config.paths import checked_model_name, resolve_model_path, served_model_name
from zmqllm.config.settings import Config, ConfigError, GatewaySettings, ModelSettings
from zmqllm.gateway.api_keys import load_api_keys
from zmqllm.gateway.app import create_app
from zmqllm.gateway.http_server import base_url, tls_files, uvicorn_config
from zmqllm.log import configure_logging, get_logger
from zmqllm.models.model_args import ModelArgs
from zmqllm.models.tokenizer import MODEL_FILES, Tokenizer

__all__ = ["META_FILES", "check_exposure", "model_files_dir", "serve"]

# The files the gateway reads: no weights.
META_FILES = MODEL_FILES

log = get_logger("zmqllm.gateway")
# SIGINT and SIGTERM: the signals a clean stop arrives by.
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def model_files_dir(model: ModelSettings) -> Path:
    """A local directory holding the model's config and tokenizer files."""
    spec = resolve_model_path(model.path)
    local = Path(spec).expanduser()
    if local.is_dir():
        return local
    # Anything that looks like a path but is not a directory is a mistake, not a repo id.
    if local.is_absolute() or spec.startswith(".") or spec.count("/") != 1:
        raise ConfigError(
            f"model {model.path!r}: {local} is not a directory (prepare it first with "
            "`zmqllm prepare-model`, or give a Hugging Face repo id like 'owner/name')"
        )
    from huggingface_hub import snapshot_download

    log.info("downloading tokenizer and config", repo=spec, revision=model.revision)
    return Path(snapshot_download(spec, revision=model.revision, allow_patterns=META_FILES))


def check_exposure(settings: GatewaySettings, keyed: bool) -> None:
    """ConfigError for a gateway without API keys bound where other machines reach it,
    unless ``open_api``: anyone there could use its workers (as the broker refuses a
    plaintext bus beyond loopback)."""
    if keyed or settings.open_api or is_loopback_host(settings.host):
        return
    raise ConfigError(
        f"refusing to serve the API on {settings.host} without API keys: anyone who "
        "reaches it could use it. Give keys with --api-key-file FILE ([gateway] "
        "api_keys_file) or $ZMQLLM_API_KEY, bind 127.0.0.1 (--host), or give --open-api "
        "([gateway] open_api) to serve it open anyway"
    )


def serve(cfg: Config) -> int:
    """Run the gateway until SIGINT/SIGTERM: 0; or 2 when its own model cannot be
    served (its name taken by a remote model), having said what to change."""
    configure_logging("gateway", cfg.log.level, cfg.log.format)
    # Checked before anything slow: a bad key or TLS file fails at once, naming the file.
    api_keys = load_api_keys(cfg.gateway.api_keys_file)
    check_exposure(cfg.gateway, api_keys is not None)
    tls_files(cfg.gateway)
    # Imported here: the client pulls in ZeroMQ, which nothing else in this package needs.
    from zmqllm.bus.keys import keys_dir, load_peer_keys
    from zmqllm.client.broker_client import BrokerClient

    folder = keys_dir(cfg.security)
    keys = load_peer_keys(folder, "client") if folder is not None else None
    settings = cfg.gateway
    tokenizer: Tokenizer | None = None
    context_length, name = 0, ""
    if settings.local_model:
        directory = model_files_dir(cfg.model)
        tokenizer = Tokenizer.from_dir(directory)
        context_length = ModelArgs.from_dir(directory).max_position_embeddings
        name = checked_model_name(served_model_name(cfg.model))
    client = BrokerClient(
        settings.broker,
        heartbeat_interval=cfg.broker.heartbeat_interval,
        liveness=cfg.broker.heartbeat_liveness,
        keys=keys,
        # Every admitted request holds one stream (queued ones hold none yet), and the
        # readiness warm-up one more.
        max_streams=settings.max_concurrent + 1,
    )
    app = create_app(client, settings, tokenizer, name, context_length, api_keys=api_keys)
    log.info(
        "gateway starting",
        url=base_url(settings),
        host=settings.host,
        port=settings.port,
        # Where the keys come from and how many; never the keys.
        api_keys=None if api_keys is None else api_keys.source,
        api_key_count=0 if api_keys is None else api_keys.count,
        broker=settings.broker,
        model=name or None,
        context_length=context_length or None,
        remote_models_only=not settings.local_model,
    )
    server = _QuietServer(uvicorn_config(app, settings))

    def give_up(reason: str) -> None:
        print(f"zmqllm gateway: {reason}", file=sys.stderr, flush=True)
        server.should_exit = True

    app.state.readiness.on_fatal = give_up
    server.run()
    return 2 if app.state.readiness.fatal is not None else 0


class _QuietServer(uvicorn.Server):
    """uvicorn re-raises SIGINT/SIGTERM after a graceful shutdown, so the process
    would end "killed by signal"; a clean stop should exit 0 like the other roles."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
