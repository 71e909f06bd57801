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
always a ProtocolError, or either. numpy and msgpack only: no torch, no sockets (those
are in ``fuzz_peers``).
"""

from __future__ import annotations

import dataclasses
import math
import string
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np

from zmqllm import PROTOCOL_VERSION, __version__
from zmqllm.messages import (
    LOAD_KEYS,
    MAX_ATTEMPTS,
    MAX_CONTEXT,
    MAX_LAYERS,
    MAX_SESSIONS,
    MAX_TOKEN_ID,
    MESSAGE_TYPES,
    Activation,
    Cancel,
    Close,
    Disconnect,
    Error,
    ErrorCode,
    Finish,
    Heartbeat,
    Message,
    Open,
    Refused,
    Register,
    Registered,
    Status,
    StatusReply,
    Step,
    Token,
)
from zmqllm.protocol import (
    MAX_DIMS,
    MAX_FRAMES,
    MAX_HEADER_BYTES,
    MAX_TENSORS,
    decode,
    encode,
)
from zmqllm.sampling_params import SamplingParams
from zmqllm.wire_types import WIRE_DTYPES, Payload, ProtocolError

__all__ = ["CATEGORIES", "EXPECTED", "check_expected", "hostile_messages", "labelled_messages"]

Rng = np.random.Generator
Frames = list[bytes]

_ID_CHARS = string.ascii_letters + string.digits + "_-"
_NAME_CHARS = "".join(chr(c) for c in range(0x21, 0x7F))
_FLOATS = ("float32", "float16", "bfloat16")


# ---------------------------------------------------------------- random values


def _pick(rng: Rng, items: Any) -> Any:
    # rng.random() costs a tenth of rng.integers(): this runs millions of times.
    return items[int(rng.random() * len(items))]


def _chance(rng: Rng, p: float) -> bool:
    return bool(rng.random() < p)


def _chars(rng: Rng, alphabet: str, lo: int, hi: int) -> str:
    """lo..hi characters of an ASCII alphabet (one numpy lookup: this runs 10**5 times)."""
    table = np.frombuffer(alphabet.encode("ascii"), np.uint8)
    idx = rng.integers(0, len(table), lo + int(rng.random() * (hi - lo + 1)))
    return table[idx].tobytes().decode("ascii")


def _weighted(rng: Rng, cumulative: np.ndarray) -> int:
    """An index drawn with the weights whose normalised cumulative sums are given
    (Generator.choice with p= costs ten times as much)."""
    return min(int(np.searchsorted(cumulative, rng.random(), side="right")), len(cumulative) - 1)


def _ident(rng: Rng) -> str:
    return _chars(rng, _ID_CHARS, 1, 64)


def _name(rng: Rng) -> str:
    return _chars(rng, _NAME_CHARS, 1, 40)


def _session(rng: Rng, sessions: list[str]) -> str:
    """Half the time one of the sessions under attack, else one nobody opened."""
    if sessions and _chance(rng, 0.5):
        return str(_pick(rng, sessions))
    return _ident(rng)


def _scalar(rng: Rng) -> Any:
    kind = int(rng.integers(12))
    if kind == 0:
        return None
    if kind == 1:
        return bool(rng.integers(2))
    if kind == 2:
        return int(rng.integers(-(2**63), 2**63 - 1))
    if kind == 3:
        return _pick(rng, [0, -1, 1, 2**31, 2**32, 2**63, 2**64 - 1, -(2**63), MAX_TOKEN_ID + 1])
    if kind == 4:
        return _pick(rng, [float("nan"), float("inf"), -float("inf"), -0.0, 1e308, 5e-324, 0.5])
    if kind == 5:
        return _chars(rng, _NAME_CHARS + " \x00\n", 0, 80) + _pick(rng, ["", "é", "\u2028"])
    if kind == 6:
        return rng.bytes(int(rng.integers(0, 40)))
    if kind == 7:
        return _pick(rng, sorted(MESSAGE_TYPES) + sorted(WIRE_DTYPES) + ["", "STEP", "uint16"])
    if kind == 8:
        return msgpack.ExtType(int(rng.integers(0, 128)), b"")  # max_ext_len=0 lets it through
    if kind == 9:
        return _chars(rng, _ID_CHARS, 60, 70)  # ids around their 64-character bound
    if kind == 10:
        return float(rng.standard_normal() * 1e6)
    return int(rng.integers(0, 1 << 20))


def _value(rng: Rng, depth: int = 0) -> Any:
    """A random msgpack value, nested lists and maps included."""
    kind = int(rng.integers(10)) if depth < 4 else 0
    if kind == 8:
        return [_value(rng, depth + 1) for _ in range(int(rng.integers(0, 6)))]
    if kind == 9:
        n = int(rng.integers(0, 6))
        keys = [_pick(rng, _FIELD_NAMES) if _chance(rng, 0.5) else _name(rng) for _ in range(n)]
        return {k: _value(rng, depth + 1) for k in keys}
    return _scalar(rng)


def _array(rng: Rng, dtype: str, shape: tuple[int, ...]) -> Payload:
    """Random bits of the given wire dtype (NaNs and infinities among the floats)."""
    wire = WIRE_DTYPES[dtype]
    raw = rng.bytes(math.prod(shape) * wire.itemsize)
    return Payload(np.frombuffer(raw, wire).reshape(shape), dtype)


# ---------------------------------------------------------------- valid messages


def _register(rng: Rng, sessions: list[str]) -> Register:
    # Bogus ranges, huge models, many distinct ranges, fingerprints of no real model.
    num_layers = int(_pick(rng, [4, 4, 32, int(rng.integers(1, MAX_LAYERS + 1)), MAX_LAYERS]))
    start = int(rng.integers(0, num_layers))
    end = int(rng.integers(start + 1, num_layers + 1))
    return Register(
        request_id=_pick(rng, ["", _ident(rng)]),
        start=start,
        end=end,
        num_layers=num_layers,
        capacity=int(_pick(rng, [1, 8, MAX_SESSIONS])),
        max_kv_tokens=int(_pick(rng, [1, 4096, 1 << 40])),
        context=int(_pick(rng, [1, 2048, MAX_CONTEXT])),
        version=_pick(rng, [__version__, "9.9.9", ""]),
        fingerprint=rng.bytes(16).hex(),
        model={"hidden_size": int(rng.integers(1, 1 << 16)), "num_layers": num_layers},
        host=_name(rng),
        pid=int(rng.integers(0, 1 << 31)),
        dtype=_pick(rng, ["float32", "bfloat16", "float16", "int8"]),
        device=_pick(rng, ["cpu", "cuda:0", "mps"]),
    )


def _heartbeat(rng: Rng, sessions: list[str]) -> Heartbeat:
    load = {k: _pick(rng, [0, 1, 2**40, 0.5, True, "x"]) for k in sorted(LOAD_KEYS)[:8]}
    return Heartbeat(
        boot=_pick(rng, [None, _ident(rng)]),
        load=_pick(rng, [None, load]),
        draining=_chance(rng, 0.5),
    )


def _open(rng: Rng, sessions: list[str]) -> Open:
    # Absurd sizes: contexts of millions, ids past any vocabulary, thousands of stop ids.
    tokens = None
    if _chance(rng, 0.6):
        n = int(_pick(rng, [1, 8, 256, 2048]))
        ids = rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32)
        if _chance(rng, 0.5):
            ids = rng.integers(0, 64, n, dtype=np.int32)
        tokens = Payload(ids, "int32")
        prompt_len = n
    else:
        prompt_len = int(_pick(rng, [1, 4096, MAX_CONTEXT]))
    return Open(
        request_id=_ident(rng),
        session=_session(rng, sessions),
        attempt=int(_pick(rng, [0, 0, 1, MAX_ATTEMPTS])),
        max_tokens=int(_pick(rng, [1, 16, MAX_CONTEXT])),
        prompt_len=prompt_len,
        sampling=SamplingParams(
            temperature=float(_pick(rng, [0.0, 1.0, 1e6])),
            top_p=float(_pick(rng, [1.0, 1e-9])),
            top_k=int(_pick(rng, [0, 1, 2**63 - 1])),
            seed=int(rng.integers(0, 2**63 - 1)),
        ),
        stop_ids=tuple(rng.integers(0, MAX_TOKEN_ID, int(_pick(rng, [0, 4096]))).tolist()),
        stage=int(rng.integers(0, 4)),
        stages=int(_pick(rng, [0, 2, MAX_LAYERS])),
        max_len=int(_pick(rng, [0, 2 * MAX_CONTEXT])),
        next=_pick(rng, ["", _name(rng)]),
        tokens=tokens,
    )


def _group(rng: Rng) -> tuple[str, int] | None:
    return _pick(rng, [None, (_ident(rng), int(rng.integers(1, MAX_SESSIONS + 1)))])


def _session_fields(rng: Rng, sessions: list[str]) -> dict[str, Any]:
    return {
        "request_id": _pick(rng, ["", _ident(rng)]),
        "session": _session(rng, sessions),
        "attempt": int(_pick(rng, [0, 0, 0, 1, 2, MAX_ATTEMPTS])),
        "step": int(_pick(rng, [0, 1, int(rng.integers(0, 1 << 20))])),
    }


def _step(rng: Rng, sessions: list[str]) -> Step:
    token = int(_pick(rng, [0, 1, int(rng.integers(0, 1 << 16)), MAX_TOKEN_ID]))
    return Step(**_session_fields(rng, sessions), token=token, group=_group(rng))


def _activation(rng: Rng, sessions: list[str]) -> Activation:
    shape = (int(rng.integers(1, 9)), int(_pick(rng, [1, 64, int(rng.integers(0, 257))])))
    return Activation(
        **_session_fields(rng, sessions),
        final=_chance(rng, 0.5),
        group=_group(rng),
        hidden=_array(rng, _pick(rng, _FLOATS), shape),
    )


def _token(rng: Rng, sessions: list[str]) -> Token:
    return Token(
        **_session_fields(rng, sessions),
        token=int(_pick(rng, [0, 2, int(rng.integers(0, 1 << 16)), MAX_TOKEN_ID])),
        finish=_pick(rng, [None, None, Finish.STOP, Finish.LENGTH]),
        group=_group(rng),
        route=_pick(rng, [None, (_name(rng), _name(rng))]),
        boot=_pick(rng, [None, _ident(rng)]),
    )


def _error(rng: Rng, sessions: list[str]) -> Error:
    return Error(
        code=_pick(rng, list(ErrorCode)),
        message=_chars(rng, _NAME_CHARS + " ", 0, 200),
        session=_pick(rng, ["", _session(rng, sessions)]),
        attempt=int(_pick(rng, [0, 1])),
    )


def _status_reply(rng: Rng, sessions: list[str]) -> StatusReply:
    if _chance(rng, 0.5):
        return StatusReply.of({"sessions": 0, "workers": [_value(rng) for _ in range(3)]})
    return StatusReply(body=_array(rng, "uint8", (int(rng.integers(0, 512)),)))


_BUILDERS: dict[type[Message], Callable[[Rng, list[str]], Message]] = {
    Register: _register,
    Registered: lambda rng, s: Registered(worker_id=_name(rng), boot=_ident(rng)),
    Refused: lambda rng, s: Refused(reason=_chars(rng, _NAME_CHARS, 0, 100)),
    Disconnect: lambda rng, s: Disconnect(reason=_chars(rng, _NAME_CHARS, 0, 100)),
    Heartbeat: _heartbeat,
    Open: _open,
    Step: _step,
    Activation: _activation,
    Token: _token,
    Close: lambda rng, s: Close(**_session_fields(rng, s)),
    Cancel: lambda rng, s: Cancel(**_session_fields(rng, s)),
    Error: _error,
    Status: lambda rng, s: Status(request_id=_pick(rng, ["", _ident(rng)])),
    StatusReply: _status_reply,
}
# How often each type is sent as a valid message: what peers send most, and what reaches
# the sessions under attack, comes most often (STATUS spam, foreign CANCELs).
_VALID_WEIGHTS: dict[type[Message], float] = {
    Register: 3,
    Registered: 1,
    Refused: 1,
    Disconnect: 1,
    Heartbeat: 2,
    Open: 3,
    Step: 3,
    Activation: 3,
    Token: 3,
    Close: 3,
    Cancel: 4,
    Error: 2,
    Status: 3,
    StatusReply: 1,
}
_TYPES = list(_VALID_WEIGHTS)
_TYPE_CUM = np.cumsum(list(_VALID_WEIGHTS.values())) / sum(_VALID_WEIGHTS.values())
_FIELD_NAMES = sorted(
    {"v", "type", "tensors"} | {n for cls in MESSAGE_TYPES.values() for n, _ in cls.wire_fields()}
)


def _valid_message(rng: Rng, sessions: list[str], cls: type[Message] | None = None) -> Message:
    cls = cls or _TYPES[_weighted(rng, _TYPE_CUM)]
    return _BUILDERS[cls](rng, sessions)


def _frames(msg: Message) -> Frames:
    return [bytes(f) for f in encode(msg)]


def _pack(head: Any) -> bytes:
    packed: bytes = msgpack.packb(head, use_bin_type=True)
    return packed


def _valid_parts(rng: Rng, sessions: list[str], cls: type[Message] | None = None) -> Any:
    """A valid message's header map and payload frames, to corrupt."""
    frames = _frames(_valid_message(rng, sessions, cls))
    return msgpack.unpackb(frames[0], raw=False), frames[1:]


# ---------------------------------------------------------------- categories


def _random_frames(rng: Rng, sessions: list[str]) -> Frames:
    # Counts past MAX_FRAMES too: a receiver must drop them before building them up.
    n = int(rng.integers(1, MAX_FRAMES + 9))
    out = [rng.bytes(int(_pick(rng, [0, 1, 8, 64, int(rng.integers(0, 2048))]))) for _ in range(n)]
    if _chance(rng, 0.3):  # a map prefix: msgpack gets further before it fails
        out[0] = bytes([0x80 + int(rng.integers(16))]) + out[0]
    return out


def _random_msgpack(rng: Rng, sessions: list[str]) -> Frames:
    head: Any = _value(rng)  # any value at all, maps among them
    if _chance(rng, 0.8):  # a map of field names, mostly past the version and type checks
        head = {_pick(rng, _FIELD_NAMES): _value(rng) for _ in range(int(rng.integers(0, 10)))}
        if _chance(rng, 0.8):
            head["v"] = PROTOCOL_VERSION
        if _chance(rng, 0.8):
            head["type"] = _pick(rng, sorted(MESSAGE_TYPES))
    frames = [rng.bytes(int(rng.integers(0, 64))) for _ in range(int(rng.integers(0, 3)))]
    return [_pack(head), *frames]


def _truncated(rng: Rng, sessions: list[str]) -> Frames:
    frames = _frames(_valid_message(rng, sessions))
    # A map declares its entries: any proper prefix of it is incomplete msgpack.
    return [frames[0][: int(rng.integers(0, len(frames[0])))], *frames[1:]]


def _trailing_garbage(rng: Rng, sessions: list[str]) -> Frames:
    frames = _frames(_valid_message(rng, sessions))
    garbage = _pick(rng, [rng.bytes(int(rng.integers(1, 64))), frames[0], b"\xc0", b"\x00"])
    return [frames[0] + garbage, *frames[1:]]


_LIES: list[Callable[[Rng], Any]] = [
    lambda rng: [_pick(rng, _FLOATS), [0, 2**64 - 1]],  # reshape of nothing into 2**64-1
    lambda rng: [_pick(rng, _FLOATS), [_pick(rng, [2**64 - 1, 2**63, 2**32, 2**30 + 1]), 1]],
    lambda rng: [_pick(rng, _FLOATS), [-1, int(rng.integers(1, 8))]],
    lambda rng: [_pick(rng, _FLOATS), [-(2**63), -(2**63)]],
    lambda rng: [_pick(rng, _FLOATS), [2**30] * MAX_DIMS],  # product overflows int64
    lambda rng: [_pick(rng, ["complex64", "uint16", "float64", "", "FLOAT32", "bf16"]), [1, 4]],
    lambda rng: [_pick(rng, [7, None, True, b"float32", ["float32"]]), [1, 4]],
    lambda rng: [_pick(rng, _FLOATS), [1] * (MAX_DIMS + 1 + int(rng.integers(4)))],
    lambda rng: [_pick(rng, _FLOATS), [1.0, 4]],
    lambda rng: [_pick(rng, _FLOATS), ["1", True]],
    lambda rng: [_pick(rng, _FLOATS), 4],
    lambda rng: _pick(rng, [["float32"], "float32", {"float32": [1]}, [], None, 3]),
]


def _lying_tensor(rng: Rng, sessions: list[str]) -> Frames:
    cls = _pick(rng, [Open, Activation, StatusReply])
    head, payloads = _valid_parts(rng, sessions, cls)
    how = int(rng.integers(4))
    if how == 0 or not payloads:  # a spec that cannot be true of any frame
        head["tensors"] = [_pick(rng, _LIES)(rng)]
        payloads = [rng.bytes(int(_pick(rng, [0, 16])))]
    elif how == 1:  # the frame is not the size its spec says
        frame = payloads[0]
        if frame and _chance(rng, 0.5):
            payloads = [frame[: int(rng.integers(0, len(frame)))]]
        else:
            payloads = [frame + rng.bytes(int(rng.integers(1, 16)))]
    elif how == 2:  # more or fewer frames than specs
        payloads = _pick(rng, [[], payloads * 2, [*payloads, b""]])
    else:  # more specs than any message may carry
        n = MAX_TENSORS + 1 + int(rng.integers(4))
        head["tensors"] = [["uint8", [0]]] * n
        payloads = [b""] * min(n, MAX_FRAMES + 4)
    return [_pack(head), *payloads]


def _bad_version(rng: Rng, sessions: list[str]) -> Frames:
    head, payloads = _valid_parts(rng, sessions)
    bad = [0, PROTOCOL_VERSION + 1, -1, 2**64 - 1, str(PROTOCOL_VERSION), True, 1.0, None, [1]]
    if _chance(rng, 0.15):
        del head["v"]
    else:
        head["v"] = _pick(rng, bad)
    return [_pack(head), *payloads]


def _unknown_type(rng: Rng, sessions: list[str]) -> Frames:
    head, payloads = _valid_parts(rng, sessions)
    bad = ["", "STEP", "step ", "reboot", "status_reply2", 5, None, True, ["step"], b"step"]
    if _chance(rng, 0.15):
        del head["type"]
    else:
        # No type's name starts with an x.
        head["type"] = _pick(rng, [*bad, "x" + _chars(rng, string.ascii_lowercase, 0, 12)])
    return [_pack(head), *payloads]


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
        _chars(rng, _ID_CHARS, 65, 2000),
        rng.bytes(8),
        [],
        [[]],
        [-1],
        ["a b"],
        {},
        {"x": [1]},
        {"temperature": -1},
        _value(rng),
    ]


def _bad_field(rng: Rng, sessions: list[str]) -> Frames:
    msg = _valid_message(rng, sessions)
    frames = _frames(msg)
    head = msgpack.unpackb(frames[0], raw=False)
    fields = [(n, spec) for n, spec in msg.wire_fields() if not spec.is_payload]
    name, spec = _pick(rng, fields)
    candidates = _hostile_values(rng)
    for i in rng.permutation(len(candidates)):
        value = candidates[int(i)]
        try:
            spec.check(name, value)
        except Exception:  # the field's own check refuses it: a wrong type or range
            head[name] = value
            return [_pack(head), *frames[1:]]
    raise AssertionError(f"no hostile value for {type(msg).__name__}.{name}")


# Tensor specs that are true of their frames but not what the field takes.
_WRONG_TENSORS: dict[type[Message], list[tuple[str, list[int]]]] = {
    Open: [("int64", [3]), ("float32", [3]), ("int32", [1, 3]), ("int32", [])],
    Activation: [("float32", [0, 8]), ("float32", [8]), ("float32", [1, 2, 4]), ("int32", [2, 4])],
    StatusReply: [("float32", [2]), ("uint8", [2, 2]), ("bool", [4])],
}


def _bad_payload(rng: Rng, sessions: list[str]) -> Frames:
    cls = _pick(rng, list(_WRONG_TENSORS))
    head, _ = _valid_parts(rng, sessions, cls)
    dtype, shape = _pick(rng, _WRONG_TENSORS[cls])
    head["tensors"] = [[dtype, shape]]
    if cls is Open and shape:
        head["prompt_len"] = shape[-1]  # only the tensor is wrong, not its length
    return [_pack(head), rng.bytes(math.prod(shape) * WIRE_DTYPES[dtype].itemsize)]


def _missing_field(rng: Rng, sessions: list[str]) -> Frames:
    msg = _valid_message(rng, sessions, _pick(rng, _REQUIRED_TYPES))
    frames = _frames(msg)
    head = msgpack.unpackb(frames[0], raw=False)
    required = [
        f
        for f in dataclasses.fields(msg)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    field = _pick(rng, required)
    if field.metadata["wire"].is_payload:
        head["tensors"], frames = [], frames[:1]
    else:
        del head[field.name]
    return [_pack(head), *frames[1:]]


_REQUIRED_TYPES = [
    cls
    for cls in MESSAGE_TYPES.values()
    if any(
        f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        for f in dataclasses.fields(cls)
    )
]


def _cross_field(rng: Rng, sessions: list[str]) -> Frames:
    if _chance(rng, 0.5):
        head, payloads = _valid_parts(rng, sessions, Register)
        start = int(rng.integers(1, MAX_LAYERS))
        # An empty or reversed range, or one past the model's end.
        head.update(
            _pick(
                rng,
                [
                    {"start": start, "end": start},
                    {"start": start, "end": int(rng.integers(1, start + 1))},
                    {"start": 0, "end": MAX_LAYERS, "num_layers": int(rng.integers(1, MAX_LAYERS))},
                ],
            )
        )
        return [_pack(head), *payloads]
    msg = _open(rng, sessions)
    while msg.tokens is None:
        msg = _open(rng, sessions)
    frames = _frames(msg)
    head = msgpack.unpackb(frames[0], raw=False)
    # Token ids that are not prompt_len of them.
    delta = int(_pick(rng, [-1, 1, 1000]))
    head["prompt_len"] = msg.prompt_len + (delta if msg.prompt_len + delta >= 1 else 1)
    return [_pack(head), *frames[1:]]


def _too_many_frames(rng: Rng, sessions: list[str]) -> Frames:
    frames = _frames(_valid_message(rng, sessions))
    extra = MAX_FRAMES + 1 - len(frames) + int(rng.integers(0, 8))
    return frames + [rng.bytes(int(rng.integers(0, 16))) for _ in range(extra)]


def _oversized_header(rng: Rng, sessions: list[str]) -> Frames:
    head, payloads = _valid_parts(rng, sessions)
    # Strs within msgpack's per-object limit, adding up past the header limit.
    n = (MAX_HEADER_BYTES + int(rng.integers(1, 4 * MAX_HEADER_BYTES))) // 8000 + 1
    head["pad"] = ["x" * 8000] * n
    return [_pack(head), *payloads]


def _valid(rng: Rng, sessions: list[str]) -> Frames:
    return _frames(_valid_message(rng, sessions))


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
        i = _weighted(rng, _CATEGORY_CUM)
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
