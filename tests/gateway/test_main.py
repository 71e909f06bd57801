"""``serve``: model files, tokenizer, client and uvicorn wiring (nothing is started)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.fake_broker_client import FakeBrokerClient
from zmqllm.config.settings import Config, ConfigError, ModelSettings
from zmqllm.gateway import main
from zmqllm.models.tiny_tokenizer import write_tiny_tokenizer

CONFIG = {
    "model_type": "mistral",
    "vocab_size": 512,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "sliding_window": 8,
}


# Each test runs `serve`, which configures logging for the whole process.
pytestmark = pytest.mark.usefixtures("restore_logging")


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "tiny-model"
    directory.mkdir()
    write_tiny_tokenizer(directory)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return directory


def test_local_directory_is_used_as_is(model_dir: Path) -> None:
    assert main.model_files_dir(ModelSettings(path=str(model_dir))) == model_dir


@pytest.mark.parametrize("path", ["/no/such/dir", "./relative", "a/b/c", "justaname"])
def test_missing_directory_is_a_clear_error(path: str) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        main.model_files_dir(ModelSettings(path=path))


def test_hub_repo_downloads_only_the_small_files(
    monkeypatch: pytest.MonkeyPatch, model_dir: Path
) -> None:
    huggingface_hub = pytest.importorskip("huggingface_hub")
    asked: dict[str, Any] = {}

    def fake_download(repo_id: str, **kwargs: Any) -> str:
        asked.update(kwargs, repo_id=repo_id)
        return str(model_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    settings = ModelSettings(path="mistralai/Some-Model", revision="main")
    assert main.model_files_dir(settings) == model_dir
    assert asked["repo_id"] == "mistralai/Some-Model" and asked["revision"] == "main"
    assert set(asked["allow_patterns"]) == set(main.META_FILES)
    assert not any("safetensors" in pattern for pattern in asked["allow_patterns"])


def test_serve_wires_client_app_and_uvicorn(
    monkeypatch: pytest.MonkeyPatch, model_dir: Path
) -> None:
    import zmqllm.client.broker_client

    made: dict[str, Any] = {}

    def fake_client(address: str, **kwargs: Any) -> FakeBrokerClient:
        made.update(kwargs, address=address)
        return FakeBrokerClient()

    def fake_run(self: Any) -> None:
        c = self.config
        made["app"] = c.app
        made["run"] = {
            "host": c.host,
            "port": c.port,
            "log_config": c.log_config,
            "access_log": c.access_log,
            "limit_concurrency": c.limit_concurrency,
            "timeout_keep_alive": c.timeout_keep_alive,
            "header_timeout": c.http.header_timeout,
        }

    monkeypatch.setattr(zmqllm.client.broker_client, "BrokerClient", fake_client)
    monkeypatch.setattr(main._QuietServer, "run", fake_run)
    cfg = Config()
    cfg.model.path = str(model_dir)
    cfg.gateway.port = 0
    cfg.gateway.broker = "tcp://127.0.0.1:7001"
    cfg.broker.heartbeat_interval = 0.25
    cfg.log.format = "json"
    main.serve(cfg)
    assert made["address"] == "tcp://127.0.0.1:7001"
    assert made["heartbeat_interval"] == 0.25 and made["liveness"] == cfg.broker.heartbeat_liveness
    assert made["run"]["host"] == "127.0.0.1" and made["run"]["port"] == 0
    assert made["run"]["log_config"] is None and made["run"]["access_log"] is False
    # The HTTP edge's limits come from [gateway].
    assert made["run"]["limit_concurrency"] == cfg.gateway.limit_concurrency == 2048
    assert made["run"]["timeout_keep_alive"] == cfg.gateway.keep_alive_timeout == 5
    assert made["run"]["header_timeout"] == cfg.gateway.header_timeout == 10.0
    gateway = made["app"].state.gateway
    assert gateway.context_length == CONFIG["max_position_embeddings"]
    assert gateway.model_name == "tiny-model"


def test_gateway_flags_reach_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from zmqllm import cli

    seen: list[Config] = []
    monkeypatch.setattr(main, "serve", lambda cfg: seen.append(cfg) or 0)
    flags = ["--max-concurrent", "8", "--max-queued", "3", "--queue-timeout", "7"]
    flags += ["--first-token-timeout", "9", "--inter-token-timeout", "4.5"]
    assert cli.main(["gateway", *flags]) == 0
    (cfg,) = seen
    g = cfg.gateway
    assert (g.max_concurrent, g.max_queued, g.queue_timeout) == (8, 3, 7.0)
    assert (g.first_token_timeout, g.inter_token_timeout) == (9.0, 4.5)


@pytest.mark.parametrize(
    ("host", "keyed", "open_api", "refused"),
    [
        ("0.0.0.0", False, False, True),
        ("::", False, False, True),
        ("198.18.0.1", False, False, True),
        ("gw.example.com", False, False, True),
        ("0.0.0.0", True, False, False),
        ("0.0.0.0", False, True, False),
        ("127.0.0.1", False, False, False),
        ("localhost", False, False, False),
        ("::1", False, False, False),
    ],
)
def test_an_open_api_beyond_loopback_is_refused_unless_asked_for(
    host: str, keyed: bool, open_api: bool, refused: bool
) -> None:
    """Issue 40, item 7: as the broker refuses a plaintext bus beyond loopback, the
    gateway refuses to serve its API without keys where other machines reach it."""
    from zmqllm.config.settings import GatewaySettings

    settings = GatewaySettings(host=host, open_api=open_api)
    if not refused:
        main.check_exposure(settings, keyed)
        return
    with pytest.raises(ConfigError) as err:
        main.check_exposure(settings, keyed)
    assert f"on {host} without API keys" in str(err.value)
    assert "--api-key-file" in str(err.value) and "--open-api" in str(err.value)


def test_the_cli_exits_2_before_loading_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from zmqllm import cli

    monkeypatch.delenv("ZMQLLM_API_KEY", raising=False)
    monkeypatch.setattr(main, "model_files_dir", lambda _: pytest.fail("loaded the model"))
    assert cli.main(["gateway", "--host", "0.0.0.0", "--model", "/nonexistent"]) == 2
    assert "refusing to serve the API on 0.0.0.0 without API keys" in capsys.readouterr().err
