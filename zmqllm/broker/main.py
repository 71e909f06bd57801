"""Running a broker process: its keys, the refusal to serve a plaintext bus beyond
loopback, and the signals that stop it.

``serve`` is what ``zmqllm broker`` runs (with ``--announce``, advertised on the local
network by announce.py). Without CURVE keys the broker binds only
loopback, ipc and inproc endpoints (``exposed_endpoints`` names the others) unless told
``--insecure``: a plaintext bus lets anyone who reaches it read every prompt. The broker
itself, its sockets and loop, is ``loop.py``. It never imports torch.
"""

from __future__ import annotations

import signal

from zmqllm.broker.loop import Broker
from zmqllm.bus.keys import keys_dir, load_broker_keys
from zmqllm.config.machine import is_loopback_host
from zmqllm.config.settings import BrokerSettings, ConfigError, SecuritySettings
from zmqllm.log import get_logger

__all__ = ["exposed_endpoints", "serve"]

log = get_logger("zmqllm.broker")


def exposed_endpoints(settings: BrokerSettings) -> list[str]:
    """The broker's endpoints that other machines could reach (not loopback, ipc or
    inproc; a host name other than localhost counts as reachable)."""
    out = []
    for endpoint in (settings.frontend, settings.backend):
        if not endpoint.startswith("tcp://"):
            continue
        if not is_loopback_host(endpoint[len("tcp://") :].rsplit(":", 1)[0]):
            out.append(endpoint)
    return out


def serve(settings: BrokerSettings, security: SecuritySettings | None = None) -> None:
    """Run a broker until SIGTERM/SIGINT. Without keys it binds loopback only (unless
    told --insecure): a plaintext bus lets anyone who reaches it read every prompt."""
    security = security or SecuritySettings()
    folder = keys_dir(security)
    keys = load_broker_keys(folder) if folder is not None else None
    if keys is None:
        exposed = exposed_endpoints(settings)
        if exposed and not security.insecure:
            raise ConfigError(
                f"refusing to bind {', '.join(exposed)} without CURVE keys: anyone who "
                "reaches it could join the bus and read every prompt. Make keys with "
                "`zmqllm keys init DIR` and give --keys DIR (or keep them in "
                "$ZMQLLM_HOME/keys), or give --insecure to bind it plaintext anyway"
            )
        log.warning(
            "no CURVE keys: the bus is plaintext and any local process may join it",
            hint="zmqllm keys init DIR, then --keys DIR",
            insecure=security.insecure,
        )
    else:
        log.info("CURVE on", keys=str(folder))
    if settings.announce and keys is None:
        raise ConfigError(
            "--announce needs CURVE keys: a worker checks the broker it discovers against "
            "the broker key it holds (give --keys DIR)"
        )
    if settings.announce:
        from zmqllm.broker.announce import announced_addresses

        announced_addresses(settings.backend)  # refused before anything binds
    broker = Broker(settings, keys=keys)
    signal.signal(signal.SIGTERM, broker.stop)
    signal.signal(signal.SIGINT, broker.stop)
    announcer = None
    if settings.announce and keys is not None:
        from zmqllm.broker.announce import Announcer

        registry = broker.registry
        try:
            announcer = Announcer(broker.endpoints[1], keys.public, lambda: list(registry.models))
        except BaseException:
            broker.close()
            raise
    try:
        broker.run()
    finally:
        if announcer is not None:
            announcer.close()
