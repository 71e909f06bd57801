"""The zmqllm wire format: message types, header pack/unpack with limits, arrays <-> frames.

A message is one header frame (a msgpack map) followed by zero or more payload frames, each
the raw C-contiguous bytes of one array. This module has no sockets in it (like MDP.py in
the ZeroMQ guide) and never imports torch, so the broker and gateway can use it without the
ML stack. Every malformed input raises ProtocolError; callers log it and drop the message.

Header map keys (full names; a header is tiny next to a payload, clarity wins):

    v           int   protocol version, must equal PROTOCOL_VERSION
    type        str   a MsgType value
    session     str   session id ("" when the message names no session)
    request_id  str   the request id carried into every log line ("" if none)
    step        int   decode step, >= 0
    fields      map   per-type fields, see REQUIRED_FIELDS; extra keys are allowed
    tensors     list  one [dtype, [dim, ...]] per payload frame, in frame order

Only v and type must be present; a missing key decodes as its empty value.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from zmqllm import PROTOCOL_VERSION

__all__ = [
    "MAX_DIMS",
    "MAX_HEADER_BYTES",
    "MAX_ID_LEN",
    "MAX_PAYLOAD_BYTES",
    "MAX_TENSORS",
    "PROTOCOL_VERSION",
    "REQUIRED_FIELDS",
    "WIRE_DTYPES",
    "Header",
    "MsgType",
    "Payload",
    "ProtocolError",
    "decode",
    "encode",
    "encode_header",
    "error_header",
    "payload",
]

# Limits. The header is checked for size before msgpack sees it, and msgpack is given
# explicit per-object limits so a crafted length prefix cannot make it allocate.
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADER_STR_LEN = 16 * 1024  # longest str anywhere in a header (error messages, reasons)
MAX_HEADER_BIN_LEN = 4 * 1024  # bulk bytes belong in payload frames, not the header
MAX_HEADER_ARRAY_LEN = 8 * 1024  # e.g. stop_ids
MAX_HEADER_MAP_LEN = 1024  # e.g. sampling options, logit bias
MAX_ID_LEN = 128  # session and request ids
MAX_TENSORS = 8
MAX_DIMS = 4
MAX_PAYLOAD_BYTES = 1 << 30  # 1 GiB per payload frame

_NONE = type(None)


class ProtocolError(ValueError):
    """A message that does not follow the wire format (or a caller trying to send one)."""


class MsgType(str, enum.Enum):
    """Message types; the wire value is the lowercase name.

    type          sender -> receiver                    required fields (payloads)
    ------------  ------------------------------------  -----------------------------------
    REGISTER      worker -> broker                      start, end, num_layers, capacity,
                                                        version, fingerprint, info
    REGISTERED    broker -> worker                      worker_id
    REFUSED       broker -> worker                      reason
    HEARTBEAT     both ways                             (optional load: dict)
    DISCONNECT    broker -> worker                      reason
    OPEN          gateway -> broker -> each stage       max_tokens, prompt_len, sampling,
                                                        stop_ids (stage 0: int32 token ids)
    STEP          broker -> stage 0                     token
    ACTIVATION    worker -> broker -> next worker       (hidden states [n_tokens, hidden])
    TOKEN         last stage -> broker -> gateway       token, finish (str or None)
    CLOSE         gateway -> broker -> each stage       -
    CANCEL        gateway -> broker -> each stage       -
    ERROR         any -> the peer it answers            code, message
    STATUS        client -> broker                      -
    STATUS_REPLY  broker -> client                      status

    Optional fields: OPEN ``next`` (the worker the stage's results go to; for the
    last stage, stage 0), ACTIVATION ``final`` (the last prompt chunk or a decode
    step), and ACTIVATION, TOKEN and STEP ``group``: ``[id, size]``, the forward the
    result came from and how many of its results go to the same next worker (the
    broker copies it from a TOKEN to the STEP it sends on).
    """

    REGISTER = "register"
    REGISTERED = "registered"
    REFUSED = "refused"
    HEARTBEAT = "heartbeat"
    DISCONNECT = "disconnect"
    OPEN = "open"
    STEP = "step"
    ACTIVATION = "activation"
    TOKEN = "token"
    CLOSE = "close"
    CANCEL = "cancel"
    ERROR = "error"
    STATUS = "status"
    STATUS_REPLY = "status_reply"


REQUIRED_FIELDS: dict[MsgType, dict[str, type | tuple[type, ...]]] = {
    MsgType.REGISTER: {
        "start": int,
        "end": int,
        "num_layers": int,
        "capacity": int,
        "version": str,
        "fingerprint": str,
        "info": dict,
    },
    MsgType.REGISTERED: {"worker_id": str},
    MsgType.REFUSED: {"reason": str},
    MsgType.HEARTBEAT: {},
    MsgType.DISCONNECT: {"reason": str},
    MsgType.OPEN: {"max_tokens": int, "prompt_len": int, "sampling": dict, "stop_ids": list},
    MsgType.STEP: {"token": int},
    MsgType.ACTIVATION: {},
    MsgType.TOKEN: {"token": int, "finish": (str, _NONE)},
    MsgType.CLOSE: {},
    MsgType.CANCEL: {},
    MsgType.ERROR: {"code": str, "message": str},
    MsgType.STATUS: {},
    MsgType.STATUS_REPLY: {"status": dict},
}

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
    dt: name for name, dt in WIRE_DTYPES.items() if name != "bfloat16"
}


@dataclass(frozen=True, slots=True)
class Payload:
    """One array and its wire dtype name (``array.dtype`` must be ``WIRE_DTYPES[dtype]``)."""

    array: np.ndarray
    dtype: str


def payload(arr: np.ndarray) -> Payload:
    """Wrap a numpy array, inferring its wire dtype. For bf16 bits use Payload(arr, "bfloat16")."""
    name = _INFERRED_NAMES.get(arr.dtype)
    if name is None:
        raise ProtocolError(f"numpy dtype {arr.dtype} has no wire dtype")
    return Payload(arr, name)


@dataclass(slots=True)
class Header:
    """The header frame, decoded. ``fields`` holds the per-type fields (REQUIRED_FIELDS)."""

    type: MsgType
    session: str = ""
    request_id: str = ""
    step: int = 0
    fields: dict[str, Any] = field(default_factory=dict)


def error_header(code: str, message: str, session: str = "", request_id: str = "") -> Header:
    """An ERROR header; name the session so only that session is failed."""
    return Header(MsgType.ERROR, session, request_id, fields={"code": code, "message": message})


def _is_type(value: Any, expected: type | tuple[type, ...]) -> bool:
    # bool is an int subclass; True must not pass as a token id or a layer index.
    allowed = expected if isinstance(expected, tuple) else (expected,)
    if isinstance(value, bool) and bool not in allowed:
        return False
    return isinstance(value, allowed)


def _type_name(expected: type | tuple[type, ...]) -> str:
    allowed = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join("None" if t is _NONE else t.__name__ for t in allowed)


def _check_header(header: Header) -> MsgType:
    """Validate everything but tensors; shared by encode and decode. Returns the type."""
    try:
        msg_type = MsgType(header.type)
    except (TypeError, ValueError):
        raise ProtocolError(f"unknown message type {header.type!r}") from None
    for name in ("session", "request_id"):
        value = getattr(header, name)
        if not isinstance(value, str) or len(value) > MAX_ID_LEN:
            raise ProtocolError(f"{name} must be a str of at most {MAX_ID_LEN} chars")
    if not _is_type(header.step, int) or header.step < 0:
        raise ProtocolError(f"step must be an int >= 0, got {header.step!r}")
    fields = header.fields
    if not isinstance(fields, dict) or not all(isinstance(k, str) for k in fields):
        raise ProtocolError("fields must be a map with str keys")
    for name, expected in REQUIRED_FIELDS[msg_type].items():
        if name not in fields:
            raise ProtocolError(f"{msg_type.value}: missing field {name!r}")
        if not _is_type(fields[name], expected):
            raise ProtocolError(
                f"{msg_type.value}: field {name!r} must be {_type_name(expected)}, "
                f"got {type(fields[name]).__name__}"
            )
    return msg_type


def encode(header: Header, payloads: Sequence[Payload] = ()) -> list[bytes | memoryview]:
    """Header frame (bytes) then one memoryview per payload, ready for send_multipart.

    Payload frames are views of the arrays, not copies: send them with copy=False and do not
    write to the arrays until zmq is done with them. The header's total size is checked here;
    the per-object msgpack limits (MAX_HEADER_STR_LEN...) are enforced by decode.
    """
    if len(payloads) > MAX_TENSORS:
        raise ProtocolError(f"{len(payloads)} payloads, at most {MAX_TENSORS}")
    tensors: list[list[Any]] = []
    frames: list[bytes | memoryview] = []
    for p in payloads:
        arr = p.array
        if WIRE_DTYPES.get(p.dtype) != arr.dtype:
            raise ProtocolError(f"array of {arr.dtype} cannot travel as {p.dtype!r}")
        if arr.ndim > MAX_DIMS:
            raise ProtocolError(f"array has {arr.ndim} dims, at most {MAX_DIMS}")
        if not arr.flags.c_contiguous:
            # Sending must not copy behind the caller's back: the caller passes a
            # C-contiguous array (np.ascontiguousarray) and knows what that costs.
            raise ProtocolError("payload array is not C-contiguous (caller's bug)")
        tensors.append([p.dtype, list(arr.shape)])
        # A flat uint8 view: one byte per element of the frame, valid for zero-size too.
        frames.append(arr.reshape(-1).view(np.uint8).data)
    return [encode_header(header, tensors), *frames]


def encode_header(header: Header, tensors: Sequence[Sequence[Any]] = ()) -> bytes:
    """The header frame alone, declaring payloads by [dtype, shape].

    The broker uses this to re-address a payload frame it received without
    touching the frame itself; ``encode`` uses it for ordinary messages.
    """
    msg_type = _check_header(header)
    head = {
        "v": PROTOCOL_VERSION,
        "type": msg_type.value,
        "session": header.session,
        "request_id": header.request_id,
        "step": header.step,
        "fields": header.fields,
        "tensors": [[str(d), [int(x) for x in shape]] for d, shape in tensors],
    }
    try:
        packed: bytes = msgpack.packb(head, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"header fields cannot be packed: {exc}") from exc
    if len(packed) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header is {len(packed)} bytes, at most {MAX_HEADER_BYTES}")
    return packed


def _byte_view(frame: Any) -> memoryview:
    """A flat byte view of a frame without copying (zmq.Frame exposes .buffer)."""
    try:
        view = memoryview(getattr(frame, "buffer", frame))
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"frame is not a contiguous buffer: {exc}") from exc


def _unpack_header(view: memoryview) -> dict[str, Any]:
    if view.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header is {view.nbytes} bytes, at most {MAX_HEADER_BYTES}")
    try:
        head = msgpack.unpackb(
            view,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_HEADER_STR_LEN,
            max_bin_len=MAX_HEADER_BIN_LEN,
            max_array_len=MAX_HEADER_ARRAY_LEN,
            max_map_len=MAX_HEADER_MAP_LEN,
            max_ext_len=0,
        )
    except Exception as exc:
        # The C unpacker raises ValueError subclasses, TypeError, StackError...: for us they
        # all mean the same thing, a header that is not well-formed msgpack within limits.
        raise ProtocolError(f"header is not valid msgpack: {exc!r}") from exc
    if not isinstance(head, dict):
        raise ProtocolError(f"header must be a map, got {type(head).__name__}")
    return head


def _check_tensor_spec(spec: Any) -> tuple[np.dtype[Any], tuple[int, ...]]:
    if not isinstance(spec, list) or len(spec) != 2:
        raise ProtocolError("tensor spec must be [dtype, shape]")
    name, shape = spec
    dtype = WIRE_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ProtocolError(f"unknown dtype {name!r}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise ProtocolError(f"shape must be a list of at most {MAX_DIMS} dims")
    if not all(_is_type(d, int) and d >= 0 for d in shape):
        raise ProtocolError(f"shape dims must be ints >= 0, got {shape!r}")
    return dtype, tuple(shape)


def decode(
    frames: Sequence[Any], *, max_payload_bytes: int = MAX_PAYLOAD_BYTES
) -> tuple[Header, list[Payload]]:
    """Parse and validate one message (routing envelope already stripped).

    Frames may be bytes, memoryviews or zmq.Frame objects. Payload arrays are read-only views
    of the frame buffers, no copy: a view keeps its whole message alive, so copy out what
    must outlive the step.
    """
    if len(frames) == 0:
        raise ProtocolError("empty message: no header frame")
    head = _unpack_header(_byte_view(frames[0]))
    version = head.get("v")
    if not _is_type(version, int) or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r}, expected {PROTOCOL_VERSION}")
    msg_type = head.get("type")
    try:
        header = Header(
            type=MsgType(msg_type),
            session=head.get("session", ""),
            request_id=head.get("request_id", ""),
            step=head.get("step", 0),
            fields=head.get("fields", {}),
        )
    except (TypeError, ValueError):
        raise ProtocolError(f"unknown message type {msg_type!r}") from None
    _check_header(header)

    specs = head.get("tensors", [])
    if not isinstance(specs, list) or len(specs) > MAX_TENSORS:
        raise ProtocolError(f"tensors must be a list of at most {MAX_TENSORS} entries")
    if len(frames) - 1 != len(specs):
        raise ProtocolError(f"{len(frames) - 1} payload frames for {len(specs)} tensors")
    payloads: list[Payload] = []
    for spec, frame in zip(specs, frames[1:], strict=True):
        dtype, shape = _check_tensor_spec(spec)
        expected = math.prod(shape) * dtype.itemsize
        if expected > max_payload_bytes:
            raise ProtocolError(f"payload of {expected} bytes, at most {max_payload_bytes}")
        view = _byte_view(frame)
        if view.nbytes != expected:
            raise ProtocolError(f"payload is {view.nbytes} bytes, shape {shape} needs {expected}")
        # frombuffer views the frame's memory; reshape of a contiguous 1-d array is a view too.
        arr = np.frombuffer(view, dtype=dtype).reshape(shape)
        payloads.append(Payload(arr, spec[0]))
    return header, payloads
