"""Reading settings: TOML files, value checks, command-line overrides (no torch needed)."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest

from zmqllm.config.layers import parse_layers
from zmqllm.config.loading import load_config, with_overrides
from zmqllm.config.settings import Config, ConfigError, StageSpec

CONFIGS = Path(__file__).parents[2] / "configs"


def write(tmp_path: Path, text: str, name: str = "cluster.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --- defaults and shipped files ---------------------------------------------------------


def test_defaults_load() -> None:
    cfg = load_config()
    assert cfg == Config()
    assert cfg.model.path == "default"
    assert cfg.model.dtype == "float32"
    assert cfg.model.device == "cpu"
    assert cfg.broker.frontend == "tcp://127.0.0.1:5555"
    assert cfg.broker.backend == "tcp://127.0.0.1:5556"
    assert cfg.broker.heartbeat_liveness == 3
    assert cfg.broker.max_message_bytes == 256 << 20
    assert cfg.worker.broker == cfg.broker.backend
    assert cfg.gateway.broker == cfg.broker.frontend
    assert cfg.gateway.port == 8080
    assert cfg.log.level == "info"
    assert cfg.stages == []


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == Config()


@pytest.mark.parametrize(
    "name", ["local.toml", "tiny.toml", "mistral-7b-instruct.toml", "mistral-7b-cpu.toml"]
)
def test_shipped_configs_load(name: str) -> None:
    cfg = load_config(CONFIGS / name)
    assert cfg.stages, "the launcher needs stages"
    stages = [parse_layers(stage.layers, 32) for stage in cfg.stages]
    # The stages must tile the model with no gap or overlap.
    assert stages[0][0] == 0 and stages[-1][1] == 32
    assert all(a[1] == b[0] for a, b in pairwise(stages))


def test_every_shipped_config_loads() -> None:
    files = sorted(CONFIGS.glob("*.toml"))
    assert {f.name for f in files} >= {"local.toml", "tiny.toml", "mistral-7b-instruct.toml"}
    for file in files:
        load_config(file)


def test_local_config_splits_default_model_in_halves() -> None:
    cfg = load_config(CONFIGS / "local.toml")
    assert cfg.model.path == "default"
    assert (cfg.model.dtype, cfg.model.device) == ("float32", "cpu")
    assert [parse_layers(s.layers, 30) for s in cfg.stages] == [(0, 15), (15, 30)]
    assert cfg.gateway.port == 8080
    assert cfg.broker.frontend.endswith(":5555") and cfg.broker.backend.endswith(":5556")


def test_tiny_config_uses_its_own_ports() -> None:
    tiny, local = load_config(CONFIGS / "tiny.toml"), load_config(CONFIGS / "local.toml")
    assert tiny.model.path == "tiny"
    assert len(tiny.stages) == 2
    assert tiny.gateway.port != local.gateway.port
    assert tiny.broker.frontend != local.broker.frontend
    assert tiny.broker.backend != local.broker.backend
    # Each client must point at its own broker's socket.
    assert tiny.gateway.broker == tiny.broker.frontend
    assert tiny.worker.broker == tiny.broker.backend


def test_mistral_config() -> None:
    cfg = load_config(CONFIGS / "mistral-7b-instruct.toml")
    assert cfg.model.path == "mistralai/Mistral-7B-Instruct-v0.3"
    assert (cfg.model.dtype, cfg.model.device) == ("bfloat16", "cuda")
    assert [s.layers for s in cfg.stages] == ["1/4", "2/4", "3/4", "4/4"]


def test_mistral_cpu_config_fits_two_16_gb_machines() -> None:
    """The int4 stages, their KV budget and runtime within the memory each is given,
    by the same plan a worker checks before it loads (at Mistral-7B's geometry)."""
    from zmqllm.engine.memory_plan import plan_stage
    from zmqllm.models.model_args import ModelArgs

    cfg = load_config(CONFIGS / "mistral-7b-cpu.toml")
    assert (cfg.model.quant, cfg.model.device) == ("int4", "cpu")
    assert cfg.worker.max_memory_mb <= 16 * 1024
    args = ModelArgs.from_dict(
        {
            "model_type": "mistral",
            "vocab_size": 32768,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
        }
    )
    for stage in cfg.stages:
        start, end = parse_layers(stage.layers, 32)
        plan = plan_stage(
            args, start, end, cfg.model.dtype, cfg.model.quant,
            cfg.worker.max_kv_tokens, cfg.worker.max_memory_mb,
        )  # fmt: skip
        assert plan.fits(), plan.refusal()
        assert plan.given_bytes - plan.need_bytes > 1 << 30  # room to spare


def test_file_values_and_stages(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        [model]
        path = "/models/x"
        revision = "main"
        [broker]
        heartbeat_interval = 2  # an int is fine for a float field
        [log]
        level = "DEBUG"
        [[stages]]
        layers = "0:10"
        count = 2
        [[stages]]
        layers = "10:"
        """,
    )
    cfg = load_config(str(path))
    assert cfg.model.path == "/models/x" and cfg.model.revision == "main"
    assert cfg.broker.heartbeat_interval == 2.0
    assert isinstance(cfg.broker.heartbeat_interval, float)
    assert cfg.log.level == "debug"
    assert cfg.stages == [StageSpec("0:10", 2), StageSpec("10:", 1)]
    # Untouched keys keep their defaults.
    assert cfg.gateway == Config().gateway


# --- errors -----------------------------------------------------------------------------


def test_unknown_key_names_key_section_file_and_valid_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "[gateway]\nprot = 9000\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "'prot'" in message
    assert "[gateway]" in message
    assert str(path) in message
    assert "port" in message and "max_body_bytes" in message


def test_unknown_section_names_section_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[gatewy]\nport = 9000\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "[gatewy]" in message and str(path) in message
    assert "gateway" in message and "stages" in message


def test_unknown_key_in_stage(tmp_path: Path) -> None:
    path = write(tmp_path, '[[stages]]\nlayers = "1/2"\nreplicas = 2\n')
    with pytest.raises(ConfigError, match=r"'replicas'.*stages"):
        load_config(path)


def test_stage_needs_layers(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="layers"):
        load_config(write(tmp_path, "[[stages]]\ncount = 2\n"))


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        ('[gateway]\nport = "8080"\n', "port", "integer"),
        ("[gateway]\nport = true\n", "port", "integer"),
        ("[gateway]\nport = 80.5\n", "port", "integer"),
        ('[broker]\nheartbeat_interval = "1s"\n', "heartbeat_interval", "number"),
        ("[broker]\nheartbeat_interval = false\n", "heartbeat_interval", "number"),
        ("[model]\npath = 3\n", "path", "string"),
        ("[model]\nrevision = 3\n", "revision", "string"),
        ("[[stages]]\nlayers = 1\n", "layers", "string"),
        ('[[stages]]\nlayers = "1/2"\ncount = "2"\n', "count", "integer"),
    ],
)
def test_wrong_types(tmp_path: Path, text: str, key: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert key in str(info.value) and expected in str(info.value)


def test_section_must_be_a_table(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="gateway"):
        load_config(write(tmp_path, "gateway = 1\n"))


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[model]\ndtype = "float64"\n', "dtype"),
        ('[model]\ndevice = "gpu"\n', "device"),
        ('[model]\npath = ""\n', "path"),
        ("[gateway]\nport = 70000\n", "port"),
        ("[gateway]\nport = -1\n", "port"),
        ("[gateway]\nmax_concurrent = 0\n", "max_concurrent"),
        ("[gateway]\nrequest_timeout = 0\n", "request_timeout"),
        ("[gateway]\nmax_queued = -1\n", "max_queued"),
        ("[gateway]\nqueue_timeout = 0\n", "queue_timeout"),
        ("[gateway]\nfirst_token_timeout = -1\n", "first_token_timeout"),
        ("[gateway]\ninter_token_timeout = inf\n", "inter_token_timeout"),
        ("[gateway]\nlimit_concurrency = 0\n", "limit_concurrency"),
        ("[gateway]\nkeep_alive_timeout = 0\n", "keep_alive_timeout"),
        ("[gateway]\nheader_timeout = 0\n", "header_timeout"),
        ("[gateway]\nbody_timeout = 0\n", "body_timeout"),
        ("[broker]\nheartbeat_interval = -1.0\n", "heartbeat_interval"),
        ("[broker]\nheartbeat_interval = nan\n", "heartbeat_interval"),
        ("[broker]\nheartbeat_liveness = 0\n", "heartbeat_liveness"),
        ("[broker]\nqueue_size = 0\n", "queue_size"),
        ('[broker]\nfrontend = "127.0.0.1:5555"\n', "frontend"),
        ("[worker]\nthreads = -1\n", "threads"),
        ("[worker]\ndiscover_timeout = 0\n", "discover_timeout"),
        ("[worker]\nprefill_chunk = 0\n", "prefill_chunk"),
        ("[worker]\nbusy_prefill_chunk = 0\n", "busy_prefill_chunk"),
        ('[worker]\nwire_dtype = "int8"\n', "wire_dtype"),
        ('[worker]\nkv_dtype = "float16"\n', "kv_dtype"),
        ('[worker]\nspeculative = "ngram"\n', "speculative"),
        ('[worker]\nspeculative = "draft"\ndraft_model = ""\n', "draft_model"),
        ("[worker]\nmax_draft_tokens = 0\n", "max_draft_tokens"),
        ("[worker]\nmax_draft_tokens = 17\n", "max_draft_tokens"),
        ('[worker]\npeer = "ipc:///tmp/p"\n', "peer"),
        ('[worker]\npeer = "on"\n', "peer"),
        ('[worker]\nlayers = "3/2"\n', "layers"),
        ('[worker]\nlayers = "half"\n', "layers"),
        ('[log]\nlevel = "loud"\n', "level"),
        ('[log]\nformat = "xml"\n', "format"),
        ('[[stages]]\nlayers = "2:1"\n', "layers"),
        ('[[stages]]\nlayers = "1/2"\ncount = 0\n', "count"),
    ],
)
def test_bad_values(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_config(write(tmp_path, text))


def test_a_draft_model_is_the_default_model_unless_named(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, '[worker]\nspeculative = "draft"\n'))
    assert (cfg.worker.speculative, cfg.worker.draft_model) == ("draft", "default")
    text = '[worker]\nspeculative = "draft"\ndraft_model = "/models/small"\n'
    assert load_config(write(tmp_path, text)).worker.draft_model == "/models/small"


def test_port_zero_means_any_free_port(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "[gateway]\nport = 0\n")).gateway.port == 0


def test_bad_toml_names_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[gateway\nport = 1\n")
    with pytest.raises(ConfigError, match="invalid TOML") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[model]\nname = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(path)


def test_missing_file_names_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=str(tmp_path)):
        load_config(tmp_path)


# --- overrides --------------------------------------------------------------------------


def test_overrides_win_and_none_is_ignored(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, '[gateway]\nport = 9000\nhost = "0.0.0.0"\n'))
    flags = {"port": 9100, "host": None, "max_concurrent": None}
    updated = with_overrides(cfg, "gateway", flags)
    assert updated.gateway.port == 9100
    assert updated.gateway.host == "0.0.0.0"
    assert updated.gateway.max_concurrent == 64
    # The original is left alone: overrides return a new Config.
    assert cfg.gateway.port == 9000
    assert updated.broker is cfg.broker


def test_overrides_validate() -> None:
    cfg = Config()
    with pytest.raises(ConfigError, match=r"'portt'.*command-line"):
        with_overrides(cfg, "gateway", {"portt": 1})
    with pytest.raises(ConfigError, match="port"):
        with_overrides(cfg, "gateway", {"port": 65536})
    with pytest.raises(ConfigError, match=r"port.*integer"):
        with_overrides(cfg, "gateway", {"port": "80"})
    with pytest.raises(ConfigError, match="nowhere"):
        with_overrides(cfg, "nowhere", {"x": 1})
    with pytest.raises(ConfigError, match="layers"):
        with_overrides(cfg, "worker", {"layers": "0/2"})


def test_overrides_normalize_and_widen() -> None:
    cfg = with_overrides(Config(), "log", {"level": "WARNING"})
    assert cfg.log.level == "warning"
    cfg = with_overrides(cfg, "broker", {"queue_timeout": 5})
    assert cfg.broker.queue_timeout == 5.0 and isinstance(cfg.broker.queue_timeout, float)


def test_no_overrides_is_identity() -> None:
    cfg = Config()
    assert with_overrides(cfg, "worker", {"layers": None}) == cfg
