"""Valid messages of every type, with random and absurd values: what the hostile message
generator (``fuzz.py``) sends as is and corrupts.

``valid_message(rng, sessions)`` builds a message of a type drawn by weight (what peers
send most, and what reaches the sessions under attack, comes most often), each field
within its wire check but otherwise absurd: bogus layer ranges and huge models, contexts
of millions, ids past any vocabulary, thousands of stop ids, half the session ids those
under attack. ``valid_parts`` gives a valid message's header map and payload frames to
corrupt. ``pick``, ``chance``, ``chars``, ``weighted`` and ``random_value`` draw the
random values, cheaply: they run millions of times. numpy and msgpack only: no torch, no
sockets.
"""

from __future__ import annotations

import json
import math
import string
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from zmqllm.bus.figure_keys import FIGURE_KEYS
from zmqllm.bus.messages import (
    MAX_ATTEMPTS,
    MAX_CONTEXT,
    MAX_LAYERS,
    MAX_SESSIONS,
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
    Open,
    Place,
    Placed,
    Refused,
    Register,
    Registered,
    Status,
    StatusReply,
    Step,
    Token,
)
from zmqllm.bus.prefix import PREFIX_BLOCK, prefix_blocks
from zmqllm.bus.protocol import encode
from zmqllm.bus.sampling_params import SamplingParams
from zmqllm.bus.wire_types import WIRE_DTYPES, Payload
from zmqllm.config.settings import MAX_DRAFT_TOKENS
from zmqllm.version import __version__

__all__ = [
    "FIELD_NAMES",
    "FLOATS",
    "ID_CHARS",
    "Frames",
    "Rng",
    "chance",
    "chars",
    "frames_of",
    "pack_header",
    "pick",
    "random_value",
    "valid_message",
    "valid_open",
    "valid_parts",
    "weighted",
]

Rng = np.random.Generator
Frames = list[bytes]

ID_CHARS = string.ascii_letters + string.digits + "_-"
_NAME_CHARS = "".join(chr(c) for c in range(0x21, 0x7F))
FLOATS = ("float32", "float16", "bfloat16")


# ---------------------------------------------------------------- random values


def pick(rng: Rng, items: Any) -> Any:
    # rng.random() costs a tenth of rng.integers(): this runs millions of times.
    return items[int(rng.random() * len(items))]


def chance(rng: Rng, p: float) -> bool:
    return bool(rng.random() < p)


def chars(rng: Rng, alphabet: str, lo: int, hi: int) -> str:
    """lo..hi characters of an ASCII alphabet (one numpy lookup: this runs 10**5 times)."""
    table = np.frombuffer(alphabet.encode("ascii"), np.uint8)
    idx = rng.integers(0, len(table), lo + int(rng.random() * (hi - lo + 1)))
    return table[idx].tobytes().decode("ascii")


def weighted(rng: Rng, cumulative: np.ndarray) -> int:
    """An index drawn with the weights whose normalised cumulative sums are given
    (Generator.choice with p= costs ten times as much)."""
    return min(int(np.searchsorted(cumulative, rng.random(), side="right")), len(cumulative) - 1)


def _ident(rng: Rng) -> str:
    return chars(rng, ID_CHARS, 1, 64)


def _name(rng: Rng) -> str:
    return chars(rng, _NAME_CHARS, 1, 40)


def _session(rng: Rng, sessions: list[str]) -> str:
    """Half the time one of the sessions under attack, else one nobody opened."""
    if sessions and chance(rng, 0.5):
        return str(pick(rng, sessions))
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
        return pick(rng, [0, -1, 1, 2**31, 2**32, 2**63, 2**64 - 1, -(2**63), MAX_TOKEN_ID + 1])
    if kind == 4:
        return pick(rng, [float("nan"), float("inf"), -float("inf"), -0.0, 1e308, 5e-324, 0.5])
    if kind == 5:
        return chars(rng, _NAME_CHARS + " \x00\n", 0, 80) + pick(rng, ["", "é", "\u2028"])
    if kind == 6:
        return rng.bytes(int(rng.integers(0, 40)))
    if kind == 7:
        return pick(rng, sorted(MESSAGE_TYPES) + sorted(WIRE_DTYPES) + ["", "STEP", "uint16"])
    if kind == 8:
        return msgpack.ExtType(int(rng.integers(0, 128)), b"")  # max_ext_len=0 lets it through
    if kind == 9:
        return chars(rng, ID_CHARS, 60, 70)  # ids around their 64-character bound
    if kind == 10:
        return float(rng.standard_normal() * 1e6)
    return int(rng.integers(0, 1 << 20))


def random_value(rng: Rng, depth: int = 0) -> Any:
    """A random msgpack value, nested lists and maps included."""
    kind = int(rng.integers(10)) if depth < 4 else 0
    if kind == 8:
        return [random_value(rng, depth + 1) for _ in range(int(rng.integers(0, 6)))]
    if kind == 9:
        n = int(rng.integers(0, 6))
        keys = [pick(rng, FIELD_NAMES) if chance(rng, 0.5) else _name(rng) for _ in range(n)]
        return {k: random_value(rng, depth + 1) for k in keys}
    return _scalar(rng)


def _array(rng: Rng, dtype: str, shape: tuple[int, ...]) -> Payload:
    """Random bits of the given wire dtype (NaNs and infinities among the floats)."""
    wire = WIRE_DTYPES[dtype]
    raw = rng.bytes(math.prod(shape) * wire.itemsize)
    return Payload(np.frombuffer(raw, wire).reshape(shape), dtype)


# ---------------------------------------------------------------- valid messages


def _register(rng: Rng, sessions: list[str]) -> Register:
    # Bogus ranges, huge models, many distinct ranges, fingerprints of no real model.
    num_layers = int(pick(rng, [4, 4, 32, int(rng.integers(1, MAX_LAYERS + 1)), MAX_LAYERS]))
    start = int(rng.integers(0, num_layers))
    end = int(rng.integers(start + 1, num_layers + 1))
    return Register(
        request_id=pick(rng, ["", _ident(rng)]),
        start=start,
        end=end,
        num_layers=num_layers,
        capacity=int(pick(rng, [1, 8, MAX_SESSIONS])),
        max_kv_tokens=int(pick(rng, [1, 4096, 1 << 40])),
        context=int(pick(rng, [1, 2048, MAX_CONTEXT])),
        version=pick(rng, [__version__, "9.9.9", ""]),
        fingerprint=rng.bytes(16).hex(),
        model={"hidden_size": int(rng.integers(1, 1 << 16)), "num_layers": num_layers},
        host=_name(rng),
        pid=int(rng.integers(0, 1 << 31)),
        dtype=pick(rng, ["float32", "bfloat16", "float16", "int8"]),
        device=pick(rng, ["cpu", "cuda:0", "mps"]),
        # Models of any name, most of them new: the registry's cap on models.
        served=pick(rng, ["", "tiny", _name(rng)]),
        proposes=chance(rng, 0.5),
    )


def _heartbeat(rng: Rng, sessions: list[str]) -> Heartbeat:
    load = {k: pick(rng, [0, 1, 2**40, 0.5, True, "x"]) for k in sorted(FIGURE_KEYS)[:8]}
    return Heartbeat(
        boot=pick(rng, [None, _ident(rng)]),
        load=pick(rng, [None, load]),
        draining=chance(rng, 0.5),
    )


def valid_open(rng: Rng, sessions: list[str]) -> Open:
    # Absurd sizes: contexts of millions, ids past any vocabulary, thousands of stop ids.
    tokens = None
    if chance(rng, 0.6):
        n = int(pick(rng, [1, 8, 256, 2048]))
        ids = rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32)
        if chance(rng, 0.5):
            ids = rng.integers(0, 64, n, dtype=np.int32)
        tokens = Payload(ids, "int32")
        prompt_len = n
    else:
        prompt_len = int(pick(rng, [1, 4096, MAX_CONTEXT]))
    return Open(
        request_id=_ident(rng),
        session=_session(rng, sessions),
        attempt=int(pick(rng, [0, 0, 1, MAX_ATTEMPTS])),
        max_tokens=int(pick(rng, [1, 16, MAX_CONTEXT])),
        prompt_len=prompt_len,
        sampling=SamplingParams(
            temperature=float(pick(rng, [0.0, 1.0, 1e6])),
            top_p=float(pick(rng, [1.0, 1e-9])),
            top_k=int(pick(rng, [0, 1, 2**63 - 1])),
            seed=int(rng.integers(0, 2**63 - 1)),
        ),
        stop_ids=tuple(rng.integers(0, MAX_TOKEN_ID, int(pick(rng, [0, 4096]))).tolist()),
        stage=int(rng.integers(0, 4)),
        stages=int(pick(rng, [0, 2, MAX_LAYERS])),
        max_len=int(pick(rng, [0, 2 * MAX_CONTEXT])),
        next=pick(rng, ["", _name(rng)]),
        tokens=tokens,
        # Keys that may name blocks some stage holds, or none.
        prefix=tuple(int(k) for k in rng.integers(0, 1 << 62, min(prefix_blocks(prompt_len), 64)))
        if chance(rng, 0.5)
        else (),
        # A replay's route build: none, one no worker has, or hops that chain nowhere.
        build=pick(rng, [(), (), _BUILDS[0], _BUILDS[1], _BUILDS[2], _BUILDS[3]]),
        speculative=chance(rng, 0.8),
    )


_BUILDS = [
    ("0:4:0123456789ab",),
    ("0:2:0123456789ab", "2:4:ba9876543210"),
    ("0:2:0123456789ab", "3:4:0123456789ab"),
    ("0:4:0123456789AB", "x" * 22),
]


# The remote model the fuzzing benchmark serves beside the tiny one.
REMOTE_MODEL = "remote-fuzz"


def _ask(rng: Rng, sessions: list[str]) -> Ask:
    # JSON that is no request, requests with fields of every wrong type, huge ones.
    body = pick(
        rng,
        [
            b"{}",
            b"not json",
            # Whole requests (the remote worker forwards them), some with stop strings.
            b'{"messages": [{"role": "user", "content": "hi"}]}',
            b'{"prompt": "once", "stop": ["x"], "seed": 3}',
            b"[1, 2]",
            json.dumps(
                {"messages": [{"role": "user", "content": "hi"}], "temperature": 1e9}
            ).encode(),
            json.dumps(
                {"prompt": random_value(rng), "stop": random_value(rng)}, default=repr
            ).encode(),
            rng.bytes(int(rng.integers(0, 4096))),
        ],
    )
    return Ask(
        **_session_fields(rng, sessions),
        model=pick(rng, ["", "tiny", REMOTE_MODEL, REMOTE_MODEL, _name(rng)]),
        kind=pick(rng, list(AskKind)),
        max_tokens=int(pick(rng, [1, 16, MAX_CONTEXT])),
        body=Payload(np.frombuffer(body, np.uint8), "uint8"),
    )


def _delta(rng: Rng, sessions: list[str]) -> Delta:
    return Delta(
        **_session_fields(rng, sessions),
        text=chars(rng, _NAME_CHARS + " ", 0, 64),
        finish=pick(rng, [None, None, "stop", "length", "x" * 32]),
        prompt_tokens=pick(rng, [None, 0, MAX_CONTEXT]),
        completion_tokens=pick(rng, [None, 3]),
        route=pick(rng, [None, (_name(rng),)]),
        boot=pick(rng, [None, _ident(rng)]),
    )


def _group(rng: Rng) -> tuple[str, int] | None:
    return pick(rng, [None, (_ident(rng), int(rng.integers(1, MAX_SESSIONS + 1)))])


def _session_fields(rng: Rng, sessions: list[str]) -> dict[str, Any]:
    return {
        "request_id": pick(rng, ["", _ident(rng)]),
        "session": _session(rng, sessions),
        "attempt": int(pick(rng, [0, 0, 0, 1, 2, MAX_ATTEMPTS])),
        "step": int(pick(rng, [0, 1, int(rng.integers(0, 1 << 20))])),
    }


def _step(rng: Rng, sessions: list[str]) -> Step:
    token = int(pick(rng, [0, 1, int(rng.integers(0, 1 << 16)), MAX_TOKEN_ID]))
    return Step(**_session_fields(rng, sessions), token=token, group=_group(rng), draft=_draft(rng))


def _draft(rng: Rng) -> tuple[int, ...]:
    """Proposals (speculative decoding): none, a few, the most, ids past any vocabulary."""
    most = tuple(int(t) for t in rng.integers(0, 1 << 16, MAX_DRAFT_TOKENS))
    return pick(rng, [(), (), (3, 4), most, (MAX_TOKEN_ID,)])


def _activation(rng: Rng, sessions: list[str]) -> Activation:
    shape = (int(rng.integers(1, 9)), int(pick(rng, [1, 64, int(rng.integers(0, 257))])))
    return Activation(
        **_session_fields(rng, sessions),
        final=chance(rng, 0.5),
        group=_group(rng),
        prefix=int(pick(rng, [0, 0, 0, PREFIX_BLOCK, int(rng.integers(0, MAX_CONTEXT))])),
        hidden=_array(rng, pick(rng, FLOATS), shape),
    )


def _token(rng: Rng, sessions: list[str]) -> Token:
    finish = pick(rng, [None, None, Finish.STOP, Finish.LENGTH])
    more = finish is None and chance(rng, 0.3)  # more tokens of its pass follow
    return Token(
        **_session_fields(rng, sessions),
        token=int(pick(rng, [0, 2, int(rng.integers(0, 1 << 16)), MAX_TOKEN_ID])),
        finish=finish,
        more=more,
        draft=() if more or finish else _draft(rng),
        group=_group(rng),
        route=pick(rng, [None, (_name(rng), _name(rng))]),
        boot=pick(rng, [None, _ident(rng)]),
        build=pick(rng, [None, _BUILDS[1]]),
        **pick(rng, [{}, {"logprob_ids": (1, 1, 2), "logprobs": (-0.5, -0.5, -1.25)}]),
    )


def _error(rng: Rng, sessions: list[str]) -> Error:
    return Error(
        code=pick(rng, list(ErrorCode)),
        message=chars(rng, _NAME_CHARS + " ", 0, 200),
        session=pick(rng, ["", _session(rng, sessions)]),
        attempt=int(pick(rng, [0, 1])),
    )


def _status_reply(rng: Rng, sessions: list[str]) -> StatusReply:
    if chance(rng, 0.5):
        return StatusReply.of({"sessions": 0, "workers": [random_value(rng) for _ in range(3)]})
    return StatusReply(body=_array(rng, "uint8", (int(rng.integers(0, 512)),)))


def _place(rng: Rng, sessions: list[str]) -> Place:
    # Figures of no real machine: zero and huge speeds, memory for nothing or for all.
    return Place(
        served=pick(rng, ["tiny", _name(rng)]),
        num_layers=int(pick(rng, [4, 32, MAX_LAYERS])),
        fingerprint=rng.bytes(8).hex(),
        figures={
            "ms_1": float(pick(rng, [0.0, 0.5, 1e9])),
            "ms_16": float(pick(rng, [0.0, 2.0, 1e9])),
            "memory_bytes": int(pick(rng, [0, 1 << 30, 1 << 50])),
            "layer_bytes": int(pick(rng, [0, 1 << 20])),
            "first_bytes": 0,
            "last_bytes": 0,
            "runtime_bytes": 0,
        },
        hold=chance(rng, 0.5),
    )


def _placed(rng: Rng, sessions: list[str]) -> Placed:
    start = int(rng.integers(0, 31))
    return Placed(start=start, end=int(rng.integers(start + 1, 33)))


_BUILDERS: dict[type[Message], Callable[[Rng, list[str]], Message]] = {
    Place: _place,
    Placed: _placed,
    Register: _register,
    Registered: lambda rng, s: Registered(worker_id=_name(rng), boot=_ident(rng)),
    Refused: lambda rng, s: Refused(reason=chars(rng, _NAME_CHARS, 0, 100)),
    Disconnect: lambda rng, s: Disconnect(reason=chars(rng, _NAME_CHARS, 0, 100)),
    Heartbeat: _heartbeat,
    Open: valid_open,
    Ask: _ask,
    Delta: _delta,
    Cached: lambda rng, s: Cached(
        **_session_fields(rng, s), tokens=int(pick(rng, [0, PREFIX_BLOCK, MAX_CONTEXT]))
    ),
    Step: _step,
    Activation: _activation,
    Token: _token,
    Close: lambda rng, s: Close(**_session_fields(rng, s)),
    Cancel: lambda rng, s: Cancel(**_session_fields(rng, s)),
    Error: _error,
    Status: lambda rng, s: Status(request_id=pick(rng, ["", _ident(rng)])),
    StatusReply: _status_reply,
}
# How often each type is sent as a valid message: what peers send most, and what reaches
# the sessions under attack, comes most often (STATUS spam, foreign CANCELs).
_VALID_WEIGHTS: dict[type[Message], float] = {
    Place: 1,
    Placed: 1,
    Register: 3,
    Registered: 1,
    Refused: 1,
    Disconnect: 1,
    Heartbeat: 2,
    Open: 3,
    Ask: 2,
    Delta: 2,
    Cached: 2,
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
FIELD_NAMES = sorted(
    {"v", "type", "tensors"} | {n for cls in MESSAGE_TYPES.values() for n, _ in cls.wire_fields()}
)


def valid_message(rng: Rng, sessions: list[str], cls: type[Message] | None = None) -> Message:
    cls = cls or _TYPES[weighted(rng, _TYPE_CUM)]
    return _BUILDERS[cls](rng, sessions)


def frames_of(msg: Message) -> Frames:
    return [bytes(f) for f in encode(msg)]


def pack_header(head: Any) -> bytes:
    packed: bytes = msgpack.packb(head, use_bin_type=True)
    return packed


def valid_parts(rng: Rng, sessions: list[str], cls: type[Message] | None = None) -> Any:
    """A valid message's header map and payload frames, to corrupt."""
    frames = frames_of(valid_message(rng, sessions, cls))
    return msgpack.unpackb(frames[0], raw=False), frames[1:]
