"""Wire format tests. No torch here: the front end runs without the ML stack."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from zmqllm import PROTOCOL_VERSION
from zmqllm.protocol import (
    MAX_HEADER_BYTES,
    MAX_HEADER_STR_LEN,
    MAX_TENSORS,
    REQUIRED_FIELDS,
    WIRE_DTYPES,
    Header,
    MsgType,
    Payload,
    ProtocolError,
    decode,
    encode,
    error_header,
    payload,
)

# One valid value per python type a required field may have.
_SAMPLE_VALUES: dict[type, Any] = {
    int: 7,
    str: "abc",
    dict: {"temperature": 0.7, "seed": 3},
    list: [2, 32000],
    type(None): None,
}


def _fields_for(msg_type: MsgType) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for name, expected in REQUIRED_FIELDS[msg_type].items():
        first = expected[0] if isinstance(expected, tuple) else expected
        fields[name] = _SAMPLE_VALUES[first]
    return fields


def _header(msg_type: MsgType = MsgType.STEP) -> Header:
    return Header(msg_type, session="s-1", request_id="r-1", step=3, fields=_fields_for(msg_type))


def _raw_head(**overrides: Any) -> dict[str, Any]:
    """A valid STEP header map with no tensors, to corrupt one key at a time."""
    head: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "type": "step",
        "session": "s",
        "request_id": "r",
        "step": 0,
        "fields": {"token": 5},
        "tensors": [],
    }
    head.update(overrides)
    return head


def _pack(head: Any) -> bytes:
    packed: bytes = msgpack.packb(head, use_bin_type=True)
    return packed


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("msg_type", list(MsgType))
@pytest.mark.parametrize("with_payloads", [False, True])
def test_round_trip_every_type(msg_type: MsgType, with_payloads: bool) -> None:
    header = _header(msg_type)
    header.fields["extra"] = {"nested": [1, 2.5, "x"]}  # extra fields are allowed
    payloads = [payload(np.arange(6, dtype=np.int32).reshape(2, 3))] if with_payloads else []
    frames = encode(header, payloads)
    assert len(frames) == 1 + len(payloads)
    got, got_payloads = decode(frames)
    assert got == header
    assert got.type is msg_type
    assert len(got_payloads) == len(payloads)
    for p, q in zip(payloads, got_payloads, strict=True):
        assert q.dtype == p.dtype
        np.testing.assert_array_equal(q.array, p.array)


def test_every_type_has_required_fields_entry() -> None:
    assert set(REQUIRED_FIELDS) == set(MsgType)
    assert {t.value for t in MsgType} == {t.name.lower() for t in MsgType}


def test_header_defaults_round_trip() -> None:
    got, payloads = decode(encode(Header(MsgType.STATUS)))
    assert got == Header(MsgType.STATUS)
    assert payloads == []


@pytest.mark.parametrize("name", sorted(WIRE_DTYPES))
@pytest.mark.parametrize("shape", [(5,), (2, 3), (1, 2, 3, 2), (), (0,), (0, 4096)])
def test_round_trip_dtypes_and_shapes(name: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    dtype = WIRE_DTYPES[name]
    # Random bits, so every value (NaN payloads, bf16 words) must come back bit-exact.
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    if name == "bool":
        raw = raw % 2
    arr = raw.view(dtype).reshape(shape)
    _, (got,) = decode(encode(Header(MsgType.ACTIVATION), [Payload(arr, name)]))
    assert got.dtype == name
    assert got.array.dtype == dtype
    assert got.array.shape == shape
    assert got.array.tobytes() == arr.tobytes()


def test_bfloat16_bits_preserved() -> None:
    # 1.0, -2.0, +inf, a NaN and the smallest subnormal as bf16 words.
    words = np.array([0x3F80, 0xC000, 0x7F80, 0x7FC1, 0x0001], dtype=np.uint16)
    _, (got,) = decode(encode(Header(MsgType.ACTIVATION), [Payload(words, "bfloat16")]))
    assert got.dtype == "bfloat16"
    np.testing.assert_array_equal(got.array, words)


def test_token_ids_and_multiple_payloads() -> None:
    ids = np.array([1, 22, 333, 32000], dtype=np.int32)
    hidden = np.linspace(-1, 1, 4 * 8, dtype=np.float32).reshape(4, 8)
    header = _header(MsgType.OPEN)
    got, (p_ids, p_hidden) = decode(encode(header, [payload(ids), payload(hidden)]))
    assert got.fields["stop_ids"] == [2, 32000]
    assert p_ids.dtype == "int32"
    np.testing.assert_array_equal(p_ids.array, ids)
    np.testing.assert_array_equal(p_hidden.array, hidden)


def test_decoded_array_views_bytes_frame() -> None:
    frames = encode(Header(MsgType.ACTIVATION), [payload(np.ones((3, 4), np.float32))])
    raw = [bytes(f) for f in frames]
    _, (got,) = decode(raw)
    assert np.shares_memory(got.array, np.frombuffer(raw[1], np.uint8))
    assert not got.array.flags.writeable


def test_encode_frames_are_views_not_copies() -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    _, frame = encode(Header(MsgType.ACTIVATION), [payload(arr)])
    assert isinstance(frame, memoryview)
    assert np.shares_memory(np.frombuffer(frame, np.uint8), arr)
    assert frame.nbytes == arr.nbytes


def test_error_header() -> None:
    header = error_header("busy", "no capacity", session="s", request_id="r")
    got, _ = decode(encode(header))
    assert got.type is MsgType.ERROR
    assert got.fields == {"code": "busy", "message": "no capacity"}
    assert (got.session, got.request_id) == ("s", "r")


def test_token_finish_accepts_str_and_none() -> None:
    for finish in (None, "stop", "length"):
        header = Header(MsgType.TOKEN, fields={"token": 3, "finish": finish})
        assert decode(encode(header))[0].fields["finish"] == finish


# ---------------------------------------------------------------- zero copy over zmq


def _address(buf: Any) -> int:
    addr: int = np.frombuffer(buf, np.uint8).__array_interface__["data"][0]
    return addr


@pytest.mark.parametrize("shape", [(16, 4096), (3,), (0, 8)])
def test_decode_zmq_frames_without_copy(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]], shape: tuple[int, ...]
) -> None:
    sender, receiver = pair
    arr = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    sender.send_multipart(encode(_header(MsgType.ACTIVATION), [payload(arr)]), copy=False)
    frames = receiver.recv_multipart(copy=False)
    assert all(isinstance(f, zmq.Frame) for f in frames)
    header, (got,) = decode(frames)
    assert header == _header(MsgType.ACTIVATION)
    np.testing.assert_array_equal(got.array, arr)
    if arr.size:
        received = np.frombuffer(frames[1].buffer, np.uint8)
        assert np.shares_memory(got.array, received)
        assert got.array.__array_interface__["data"][0] == _address(frames[1].buffer)


# ---------------------------------------------------------------- malformed input


def _frames_with_head(head: Any, *payload_frames: bytes) -> list[bytes]:
    return [_pack(head), *payload_frames]


def _f32(n: int) -> bytes:
    return np.zeros(n, np.float32).tobytes()


def _tensor_head(shape: Any, dtype: Any = "float32") -> dict[str, Any]:
    return _raw_head(type="activation", fields={}, tensors=[[dtype, shape]])


_MALFORMED: dict[str, Callable[[], list[Any]]] = {
    "empty frame list": lambda: [],
    "garbage bytes": lambda: [b"\xc1\xc1\xc1"],
    "empty header frame": lambda: [b""],
    "truncated msgpack": lambda: [_pack(_raw_head())[:-3]],
    "trailing bytes": lambda: [_pack(_raw_head()) + b"\x00"],
    "header over 64 KiB": lambda: [_pack(_raw_head(pad="x" * MAX_HEADER_BYTES))],
    "header not a map": lambda: [_pack([1, "step"])],
    "header a scalar": lambda: [_pack(1)],
    "non-str map key": lambda: [_pack({1: 2})],
    "wrong version": lambda: _frames_with_head(_raw_head(v=PROTOCOL_VERSION + 1)),
    "version missing": lambda: _frames_with_head(
        {k: v for k, v in _raw_head().items() if k != "v"}
    ),
    "version as str": lambda: _frames_with_head(_raw_head(v=str(PROTOCOL_VERSION))),
    "unknown type": lambda: _frames_with_head(_raw_head(type="reboot")),
    "type not a str": lambda: _frames_with_head(_raw_head(type=["step"])),
    "missing required field": lambda: _frames_with_head(_raw_head(fields={})),
    "wrong field type": lambda: _frames_with_head(_raw_head(fields={"token": "5"})),
    "bool as int field": lambda: _frames_with_head(_raw_head(fields={"token": True})),
    "finish wrong type": lambda: _frames_with_head(
        _raw_head(type="token", fields={"token": 1, "finish": 3})
    ),
    "fields not a map": lambda: _frames_with_head(_raw_head(fields=[1])),
    "session too long": lambda: _frames_with_head(_raw_head(session="s" * 129)),
    "session not a str": lambda: _frames_with_head(_raw_head(session=5)),
    "request id too long": lambda: _frames_with_head(_raw_head(request_id="r" * 129)),
    "negative step": lambda: _frames_with_head(_raw_head(step=-1)),
    "float step": lambda: _frames_with_head(_raw_head(step=1.5)),
    "tensors not a list": lambda: _frames_with_head(_raw_head(tensors={"a": 1})),
    "too many tensors": lambda: _frames_with_head(
        _raw_head(tensors=[["uint8", [0]]] * (MAX_TENSORS + 1)), *[b""] * (MAX_TENSORS + 1)
    ),
    "unknown dtype": lambda: _frames_with_head(_tensor_head([2], "complex64"), _f32(4)),
    "dtype not a str": lambda: _frames_with_head(_tensor_head([2], 4), _f32(2)),
    "uint16 is not a wire name": lambda: _frames_with_head(_tensor_head([2], "uint16"), _f32(1)),
    "tensor spec not a pair": lambda: _frames_with_head(
        _raw_head(type="activation", fields={}, tensors=[["float32"]]), _f32(1)
    ),
    "negative dim": lambda: _frames_with_head(_tensor_head([-1, 2]), _f32(0)),
    "too many dims": lambda: _frames_with_head(_tensor_head([1, 1, 1, 1, 1]), _f32(1)),
    "float dim": lambda: _frames_with_head(_tensor_head([2.0]), _f32(2)),
    "str dim": lambda: _frames_with_head(_tensor_head(["2"]), _f32(2)),
    "shape not a list": lambda: _frames_with_head(_tensor_head(2), _f32(2)),
    "truncated payload": lambda: _frames_with_head(_tensor_head([4, 4]), _f32(15)),
    "payload too long": lambda: _frames_with_head(_tensor_head([4]), _f32(5)),
    "fewer payload frames": lambda: _frames_with_head(_tensor_head([4])),
    "more payload frames": lambda: _frames_with_head(_tensor_head([4]), _f32(4), _f32(4)),
    "payload frames without tensors": lambda: _frames_with_head(_raw_head(), _f32(4)),
    "huge declared shape": lambda: _frames_with_head(_tensor_head([2**40, 2**40]), _f32(1)),
    "msgpack ext type": lambda: [
        _pack(_raw_head(fields={"token": 1, "x": msgpack.ExtType(1, b"ab")}))
    ],
    "msgpack timestamp": lambda: [_pack(_raw_head(fields={"token": 1, "t": msgpack.Timestamp(1)}))],
    "huge declared map": lambda: [b"\xdf\x80\x00\x00\x00"],
    "huge declared array": lambda: [b"\xdd\x80\x00\x00\x00"],
    "huge declared str": lambda: [b"\xdb\x7f\xff\xff\xff" + b"x" * 16],
    "str over limit": lambda: [
        _pack(_raw_head(fields={"token": 1, "x": "y" * (MAX_HEADER_STR_LEN + 1)}))
    ],
    "payload frame not a buffer": lambda: _frames_with_head(_tensor_head([1]), 12345),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("case", list(_MALFORMED))
def test_malformed_raises_protocol_error(case: str) -> None:
    frames = _MALFORMED[case]()
    with pytest.raises(ProtocolError):
        decode(frames)


def test_protocol_error_is_value_error() -> None:
    assert issubclass(ProtocolError, ValueError)


def test_wrong_version_message() -> None:
    with pytest.raises(ProtocolError, match=f"protocol version 99, expected {PROTOCOL_VERSION}"):
        decode([_pack(_raw_head(v=99))])


def test_missing_field_is_named() -> None:
    with pytest.raises(ProtocolError, match="'token'"):
        decode([_pack(_raw_head(fields={"tok": 1}))])


def test_payload_over_limit() -> None:
    frames = encode(Header(MsgType.ACTIVATION), [payload(np.zeros(64, np.float32))])
    assert decode(frames, max_payload_bytes=256)[1][0].array.nbytes == 256
    with pytest.raises(ProtocolError, match="at most 255"):
        decode(frames, max_payload_bytes=255)


# ---------------------------------------------------------------- encode refuses bad input


_BAD_ENCODE: dict[str, Callable[[], tuple[Header, list[Payload]]]] = {
    "missing field": lambda: (Header(MsgType.STEP), []),
    "wrong field type": lambda: (Header(MsgType.STEP, fields={"token": 1.5}), []),
    "unknown type": lambda: (Header("nope"), []),  # type: ignore[arg-type]
    "session too long": lambda: (Header(MsgType.STATUS, session="s" * 200), []),
    "negative step": lambda: (Header(MsgType.STATUS, step=-2), []),
    "unpackable field": lambda: (Header(MsgType.STATUS, fields={"x": object()}), []),
    "header too big": lambda: (Header(MsgType.STATUS, fields={"x": "y" * MAX_HEADER_BYTES}), []),
    "non-contiguous": lambda: (
        Header(MsgType.ACTIVATION),
        [payload(np.zeros((4, 4), np.float32)[:, ::2])],
    ),
    "dtype mismatch": lambda: (
        Header(MsgType.ACTIVATION),
        [Payload(np.zeros(4, np.float32), "bfloat16")],
    ),
    "unknown dtype name": lambda: (
        Header(MsgType.ACTIVATION),
        [Payload(np.zeros(4, np.float32), "float8")],
    ),
    "big-endian array": lambda: (
        Header(MsgType.ACTIVATION),
        [Payload(np.zeros(4, ">f4"), "float32")],
    ),
    "too many dims": lambda: (
        Header(MsgType.ACTIVATION),
        [payload(np.zeros((1, 1, 1, 1, 1), np.float32))],
    ),
    "too many payloads": lambda: (
        Header(MsgType.ACTIVATION),
        [payload(np.zeros(1, np.uint8))] * (MAX_TENSORS + 1),
    ),
}


@pytest.mark.parametrize("case", list(_BAD_ENCODE))
def test_encode_refuses(case: str) -> None:
    header, payloads = _BAD_ENCODE[case]()
    with pytest.raises(ProtocolError):
        encode(header, payloads)


def test_non_contiguous_message_says_callers_bug() -> None:
    arr = np.zeros((4, 4), np.float32).T
    with pytest.raises(ProtocolError, match="caller's bug"):
        encode(Header(MsgType.ACTIVATION), [payload(arr)])


def test_payload_inference() -> None:
    for name, dtype in WIRE_DTYPES.items():
        arr = np.zeros(2, dtype)
        if name == "bfloat16":
            with pytest.raises(ProtocolError):
                payload(arr)  # uint16 is never guessed to be bf16
        else:
            assert payload(arr).dtype == name
    with pytest.raises(ProtocolError):
        payload(np.zeros(2, np.float64))
