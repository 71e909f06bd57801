"""The wire format: encode/decode, limits, payload frames and zero copy, and fuzzing of
decode (hypothesis): any list of frames gives a Message or a ProtocolError, nothing else.

No torch here: the front end runs without the ML stack. Each message type's own fields
are tested in test_messages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.bus.test_messages import EXAMPLES, assert_same_message, valid_messages
from zmqllm.bus.messages import (
    MESSAGE_TYPES,
    Activation,
    Error,
    ErrorCode,
    Message,
    Open,
    Register,
    Status,
    StatusReply,
    Step,
)
from zmqllm.bus.protocol import (
    MAX_FRAMES,
    MAX_HEADER_ARRAY_LEN,
    MAX_HEADER_BIN_LEN,
    MAX_HEADER_BYTES,
    MAX_HEADER_MAP_LEN,
    MAX_HEADER_STR_LEN,
    MAX_PAYLOAD_BYTES,
    PROTOCOL_VERSION,
    decode,
    decode_header,
    encode,
)
from zmqllm.bus.wire_types import (
    MAX_DIMS,
    MAX_TENSORS,
    WIRE_DTYPES,
    Payload,
    ProtocolError,
    payload,
)

FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _pack(head: Any) -> bytes:
    packed: bytes = msgpack.packb(head, use_bin_type=True)
    return packed


def _step_head(**overrides: Any) -> dict[str, Any]:
    """A valid STEP header map, to corrupt one key at a time."""
    head: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": "step", "session": "s", "token": 5}
    head.update(overrides)
    return head


def _hidden(rows: int = 2, cols: int = 4, dtype: str = "float32") -> Payload:
    arr = np.arange(rows * cols, dtype=WIRE_DTYPES[dtype]).reshape(rows, cols)
    return Payload(arr, dtype)


# ---------------------------------------------------------------- round trips


def test_status_has_only_a_header() -> None:
    frames = encode(Status(request_id="r"))
    assert len(frames) == 1
    assert msgpack.unpackb(frames[0]) == {
        "v": PROTOCOL_VERSION,
        "type": "status",
        "request_id": "r",
        "tensors": [],
    }
    assert decode(frames) == Status(request_id="r")


def test_header_carries_version_type_and_tensor_specs() -> None:
    head = msgpack.unpackb(encode(Activation(session="s", hidden=_hidden(3, 8)))[0])
    assert (head["v"], head["type"], head["tensors"]) == (
        PROTOCOL_VERSION,
        "activation",
        [["float32", [3, 8]]],
    )


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 1), (2, 3), (16, 4096), (5, 0)])
def test_hidden_states_round_trip_bit_exact(dtype: str, shape: tuple[int, int]) -> None:
    # Random bits: NaN payloads, infinities and subnormals must come back as they went.
    wire = WIRE_DTYPES[dtype]
    raw = np.random.default_rng(0).integers(0, 256, int(np.prod(shape)) * wire.itemsize, np.uint8)
    msg = Activation(session="s", step=9, hidden=Payload(raw.view(wire).reshape(shape), dtype))
    got = decode(encode(msg))
    assert_same_message(got, msg)
    assert isinstance(got, Activation)
    assert got.hidden.array.dtype == wire


@pytest.mark.parametrize("name", sorted(WIRE_DTYPES))
def test_every_wire_dtype_is_read(name: str) -> None:
    """Each dtype name is understood; the message type then says whether it fits."""
    wire = WIRE_DTYPES[name]
    raw = np.arange(6, dtype=np.uint8).astype(wire).tobytes()
    head = {
        "v": PROTOCOL_VERSION,
        "type": "activation",
        "session": "s",
        "tensors": [[name, [2, 3]]],
    }
    frames = [_pack(head), raw]
    if name in ("float32", "float16", "bfloat16"):
        got = decode(frames)
        assert isinstance(got, Activation)
        assert got.hidden.array.tobytes() == raw
    else:
        with pytest.raises(ProtocolError, match="'hidden'"):
            decode(frames)


def test_bfloat16_travels_as_uint16_words() -> None:
    # 1.0, -2.0, +inf, a NaN and the smallest subnormal as bf16 words.
    words = np.array([[0x3F80, 0xC000, 0x7F80, 0x7FC1, 0x0001]], dtype=np.uint16)
    frames = encode(Activation(session="s", hidden=Payload(words, "bfloat16")))
    assert msgpack.unpackb(frames[0])["tensors"] == [["bfloat16", [1, 5]]]
    got = decode(frames)
    assert isinstance(got, Activation)
    assert got.hidden.dtype == "bfloat16"
    assert got.hidden.array.dtype == np.dtype("<u2")
    np.testing.assert_array_equal(got.hidden.array, words)


def test_payload_infers_wire_names_but_never_bfloat16() -> None:
    for name, dtype in WIRE_DTYPES.items():
        arr = np.zeros(2, dtype)
        if name == "bfloat16":
            with pytest.raises(ProtocolError):
                payload(arr)  # uint16 is only ever bf16 bits, and must be said so
        else:
            assert payload(arr).dtype == name
    with pytest.raises(ProtocolError, match="float64"):
        payload(np.zeros(2, np.float64))


def test_frames_may_be_bytes_memoryviews_or_bytearrays() -> None:
    msg = Open(
        session="s", max_tokens=2, prompt_len=3, tokens=payload(np.arange(3, dtype=np.int32))
    )
    frames = encode(msg)
    for convert in (bytes, memoryview, bytearray):
        assert_same_message(decode([convert(f) for f in frames]), msg)


def test_decode_header_reads_only_the_header() -> None:
    cls, head = decode_header(encode(Activation(session="s9", hidden=_hidden()))[0])
    assert cls is Activation
    assert head["session"] == "s9"


# ---------------------------------------------------------------- zero copy


def test_decoded_payload_views_the_frame() -> None:
    frames = [bytes(f) for f in encode(Activation(session="s", hidden=_hidden(3, 4)))]
    got = decode(frames)
    assert isinstance(got, Activation)
    assert np.shares_memory(got.hidden.array, np.frombuffer(frames[1], np.uint8))
    assert not got.hidden.array.flags.writeable


def test_encoded_payload_frame_views_the_array() -> None:
    hidden = _hidden(3, 4)
    _, frame = encode(Activation(session="s", hidden=hidden))
    assert isinstance(frame, memoryview)
    assert frame.nbytes == hidden.array.nbytes
    assert np.shares_memory(np.frombuffer(frame, np.uint8), hidden.array)


def _address(buf: Any) -> int:
    addr: int = np.frombuffer(buf, np.uint8).__array_interface__["data"][0]
    return addr


@pytest.mark.parametrize("shape", [(16, 4096), (1, 3)])
def test_decode_zmq_frames_without_copy(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]], shape: tuple[int, int]
) -> None:
    sender, receiver = pair
    arr = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    msg = Activation(session="s", step=4, hidden=payload(arr))
    sender.send_multipart(encode(msg), copy=False)
    frames = receiver.recv_multipart(copy=False)
    assert all(isinstance(f, zmq.Frame) for f in frames)
    got = decode(frames)
    assert_same_message(got, msg)
    assert isinstance(got, Activation)
    received = np.frombuffer(frames[1].buffer, np.uint8)
    assert np.shares_memory(got.hidden.array, received)
    assert got.hidden.array.__array_interface__["data"][0] == _address(frames[1].buffer)


# ---------------------------------------------------------------- encode refuses


_BAD_ENCODE: dict[str, Callable[[], Message]] = {
    "non-contiguous": lambda: Activation(
        session="s", hidden=payload(np.zeros((4, 8), np.float32)[:, ::2])
    ),
    "transposed": lambda: Activation(session="s", hidden=payload(np.zeros((4, 8), np.float32).T)),
    "dtype not its name": lambda: Activation(
        session="s", hidden=Payload(np.zeros((1, 4), np.float32), "bfloat16")
    ),
    "unknown dtype name": lambda: Activation(
        session="s", hidden=Payload(np.zeros((1, 4), np.float32), "float8")
    ),
    "big-endian array": lambda: Activation(
        session="s", hidden=Payload(np.zeros((1, 4), ">f4"), "float32")
    ),
    "float64 array": lambda: Activation(
        session="s", hidden=Payload(np.zeros((1, 4), np.float64), "float32")
    ),
    "too many dims": lambda: Activation(
        session="s", hidden=payload(np.zeros((1,) * (MAX_DIMS + 1), np.float32))
    ),
    "header too big": lambda: Error(code=ErrorCode.INTERNAL, message="x" * MAX_HEADER_BYTES),
    "unpackable field": lambda: Register(
        start=0,
        end=1,
        num_layers=1,
        capacity=1,
        max_kv_tokens=1,
        context=1,
        version="v",
        fingerprint="f",
        model={"x": object()},
    ),
    "int beyond msgpack": lambda: Step(session="s", token=2**70),
}


@pytest.mark.parametrize("case", list(_BAD_ENCODE))
def test_encode_refuses(case: str) -> None:
    with pytest.raises(ProtocolError):
        encode(_BAD_ENCODE[case]())


def test_non_contiguous_is_the_callers_bug() -> None:
    with pytest.raises(ProtocolError, match="caller's bug"):
        encode(_BAD_ENCODE["transposed"]())


# ---------------------------------------------------------------- malformed input


def _tensor(shape: Any, dtype: Any = "float32", *frames: Any) -> list[Any]:
    """An ACTIVATION header declaring one tensor, then the given payload frames."""
    head = {
        "v": PROTOCOL_VERSION,
        "type": "activation",
        "session": "s",
        "tensors": [[dtype, shape]],
    }
    return [_pack(head), *frames]


def _f32(n: int) -> bytes:
    return np.zeros(n, np.float32).tobytes()


_MALFORMED: dict[str, Callable[[], list[Any]]] = {
    "no frames": lambda: [],
    "more frames than any type has": lambda: [_pack(_step_head())] + [b""] * MAX_FRAMES,
    "garbage bytes": lambda: [b"\xc1\xc1\xc1"],
    "empty header frame": lambda: [b""],
    "truncated msgpack": lambda: [_pack(_step_head())[:-3]],
    "trailing bytes": lambda: [_pack(_step_head()) + b"\x00"],
    "two maps": lambda: [_pack(_step_head()) * 2],
    "header over 64 KiB": lambda: [_pack(_step_head(pad="x" * MAX_HEADER_BYTES))],
    "header not a map": lambda: [_pack([1, "step"])],
    "header a scalar": lambda: [_pack(1)],
    "header nil": lambda: [_pack(None)],
    "non-str map key": lambda: [_pack({1: 2})],
    "non-str nested key": lambda: [_pack(_step_head(x={1: 2}))],
    "invalid utf-8": lambda: [_pack(_step_head())[:-1] + b"\xa2\xff\xfe"],
    "wrong version": lambda: [_pack(_step_head(v=PROTOCOL_VERSION + 1))],
    "version 0": lambda: [_pack(_step_head(v=0))],
    "version missing": lambda: [_pack({k: v for k, v in _step_head().items() if k != "v"})],
    "version as str": lambda: [_pack(_step_head(v=str(PROTOCOL_VERSION)))],
    "version as bool": lambda: [_pack(_step_head(v=True))],
    "version as float": lambda: [_pack(_step_head(v=float(PROTOCOL_VERSION)))],
    "version huge": lambda: [_pack(_step_head(v=2**64 - 1))],
    "unknown type": lambda: [_pack(_step_head(type="reboot"))],
    "type in capitals": lambda: [_pack(_step_head(type="STEP"))],
    "type not a str": lambda: [_pack(_step_head(type=["step"]))],
    "type missing": lambda: [_pack({k: v for k, v in _step_head().items() if k != "type"})],
    "tensors not a list": lambda: [_pack(_step_head(tensors={"a": 1}))],
    "too many tensors": lambda: [
        _pack(_step_head(type="status", tensors=[["uint8", [0]]] * (MAX_TENSORS + 1))),
        *[b""] * (MAX_TENSORS + 1),
    ],
    "unknown dtype": lambda: _tensor([1, 2], "complex64", _f32(4)),
    "dtype not a str": lambda: _tensor([1, 2], 4, _f32(2)),
    "dtype in capitals": lambda: _tensor([1, 2], "FLOAT32", _f32(2)),
    "uint16 is not a wire name": lambda: _tensor([1, 2], "uint16", _f32(1)),
    "float64 is not a wire name": lambda: _tensor([1, 2], "float64", _f32(4)),
    "tensor spec not a pair": lambda: [
        _pack(
            {"v": PROTOCOL_VERSION, "type": "activation", "session": "s", "tensors": [["float32"]]}
        ),
        _f32(1),
    ],
    "tensor spec a map": lambda: [
        _pack(
            {
                "v": PROTOCOL_VERSION,
                "type": "activation",
                "session": "s",
                "tensors": [{"float32": [1]}],
            }
        ),
        _f32(1),
    ],
    "negative dim": lambda: _tensor([-1, 2], "float32", _f32(0)),
    "dim 2**64-1 with an empty frame": lambda: _tensor([0, 2**64 - 1], "float32", b""),
    "dim 2**63 with an empty frame": lambda: _tensor([2**63, 0], "float32", b""),
    "dim above 2**30": lambda: _tensor([0, 2**30 + 1], "float32", b""),
    "dims product overflowing int64": lambda: _tensor([2**30] * 4, "float32", b""),
    "too many dims": lambda: _tensor([1] * (MAX_DIMS + 1), "float32", _f32(1)),
    "float dim": lambda: _tensor([1, 2.0], "float32", _f32(2)),
    "str dim": lambda: _tensor([1, "2"], "float32", _f32(2)),
    "bool dim": lambda: _tensor([1, True], "float32", _f32(1)),
    "nil dim": lambda: _tensor([1, None], "float32", _f32(1)),
    "shape not a list": lambda: _tensor(2, "float32", _f32(2)),
    "truncated payload": lambda: _tensor([4, 4], "float32", _f32(15)),
    "payload too long": lambda: _tensor([1, 4], "float32", _f32(5)),
    "fewer payload frames": lambda: _tensor([1, 4]),
    "more payload frames": lambda: _tensor([1, 4], "float32", _f32(4), _f32(4)),
    "payload frames without tensors": lambda: [_pack(_step_head()), _f32(4)],
    "huge declared shape": lambda: _tensor([2**30, 2**30], "float32", _f32(1)),
    "msgpack ext type": lambda: [_pack(_step_head(x=msgpack.ExtType(1, b"ab")))],
    "msgpack timestamp": lambda: [_pack(_step_head(t=msgpack.Timestamp(1)))],
    "huge declared map": lambda: [b"\xdf\x80\x00\x00\x00"],
    "huge declared array": lambda: [b"\xdd\x80\x00\x00\x00"],
    "huge declared str": lambda: [b"\xdb\x7f\xff\xff\xff" + b"x" * 16],
    "huge declared bin": lambda: [b"\xc6\x7f\xff\xff\xff" + b"x" * 16],
    "str over limit": lambda: [_pack(_step_head(x="y" * (MAX_HEADER_STR_LEN + 1)))],
    "bin over limit": lambda: [_pack(_step_head(x=b"y" * (MAX_HEADER_BIN_LEN + 1)))],
    "array over limit": lambda: [_pack(_step_head(x=[0] * (MAX_HEADER_ARRAY_LEN + 1)))],
    "map over limit": lambda: [
        _pack(_step_head(x={str(i): 0 for i in range(MAX_HEADER_MAP_LEN + 1)}))
    ],
    "nested too deep": lambda: [_pack(_step_head())[:-1] + b"\x91" * 10_000 + b"\xc0"],
    "payload frame not a buffer": lambda: _tensor([1, 1], "float32", 12345),
    "header frame not a buffer": lambda: [_step_head()],
    "frames not a sequence": lambda: 5,  # type: ignore[return-value]
}


@pytest.mark.parametrize("case", list(_MALFORMED))
def test_malformed_raises_protocol_error(case: str) -> None:
    with pytest.raises(ProtocolError):
        decode(_MALFORMED[case]())


def test_protocol_error_is_value_error() -> None:
    assert issubclass(ProtocolError, ValueError)


def test_wrong_version_is_said() -> None:
    with pytest.raises(ProtocolError, match=f"protocol version 99, expected {PROTOCOL_VERSION}"):
        decode([_pack(_step_head(v=99))])


def test_unknown_type_is_said() -> None:
    with pytest.raises(ProtocolError, match="unknown message type 'reboot'"):
        decode([_pack(_step_head(type="reboot"))])


def test_frame_count_bound() -> None:
    assert MAX_FRAMES == 1 + MAX_TENSORS
    with pytest.raises(ProtocolError, match=f"1 to {MAX_FRAMES}"):
        decode([_pack(_step_head())] * (MAX_FRAMES + 1))


def test_payload_size_limit() -> None:
    frames = encode(Activation(session="s", hidden=payload(np.zeros((1, 64), np.float32))))
    got = decode(frames, max_payload_bytes=256)
    assert isinstance(got, Activation)
    assert got.hidden.array.nbytes == 256
    with pytest.raises(ProtocolError, match="at most 255"):
        decode(frames, max_payload_bytes=255)
    assert MAX_PAYLOAD_BYTES == 1 << 30


def test_limits_are_on_the_declared_size_before_any_allocation() -> None:
    # 2**30 x 2**30 float32 would be 4 EiB: refused by its spec, not by numpy.
    with pytest.raises(ProtocolError, match="payload of 4611686018427387904 bytes"):
        decode(_tensor([2**30, 2**30], "float32", b""))


def test_a_header_of_exactly_the_limit_is_read() -> None:
    head = _step_head(pad=["x" * (MAX_HEADER_STR_LEN - 64)] * 4, pad2="")
    # Grow an unknown str until the header is exactly MAX_HEADER_BYTES.
    head["pad2"] = "y" * (MAX_HEADER_BYTES - len(_pack(head)) - 4)
    while len(_pack(head)) < MAX_HEADER_BYTES:
        head["pad2"] += "y"
    packed = _pack(head)
    assert len(packed) == MAX_HEADER_BYTES
    assert decode([packed]) == Step(session="s", token=5)
    with pytest.raises(ProtocolError, match="header is"):
        decode([packed + b"\xc0"])


# ---------------------------------------------------------------- fuzzing decode


def _decode_or_error(frames: Any) -> Message | None:
    """decode's only two outcomes. A message that decodes must also survive a re-encode:
    whatever decode accepts, a peer can send on."""
    try:
        msg = decode(frames)
    except ProtocolError:
        return None
    assert isinstance(msg, Message)
    assert_same_message(decode(encode(msg)), msg)
    return msg


_KNOWN_KEYS = sorted(
    {"v", "type", "tensors"}
    | {name for cls in MESSAGE_TYPES.values() for name, _ in cls.wire_fields()}
)
_WIRE_NAMES = sorted(WIRE_DTYPES)
keys = st.sampled_from(_KNOWN_KEYS) | st.text(max_size=8)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, 1, -1, 2**31, 2**32, 2**63, 2**64 - 1, -(2**63)]),
    st.floats(),
    st.text(max_size=24),
    st.sampled_from(sorted(MESSAGE_TYPES)) | st.sampled_from(_WIRE_NAMES),
    st.text("ab_-.", min_size=60, max_size=70),  # ids near their 64-character bound
    st.binary(max_size=24),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4)),
)
# Nested lists and maps, keys mostly str (a few ints: strict_map_key refuses them).
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(keys | st.integers(0, 3), inner, max_size=4)
    ),
    max_leaves=6,
)
dims = st.one_of(
    st.integers(0, 8),
    st.sampled_from([-1, -(2**63), 2**30, 2**30 + 1, 2**31, 2**32, 2**63, 2**64 - 1]),
    st.integers(-(2**63), 2**64 - 1),
)
specs = st.tuples(
    st.sampled_from(_WIRE_NAMES) | st.sampled_from(["uint16", "float64", "", "FLOAT32"]) | scalars,
    st.lists(dims, max_size=MAX_DIMS + 2) | values,
)


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=12))
def test_fuzz_random_frames(frames: list[bytes]) -> None:
    if _decode_or_error(frames) is not None:
        assert msgpack.unpackb(frames[0])["v"] == PROTOCOL_VERSION


@st.composite
def random_headers(draw: st.DrawFn) -> list[bytes]:
    """A random map, mostly past the version and type checks, with tensor specs whose
    frames are the size they claim (so the field checks are reached) or random."""
    head: dict[Any, Any] = draw(st.dictionaries(keys, values, max_size=8))
    if draw(st.integers(0, 9)):
        head["v"] = PROTOCOL_VERSION
    if draw(st.integers(0, 9)):
        head["type"] = draw(st.sampled_from(sorted(MESSAGE_TYPES)))
    frames: list[bytes] = []
    if draw(st.booleans()):
        tensors = draw(
            st.lists(
                st.tuples(
                    st.sampled_from(_WIRE_NAMES), st.lists(st.integers(0, 6), max_size=MAX_DIMS)
                ),
                max_size=3,
            )
        )
        head["tensors"] = [[name, shape] for name, shape in tensors]
        # Payload bits from a drawn seed: drawing kilobytes byte by byte is slow.
        rng = np.random.default_rng(draw(st.integers(0, 2**32)))
        for name, shape in tensors:
            size = int(np.prod(shape)) * WIRE_DTYPES[name].itemsize
            frames.append(rng.bytes(size))
    extra = draw(st.lists(st.binary(max_size=16), max_size=2))
    return [_pack(head), *frames, *extra]


@FUZZ
@given(random_headers())
def test_fuzz_random_msgpack_maps(frames: list[bytes]) -> None:
    msg = _decode_or_error(frames)
    if msg is not None:
        assert msg.TYPE.value == msgpack.unpackb(frames[0], strict_map_key=False)["type"]


@st.composite
def mutated(draw: st.DrawFn) -> tuple[Message, list[bytes]]:
    """A valid message with one header key set to a random value, or removed."""
    msg = draw(valid_messages)
    frames = [bytes(f) for f in encode(msg)]
    head = msgpack.unpackb(frames[0], raw=False)
    key = draw(st.sampled_from(sorted(head)) | keys)
    if draw(st.integers(0, 5)):
        head[key] = draw(values)
    else:
        head.pop(key, None)
    return msg, [_pack(head), *frames[1:]]


@FUZZ
@given(mutated())
def test_fuzz_valid_messages_with_one_field_mutated(case: tuple[Message, list[bytes]]) -> None:
    _, frames = case
    got = _decode_or_error(frames)
    if got is not None:
        # What decoded is still its own type (or the type the mutation named).
        assert got.TYPE.value == msgpack.unpackb(frames[0])["type"]


@st.composite
def lying_specs(draw: st.DrawFn) -> list[bytes]:
    """A message with payloads whose tensor specs lie: huge, negative or overflowing
    dims, unknown dtype names, specs that are not specs, frames dropped or added."""
    msg = draw(st.sampled_from([EXAMPLES[Open], EXAMPLES[Activation], EXAMPLES[StatusReply]]))
    frames = [bytes(f) for f in encode(msg)]
    head = msgpack.unpackb(frames[0], raw=False)
    head["tensors"] = [list(draw(specs)) for _ in range(draw(st.integers(1, 3)))]
    payloads = frames[1:] + draw(st.lists(st.binary(max_size=32), max_size=2))
    return [_pack(head), *payloads[: draw(st.integers(0, len(payloads)))]]


@FUZZ
@given(lying_specs())
def test_fuzz_lying_tensor_specs(frames: list[bytes]) -> None:
    got = _decode_or_error(frames)
    if got is not None:  # the lie happened to be a truth: sizes add up exactly
        assert len(frames) == 1 + len(msgpack.unpackb(frames[0])["tensors"])


@FUZZ
@given(valid_messages, st.data())
def test_fuzz_truncated_and_trailing_garbage(msg: Message, data: st.DataObject) -> None:
    frames = [bytes(f) for f in encode(msg)]
    header = frames[0]
    cut = data.draw(st.integers(0, len(header) - 1))
    with pytest.raises(ProtocolError):
        decode([header[:cut], *frames[1:]])
    garbage = data.draw(st.binary(min_size=1, max_size=32))
    with pytest.raises(ProtocolError):
        decode([header + garbage, *frames[1:]])
    assert_same_message(decode(frames), msg)
