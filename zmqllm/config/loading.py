"""Reading settings into a ``Config``: a TOML file (``load_config``) and command-line
values (``with_overrides``).

Every value is checked against its field's type (TOML's names in the message: the user
wrote TOML, not Python; ints widen to float), then each section's values against what
they may be (endpoints, devices, positive counts and timeouts, layer specs). Unknown
sections and keys are errors, never ignored. Mistakes raise ``ConfigError`` naming the
key, the section and the file (or "command-line overrides").

The settings themselves, their defaults and help, are in ``settings.py``. Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, Union, get_args, get_origin, get_type_hints

from zmqllm.config.layers import check_layer_spec
from zmqllm.config.names import NAME_RULE, is_name
from zmqllm.config.settings import (
    DTYPES,
    KV_DTYPE_CHOICES,
    MAX_DRAFT_TOKENS,
    PLACEMENT_STRATEGIES,
    QUANTS,
    SPECULATIVE_CHOICES,
    WIRE_DTYPE_CHOICES,
    BrokerSettings,
    Config,
    ConfigError,
    GatewaySettings,
    LogSettings,
    ModelSettings,
    RaySettings,
    RemoteSpec,
    SecuritySettings,
    StageSpec,
    WorkerSettings,
)
from zmqllm.log import LOG_FORMATS, LOG_LEVELS

if sys.version_info >= (3, 11):
    import tomllib
else:  # tomllib joined the standard library in 3.11; tomli is the same parser
    import tomli as tomllib

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["load_config", "parse_size", "with_overrides"]

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
_URL_RE = re.compile(r"https?://[^\s/?#]+(/[^\s?#]*)?")


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
        check_layer_spec(value)
    except ConfigError as err:
        raise ConfigError(f"{key} {where}: {err}") from None


def kv_dtype_of(kv_dtype: str, dtype: str) -> str:
    """The dtype a stage's KV caches take: ``[worker] kv_dtype`` under a model of ``dtype``.
    "auto" is the model's own; bfloat16 under a float32 model halves the cache; anything
    else (a float32 cache under a 16-bit model doubles it for nothing, bfloat16 under
    float16 drops mantissa bits the model computes with) is refused."""
    if kv_dtype not in KV_DTYPE_CHOICES:
        raise ConfigError(
            f"kv_dtype must be one of {', '.join(KV_DTYPE_CHOICES)}, not {kv_dtype!r}"
        )
    if kv_dtype in ("auto", dtype):
        return dtype
    if kv_dtype == "bfloat16" and dtype == "float32":
        return kv_dtype
    raise ConfigError(
        f'kv_dtype {kv_dtype} under a {dtype} model: use "auto" (its own dtype), or '
        "bfloat16 under a float32 model"
    )


def _check_model(s: ModelSettings, where: str) -> ModelSettings:
    if not s.path:
        raise _fail("path", where, 'a directory, a repo id, "default" or "tiny"', s.path)
    if s.dtype not in DTYPES:
        raise _fail("dtype", where, f"one of {', '.join(DTYPES)}", s.dtype)
    if s.name and not is_name(s.name):
        raise _fail("name", where, NAME_RULE, s.name)
    if not _DEVICE_RE.fullmatch(s.device):
        raise _fail("device", where, '"cpu", "cuda" or "cuda:N"', s.device)
    if s.quant not in QUANTS:
        raise _fail("quant", where, f"one of {', '.join(QUANTS)}", s.quant)
    if s.quant != "none" and (s.dtype != "float32" or s.device != "cpu"):
        raise ConfigError(
            f"quant {s.quant} {where}: quantized weights run with dtype float32 on the cpu"
            f" (not {s.dtype} on {s.device})"
        )
    return s


def _check_broker(s: BrokerSettings, where: str) -> BrokerSettings:
    _check_endpoint("frontend", s.frontend, where)
    _check_endpoint("backend", s.backend, where)
    _check_positive(
        s, ("heartbeat_interval", "queue_timeout", "session_timeout", "place_hold"), where
    )
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
        s,
        ("threads", "batch_threads", "max_memory_mb", "packed_rows", "micro_batches"),
        where,
        minimum=0,
    )
    _check_positive(s, ("max_sessions", "prefill_chunk", "busy_prefill_chunk"), where)
    _check_positive(s, ("max_kv_tokens",), where, minimum=0)
    if s.peer not in ("auto", "off") and not s.peer.startswith("tcp://"):
        raise _fail("peer", where, "auto, off or tcp://HOST:PORT", s.peer)
    if s.kv_dtype not in KV_DTYPE_CHOICES:
        raise _fail("kv_dtype", where, f"one of {', '.join(KV_DTYPE_CHOICES)}", s.kv_dtype)
    if s.wire_dtype not in WIRE_DTYPE_CHOICES:
        raise _fail("wire_dtype", where, f"one of {', '.join(WIRE_DTYPE_CHOICES)}", s.wire_dtype)
    if s.speculative not in SPECULATIVE_CHOICES:
        raise _fail("speculative", where, ", ".join(SPECULATIVE_CHOICES), s.speculative)
    if s.speculative == "draft" and not s.draft_model:
        raise _fail("draft_model", where, 'a model (a directory, a repo id or "default")', "")
    if not 1 <= s.max_draft_tokens <= MAX_DRAFT_TOKENS:
        raise _fail("max_draft_tokens", where, f"in 1..{MAX_DRAFT_TOKENS}", s.max_draft_tokens)
    if s.remote and not s.remote.startswith("@") and not _URL_RE.fullmatch(s.remote):
        # Not echoed: a URL may hold a password or a key.
        raise ConfigError(
            f"remote {where} must be an http(s) URL like 'http://host:8000/v1', or @FILE "
            "holding one"
        )
    _check_positive(s, ("remote_stall_timeout", "discover_timeout"), where)
    _check_positive(s, ("remote_retries",), where, minimum=0)
    for key in ("served_name", "remote_model"):
        value = getattr(s, key)
        if value and not is_name(value):
            raise _fail(key, where, NAME_RULE, value)
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
    _check_positive(
        s,
        ("max_queued", "failover_retries", "key_max_concurrent", "key_max_kv_tokens"),
        where,
        minimum=0,
    )
    # Below a kernel send buffer's least size the bound could not be set on a socket.
    _check_positive(s, ("max_unread_bytes",), where, minimum=4096)
    _check_positive(
        s,
        (
            "failover_timeout",
            "queue_timeout",
            "first_token_timeout",
            "inter_token_timeout",
            "request_timeout",
            "header_timeout",
            "body_timeout",
            "write_timeout",
        ),
        where,
    )
    return s


def _check_security(s: SecuritySettings, where: str) -> SecuritySettings:
    return s


_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B?|B)?\s*", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(text: str) -> int:
    """Bytes of a size as people write it: "16GiB", "512MiB", "32GB", "4096" (bytes);
    ValueError otherwise."""
    m = _SIZE_RE.fullmatch(text)
    if not m:
        raise ValueError(f"{text!r} is not a size like '16GiB'")
    number, unit = float(m[1]), (m[2] or "").lower()
    if unit.endswith("ib") or (len(unit) == 2 and unit[1] == "i"):
        factor = 1024 ** ("kmgt".index(unit[0]) + 1)
    else:
        factor = _SIZE_UNITS[unit[:1]]
    return int(number * factor)


def _check_ray(s: RaySettings, where: str) -> RaySettings:
    if s.address and not re.fullmatch(r"[A-Za-z0-9.\-\[\]:]+:[0-9]+|auto", s.address):
        raise _fail("address", where, "HOST:PORT of the Ray head (or 'auto')", s.address)
    if not is_name(s.namespace):
        raise _fail("namespace", where, NAME_RULE, s.namespace)
    strategy = s.strategy.upper()
    if strategy not in PLACEMENT_STRATEGIES:
        raise _fail("strategy", where, f"one of {', '.join(PLACEMENT_STRATEGIES)}", s.strategy)
    if s.front_resource and not is_name(s.front_resource):
        raise _fail("front_resource", where, NAME_RULE, s.front_resource)
    _check_positive(s, ("ready_timeout",), where)
    return dataclasses.replace(s, strategy=strategy)


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
    "ray": _check_ray,
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


def _tables(raw: object, origin: str, section: str, cls: type, required: str) -> list[Any]:
    """An array of [[section]] tables as ``cls`` values, each key known and typed."""
    if not isinstance(raw, list):
        raise ConfigError(f"{section} in {origin} must be an array of [[{section}]] tables")
    types = _field_types(cls)
    out = []
    for number, table in enumerate(raw, start=1):
        where = f"in [[{section}]] #{number} of {origin}"
        if not isinstance(table, dict):
            raise ConfigError(f"[[{section}]] #{number} in {origin} must be a table")
        for key in table:
            if key not in types:
                raise ConfigError(
                    f"unknown key {key!r} in section [[{section}]] #{number} of {origin}; "
                    f"valid keys: {', '.join(types)}"
                )
        if required not in table:
            raise ConfigError(f"{required} {where} is required")
        values = {key: _coerce(value, types[key], key, where) for key, value in table.items()}
        item = cls(**values)
        _check_positive(item, ("count",), where)
        out.append((item, where))
    return out


def _load_stages(raw: object, origin: str) -> list[StageSpec]:
    stages = []
    try:
        tables = _tables(raw, origin, "stages", StageSpec, "layers")
    except ConfigError as err:
        if "layers in" in str(err) and "is required" in str(err):
            raise ConfigError(f'{err} (e.g. layers = "1/2")') from None
        raise
    for stage, where in tables:
        _check_layers("layers", stage.layers, where)
        if not (math.isfinite(stage.cpus) and stage.cpus > 0):
            raise _fail("cpus", where, "a positive number of CPUs", stage.cpus)
        for key in ("memory", "disk"):
            value = getattr(stage, key)
            if value:
                try:
                    parse_size(value)
                except ValueError:
                    raise _fail(key, where, "a size like '16GiB'", value) from None
        stages.append(stage)
    return stages


def _load_remotes(raw: object, origin: str) -> list[RemoteSpec]:
    remotes = []
    for remote, where in _tables(raw, origin, "remotes", RemoteSpec, "url"):
        if not _URL_RE.fullmatch(remote.url):
            # Not echoed: a URL may hold a password or a key.
            raise ConfigError(f"url {where} must be an http(s) URL like 'http://host:8000/v1'")
        for key in ("model", "served_name"):
            value = getattr(remote, key)
            if value and not is_name(value):
                raise _fail(key, where, NAME_RULE, value)
        remotes.append(remote)
    return remotes


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
        elif section == "remotes":
            cfg.remotes = _load_remotes(values, origin)
        elif section in _SECTIONS:
            if not isinstance(values, dict):
                raise ConfigError(f"[{section}] in {origin} must be a table, got {values!r}")
            setattr(cfg, section, _apply(section, getattr(cfg, section), values, origin))
        else:
            raise ConfigError(
                f"unknown section [{section}] in {origin}; "
                f"valid sections: {', '.join([*_SECTIONS, 'stages', 'remotes'])}"
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
