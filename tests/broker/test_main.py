"""Starting a broker: which endpoints other machines could reach, and the refusal to bind
them without CURVE keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from zmqllm.broker.main import exposed_endpoints, serve
from zmqllm.config.settings import BrokerSettings, ConfigError, SecuritySettings


def test_exposed_endpoints() -> None:
    local = BrokerSettings(frontend="tcp://127.0.0.1:5555", backend="tcp://localhost:5556")
    assert exposed_endpoints(local) == []
    assert exposed_endpoints(BrokerSettings(frontend="ipc:///tmp/x", backend="tcp://[::1]:1")) == []
    wide = BrokerSettings(frontend="tcp://0.0.0.0:5555", backend="tcp://*:5556")
    assert exposed_endpoints(wide) == ["tcp://0.0.0.0:5555", "tcp://*:5556"]
    lan = BrokerSettings(backend="tcp://198.18.0.1:5556")
    assert exposed_endpoints(lan) == ["tcp://198.18.0.1:5556"]


def test_a_keyless_broker_refuses_to_bind_beyond_loopback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZMQLLM_HOME", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        serve(BrokerSettings(frontend="tcp://0.0.0.0:0"), SecuritySettings())
    assert "zmqllm keys init" in str(err.value) and "--insecure" in str(err.value)
