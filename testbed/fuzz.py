"""Hostile multipart messages for the bus: what a fuzzer, a crashed half-written peer or
an attacker sends to a broker socket (the live fuzz test and ``benchmarks/fuzz_bus.py``).

``hostile_messages(rng, sessions=[...])`` yields, forever and reproducibly for a seeded
``numpy.random.Generator``, frame lists (routing envelope not included) from a mix of
categories (``CATEGORIES``): random frames and counts, random msgpack, truncated and
trailing-garbage headers, lying tensor specs, wrong versions and types, each field of each
type with a wrong type or range, required fields left out, checks across fields broken,
and valid messages of every type, many of them naming the given sessions (foreign CANCELs
and CLOSEs, STEPs and TOKENs for sessions their sender has nothing to do with).

``EXPECTED`` says what ``protocol.decode`` makes of each category: always a message,
always a ProtocolError, or either. The valid messages, and the random values, come from
``fuzz_messages``; each category here corrupts them its own way. numpy and msgpack only:
no torch, no sockets (those are in ``fuzz_peers``).
"""

from __future__ import annotations

import dataclasses
import math
import string
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np

from testbed.fuzz_messages import (
    FIELD_NAMES,
    FLOATS,
    ID_CHARS,
    Frames,
    Rng,
    chance,
    chars,
    frames_of,
    pack_header,
    pick,
    random_value,
    valid_message,
    valid_open,
    valid_parts,
    weighted,
)
from zmqllm.bus.messages import (
    MAX_LAYERS,
    MESSAGE_TYPES,
    Activation,
    Message,
    Open,
    Register,
    StatusReply,
)
from zmqllm.bus.protocol import MAX_FRAMES, MAX_HEADER_BYTES, PROTOCOL_VERSION, decode
from zmqllm.bus.wire_types import MAX_DIMS, MAX_TENSORS, WIRE_DTYPES, ProtocolError

__all__ = ["CATEGORIES", "EXPECTED", "check_expected", "hostile_messages", "labelled_messages"]


# ---------------------------------------------------------------- categories


def _random_frames(rng: Rng, sessions: list[str]) -> Frames:
    # Counts past MAX_FRAMES too: a receiver must drop them before building them up.
    n = int(rng.integers(1, MAX_FRAMES + 9))
    out = [rng.bytes(int(pick(rng, [0, 1, 8, 64, int(rng.integers(0, 2048))]))) for _ in range(n)]
    if chance(rng, 0.3):  # a map prefix: msgpack gets further before it fails
        out[0] = bytes([0x80 + int(rng.integers(16))]) + out[0]
    return out


def _random_msgpack(rng: Rng, sessions: list[str]) -> Frames:
    head: Any = random_value(rng)  # any value at all, maps among them
    if chance(rng, 0.8):  # a map of field names, mostly past the version and type checks
        head = {pick(rng, FIELD_NAMES): random_value(rng) for _ in range(int(rng.integers(0, 10)))}
        if chance(rng, 0.8):
            head["v"] = PROTOCOL_VERSION
        if chance(rng, 0.8):
            head["type"] = pick(rng, sorted(MESSAGE_TYPES))
    frames = [rng.bytes(int(rng.integers(0, 64))) for _ in range(int(rng.integers(0, 3)))]
    return [pack_header(head), *frames]


def _truncated(rng: Rng, sessions: list[str]) -> Frames:
    frames = frames_of(valid_message(rng, sessions))
    # A map declares its entries: any proper prefix of it is incomplete msgpack.
    return [frames[0][: int(rng.integers(0, len(frames[0])))], *frames[1:]]


def _trailing_garbage(rng: Rng, sessions: list[str]) -> Frames:
    frames = frames_of(valid_message(rng, sessions))
    garbage = pick(rng, [rng.bytes(int(rng.integers(1, 64))), frames[0], b"\xc0", b"\x00"])
    return [frames[0] + garbage, *frames[1:]]


_LIES: list[Callable[[Rng], Any]] = [
    lambda rng: [pick(rng, FLOATS), [0, 2**64 - 1]],  # reshape of nothing into 2**64-1
    lambda rng: [pick(rng, FLOATS), [pick(rng, [2**64 - 1, 2**63, 2**32, 2**30 + 1]), 1]],
    lambda rng: [pick(rng, FLOATS), [-1, int(rng.integers(1, 8))]],
    lambda rng: [pick(rng, FLOATS), [-(2**63), -(2**63)]],
    lambda rng: [pick(rng, FLOATS), [2**30] * MAX_DIMS],  # product overflows int64
    lambda rng: [pick(rng, ["complex64", "uint16", "float64", "", "FLOAT32", "bf16"]), [1, 4]],
    lambda rng: [pick(rng, [7, None, True, b"float32", ["float32"]]), [1, 4]],
    lambda rng: [pick(rng, FLOATS), [1] * (MAX_DIMS + 1 + int(rng.integers(4)))],
    lambda rng: [pick(rng, FLOATS), [1.0, 4]],
    lambda rng: [pick(rng, FLOATS), ["1", True]],
    lambda rng: [pick(rng, FLOATS), 4],
    lambda rng: pick(rng, [["float32"], "float32", {"float32": [1]}, [], None, 3]),
]


def _lying_tensor(rng: Rng, sessions: list[str]) -> Frames:
    cls = pick(rng, [Open, Activation, StatusReply])
    head, payloads = valid_parts(rng, sessions, cls)
    how = int(rng.integers(4))
    if how == 0 or not payloads:  # a spec that cannot be true of any frame
        head["tensors"] = [pick(rng, _LIES)(rng)]
        payloads = [rng.bytes(int(pick(rng, [0, 16])))]
    elif how == 1:  # the frame is not the size its spec says
        frame = payloads[0]
        if frame and chance(rng, 0.5):
            payloads = [frame[: int(rng.integers(0, len(frame)))]]
        else:
            payloads = [frame + rng.bytes(int(rng.integers(1, 16)))]
    elif how == 2:  # more or fewer frames than specs
        payloads = pick(rng, [[], payloads * 2, [*payloads, b""]])
    else:  # more specs than any message may carry
        n = MAX_TENSORS + 1 + int(rng.integers(4))
        head["tensors"] = [["uint8", [0]]] * n
        payloads = [b""] * min(n, MAX_FRAMES + 4)
    return [pack_header(head), *payloads]


def _bad_version(rng: Rng, sessions: list[str]) -> Frames:
    head, payloads = valid_parts(rng, sessions)
    bad = [0, PROTOCOL_VERSION + 1, -1, 2**64 - 1, str(PROTOCOL_VERSION), True, 1.0, None, [1]]
    if head.get("type") == "refused":
        # A REFUSED of any int version is read on purpose (protocol.decode_header).
        bad = [str(PROTOCOL_VERSION), True, 1.0, None, [1]]
    if chance(rng, 0.15):
        del head["v"]
    else:
        head["v"] = pick(rng, bad)
    return [pack_header(head), *payloads]


def _unknown_type(rng: Rng, sessions: list[str]) -> Frames:
    head, payloads = valid_parts(rng, sessions)
    bad = ["", "STEP", "step ", "reboot", "status_reply2", 5, None, True, ["step"], b"step"]
    if chance(rng, 0.15):
        del head["type"]
    else:
        # No type's name starts with an x.
        head["type"] = pick(rng, [*bad, "x" + chars(rng, string.ascii_lowercase, 0, 12)])
    return [pack_header(head), *payloads]


def _hostile_values(rng: Rng) -> list[Any]:
    """Values of every wrong type and past every range, for one field."""
    return [
        None,
        True,
        -1,
        0,
        2**31,
        2**64 - 1,
        -(2**63),
        1.5,
        float("nan"),
        float("inf"),
        "",
        "a b",
        "s.2",
        "é",
        chars(rng, ID_CHARS, 65, 2000),
        rng.bytes(8),
        [],
        [[]],
        [-1],
        ["a b"],
        {},
        {"x": [1]},
        {"temperature": -1},
        random_value(rng),
    ]


def _bad_field(rng: Rng, sessions: list[str]) -> Frames:
    msg = valid_message(rng, sessions)
    frames = frames_of(msg)
    head = msgpack.unpackb(frames[0], raw=False)
    fields = [(n, spec) for n, spec in msg.wire_fields() if not spec.is_payload]
    name, spec = pick(rng, fields)
    candidates = _hostile_values(rng)
    for i in rng.permutation(len(candidates)):
        value = candidates[int(i)]
        try:
            spec.check(name, value)
        except Exception:  # the field's own check refuses it: a wrong type or range
            head[name] = value
            return [pack_header(head), *frames[1:]]
    raise AssertionError(f"no hostile value for {type(msg).__name__}.{name}")


# Tensor specs that are true of their frames but not what the field takes.
_WRONG_TENSORS: dict[type[Message], list[tuple[str, list[int]]]] = {
    Open: [("int64", [3]), ("float32", [3]), ("int32", [1, 3]), ("int32", [])],
    Activation: [("float32", [0, 8]), ("float32", [8]), ("float32", [1, 2, 4]), ("int32", [2, 4])],
    StatusReply: [("float32", [2]), ("uint8", [2, 2]), ("bool", [4])],
}


def _bad_payload(rng: Rng, sessions: list[str]) -> Frames:
    cls = pick(rng, list(_WRONG_TENSORS))
    head, _ = valid_parts(rng, sessions, cls)
    dtype, shape = pick(rng, _WRONG_TENSORS[cls])
    head["tensors"] = [[dtype, shape]]
    if cls is Open and shape:
        head["prompt_len"] = shape[-1]  # only the tensor is wrong, not its length
    return [pack_header(head), rng.bytes(math.prod(shape) * WIRE_DTYPES[dtype].itemsize)]


def _missing_field(rng: Rng, sessions: list[str]) -> Frames:
    msg = valid_message(rng, sessions, pick(rng, _REQUIRED_TYPES))
    frames = frames_of(msg)
    head = msgpack.unpackb(frames[0], raw=False)
    required = [
        f
        for f in dataclasses.fields(msg)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    field = pick(rng, required)
    if field.metadata["wire"].is_payload:
        head["tensors"], frames = [], frames[:1]
    else:
        del head[field.name]
    return [pack_header(head), *frames[1:]]


_REQUIRED_TYPES = [
    cls
    for cls in MESSAGE_TYPES.values()
    if any(
        f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        for f in dataclasses.fields(cls)
    )
]


def _cross_field(rng: Rng, sessions: list[str]) -> Frames:
    if chance(rng, 0.5):
        head, payloads = valid_parts(rng, sessions, Register)
        start = int(rng.integers(1, MAX_LAYERS))
        # An empty or reversed range, or one past the model's end.
        head.update(
            pick(
                rng,
                [
                    {"start": start, "end": start},
                    {"start": start, "end": int(rng.integers(1, start + 1))},
                    {"start": 0, "end": MAX_LAYERS, "num_layers": int(rng.integers(1, MAX_LAYERS))},
                ],
            )
        )
        return [pack_header(head), *payloads]
    msg = valid_open(rng, sessions)
    while msg.tokens is None:
        msg = valid_open(rng, sessions)
    frames = frames_of(msg)
    head = msgpack.unpackb(frames[0], raw=False)
    # Token ids that are not prompt_len of them.
    delta = int(pick(rng, [-1, 1, 1000]))
    head["prompt_len"] = msg.prompt_len + (delta if msg.prompt_len + delta >= 1 else 1)
    return [pack_header(head), *frames[1:]]


def _too_many_frames(rng: Rng, sessions: list[str]) -> Frames:
    frames = frames_of(valid_message(rng, sessions))
    extra = MAX_FRAMES + 1 - len(frames) + int(rng.integers(0, 8))
    return frames + [rng.bytes(int(rng.integers(0, 16))) for _ in range(extra)]


def _oversized_header(rng: Rng, sessions: list[str]) -> Frames:
    head, payloads = valid_parts(rng, sessions)
    # Strs within msgpack's per-object limit, adding up past the header limit.
    n = (MAX_HEADER_BYTES + int(rng.integers(1, 4 * MAX_HEADER_BYTES))) // 8000 + 1
    head["pad"] = ["x" * 8000] * n
    return [pack_header(head), *payloads]


def _valid(rng: Rng, sessions: list[str]) -> Frames:
    return frames_of(valid_message(rng, sessions))


# name -> (generator, weight, expected outcome of decode: True a message, False a
# ProtocolError, None either)
_CATEGORIES: dict[str, tuple[Callable[[Rng, list[str]], Frames], float, bool | None]] = {
    "random_frames": (_random_frames, 8, None),
    "random_msgpack": (_random_msgpack, 8, None),
    "truncated": (_truncated, 5, False),
    "trailing_garbage": (_trailing_garbage, 5, False),
    "lying_tensor": (_lying_tensor, 8, False),
    "bad_version": (_bad_version, 4, False),
    "unknown_type": (_unknown_type, 4, False),
    "bad_field": (_bad_field, 16, False),
    "bad_payload": (_bad_payload, 3, False),
    "missing_field": (_missing_field, 4, False),
    "cross_field": (_cross_field, 3, False),
    "too_many_frames": (_too_many_frames, 3, False),
    "oversized_header": (_oversized_header, 0.5, False),
    "valid": (_valid, 32, True),
}
CATEGORIES: tuple[str, ...] = tuple(_CATEGORIES)
EXPECTED: dict[str, bool | None] = {name: c[2] for name, c in _CATEGORIES.items()}
_CATEGORY_CUM = np.cumsum([c[1] for c in _CATEGORIES.values()]) / sum(
    c[1] for c in _CATEGORIES.values()
)


def labelled_messages(rng: Rng, *, sessions: list[str]) -> Iterator[tuple[str, Frames]]:
    """(category, frames) forever; the same sequence for the same seed and sessions."""
    gens = [c[0] for c in _CATEGORIES.values()]
    while True:
        i = weighted(rng, _CATEGORY_CUM)
        yield CATEGORIES[i], gens[i](rng, sessions)


def hostile_messages(rng: Rng, *, sessions: list[str]) -> Iterator[Frames]:
    """Hostile multipart messages (no routing envelope) forever, in a random mix."""
    for _, frames in labelled_messages(rng, sessions=sessions):
        yield frames


def check_expected(category: str, frames: Frames) -> None:
    """Raise AssertionError unless ``protocol.decode`` does what ``EXPECTED`` says."""
    try:
        decode(frames)
    except ProtocolError:
        if EXPECTED[category] is True:
            raise AssertionError(f"{category}: a valid message was refused") from None
        return
    if EXPECTED[category] is False:
        raise AssertionError(f"{category}: a hostile message decoded")
