"""Typed wire messages: every field's type and range, the checks that span fields, and
round trips of random valid instances of every type (hypothesis).

No torch here: the front end runs without the ML stack. The strategies below
(``MESSAGES``, ``valid_messages``) are shared with test_protocol's fuzzing.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zmqllm.bus.figure_keys import FIGURE_KEYS, MEASURED_KEYS
from zmqllm.bus.messages import (
    MAX_ATTEMPTS,
    MAX_CONTEXT,
    MAX_DELTA,
    MAX_LAYERS,
    MAX_SESSIONS,
    MAX_STATUS_BYTES,
    MAX_STEP,
    MAX_TEXT,
    MAX_TOKEN_ID,
    MESSAGE_TYPES,
    Activation,
    Ask,
    AskKind,
    Cached,
    Cancel,
    Close,
    Delta,
    Disconnect,
    Error,
    ErrorCode,
    Finish,
    Heartbeat,
    Message,
    MsgType,
    Open,
    Place,
    Placed,
    Refused,
    Register,
    Registered,
    SessionError,
    SessionMessage,
    Status,
    StatusReply,
    Step,
    Token,
)
from zmqllm.bus.prefix import MAX_PREFIX_KEY, prefix_blocks
from zmqllm.bus.protocol import PROTOCOL_VERSION, decode, encode
from zmqllm.bus.sampling_params import MAX_SEED, SamplingParams
from zmqllm.bus.wire_types import ID_PATTERN, Payload, ProtocolError, WireField, is_valid_id
from zmqllm.config.settings import MAX_DRAFT_TOKENS

# Modest and reproducible: the suite runs on 2 shared cores, and no .hypothesis/ database
# is written into the checkout.
FUZZ = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ---------------------------------------------------------------- strategies of valid fields

ids = st.from_regex(ID_PATTERN, fullmatch=True)
request_ids = st.one_of(st.just(""), ids)
names = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=255)


def texts(max_len: int) -> st.SearchStrategy[str]:
    return st.text(max_size=max_len)


# What msgpack carries as a map value: int64/uint64, finite floats, bools, short strs.
scalars = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.text(max_size=256),
)
groups = st.none() | st.tuples(texts(320), st.integers(1, MAX_SESSIONS))
samplings = st.builds(
    SamplingParams,
    temperature=st.floats(0, 1e6),
    top_p=st.floats(0, 1, exclude_min=True),
    top_k=st.integers(0, 2**63 - 1),
    seed=st.integers(0, MAX_SEED),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    grammar=st.just("") | st.text(max_size=64),
)


def arrays(dtype: str, shape: tuple[int, ...]) -> st.SearchStrategy[Payload]:
    """Random bits (NaN payloads and subnormals included): round trips must be bit-exact."""
    np_dtype = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2", "int32": "<i4"}
    dt = np.dtype(np_dtype.get(dtype, dtype))
    size = int(np.prod(shape)) * dt.itemsize
    raw = st.binary(min_size=size, max_size=size)
    return raw.map(lambda b: Payload(np.frombuffer(b, dt).reshape(shape).copy(), dtype))


def session_fields() -> dict[str, st.SearchStrategy[Any]]:
    return {
        "request_id": request_ids,
        "session": ids,
        "attempt": st.integers(0, MAX_ATTEMPTS),
        "step": st.integers(0, MAX_STEP),
    }


@st.composite
def registers(draw: st.DrawFn) -> Register:
    num_layers = draw(st.integers(1, MAX_LAYERS))
    start = draw(st.integers(0, num_layers - 1))
    return Register(
        request_id=draw(request_ids),
        start=start,
        end=draw(st.integers(start + 1, num_layers)),
        num_layers=num_layers,
        capacity=draw(st.integers(1, MAX_SESSIONS)),
        max_kv_tokens=draw(st.integers(1, 1 << 40)),
        context=draw(st.integers(1, MAX_CONTEXT)),
        version=draw(texts(32)),
        fingerprint=draw(texts(128)),
        # At most 16 entries: 64 of 256 four-byte characters would outgrow a header.
        model=draw(st.dictionaries(texts(64), scalars, max_size=16)),
        host=draw(names),
        pid=draw(st.integers(0, (1 << 31) - 1)),
        dtype=draw(texts(16)),
        device=draw(texts(32)),
        prefill_chunk=draw(st.integers(0, MAX_CONTEXT)),
        served=draw(st.just("") | names),
        proposes=draw(st.booleans()),
    )


@st.composite
def opens(draw: st.DrawFn) -> Open:
    # Stage 0 gets the prompt's ids; the other stages only its length.
    tokens = None
    if draw(st.booleans()):
        n = draw(st.integers(1, 64))
        tokens = draw(arrays("int32", (n,)))
        prompt_len = n
    else:
        prompt_len = draw(st.integers(1, MAX_CONTEXT))
    fields = draw(st.fixed_dictionaries(session_fields()))
    return Open(
        **fields,
        max_tokens=draw(st.integers(1, MAX_CONTEXT)),
        prompt_len=prompt_len,
        sampling=draw(samplings),
        stop_ids=tuple(draw(st.lists(st.integers(0, MAX_TOKEN_ID), max_size=64))),
        stage=draw(st.integers(0, MAX_LAYERS)),
        stages=draw(st.integers(0, MAX_LAYERS)),
        max_len=draw(st.integers(0, 2 * MAX_CONTEXT)),
        next=draw(st.just("") | names),
        tokens=tokens,
        prefix=tuple(
            draw(
                st.lists(st.integers(0, MAX_PREFIX_KEY), max_size=min(8, prefix_blocks(prompt_len)))
            )
        ),
        speculative=draw(st.booleans()),
    )


@st.composite
def activations(draw: st.DrawFn) -> Activation:
    shape = (draw(st.integers(1, 8)), draw(st.integers(0, 16)))
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
    return Activation(
        **draw(st.fixed_dictionaries(session_fields())),
        final=draw(st.booleans()),
        group=draw(groups),
        prefix=draw(st.integers(0, MAX_CONTEXT)),
        hidden=draw(arrays(dtype, shape)),
    )


@st.composite
def asks(draw: st.DrawFn) -> Ask:
    body = json.dumps(draw(st.dictionaries(texts(8), scalars, max_size=4))).encode()
    return Ask(
        **draw(st.fixed_dictionaries(session_fields())),
        model=draw(st.just("") | names),
        kind=draw(st.sampled_from(AskKind)),
        max_tokens=draw(st.integers(1, MAX_CONTEXT)),
        body=Payload(np.frombuffer(body, np.uint8).copy(), "uint8"),
    )


# Proposed tokens (speculative decoding), as STEP and TOKEN carry them.
drafts = st.lists(st.integers(0, MAX_TOKEN_ID), max_size=MAX_DRAFT_TOKENS).map(tuple)

MESSAGES: dict[type[Message], st.SearchStrategy[Any]] = {
    Register: registers(),
    Registered: st.builds(Registered, request_id=request_ids, worker_id=names, boot=texts(64)),
    Place: st.builds(
        Place,
        request_id=request_ids,
        served=names,
        num_layers=st.integers(1, MAX_LAYERS),
        fingerprint=texts(128),
        figures=st.dictionaries(st.sampled_from(sorted(MEASURED_KEYS)), scalars, max_size=9),
        hold=st.booleans(),
    ),
    Placed: st.integers(0, MAX_LAYERS - 1).flatmap(
        lambda a: st.builds(
            Placed,
            request_id=request_ids,
            start=st.just(a),
            end=st.integers(a + 1, MAX_LAYERS),
            why=texts(MAX_TEXT),
        )
    ),
    Refused: st.builds(Refused, request_id=request_ids, reason=texts(MAX_TEXT)),
    Disconnect: st.builds(Disconnect, request_id=request_ids, reason=texts(MAX_TEXT)),
    Heartbeat: st.builds(
        Heartbeat,
        request_id=request_ids,
        boot=st.none() | texts(64),
        load=st.none() | st.dictionaries(st.sampled_from(sorted(FIGURE_KEYS)), scalars),
        draining=st.booleans(),
    ),
    Open: opens(),
    Ask: asks(),
    Delta: st.builds(
        Delta,
        **session_fields(),
        text=texts(64),
        finish=st.none() | texts(32),
        prompt_tokens=st.none() | st.integers(0, MAX_CONTEXT),
        completion_tokens=st.none() | st.integers(0, MAX_CONTEXT),
        route=st.none() | st.lists(names, max_size=8).map(tuple),
        boot=st.none() | texts(64),
    ),
    Cached: st.builds(Cached, **session_fields(), tokens=st.integers(0, MAX_CONTEXT)),
    Step: st.builds(
        Step,
        **session_fields(),
        token=st.integers(0, MAX_TOKEN_ID),
        group=groups,
        draft=drafts,
    ),
    Activation: activations(),
    Token: st.builds(
        Token,
        **session_fields(),
        token=st.integers(0, MAX_TOKEN_ID),
        finish=st.none() | st.sampled_from(Finish),
        group=groups,
        route=st.none() | st.lists(names, max_size=8).map(tuple),
        boot=st.none() | texts(64),
        draft=drafts,
    ),
    Close: st.builds(Close, **session_fields()),
    Cancel: st.builds(Cancel, **session_fields()),
    Error: st.builds(
        Error,
        request_id=request_ids,
        code=st.sampled_from(ErrorCode),
        message=texts(MAX_TEXT),
        session=request_ids,
        attempt=st.integers(0, MAX_ATTEMPTS),
    ),
    Status: st.builds(Status, request_id=request_ids),
    StatusReply: st.builds(
        StatusReply,
        request_id=request_ids,
        body=st.integers(0, 256).flatmap(lambda n: arrays("uint8", (n,))),
    ),
}
valid_messages = st.one_of(*MESSAGES.values())


def assert_same_message(got: Message, want: Message) -> None:
    """Field by field; payloads by dtype, shape and bits (NaNs included)."""
    assert type(got) is type(want)
    for fname, spec in want.wire_fields():
        a, b = getattr(got, fname), getattr(want, fname)
        if spec.is_payload and b is not None:
            assert isinstance(a, Payload), fname
            assert a.dtype == b.dtype, fname
            assert (a.array.dtype, a.array.shape) == (b.array.dtype, b.array.shape), fname
            assert np.array_equal(a.array.view(np.uint8), b.array.view(np.uint8)), fname
        else:
            assert a == b, fname
            assert type(a) is type(b), fname


def test_strategies_cover_every_type() -> None:
    assert set(MESSAGES) == set(MESSAGE_TYPES.values())


@pytest.mark.parametrize("cls", list(MESSAGES), ids=lambda c: c.__name__)
@FUZZ
@given(data=st.data())
def test_every_type_round_trips(cls: type[Message], data: st.DataObject) -> None:
    msg = data.draw(MESSAGES[cls])
    assert_same_message(decode(encode(msg)), msg)
    # Through bytes, as a socket delivers them.
    assert_same_message(decode([bytes(f) for f in encode(msg)]), msg)


# ---------------------------------------------------------------- the registry of types


def test_every_msg_type_has_one_class() -> None:
    assert set(MESSAGE_TYPES) == {t.value for t in MsgType}
    for value, cls in MESSAGE_TYPES.items():
        assert cls.TYPE.value == value
        assert value == cls.TYPE.name.lower()


def test_every_field_says_how_it_travels() -> None:
    payload_fields = set()
    for cls in MESSAGE_TYPES.values():
        for f in dataclasses.fields(cls):
            assert isinstance(f.metadata.get("wire"), WireField), (cls, f.name)
            if f.metadata["wire"].is_payload:
                payload_fields.add((cls.__name__, f.name))
    assert payload_fields == {
        ("Open", "tokens"),
        ("Ask", "body"),
        ("Activation", "hidden"),
        ("StatusReply", "body"),
    }


def test_session_messages_are_the_ones_about_a_session() -> None:
    about_a_session = {c for c in MESSAGE_TYPES.values() if issubclass(c, SessionMessage)}
    assert about_a_session == {Open, Ask, Cached, Step, Activation, Token, Delta, Close, Cancel}


def test_messages_are_frozen() -> None:
    msg = Step(session="s", token=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.token = 2  # type: ignore[misc]


# ---------------------------------------------------------------- every field, wrongly typed

# One valid instance per type: each test below corrupts one field of its header.
_KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"  # a CURVE public key in Z85
# An endpoint's host, port and scheme each wrong; a key too short, too long, off Z85.
_ENDPOINTS = [
    None,
    5,
    "tcp://h",
    "tcp://h:0",
    "tcp://h:65536",
    "tcp://h:*",
    "ipc:///tmp/x",
    "tcp://a b:1",
    "tcp://h:1/x",
    "tcp://" + "h" * 254 + ":1",
]
_KEYS = [None, 5, _KEY[:39], _KEY + "x", "~" * 40, " " * 40]

EXAMPLES: dict[type[Message], Message] = {
    Register: Register(
        start=0,
        end=2,
        num_layers=4,
        capacity=8,
        max_kv_tokens=4096,
        context=2048,
        version="0.1.0",
        fingerprint="abc",
        model={"hidden_size": 64},
        host="h",
        pid=12,
        dtype="float32",
        device="cpu",
        prefill_chunk=2048,
        served="tiny",
        peer="tcp://127.0.0.1:40001",
    ),
    Registered: Registered(worker_id="w-1", boot="b"),
    Place: Place(
        served="tiny",
        num_layers=4,
        fingerprint="abc",
        figures={"ms_1": 0.5, "ms_16": 2.0, "memory_bytes": 1 << 30},
        hold=True,
    ),
    Placed: Placed(start=0, end=2, why="uncovered"),
    Refused: Refused(reason="no"),
    Disconnect: Disconnect(reason="bye"),
    Heartbeat: Heartbeat(boot="b", load={"sessions": 1}, draining=False),
    Open: Open(
        session="s",
        max_tokens=4,
        prompt_len=3,
        stop_ids=(2,),
        next="w-2",
        tokens=Payload(np.array([1, 2, 3], np.int32), "int32"),
        next_peer="tcp://[::1]:40002",
        next_key=_KEY,
        prev="w-0",
        prev_key=_KEY,
        build=("0:2:0123456789ab", "2:4:ba9876543210"),
    ),
    Ask: Ask(
        session="s",
        model="remote",
        kind=AskKind.COMPLETION,
        max_tokens=4,
        body=Payload(np.frombuffer(b'{"prompt": "hi"}', np.uint8).copy(), "uint8"),
    ),
    Delta: Delta(session="s", step=2, text="hi", finish="stop", prompt_tokens=3, route=("w",)),
    Cached: Cached(session="s", tokens=32),
    Step: Step(session="s", token=5, group=("g", 1)),
    Activation: Activation(
        session="s", group=("g", 1), hidden=Payload(np.zeros((2, 4), np.float32), "float32")
    ),
    Token: Token(
        session="s",
        token=5,
        finish=Finish.STOP,
        route=("w-1",),
        boot="b",
        build=("0:4:0123456789ab",),
        logprob_ids=(5, 5, 7),
        logprobs=(-0.25, -0.25, -1.5),
        stepped=True,
    ),
    Close: Close(session="s"),
    Cancel: Cancel(session="s"),
    Error: Error(code=ErrorCode.BUSY, message="m", session="s"),
    Status: Status(request_id="r"),
    StatusReply: StatusReply.of({"sessions": 0}),
}

NAN, INF = float("nan"), float("inf")


def _ints(lo: int, hi: int) -> list[Any]:
    return [None, True, 1.5, str(lo), [lo], {"v": lo}, lo - 1, hi + 1, 2**64 - 1, -(2**63)]


def _texts(max_len: int) -> list[Any]:
    return [None, 5, True, b"x", ["x"], "x" * (max_len + 1)]


_IDS = [None, 5, True, b"s", ["s"], "", "a" * 65, "a b", "s.2", "s/1", "é", "s\n"]
_NAMES = [None, 5, b"w", "", "a b", "x" * 256, "é", "w\x00"]
_FLAGS = [None, 1, 0, "true", [True]]
_GROUPS = [5, "g", [], ["g"], ["g", 0], ["g", MAX_SESSIONS + 1], ["g", 1, 2], [5, 1]]
_GROUPS += [["x" * 321, 1], ["g", True], ["g", 1.0], {"g": 1}]
_DRAFTS = [None, 5, "x", [-1], [MAX_TOKEN_ID + 1], [1.5], [True], [0] * (MAX_DRAFT_TOKENS + 1)]


def _maps(key: str) -> list[Any]:
    return [
        None,
        5,
        [],
        {key: [1]},
        {key: {"a": 1}},
        {key: None},
        {key: b"b"},
        {key: NAN},
        {key: INF},
        {key: "x" * 257},
        {"x" * 65: 1},
        {f"k{i}": i for i in range(65)},
    ]


def _without(values: list[Any], *ok: Any) -> list[Any]:
    """Drop the values a field accepts (None for an optional one, "" where empty is fine)."""
    return [v for v in values if not any(v is o or (type(v) is type(o) and v == o) for o in ok)]


_COMMON: dict[str, list[Any]] = {"request_id": _without(_IDS, "")}
_SESSION: dict[str, list[Any]] = {
    **_COMMON,
    "session": _IDS,
    "attempt": _ints(0, MAX_ATTEMPTS),
    "step": _ints(0, MAX_STEP),
}
# A route's build: hops of at most 22 characters (the broker reads their form), at most
# MAX_LAYERS of them.
_BUILDS = [5, "0:2:0123456789ab", [5], [None], ["0" * 23], ["0:1:0123456789ab"] * (MAX_LAYERS + 1)]
BAD: dict[type[Message], dict[str, list[Any]]] = {
    Register: {
        **_COMMON,
        "start": _ints(0, MAX_LAYERS - 1),
        "end": _ints(1, MAX_LAYERS),
        "num_layers": _ints(1, MAX_LAYERS),
        "capacity": _ints(1, MAX_SESSIONS),
        "max_kv_tokens": _ints(1, 1 << 40),
        "context": _ints(1, MAX_CONTEXT),
        "version": _texts(32),
        "fingerprint": _texts(128),
        "model": _maps("k"),
        "host": _NAMES,
        "pid": _ints(0, (1 << 31) - 1),
        "dtype": _texts(16),
        "device": _texts(32),
        "prefill_chunk": _ints(0, MAX_CONTEXT),
        "served": _without(_NAMES, ""),
        "text_model": _FLAGS,
        "peer": _ENDPOINTS,
        "build": _maps("torch"),
        "measured": _maps("ms_1"),
        "proposes": _FLAGS,
    },
    Registered: {**_COMMON, "worker_id": _NAMES, "boot": _texts(64)},
    Place: {
        **_COMMON,
        "served": _NAMES,
        "num_layers": _ints(1, MAX_LAYERS),
        "fingerprint": _texts(128),
        "figures": _maps("ms_1"),
        "hold": _FLAGS,
    },
    Placed: {
        **_COMMON,
        "start": _ints(0, MAX_LAYERS - 1),
        "end": _ints(1, MAX_LAYERS),
        "why": _texts(MAX_TEXT),
    },
    Refused: {**_COMMON, "reason": _texts(MAX_TEXT)},
    Disconnect: {**_COMMON, "reason": _texts(MAX_TEXT)},
    Heartbeat: {
        **_COMMON,
        "boot": _without(_texts(64), None),
        "load": _without(_maps("sessions"), None),
        "draining": _FLAGS,
    },
    Open: {
        **_SESSION,
        "max_tokens": _ints(1, MAX_CONTEXT),
        "prompt_len": _ints(1, MAX_CONTEXT),
        "sampling": [
            None,
            5,
            [],
            "greedy",
            {"temperature": -1},
            {"temperature": NAN},
            {"temperature": INF},
            {"temperature": "0"},
            {"temperature": True},
            {"top_p": 0},
            {"top_p": 1.5},
            {"top_k": -1},
            {"top_k": 1.5},
            {"seed": -1},
            {"seed": 2**63},
            {"presence_penalty": 2.5},
            {"frequency_penalty": NAN},
            {"frequency_penalty": "1"},
            {"grammar": 5},
            {"grammar": "x" * (12 * 1024 + 1)},
            {"bogus": 1},
        ],
        "stop_ids": [None, 5, "12", [1.5], [-1], [MAX_TOKEN_ID + 1], [True], [0] * 4097],
        "stage": _ints(0, MAX_LAYERS),
        "stages": _ints(0, MAX_LAYERS),
        "max_len": _ints(0, 2 * MAX_CONTEXT),
        "next": _without(_NAMES, ""),
        # More tokens than the prompt, or ids out of range.
        "generated": [None, 5, [-1], [MAX_TOKEN_ID + 1], [1.5], [1, 2, 3, 4]],
        # A key out of range, a key of another type, more keys than the prompt has blocks.
        "prefix": [None, 5, [-1], [MAX_PREFIX_KEY + 1], [1.5], [True], ["k"], [1]],
        "model": _without(_NAMES, ""),
        "next_peer": _ENDPOINTS,
        "next_key": _KEYS,
        "prev": _without(_NAMES, ""),
        "prev_key": _KEYS,
        "build": [None, *_BUILDS],
        "speculative": _FLAGS,
    },
    Ask: {
        **_SESSION,
        "model": _without(_NAMES, ""),
        "kind": [None, 5, "CHAT", "image", [], ""],
        "max_tokens": _ints(1, MAX_CONTEXT),
    },
    Delta: {
        **_SESSION,
        "text": _texts(MAX_DELTA),
        "finish": _without(_texts(32), None),
        "prompt_tokens": _without(_ints(0, MAX_CONTEXT), None),
        "completion_tokens": _without(_ints(0, MAX_CONTEXT), None),
        "route": [5, "w-1", [5], ["a b"], [""], [None], ["w"] * (MAX_LAYERS + 1)],
        "boot": _without(_texts(64), None),
    },
    Cached: {**_SESSION, "tokens": _ints(0, MAX_CONTEXT)},
    Step: {**_SESSION, "token": _ints(0, MAX_TOKEN_ID), "group": _GROUPS, "draft": _DRAFTS},
    Activation: {**_SESSION, "final": _FLAGS, "group": _GROUPS, "prefix": _ints(0, MAX_CONTEXT)},
    Token: {
        **_SESSION,
        "token": _ints(0, MAX_TOKEN_ID),
        "finish": [5, True, "STOP", "eos", ["stop"], ""],
        "group": _GROUPS,
        "stepped": _FLAGS,
        "route": [5, "w-1", [5], ["a b"], [""], [None], ["w"] * (MAX_LAYERS + 1)],
        "boot": _without(_texts(64), None),
        "build": _BUILDS,
        # A token with more of its pass to follow has no finish (the example has one).
        "more": [*_FLAGS, True],
        "draft": _DRAFTS,
        # Alone, or one id too many: the two lists come together and alike long.
        "logprob_ids": [5, "x", [-1], [1.5], [True], [0] * 22, [5, 5], [5, 5, 7, 8], None],
        "logprobs": [
            5,
            [0.5, 0, 0],
            [NAN, 0, 0],
            [-INF, 0, 0],
            [-1e9, 0, 0],
            ["x", 0, 0],
            [True, 0, 0],
            [-1.0] * 22,
            [-1.0],
            None,
        ],
    },
    Close: _SESSION,
    Cancel: _SESSION,
    Error: {
        **_COMMON,
        "code": [None, 5, "BUSY", "nope", ["busy"], ""],
        "message": _texts(MAX_TEXT),
        "session": _without(_IDS, ""),
        "attempt": _ints(0, MAX_ATTEMPTS),
    },
    Status: _COMMON,
    StatusReply: _COMMON,
}


def _head(msg: Message) -> tuple[dict[str, Any], list[bytes]]:
    frames = encode(msg)
    return msgpack.unpackb(frames[0], raw=False), [bytes(f) for f in frames[1:]]


def _decode_with(msg: Message, **changes: Any) -> Message:
    head, payloads = _head(msg)
    head.update(changes)
    return decode([msgpack.packb(head, use_bin_type=True), *payloads])


def test_examples_are_valid_and_bad_values_cover_every_field() -> None:
    for cls, msg in EXAMPLES.items():
        assert type(msg) is cls
        assert_same_message(decode(encode(msg)), msg)
        header_fields = {f for f, spec in cls.wire_fields() if not spec.is_payload}
        assert set(BAD[cls]) == header_fields, cls.__name__


_BAD_CASES = [
    pytest.param(cls, fname, value, id=f"{cls.__name__}.{fname}-{i}")
    for cls, table in BAD.items()
    for fname, values in table.items()
    for i, value in enumerate(values)
]


@pytest.mark.parametrize(("cls", "fname", "value"), _BAD_CASES)
def test_each_field_wrong_type_or_range_is_named(
    cls: type[Message], fname: str, value: Any
) -> None:
    with pytest.raises(ProtocolError, match=f"'{fname}'"):
        _decode_with(EXAMPLES[cls], **{fname: value})


_REQUIRED = [
    pytest.param(cls, f.name, id=f"{cls.__name__}.{f.name}")
    for cls in MESSAGE_TYPES.values()
    for f in dataclasses.fields(cls)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
]


@pytest.mark.parametrize(("cls", "fname"), _REQUIRED)
def test_missing_required_field_is_named(cls: type[Message], fname: str) -> None:
    head, payloads = _head(EXAMPLES[cls])
    if fname in head:
        del head[fname]
    else:  # a payload: drop its frame and its tensor spec
        head["tensors"], payloads = [], []
    with pytest.raises(ProtocolError, match=f"missing: .*{fname}"):
        decode([msgpack.packb(head, use_bin_type=True), *payloads])


def test_optional_fields_default_when_absent_and_unknown_keys_are_ignored() -> None:
    head = {"v": PROTOCOL_VERSION, "type": "token", "session": "s", "token": 3}
    head["from_a_newer_peer"] = {"nested": [1, 2.5, "x"]}
    got = decode([msgpack.packb(head)])
    assert got == Token(session="s", token=3)
    assert (got.request_id, got.attempt, got.step, got.finish, got.route) == ("", 0, 0, None, None)
    assert decode([msgpack.packb({"v": PROTOCOL_VERSION, "type": "status"})]) == Status()


def test_optional_fields_accept_nil() -> None:
    got = _decode_with(
        EXAMPLES[Token],
        finish=None,
        group=None,
        route=None,
        boot=None,
        build=None,
        logprob_ids=None,
        logprobs=None,
    )
    assert got == Token(session="s", token=5, stepped=True)
    assert _decode_with(EXAMPLES[Heartbeat], load=None, boot=None) == Heartbeat()


@pytest.mark.parametrize("finish", list(Finish))
def test_finish_decodes_to_the_enum(finish: Finish) -> None:
    got = _decode_with(EXAMPLES[Token], finish=finish.value)
    assert isinstance(got, Token)
    assert got.finish is finish


def test_heartbeat_load_keeps_only_known_statistics() -> None:
    got = _decode_with(EXAMPLES[Heartbeat], load={"sessions": 2, "from_the_future": [1]})
    assert isinstance(got, Heartbeat)
    assert got.load == {"sessions": 2}


def test_sampling_decodes_to_params() -> None:
    got = _decode_with(EXAMPLES[Open], sampling={"temperature": 1, "top_k": 5})
    assert isinstance(got, Open)
    assert got.sampling == SamplingParams(temperature=1.0, top_k=5)


# ---------------------------------------------------------------- ids


@pytest.mark.parametrize("good", ["s", "A-z_09", "x" * 64, "-", "_"])
def test_ids_of_64_safe_characters(good: str) -> None:
    assert is_valid_id(good)
    assert _decode_with(EXAMPLES[Step], session=good, request_id=good) == Step(
        session=good, request_id=good, token=5, group=("g", 1)
    )


@pytest.mark.parametrize("bad", ["", "x" * 65, "a.b", "a b", "é", "a/b", "a\x00", 5, None])
def test_ids_refused(bad: Any) -> None:
    assert not is_valid_id(bad)


def test_retry_attempt_travels_as_its_own_field() -> None:
    # A 64-character id stays legal on its last retry: nothing is appended to it.
    got = _decode_with(EXAMPLES[Close], session="x" * 64, attempt=MAX_ATTEMPTS)
    assert isinstance(got, Close)
    assert (got.session, got.attempt) == ("x" * 64, MAX_ATTEMPTS)


# ---------------------------------------------------------------- checks across fields


@pytest.mark.parametrize(("start", "end", "num_layers"), [(2, 2, 4), (3, 1, 4), (0, 5, 4)])
def test_register_layer_range_inside_the_model(start: int, end: int, num_layers: int) -> None:
    with pytest.raises(ProtocolError, match="layers"):
        _decode_with(EXAMPLES[Register], start=start, end=end, num_layers=num_layers)


def test_register_whole_model() -> None:
    got = _decode_with(EXAMPLES[Register], start=0, end=MAX_LAYERS, num_layers=MAX_LAYERS)
    assert isinstance(got, Register)
    assert got.end == MAX_LAYERS


@pytest.mark.parametrize("prompt_len", [1, 2, 4, MAX_CONTEXT])
def test_open_token_ids_must_match_prompt_len(prompt_len: int) -> None:
    with pytest.raises(ProtocolError, match="prompt_len"):
        _decode_with(EXAMPLES[Open], prompt_len=prompt_len)


def test_open_without_token_ids_is_a_later_stage() -> None:
    msg = dataclasses.replace(EXAMPLES[Open], tokens=None, prompt_len=MAX_CONTEXT, stage=1)
    assert_same_message(decode(encode(msg)), msg)


def _with_payload(msg: Message, dtype: str, shape: list[int], raw: bytes) -> Message:
    head, _ = _head(msg)
    head["tensors"] = [[dtype, shape]]
    return decode([msgpack.packb(head, use_bin_type=True), raw])


_BAD_PAYLOADS = [
    (Open, "tokens", "int64", [3]),
    (Open, "tokens", "float32", [3]),
    (Open, "tokens", "int32", [1, 3]),
    (Open, "tokens", "int32", []),
    (Activation, "hidden", "float32", [0, 4]),  # 0 rows: a forward of nothing
    (Activation, "hidden", "float32", [8]),
    (Activation, "hidden", "float32", [1, 2, 4]),
    (Activation, "hidden", "int32", [2, 4]),
    (Activation, "hidden", "uint8", [2, 4]),
    (StatusReply, "body", "float32", [2]),
    (StatusReply, "body", "uint8", [2, 2]),
]


@pytest.mark.parametrize(("cls", "fname", "dtype", "shape"), _BAD_PAYLOADS)
def test_payload_of_wrong_dtype_or_shape_is_named(
    cls: type[Message], fname: str, dtype: str, shape: list[int]
) -> None:
    from zmqllm.bus.wire_types import WIRE_DTYPES

    raw = bytes(int(np.prod(shape)) * WIRE_DTYPES[dtype].itemsize)
    with pytest.raises(ProtocolError, match=f"'{fname}'"):
        _with_payload(EXAMPLES[cls], dtype, shape, raw)


def test_activation_of_one_row() -> None:
    got = _with_payload(EXAMPLES[Activation], "bfloat16", [1, 3], bytes(6))
    assert isinstance(got, Activation)
    assert got.hidden.array.shape == (1, 3)
    assert got.hidden.dtype == "bfloat16"


def test_a_payload_for_a_type_without_one_is_refused() -> None:
    with pytest.raises(ProtocolError, match="too many payload frames"):
        _with_payload(EXAMPLES[Step], "uint8", [1], b"\x00")


# ---------------------------------------------------------------- errors


def test_error_of_cuts_its_message_to_fit() -> None:
    err = Error.of(ErrorCode.TIMEOUT, "x" * (MAX_TEXT * 3), session="s", attempt=2)
    got = decode(encode(err))
    assert isinstance(got, Error)
    assert got.message == "x" * MAX_TEXT
    assert (got.code, got.session, got.attempt) == (ErrorCode.TIMEOUT, "s", 2)


def test_session_error_carries_its_code() -> None:
    err = SessionError("slow_consumer", "did not read")
    assert err.code is ErrorCode.SLOW_CONSUMER
    assert err.message == "did not read"
    assert str(err) == "slow_consumer: did not read"
    with pytest.raises(ValueError):
        SessionError("nope", "x")


def test_error_codes_are_lowercase_names() -> None:
    assert all(c.value == c.name.lower() for c in ErrorCode)


# ---------------------------------------------------------------- status replies


def _status(workers: int) -> dict[str, Any]:
    """What the broker reports, at the size of a large deployment."""
    return {
        "sessions": 3,
        "queue": 1,
        "boot": "b",
        "workers": [
            {
                "id": f"host-{i}.example/12345-{i}",
                "layers": [i % 32, i % 32 + 1],
                "sessions": i % 7,
                "kv_tokens_reserved": 4096 * i,
                "draining": i % 2 == 0,
                "info": {"host": f"host-{i}.example", "pid": 10000 + i},
                "stats": {"mean_batch": 1.5, "rss_bytes": 2**33},
            }
            for i in range(workers)
        ],
    }


@pytest.mark.parametrize("workers", [0, 1, 500])
def test_status_reply_round_trip(workers: int) -> None:
    status = _status(workers)
    got = decode([bytes(f) for f in encode(StatusReply.of(status, request_id="r"))])
    assert isinstance(got, StatusReply)
    assert got.request_id == "r"
    assert got.status() == status


def _reply(raw: bytes) -> StatusReply:
    return StatusReply(body=Payload(np.frombuffer(raw, np.uint8), "uint8"))


_BAD_STATUS = {
    "empty": b"",
    "not msgpack": b"\xc1",
    "truncated": msgpack.packb({"sessions": 1})[:-1],
    "trailing bytes": msgpack.packb({"sessions": 1}) + b"\x00",
    "not a map": msgpack.packb([1, 2]),
    "non-str key": msgpack.packb({1: 2}),
    "ext type": msgpack.packb({"x": msgpack.ExtType(1, b"ab")}),
    "nested too deep": b"\x91" * 100_000 + b"\xc0",
    "huge declared array": b"\x81\xa1x\xdd\x7f\xff\xff\xff",
    "huge declared str": b"\x81\xa1x\xdb\x7f\xff\xff\xff",
    "over the limit": msgpack.packb({"x": b"\x00" * MAX_STATUS_BYTES}),
}


@pytest.mark.parametrize("case", list(_BAD_STATUS))
def test_status_reply_body_within_limits(case: str) -> None:
    got = decode(encode(_reply(_BAD_STATUS[case])))
    assert isinstance(got, StatusReply)
    with pytest.raises(ProtocolError, match="status"):
        got.status()


def test_a_step_carries_its_proposals_and_a_token_its_next_ones() -> None:
    token = Token(session="s", step=4, token=7, draft=(8, 9), group=("g", 1))
    assert decode(encode(token)) == token
    step = Step.following(token, "r")
    assert (step.step, step.token, step.draft, step.group) == (5, 7, (8, 9), ("g", 1))
    assert decode(encode(step)) == step
    # A token with more of its pass to follow: no finish, no proposals, no step.
    more = Token(session="s", step=3, token=6, more=True)
    assert decode(encode(more)) == more
    for bad in ({"draft": [1]}, {"stepped": True}, {"finish": "stop"}):
        with pytest.raises(ProtocolError, match="more"):
            _decode_with(more, **bad)


def test_speculation_defaults_keep_older_peers_working() -> None:
    head = {"v": PROTOCOL_VERSION, "type": "step", "session": "s", "token": 3}
    assert decode([msgpack.packb(head)]).draft == ()
    assert EXAMPLES[Open].speculative is True
    assert EXAMPLES[Register].proposes is False
