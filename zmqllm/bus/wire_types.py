"""The building blocks of typed wire messages: payloads, wire dtypes and field checks.

Each message field is declared with :func:`wire`, naming a check that turns the value
read from msgpack into the field's Python value or raises :class:`ProtocolError`. The
checks are small closures made by the factories below (``integer(0, 10)``,
``text(64)``...), so a message class states every field's type and range where the field
is declared, and ``Message.from_wire`` applies them all in one loop.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from zmqllm.config.names import NAME_RULE, is_name

__all__ = [
    "ID_PATTERN",
    "MAX_DIMS",
    "MAX_ID_LEN",
    "MAX_TENSORS",
    "WIRE_DTYPES",
    "Check",
    "Payload",
    "ProtocolError",
    "SessionKey",
    "WireField",
    "curve_key",
    "endpoint",
    "flag",
    "group",
    "ident",
    "int_list",
    "integer",
    "is_valid_id",
    "name",
    "number",
    "number_list",
    "one_of",
    "optional",
    "payload",
    "scalar_map",
    "str_list",
    "tensor",
    "text",
    "wire",
]

MAX_TENSORS = 8
MAX_DIMS = 4
# Ids a client supplies (sessions, requests): short and safe to log and to key tables by.
MAX_ID_LEN = 64
ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")


class SessionKey(NamedTuple):
    """One try of one client session (two ids a session message carries): what a worker
    keys its sessions by, each try apart, so a replay never meets the try it replaces."""

    session: str
    attempt: int

    @classmethod
    def of(cls, msg: Any) -> SessionKey:
        """The key of a session message (any message with ``session`` and ``attempt``)."""
        return cls(msg.session, msg.attempt)

    def __str__(self) -> str:
        return f"{self.session}/{self.attempt}"  # how logs name it


# Wire dtype name -> numpy dtype. Little-endian on the wire. numpy has no bfloat16: its raw
# 2-byte words travel as a uint16 array under the wire name "bfloat16".
WIRE_DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}
# uint16 is deliberately absent: a uint16 array is only ever bf16 bits, said explicitly.
_INFERRED_NAMES: dict[np.dtype[Any], str] = {
    dt: n for n, dt in WIRE_DTYPES.items() if n != "bfloat16"
}


class ProtocolError(ValueError):
    """A message that does not follow the wire format (or a caller trying to send one)."""


@dataclass(frozen=True, slots=True)
class Payload:
    """One array and its wire dtype name (``array.dtype`` must be ``WIRE_DTYPES[dtype]``)."""

    array: np.ndarray
    dtype: str


def payload(arr: np.ndarray) -> Payload:
    """Wrap a numpy array, inferring its wire dtype. For bf16 bits use Payload(arr, "bfloat16")."""
    n = _INFERRED_NAMES.get(arr.dtype)
    if n is None:
        raise ProtocolError(f"numpy dtype {arr.dtype} has no wire dtype")
    return Payload(arr, n)


def is_valid_id(value: object) -> bool:
    return isinstance(value, str) and ID_PATTERN.fullmatch(value) is not None


Check = Callable[[str, Any], Any]


@dataclass(frozen=True, slots=True)
class WireField:
    """How one dataclass field travels: its check, and whether it is a payload frame."""

    check: Check
    is_payload: bool = False


def wire(
    check: Check,
    default: Any = dataclasses.MISSING,
    *,
    factory: Any = dataclasses.MISSING,
    is_payload: bool = False,
) -> Any:
    """A dataclass field carrying its wire check (``default``/``factory`` as for
    dataclasses.field)."""
    meta = {"wire": WireField(check, is_payload)}
    return dataclasses.field(default=default, default_factory=factory, metadata=meta)


def _fail(name: str, what: str, value: Any) -> ProtocolError:
    shown = type(value).__name__ if isinstance(value, dict | list | bytes | str) else repr(value)
    return ProtocolError(f"field {name!r} must be {what}, got {shown[:40]}")


def integer(lo: int, hi: int) -> Check:
    def check(name: str, value: Any) -> int:
        # type() and not isinstance(): a bool is not a count, and no int subclass travels.
        if type(value) is not int or not lo <= value <= hi:
            raise _fail(name, f"an int in [{lo}, {hi}]", value)
        return value

    return check


def number(lo: float, hi: float) -> Check:
    def check(name: str, value: Any) -> float:
        if type(value) not in (int, float) or not math.isfinite(value) or not lo <= value <= hi:
            raise _fail(name, f"a finite number in [{lo}, {hi}]", value)
        return float(value)

    return check


def flag() -> Check:
    def check(name: str, value: Any) -> bool:
        if type(value) is not bool:
            raise _fail(name, "a bool", value)
        return value

    return check


def text(max_len: int) -> Check:
    def check(name: str, value: Any) -> str:
        if type(value) is not str or len(value) > max_len:
            raise _fail(name, f"a str of at most {max_len} chars", value)
        return value

    return check


def ident(*, empty: bool = False) -> Check:
    """A client-supplied id: 1 to 64 of [A-Za-z0-9_-] ("" too when ``empty``)."""

    def check(field_name: str, value: Any) -> str:
        if empty and value == "":
            return ""
        if not is_valid_id(value):
            raise _fail(field_name, "1 to 64 of [A-Za-z0-9_-]", value)
        return str(value)

    return check


# A peer link's address: TCP to a host name, IPv4 or bracketed IPv6 address, and a port.
_ENDPOINT_PATTERN = re.compile(r"tcp://(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9.-]{1,253}):[0-9]{1,5}")
# A CURVE public key in Z85: 40 characters of its alphabet.
_Z85_PATTERN = re.compile(r"[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")


def endpoint(*, empty: bool = False) -> Check:
    """A TCP endpoint a worker can connect to ("tcp://HOST:PORT"; "" too when ``empty``)."""

    def check(field_name: str, value: Any) -> str:
        if empty and value == "":
            return ""
        if (
            type(value) is not str
            or _ENDPOINT_PATTERN.fullmatch(value) is None
            or not 0 < int(value.rpartition(":")[2]) < 65536
        ):
            raise _fail(field_name, "an endpoint tcp://HOST:PORT", value)
        return value

    return check


def curve_key(*, empty: bool = False) -> Check:
    """A CURVE public key, Z85-encoded (40 characters; "" too when ``empty``)."""

    def check(field_name: str, value: Any) -> str:
        if empty and value == "":
            return ""
        if type(value) is not str or _Z85_PATTERN.fullmatch(value) is None:
            raise _fail(field_name, "a Z85 CURVE public key", value)
        return value

    return check


def name(*, empty: bool = False) -> Check:
    """A name a peer picks for itself (worker ids hold the host name): config's name
    rule."""

    def check(field_name: str, value: Any) -> str:
        if empty and value == "":
            return ""
        if type(value) is not str or not is_name(value):  # bytes keep the rule too
            raise _fail(field_name, NAME_RULE, value)
        return value

    return check


def optional(inner: Check) -> Check:
    def check(field_name: str, value: Any) -> Any:
        return None if value is None else inner(field_name, value)

    return check


def one_of(kind: type[enum.Enum]) -> Check:
    def check(field_name: str, value: Any) -> Any:
        # A value that is not a str is as wrong as an unknown one (it must not become None).
        if type(value) is str:
            try:
                return kind(value)
            except ValueError:
                pass
        raise _fail(field_name, "one of " + ", ".join(str(m.value) for m in kind), value)

    return check


def _list_of(item: Check, max_len: int, what: str) -> Check:
    """A list of at most ``max_len`` values, each passing ``item``, as a tuple."""

    def check(field_name: str, value: Any) -> tuple[Any, ...]:
        if type(value) is not list or len(value) > max_len:
            raise _fail(field_name, f"a list of at most {max_len} {what}", value)
        return tuple(item(field_name, v) for v in value)

    return check


def int_list(lo: int, hi: int, max_len: int) -> Check:
    return _list_of(integer(lo, hi), max_len, "ints")


def number_list(lo: float, hi: float, max_len: int) -> Check:
    return _list_of(number(lo, hi), max_len, "numbers")


def str_list(item: Check, max_len: int) -> Check:
    return _list_of(item, max_len, "strs")


def scalar_map(max_len: int, keys: frozenset[str] | None = None) -> Check:
    """A flat map of str keys (from ``keys`` if given) to numbers, short strs or bools."""
    key_check = text(64)

    def check(field_name: str, value: Any) -> dict[str, Any]:
        if type(value) is not dict or len(value) > max_len:
            raise _fail(field_name, f"a map of at most {max_len} entries", value)
        out: dict[str, Any] = {}
        for k, v in value.items():
            key_check(field_name, k)
            if keys is not None and k not in keys:
                continue  # a newer peer's statistic: not ours to carry on
            if type(v) is float and not math.isfinite(v):
                raise _fail(field_name, "finite numbers", v)
            if type(v) not in (int, float, bool, str) or (type(v) is str and len(v) > 256):
                raise _fail(field_name, "a map of numbers, bools and short strs", v)
            out[k] = v
        return out

    return check


def group(max_size: int) -> Check:
    """A forward's group tag ``[id, size]`` (see Activation)."""
    id_check = text(320)

    def check(field_name: str, value: Any) -> tuple[str, int]:
        if type(value) is not list or len(value) != 2:
            raise _fail(field_name, "[id, size]", value)
        gid = id_check(field_name, value[0])
        if type(value[1]) is not int or not 1 <= value[1] <= max_size:
            raise _fail(field_name, f"[id, size] with size in [1, {max_size}]", value[1])
        return gid, value[1]

    return check


def tensor(dtypes: frozenset[str], ndim: int, min_rows: int = 0) -> Check:
    """A payload frame of one of ``dtypes``, ``ndim`` dims, at least ``min_rows`` rows."""

    def check(field_name: str, value: Any) -> Payload:
        if not isinstance(value, Payload) or value.dtype not in dtypes:
            raise _fail(field_name, "a payload of " + "/".join(sorted(dtypes)), value)
        shape = value.array.shape
        if len(shape) != ndim or (ndim and shape[0] < min_rows):
            raise ProtocolError(f"field {field_name!r}: shape {shape} is not {ndim}-d")
        return value

    return check
