"""Settings: ConfigError (no torch needed)."""

from __future__ import annotations

from zmqllm.config.settings import ConfigError


def test_isinstance_value_error() -> None:
    assert issubclass(ConfigError, ValueError)
