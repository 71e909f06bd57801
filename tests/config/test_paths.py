"""Locations and names: the model aliases, $ZMQLLM_HOME, the served name (no torch needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from zmqllm.config.paths import (
    default_model_dir,
    log_dir,
    resolve_model_path,
    served_model_name,
    tiny_model_dir,
    zmqllm_home,
)
from zmqllm.config.settings import LogSettings, ModelSettings


def test_model_aliases_honour_zmqllm_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZMQLLM_HOME", str(tmp_path))
    assert zmqllm_home() == tmp_path
    assert default_model_dir() == tmp_path / "models" / "smollm2-135m-instruct"
    assert tiny_model_dir() == tmp_path / "models" / "tiny"
    assert resolve_model_path("default") == str(default_model_dir())
    assert resolve_model_path("tiny") == str(tmp_path / "models" / "tiny")
    repo = "mistralai/Mistral-7B-Instruct-v0.3"
    assert resolve_model_path(repo) == repo
    assert resolve_model_path("/some/dir") == "/some/dir"
    assert log_dir(LogSettings()) == tmp_path / "logs"
    assert log_dir(LogSettings(dir=str(tmp_path / "x"))) == tmp_path / "x"


def test_home_defaults_to_user_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZMQLLM_HOME", raising=False)
    assert zmqllm_home() == Path.home() / ".cache" / "zmqllm"


def test_served_model_name(tmp_path: Path) -> None:
    assert served_model_name(ModelSettings(name="chat")) == "chat"
    assert served_model_name(ModelSettings()) == "smollm2-135m-instruct"
    assert served_model_name(ModelSettings(path="tiny")) == "tiny"
    repo = "mistralai/Mistral-7B-Instruct-v0.3"
    assert served_model_name(ModelSettings(path=repo)) == repo
    local = tmp_path / "my-model"
    local.mkdir()
    assert served_model_name(ModelSettings(path=str(local))) == "my-model"
