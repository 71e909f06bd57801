"""Settings for every zmqllm process, read from one TOML file.

A file has one table per section (``[model]``, ``[broker]``, ``[worker]``, ``[gateway]``,
``[log]``, ``[security]``) plus an array of ``[[stages]]`` tables for the launcher. Every
key has a default, so a file only names what it changes, and every key has a command-line
flag (settings_flags.py) that overrides the file through ``with_overrides``. Mistakes
are reported as ``ConfigError`` naming the key, the section and the file, because a typo
that silently falls back to a default is the hardest kind of misconfiguration to spot in
a cluster of processes.

This module runs in the broker and the gateway, so it must not import torch.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, Union, get_args, get_origin, get_type_hints

from .log import LOG_FORMATS, LOG_LEVELS

if sys.version_info >= (3, 11):
    import tomllib
else:  # tomllib joined the standard library in 3.11; tomli is the same parser
    import tomli as tomllib

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "BrokerSettings",
    "Config",
    "ConfigError",
    "GatewaySettings",
    "LogSettings",
    "ModelSettings",
    "SecuritySettings",
    "StageSpec",
    "WorkerSettings",
    "check_layer_spec",
    "default_model_dir",
    "load_config",
    "log_dir",
    "parse_layers",
    "resolve_model_path",
    "served_model_name",
    "setting",
    "split_layers",
    "tiny_model_dir",
    "with_overrides",
    "zmqllm_home",
]

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MODEL = "default"
TINY_MODEL = "tiny"


class ConfigError(ValueError):
    """A config file, a flag or a layer spec that cannot be used as given."""


# --- sections ---------------------------------------------------------------------------
#
# Every setting is declared once, here: its default and the help text of its flag.
# zmqllm/settings_flags.py makes the command-line flags from these fields, so a new field
# gets its flag (``--field-name``) without touching the command line.

_T = TypeVar("_T")


def setting(
    default: _T,
    help: str,
    *,
    flag: str | None = None,
    metavar: str | None = None,
    choices: Sequence[str] | None = None,
) -> _T:
    """A settings field: its default and its flag's help text.

    ``flag`` replaces the generated ``--field-name`` (``--model`` for ``[model] path``);
    ``metavar`` names the value in ``--help``; ``choices`` lists the values the section's
    check accepts, so argparse refuses others before anything starts.
    """
    metadata = {
        "help": help,
        "flag": flag,
        "metavar": metavar,
        "choices": tuple(choices) if choices is not None else None,
    }
    return field(default=default, metadata=metadata)


@dataclass
class ModelSettings:
    # "default" and "tiny" are resolved by resolve_model_path.
    path: str = setting(
        DEFAULT_MODEL,
        '"default", "tiny", a checkpoint directory or a Hugging Face repo id',
        flag="--model",
        metavar="MODEL",
    )
    revision: str | None = setting(None, "Hub revision (branch, tag or commit)", metavar="REV")
    dtype: str = setting("float32", "dtype of weights and activations", choices=DTYPES)
    device: str = setting("cpu", '"cpu", "cuda" or "cuda:N"')
    name: str = setting(
        "",
        "model name served by the OpenAI API; empty = derived from the path",
        flag="--model-name",
        metavar="NAME",
    )


@dataclass
class BrokerSettings:
    frontend: str = setting(
        "tcp://127.0.0.1:5555", "bind address for gateways and clients", metavar="ADDR"
    )
    backend: str = setting("tcp://127.0.0.1:5556", "bind address for workers", metavar="ADDR")
    heartbeat_interval: float = setting(1.0, "seconds between heartbeats")
    heartbeat_liveness: int = setting(3, "missed heartbeats before a peer counts as dead")
    queue_size: int = setting(256, "sessions waiting for a route")
    queue_timeout: float = setting(30.0, "seconds a session may wait for a route")
    # A lost message must not hold a slot or a KV reservation. Longer than the longest
    # forward: a 2048-token prefill of a 7B model on a CPU.
    session_timeout: float = setting(
        120.0,
        "seconds a session may go without any message from its route before it is "
        "failed and freed everywhere",
    )
    # The activations of a prefill chunk: prefill_chunk x hidden x 4 bytes for fp32.
    max_message_bytes: int = setting(
        256 << 20, "largest message on the backend; ZeroMQ disconnects a peer sending more"
    )
    # An OPEN carries 4 bytes per prompt token.
    frontend_max_message_bytes: int = setting(16 << 20, "largest message on the frontend")
    # Its sessions fail (slow_consumer) instead of the broker waiting for it.
    peer_queue: int = setting(
        10000, "messages queued to one client before it counts as not reading"
    )
    # Larger: a worker takes a burst of one message per session it serves at every step.
    worker_queue: int = setting(100000, "messages queued to one worker before it counts as lost")
    max_workers: int = setting(1024, "most workers registered at once; past it REGISTER fails")
    max_ranges: int = setting(
        512, "most distinct layer ranges (pools) at once; past it REGISTER fails"
    )
    model_fingerprint: str = setting(
        "",
        "admit only workers of the model with this digest (sent in REGISTER), even into an "
        "empty cluster; empty = the first worker defines the model until the last leaves",
        metavar="DIGEST",
    )


@dataclass
class WorkerSettings:
    broker: str = setting("tcp://127.0.0.1:5556", "the broker's backend address", metavar="ADDR")
    layers: str = setting(
        "",
        'half-open layer range "0:15", stage "1/2" (split evenly) or "" for all layers',
        metavar="SPEC",
    )
    threads: int = setting(0, "torch CPU threads; 0 = torch's default")
    # Stages sharing the cores all compute at once then, and oversubscribed OpenMP is far
    # slower.
    batch_threads: int = setting(
        0, "torch CPU threads while several sessions are in flight; 0 = threads"
    )
    # Stages sharing the cores take turns with all their threads instead of
    # oversubscribing them.
    cpu_lock: str = setting(
        "",
        "lock file shared by the workers of one machine, held by each forward; empty = off",
        metavar="FILE",
    )
    native_attention: bool = setting(
        True,
        "attend batched decode steps with the compiled kernel (zmqllm/engine/csrc, built on "
        "first use; float32 on the CPU only); off, or no compiler: the PyTorch path",
    )
    # ~25% faster batched decode at the cost of about a second copy of the weights.
    packed_rows: int = setting(
        16,
        "keep an MKL-packed copy of the weights for batches of 7 to N rows (float32 on the "
        "CPU only); 0 = off",
    )
    max_sessions: int = setting(64, "sessions served at once")
    max_kv_tokens: int = setting(
        65536, "KV cache tokens reserved by all sessions together; past it new ones are refused"
    )
    max_memory_mb: int = setting(
        0,
        "refuse a new session when this process's memory (RSS on cpu, allocated GPU memory "
        "on cuda) plus its KV cache would pass this many MiB; 0 = no limit",
    )
    # llama.cpp's server batches 2048 too. A long prompt stalls the other sessions'
    # decode steps one chunk at a time (~1 ms per token for the default model on 2 cores);
    # a burst of short prompts that fits is prefilled in one forward (32 chat prompts of
    # ~40 tokens do). Split over two, the streams of the first start decoding and their
    # next token waits on the second.
    prefill_chunk: int = setting(2048, "prompt tokens per forward", metavar="TOKENS")
    name: str = setting("", "a name for logs and status; empty = HOST-PID")


@dataclass
class GatewaySettings:
    host: str = setting("127.0.0.1", "address the HTTP server listens on")
    port: int = setting(8080, "HTTP port; 0 = pick a free port")
    broker: str = setting("tcp://127.0.0.1:5555", "the broker's frontend address", metavar="ADDR")
    max_body_bytes: int = setting(1_000_000, "largest request body; past it 413")
    default_max_tokens: int = setting(256, "max_tokens of a request that gives none")
    # As many as one route's worker takes by default (max_sessions).
    max_concurrent: int = setting(
        64, "generations running at once; more wait in the queue, oldest first"
    )
    max_queued: int = setting(1024, "requests waiting for a slot; past it 429 with Retry-After")
    queue_timeout: float = setting(300.0, "seconds a request may wait in the queue; then 503")
    first_token_timeout: float = setting(
        120.0,
        "seconds from leaving the queue to the first token (the broker's queue, the "
        "prefill); then the session is cancelled and the client gets 504",
    )
    inter_token_timeout: float = setting(
        60.0,
        "seconds without a token once streaming; then the session is cancelled and the "
        "stream ends with an error",
    )
    request_timeout: float = setting(600.0, "seconds for a whole generation once out of the queue")
    # Above max_concurrent + max_queued so the queue, not this, is what a burst meets.
    limit_concurrency: int = setting(
        2048, "HTTP connections plus requests in progress past which uvicorn answers 503"
    )
    keep_alive_timeout: int = setting(
        5, "seconds an idle keep-alive connection stays open", metavar="S"
    )
    # Against slowloris.
    header_timeout: float = setting(
        10.0, "seconds for a request's line and headers to arrive; then the connection closes"
    )
    body_timeout: float = setting(30.0, "seconds to read a request's whole body; then 408")
    api_keys_file: str = setting(
        "",
        "file of API keys, one a line ('#' starts a comment): /chat, /v1/* and /metrics then "
        "need 'Authorization: Bearer KEY'; re-read when it changes. Empty = the "
        "ZMQLLM_API_KEY environment variable if set, else no keys (open)",
        flag="--api-key-file",
        metavar="FILE",
    )
    ssl_certfile: str = setting(
        "", "serve https with this PEM certificate (chain); empty = http", metavar="FILE"
    )
    ssl_keyfile: str = setting("", "the certificate's private key (PEM)", metavar="FILE")


@dataclass
class SecuritySettings:
    keys: str = setting(
        "",
        "CURVE key folder (made by `zmqllm keys init DIR`); empty = $ZMQLLM_HOME/keys if it "
        "exists, else no keys: the bus is plaintext and the broker binds loopback only",
        metavar="DIR",
    )
    insecure: bool = setting(False, "run without CURVE even where keys exist")


@dataclass
class StageSpec:
    layers: str  # same forms as WorkerSettings.layers
    count: int = 1  # replicas of this stage the launcher starts


@dataclass
class LogSettings:
    level: str = setting("info", "log level", flag="--log-level", choices=tuple(LOG_LEVELS))
    format: str = setting(
        "auto",
        '"auto" = console on a TTY, else JSON',
        flag="--log-format",
        choices=LOG_FORMATS,
    )
    dir: str = setting(
        "", "the launcher's log folder; empty = $ZMQLLM_HOME/logs", flag="--log-dir", metavar="DIR"
    )


@dataclass
class Config:
    model: ModelSettings = field(default_factory=ModelSettings)
    broker: BrokerSettings = field(default_factory=BrokerSettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    log: LogSettings = field(default_factory=LogSettings)
    security: SecuritySettings = field(default_factory=SecuritySettings)
    stages: list[StageSpec] = field(default_factory=list)


# --- locations --------------------------------------------------------------------------


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


def log_dir(settings: LogSettings) -> Path:
    """The launcher's log folder."""
    return Path(settings.dir).expanduser() if settings.dir else zmqllm_home() / "logs"


# --- layer specs ------------------------------------------------------------------------

_RANGE_RE = re.compile(r"([0-9]*)\s*:\s*([0-9]*)")
_STAGE_RE = re.compile(r"([0-9]+)\s*/\s*([0-9]+)")


def split_layers(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous half-open ranges covering ``[0, num_layers)``; earlier stages take the
    remainder (30 layers in 4 stages -> 8, 8, 7, 7)."""
    if num_layers < 1:
        raise ConfigError(f"a model needs at least one layer, got {num_layers}")
    if not 1 <= stages <= num_layers:
        raise ConfigError(f"cannot split {num_layers} layers into {stages} stages")
    base, extra = divmod(num_layers, stages)
    ranges = []
    start = 0
    for index in range(stages):
        end = start + base + (1 if index < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def _parse_layer_form(spec: str) -> tuple[str, int | None, int | None]:
    """Check a layer spec's syntax and whatever can be checked without the model.

    Returns ("all", None, None), ("range", start | None, end | None) or ("stage", k, n).
    """
    text = spec.strip()
    if not text:
        return ("all", None, None)
    stage = _STAGE_RE.fullmatch(text)
    if stage:
        k, n = int(stage[1]), int(stage[2])
        if n < 1 or not 1 <= k <= n:
            raise ConfigError(f"layer spec {spec!r}: stage k/n needs 1 <= k <= n (1-based)")
        return ("stage", k, n)
    span = _RANGE_RE.fullmatch(text)
    if span:
        start = int(span[1]) if span[1] else None
        end = int(span[2]) if span[2] else None
        if start is not None and end is not None and start >= end:
            raise ConfigError(f"layer spec {spec!r}: start must be below end (half-open)")
        return ("range", start, end)
    raise ConfigError(
        f"bad layer spec {spec!r}: expected 'start:end' (half-open, either side may be "
        "omitted), 'k/n' (stage k of n, 1-based) or '' (all layers)"
    )


def check_layer_spec(spec: str) -> None:
    """Reject a layer spec that is wrong for any model ("3/2", "5:1", "half").

    For checking flags before the model's layer count is known; parse_layers still checks
    the spec against the model.
    """
    _parse_layer_form(spec)


def parse_layers(spec: str, num_layers: int) -> tuple[int, int]:
    """The half-open layer range ``(start, end)`` a layer spec selects in a model."""
    if num_layers < 1:
        raise ConfigError(f"layer spec {spec!r}: a model needs at least one layer")
    kind, a, b = _parse_layer_form(spec)
    if kind == "all":
        return (0, num_layers)
    if kind == "stage":
        assert a is not None and b is not None
        if b > num_layers:
            raise ConfigError(
                f"layer spec {spec!r}: {b} stages but the model has only {num_layers} layers"
            )
        return split_layers(num_layers, b)[a - 1]
    start = 0 if a is None else a
    end = num_layers if b is None else b
    if not 0 <= start < end <= num_layers:
        raise ConfigError(
            f"layer spec {spec!r}: range [{start}, {end}) is outside the model's "
            f"{num_layers} layers"
        )
    return (start, end)


# --- type checks ------------------------------------------------------------------------

_DataclassT = TypeVar("_DataclassT", bound="DataclassInstance")


def _toml_type(value: object) -> str:
    # Name types the way TOML does: the user wrote TOML, not Python.
    if isinstance(value, bool):
        return "boolean"
    for python_type, name in ((int, "integer"), (float, "float"), (str, "string")):
        if isinstance(value, python_type):
            return name
    if isinstance(value, dict):
        return "table"
    if isinstance(value, list):
        return "array"
    return type(value).__name__


def _coerce(value: object, expected: Any, key: str, where: str) -> Any:
    """Check one value against a field's type; ints widen to float."""
    if get_origin(expected) in (Union, types.UnionType):
        if value is None:
            return None
        (expected,) = [arg for arg in get_args(expected) if arg is not type(None)]
    # bool is a subclass of int, so it must be turned away before the int checks.
    if isinstance(value, bool) and expected is not bool:
        ok = False
    elif expected is float:
        ok = isinstance(value, (int, float))
        value = float(value) if ok else value  # type: ignore[arg-type]
    else:
        ok = isinstance(value, expected)
    if not ok:
        names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
        raise ConfigError(
            f"{key} {where} must be {names.get(expected, expected.__name__)}, "
            f"got {_toml_type(value)} {value!r}"
        )
    return value


def _field_types(cls: type) -> dict[str, Any]:
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


# --- value checks -----------------------------------------------------------------------

_ENDPOINT_RE = re.compile(r"(tcp|ipc|inproc)://\S+")
_DEVICE_RE = re.compile(r"cpu|cuda|cuda:[0-9]+")


def _fail(key: str, where: str, must: str, value: object) -> ConfigError:
    return ConfigError(f"{key} {where} must be {must}, got {value!r}")


def _check_positive(obj: object, names: tuple[str, ...], where: str, minimum: int = 1) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, float):
            if not (math.isfinite(value) and value > 0):
                raise _fail(name, where, "a positive number of seconds", value)
        elif value < minimum:
            raise _fail(name, where, f"at least {minimum}", value)


def _check_endpoint(key: str, value: str, where: str) -> None:
    if not _ENDPOINT_RE.fullmatch(value):
        raise _fail(key, where, "a ZeroMQ endpoint like 'tcp://127.0.0.1:5555'", value)


def _check_layers(key: str, value: str, where: str) -> None:
    try:
        _parse_layer_form(value)
    except ConfigError as err:
        raise ConfigError(f"{key} {where}: {err}") from None


def _check_model(s: ModelSettings, where: str) -> ModelSettings:
    if not s.path:
        raise _fail("path", where, 'a directory, a repo id, "default" or "tiny"', s.path)
    if s.dtype not in DTYPES:
        raise _fail("dtype", where, f"one of {', '.join(DTYPES)}", s.dtype)
    if not _DEVICE_RE.fullmatch(s.device):
        raise _fail("device", where, '"cpu", "cuda" or "cuda:N"', s.device)
    return s


def _check_broker(s: BrokerSettings, where: str) -> BrokerSettings:
    _check_endpoint("frontend", s.frontend, where)
    _check_endpoint("backend", s.backend, where)
    _check_positive(s, ("heartbeat_interval", "queue_timeout", "session_timeout"), where)
    _check_positive(
        s,
        (
            "heartbeat_liveness",
            "queue_size",
            "max_message_bytes",
            "frontend_max_message_bytes",
            "peer_queue",
            "worker_queue",
            "max_workers",
            "max_ranges",
        ),
        where,
    )
    return s


def _check_worker(s: WorkerSettings, where: str) -> WorkerSettings:
    _check_endpoint("broker", s.broker, where)
    _check_layers("layers", s.layers, where)
    _check_positive(
        s, ("threads", "batch_threads", "max_memory_mb", "packed_rows"), where, minimum=0
    )
    _check_positive(s, ("max_sessions", "max_kv_tokens", "prefill_chunk"), where)
    return s


def _check_gateway(s: GatewaySettings, where: str) -> GatewaySettings:
    if not s.host:
        raise _fail("host", where, "a host name or address", s.host)
    if not 0 <= s.port <= 65535:
        raise _fail("port", where, "between 1 and 65535 (0 = pick a free port)", s.port)
    _check_endpoint("broker", s.broker, where)
    _check_positive(
        s,
        (
            "max_body_bytes",
            "default_max_tokens",
            "max_concurrent",
            "limit_concurrency",
            "keep_alive_timeout",
        ),
        where,
    )
    _check_positive(s, ("max_queued",), where, minimum=0)
    _check_positive(
        s,
        (
            "queue_timeout",
            "first_token_timeout",
            "inter_token_timeout",
            "request_timeout",
            "header_timeout",
            "body_timeout",
        ),
        where,
    )
    return s


def _check_security(s: SecuritySettings, where: str) -> SecuritySettings:
    return s


def _check_log(s: LogSettings, where: str) -> LogSettings:
    level, fmt = s.level.lower(), s.format.lower()
    if level not in LOG_LEVELS:
        raise _fail("level", where, f"one of {', '.join(LOG_LEVELS)}", s.level)
    if fmt not in LOG_FORMATS:
        raise _fail("format", where, f"one of {', '.join(LOG_FORMATS)}", s.format)
    # Store lower case so later comparisons need not care how the user spelled it.
    return dataclasses.replace(s, level=level, format=fmt)


_SECTIONS: dict[str, Callable[[Any, str], Any]] = {
    "model": _check_model,
    "broker": _check_broker,
    "worker": _check_worker,
    "gateway": _check_gateway,
    "log": _check_log,
    "security": _check_security,
}


# --- loading ----------------------------------------------------------------------------


def _apply(section: str, base: _DataclassT, values: Mapping[str, Any], origin: str) -> _DataclassT:
    """``base`` with ``values`` applied, type-checked and validated."""
    types = _field_types(type(base))
    changes = {}
    for key, value in values.items():
        if key not in types:
            raise ConfigError(
                f"unknown key {key!r} in section [{section}] of {origin}; "
                f"valid keys: {', '.join(types)}"
            )
        changes[key] = _coerce(value, types[key], key, f"in [{section}] of {origin}")
    updated = dataclasses.replace(base, **changes)
    checked: _DataclassT = _SECTIONS[section](updated, f"in [{section}] of {origin}")
    return checked


def _load_stages(raw: object, origin: str) -> list[StageSpec]:
    if not isinstance(raw, list):
        raise ConfigError(f"stages in {origin} must be an array of [[stages]] tables")
    types = _field_types(StageSpec)
    stages = []
    for number, table in enumerate(raw, start=1):
        where = f"in [[stages]] #{number} of {origin}"
        if not isinstance(table, dict):
            raise ConfigError(f"[[stages]] #{number} in {origin} must be a table")
        for key in table:
            if key not in types:
                raise ConfigError(
                    f"unknown key {key!r} in section [[stages]] #{number} of {origin}; "
                    f"valid keys: {', '.join(types)}"
                )
        if "layers" not in table:
            raise ConfigError(f'layers {where} is required (e.g. layers = "1/2")')
        values = {key: _coerce(value, types[key], key, where) for key, value in table.items()}
        stage = StageSpec(**values)
        _check_layers("layers", stage.layers, where)
        _check_positive(stage, ("count",), where)
        stages.append(stage)
    return stages


def load_config(path: str | Path | None = None) -> Config:
    """Read a TOML config file; ``None`` gives all defaults."""
    if path is None:
        return Config()
    file = Path(path).expanduser()
    try:
        with file.open("rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {file} does not exist") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {file}: {err.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"invalid TOML in {file}: {err}") from None

    cfg = Config()
    origin = str(file)
    for section, values in data.items():
        if section == "stages":
            cfg.stages = _load_stages(values, origin)
        elif section in _SECTIONS:
            if not isinstance(values, dict):
                raise ConfigError(f"[{section}] in {origin} must be a table, got {values!r}")
            setattr(cfg, section, _apply(section, getattr(cfg, section), values, origin))
        else:
            raise ConfigError(
                f"unknown section [{section}] in {origin}; "
                f"valid sections: {', '.join([*_SECTIONS, 'stages'])}"
            )
    return cfg


def with_overrides(cfg: Config, section: str, values: Mapping[str, Any]) -> Config:
    """A copy of ``cfg`` with command-line values applied to one section.

    ``None`` means "flag not given" (argparse's default), so it never overrides the file.
    """
    if section not in _SECTIONS:
        raise ConfigError(
            f"unknown section [{section}] in command-line overrides; "
            f"valid sections: {', '.join(_SECTIONS)}"
        )
    given = {key: value for key, value in values.items() if value is not None}
    updated = _apply(section, getattr(cfg, section), given, "command-line overrides")
    return dataclasses.replace(cfg, **{section: updated})
