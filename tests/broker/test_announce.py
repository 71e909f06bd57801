"""`zmqllm broker --announce` (broker/announce.py): what is announced for which backend,
and the refusals before anything binds. The announcement crossing a bridge is in
tests/e2e/test_discovery.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from zmqllm.broker.announce import announced_addresses
from zmqllm.broker.main import serve
from zmqllm.bus.keys import init_keys
from zmqllm.config.settings import BrokerSettings, ConfigError, SecuritySettings


def test_a_backend_on_every_interface_is_announced_on_each_address() -> None:
    local = lambda: ["198.18.0.1", "198.18.0.9"]  # noqa: E731
    assert announced_addresses("tcp://0.0.0.0:5556", local) == ["198.18.0.1", "198.18.0.9"]
    assert announced_addresses("tcp://*:5556", local) == ["198.18.0.1", "198.18.0.9"]
    assert announced_addresses("tcp://198.18.0.4:5556", local) == ["198.18.0.4"]
    with pytest.raises(ConfigError, match="no IPv4 address but loopback"):
        announced_addresses("tcp://*:5556", lambda: [])


@pytest.mark.parametrize("backend", ["tcp://127.0.0.1:5556", "ipc:///tmp/b", "tcp://[::1]:1"])
def test_a_backend_no_other_machine_reaches_is_refused(backend: str) -> None:
    with pytest.raises(ConfigError, match="--announce"):
        announced_addresses(backend)


def test_the_broker_refuses_to_announce_without_keys_or_on_loopback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZMQLLM_HOME", str(tmp_path / "home"))
    settings = BrokerSettings(backend="tcp://127.0.0.1:0", frontend="tcp://127.0.0.1:0")
    announce = replace(settings, announce=True)
    with pytest.raises(ConfigError, match="needs CURVE keys"):
        serve(announce, SecuritySettings())
    keys = SecuritySettings(keys=str(init_keys(tmp_path / "keys")))
    with pytest.raises(ConfigError, match="not reachable from other machines"):
        serve(announce, keys)
