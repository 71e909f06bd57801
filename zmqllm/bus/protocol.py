"""The zmqllm wire format: typed messages, decoded and validated in one place.

A message is one header frame (a msgpack map) followed by zero or more payload frames,
each the raw C-contiguous bytes of one array. Every message type is a frozen dataclass
(``messages.py``) whose fields say their wire type and range; ``decode`` turns frames into
one of them or raises :class:`ProtocolError` (whatever went wrong, whatever Python
raised), and ``encode`` does the reverse. This module has no sockets in it (like MDP.py in
the ZeroMQ guide) and never imports torch.

Header map keys: ``v`` (PROTOCOL_VERSION), ``type`` (a MsgType value), ``tensors`` (one
``[dtype, [dim, ...]]`` per payload frame, in frame order), then the message's own fields
by name. A field left out decodes as its default; a required one left out is an error;
unknown keys are ignored (a newer peer may add optional fields).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from zmqllm.bus.messages import MESSAGE_TYPES, Message, MsgType
from zmqllm.bus.wire_types import (
    MAX_DIMS,
    MAX_TENSORS,
    WIRE_DTYPES,
    Payload,
    ProtocolError,
)

# The header's ``v``: bumped with every change of the wire format (messages, fields, framing);
# tests/bus/test_wire_version.py fails on a change of the messages without a bump.
PROTOCOL_VERSION = 5

__all__ = [
    "MAX_FRAMES",
    "MAX_HEADER_BYTES",
    "MAX_PAYLOAD_BYTES",
    "PROTOCOL_VERSION",
    "VersionMismatch",
    "decode",
    "decode_header",
    "encode",
]

# Limits. The header is checked for size before msgpack sees it, and msgpack is given
# explicit per-object limits so a crafted length prefix cannot make it allocate.
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADER_STR_LEN = 16 * 1024
MAX_HEADER_BIN_LEN = 4 * 1024  # bulk bytes belong in payload frames, not the header
MAX_HEADER_ARRAY_LEN = 8 * 1024  # e.g. stop_ids
MAX_HEADER_MAP_LEN = 1024
MAX_PAYLOAD_BYTES = 1 << 30  # 1 GiB per payload frame
# No message type has more frames than a header and MAX_TENSORS payloads: a socket reads
# at most this many frames of one message and discards the rest unread.
MAX_FRAMES = 1 + MAX_TENSORS


def encode(msg: Message) -> list[Any]:
    """Header frame (bytes) then one memoryview per payload, ready for send_multipart.

    Payload frames are views of the arrays, not copies: send them with copy=False and do
    not write to the arrays until zmq is done with them.
    """
    head, payloads = msg.to_wire()
    tensors: list[list[Any]] = []
    frames: list[Any] = []
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
    head["v"] = PROTOCOL_VERSION
    head["type"] = msg.TYPE.value
    head["tensors"] = tensors
    try:
        packed: bytes = msgpack.packb(head, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"{msg.TYPE.value}: fields cannot be packed: {exc}") from exc
    if len(packed) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header is {len(packed)} bytes, at most {MAX_HEADER_BYTES}")
    return [packed, *frames]


def _byte_view(frame: Any) -> memoryview:
    """A flat byte view of a frame without copying (zmq.Frame exposes .buffer)."""
    view = memoryview(getattr(frame, "buffer", frame))
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


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
        raise ProtocolError(f"header is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(head, dict):
        raise ProtocolError(f"header must be a map, got {type(head).__name__}")
    return head


def _tensor_spec(spec: Any) -> tuple[str, np.dtype[Any], tuple[int, ...]]:
    if not isinstance(spec, list) or len(spec) != 2:
        raise ProtocolError("tensor spec must be [dtype, shape]")
    name, shape = spec
    dtype = WIRE_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ProtocolError(f"unknown dtype {str(name)[:32]!r}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise ProtocolError(f"shape must be a list of at most {MAX_DIMS} dims")
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_PAYLOAD_BYTES:
            raise ProtocolError("shape dims must be ints in [0, 2**30]")
    return name, dtype, tuple(shape)


class VersionMismatch(ProtocolError):
    """A message of another protocol version; ``kind`` is the type its header names (the
    broker answers a REGISTER of another version with a REFUSED naming both)."""

    def __init__(self, version: object, kind: object) -> None:
        super().__init__(f"protocol version {str(version)[:16]}, expected {PROTOCOL_VERSION}")
        self.version = str(version)[:16]
        self.kind = str(kind)[:32]


def decode_header(frame: Any) -> tuple[type[Message], dict[str, Any]]:
    """The header map and its message class, without payloads (the version checked).

    A REFUSED of any version is read: its one field has kept its shape since version 1,
    so a peer of another version still learns why it was turned away."""
    head = _unpack_header(_byte_view(frame))
    version = head.get("v")
    kind = head.get("type")
    ours = type(version) is int and version == PROTOCOL_VERSION
    if not ours and not (type(version) is int and kind == MsgType.REFUSED.value):
        raise VersionMismatch(version, kind)
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {str(kind)[:32]!r}")
    return cls, head


def _payloads(head: dict[str, Any], frames: Sequence[Any], limit: int) -> list[Payload]:
    specs = head.get("tensors", [])
    if not isinstance(specs, list) or len(specs) > MAX_TENSORS:
        raise ProtocolError(f"tensors must be a list of at most {MAX_TENSORS} entries")
    if len(frames) != len(specs):
        raise ProtocolError(f"{len(frames)} payload frames for {len(specs)} tensors")
    out: list[Payload] = []
    for spec, frame in zip(specs, frames, strict=True):
        name, dtype, shape = _tensor_spec(spec)
        # Python ints: no overflow however large the dims claim to be.
        expected = math.prod(shape) * dtype.itemsize
        if expected > limit:
            raise ProtocolError(f"payload of {expected} bytes, at most {limit}")
        view = _byte_view(frame)
        if view.nbytes != expected:
            raise ProtocolError(f"payload is {view.nbytes} bytes, shape {shape} needs {expected}")
        # frombuffer views the frame's memory; reshape of a contiguous 1-d array is a view.
        out.append(Payload(np.frombuffer(view, dtype=dtype).reshape(shape), name))
    return out


def decode(frames: Sequence[Any], *, max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> Message:
    """Parse and validate one message (routing envelope already stripped).

    Frames may be bytes, memoryviews or zmq.Frame objects. Payload arrays are read-only
    views of the frame buffers, no copy: a view keeps its whole message alive, so copy out
    what must outlive the step. Any failure at all is a ProtocolError.
    """
    try:
        if not 1 <= len(frames) <= MAX_FRAMES:
            raise ProtocolError(f"{len(frames)} frames, a message has 1 to {MAX_FRAMES}")
        cls, head = decode_header(frames[0])
        return cls.from_wire(head, _payloads(head, frames[1:], max_payload_bytes))
    except ProtocolError:
        raise
    except Exception as exc:  # whatever a crafted message makes Python raise
        raise ProtocolError(f"malformed message: {type(exc).__name__}") from None
