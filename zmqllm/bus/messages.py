"""One frozen dataclass per wire message type, each field with its wire check.

``Message.from_wire`` is the one place where what a peer sent becomes a typed value: every
field's type and range, optional fields included, then the checks that span fields
(``_validate``). Decoding is ``protocol.decode``; this module only describes.

    type          sender -> receiver                    payloads
    ------------  ------------------------------------  ------------------------------
    PLACE         worker -> broker (--layers auto: its measured figures, before it loads)
    PLACED        broker -> worker (the layer range it should load)
    REGISTER      worker -> broker
    REGISTERED    broker -> worker
    REFUSED       broker -> worker
    HEARTBEAT     both ways
    DISCONNECT    either way (a worker leaving; the broker asking it to register again)
    OPEN          client -> broker -> each stage        stage 0: int32 token ids [prompt_len]
    ASK           client -> broker -> a text worker     uint8: the request, JSON
    CACHED        stage k>0 -> broker -> stage 0
    STEP          broker or the last stage -> stage 0
    ACTIVATION    worker -> (broker ->) next worker     hidden states [rows, hidden]
    TOKEN         last stage -> broker -> client
    DELTA         text worker -> broker -> client
    CLOSE         broker -> each stage
    CANCEL        client -> broker
    ERROR         any -> the peer it answers
    STATUS        client -> broker
    STATUS_REPLY  broker -> client                      uint8: the status, msgpack
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import msgpack
import numpy as np

from zmqllm.bus.figure_keys import FIGURE_KEYS, MEASURED_KEYS
from zmqllm.bus.prefix import MAX_PREFIX_BLOCKS, MAX_PREFIX_KEY, prefix_blocks
from zmqllm.bus.sampling_params import LOGPROB_FLOOR, MAX_LOGPROBS, SamplingParams
from zmqllm.bus.wire_types import (
    Payload,
    ProtocolError,
    WireField,
    curve_key,
    endpoint,
    flag,
    group,
    ident,
    int_list,
    integer,
    name,
    number_list,
    one_of,
    optional,
    scalar_map,
    str_list,
    tensor,
    text,
    wire,
)
from zmqllm.config.settings import MAX_DRAFT_TOKENS

__all__ = [
    "MAX_CONTEXT",
    "MAX_LAYERS",
    "MAX_TOKEN_ID",
    "MESSAGE_TYPES",
    "Activation",
    "Ask",
    "AskKind",
    "Cached",
    "Cancel",
    "Close",
    "Delta",
    "Disconnect",
    "Error",
    "ErrorCode",
    "Heartbeat",
    "Message",
    "MsgType",
    "Open",
    "Place",
    "Placed",
    "Refused",
    "Register",
    "Registered",
    "SessionError",
    "SessionMessage",
    "Status",
    "StatusReply",
    "Step",
    "Token",
]

MAX_LAYERS = 1024  # the deepest open models have ~130 decoder layers
MAX_CONTEXT = 1 << 22  # tokens in one session: prompt + answer
MAX_TOKEN_ID = (1 << 31) - 1  # int32 on the wire; the worker checks its vocabulary
MAX_SESSIONS = 1 << 16  # one worker's concurrent sessions
MAX_ATTEMPTS = 1000  # routes one request may be tried on
MAX_STEP = MAX_CONTEXT
MAX_STATUS_BYTES = 4 << 20
# Tokens a replayed stream's last stage is given to restore its penalties and grammar
# (what fits in a header): a constrained stream past it cannot be replayed.
MAX_GENERATED = 8192
MAX_TEXT = 1024  # reasons and error messages
# Characters in one DELTA: at 4 UTF-8 bytes each they stay under protocol.py's
# MAX_HEADER_STR_LEN (16 KiB), the longest string a header may hold.
MAX_DELTA = 4000
MAX_ASK_BYTES = 4 << 20  # a text session's request: its messages as JSON


class MsgType(str, enum.Enum):
    """Message types; the wire value is the lowercase name."""

    PLACE = "place"
    PLACED = "placed"
    REGISTER = "register"
    REGISTERED = "registered"
    REFUSED = "refused"
    HEARTBEAT = "heartbeat"
    DISCONNECT = "disconnect"
    OPEN = "open"
    ASK = "ask"
    CACHED = "cached"
    STEP = "step"
    ACTIVATION = "activation"
    TOKEN = "token"
    DELTA = "delta"
    CLOSE = "close"
    CANCEL = "cancel"
    ERROR = "error"
    STATUS = "status"
    STATUS_REPLY = "status_reply"


class ErrorCode(str, enum.Enum):
    """Why a session failed; the same codes in the broker, workers, client and gateway."""

    BAD_REQUEST = "bad_request"  # the request itself is wrong (e.g. longer than the context)
    BUSY = "busy"  # the broker's queue is full: retry shortly
    NO_CAPACITY = "no_capacity"  # no route with room came in time
    FULL = "full"  # a worker had no room after all (the broker retries elsewhere)
    WORKER_LOST = "worker_lost"  # a worker on the route left or stopped answering
    BROKER_UNREACHABLE = "broker_unreachable"
    TIMEOUT = "timeout"  # a deadline passed (first token, next token, inactivity)
    SLOW_CONSUMER = "slow_consumer"  # the client did not read its messages
    CANCELLED = "cancelled"
    INTERNAL = "internal"
    UPSTREAM_ERROR = "upstream_error"  # a remote model's API failed (unreachable, 5xx, cut short)


class SessionError(Exception):
    """A generation failed; ``code`` is machine-readable, ``message`` for people."""

    def __init__(self, code: ErrorCode | str, message: str) -> None:
        super().__init__(f"{ErrorCode(code).value}: {message}")
        self.code = ErrorCode(code)
        self.message = message


def _sampling(field_name: str, value: Any) -> SamplingParams:
    try:
        return SamplingParams.from_dict(value)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"field {field_name!r}: {str(exc)[:200]}") from None


_M = TypeVar("_M", bound="Message")
_WIRE_FIELDS: dict[type, tuple[tuple[str, WireField], ...]] = {}


@dataclass(frozen=True, kw_only=True, slots=True)
class Message:
    TYPE: ClassVar[MsgType]
    request_id: str = wire(ident(empty=True), "")

    @classmethod
    def wire_fields(cls) -> tuple[tuple[str, WireField], ...]:
        spec = _WIRE_FIELDS.get(cls)
        if spec is None:
            spec = tuple((f.name, f.metadata["wire"]) for f in dataclasses.fields(cls))
            _WIRE_FIELDS[cls] = spec
        return spec

    @classmethod
    def from_wire(cls: type[_M], head: dict[str, Any], payloads: list[Payload]) -> _M:
        values: dict[str, Any] = {}
        frames = iter(payloads)
        for fname, spec in cls.wire_fields():
            if spec.is_payload:
                value = next(frames, None)
            elif fname in head:
                value = head[fname]
            else:
                continue  # its default, or the constructor names the missing field
            if value is not None or not spec.is_payload:
                values[fname] = spec.check(fname, value)
        if next(frames, None) is not None:
            raise ProtocolError(f"{cls.TYPE.value}: too many payload frames")
        try:
            msg = cls(**values)
        except TypeError:
            # Name what is missing: the peer's author reads this in our log.
            missing = [
                f.name
                for f in dataclasses.fields(cls)
                if f.name not in values
                and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING
            ]
            raise ProtocolError(
                f"{cls.TYPE.value}: required field(s) missing: {', '.join(missing)}"
            ) from None
        msg._validate()
        return msg

    def to_wire(self) -> tuple[dict[str, Any], list[Payload]]:
        head: dict[str, Any] = {}
        payloads: list[Payload] = []
        for fname, spec in self.wire_fields():
            value = getattr(self, fname)
            if spec.is_payload:
                if value is not None:
                    payloads.append(value)
            elif value is not None:
                if isinstance(value, enum.Enum):
                    value = value.value
                elif isinstance(value, SamplingParams):
                    value = value.to_dict()
                head[fname] = value
        return head, payloads

    def _validate(self) -> None:
        """Checks that span fields; raise ProtocolError."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SessionMessage(Message):
    """A message about one session: the id its client chose, and which try of it."""

    session: str = wire(ident())
    attempt: int = wire(integer(0, MAX_ATTEMPTS), 0)
    step: int = wire(integer(0, MAX_STEP), 0)


MESSAGE_TYPES: dict[str, type[Message]] = {}


def _register(kind: MsgType) -> Any:
    def add(cls: type[Message]) -> type[Message]:
        cls.TYPE = kind
        MESSAGE_TYPES[kind.value] = cls
        return cls

    return add


@_register(MsgType.REGISTER)
@dataclass(frozen=True, kw_only=True, slots=True)
class Register(Message):
    start: int = wire(integer(0, MAX_LAYERS - 1))
    end: int = wire(integer(1, MAX_LAYERS))
    num_layers: int = wire(integer(1, MAX_LAYERS))
    capacity: int = wire(integer(1, MAX_SESSIONS))
    max_kv_tokens: int = wire(integer(1, 1 << 40))
    context: int = wire(integer(1, MAX_CONTEXT))
    version: str = wire(text(32))
    fingerprint: str = wire(text(128))  # digest of the model's config and tensors
    model: dict[str, Any] = wire(scalar_map(64), factory=dict)
    host: str = wire(name(), "unknown")
    pid: int = wire(integer(0, (1 << 31) - 1), 0)
    dtype: str = wire(text(16), "")
    device: str = wire(text(32), "")
    # Most prompt tokens per forward: the rows of the largest activation it sends and
    # takes, the same on every worker of a cluster (0: not said).
    prefill_chunk: int = wire(integer(0, MAX_CONTEXT), 0)
    # The model's name, what clients ask for. A worker always names one: the broker
    # refuses "" (only an OPEN's "" means "the broker's only model").
    served: str = wire(name(empty=True), "")
    # A text model (a remote API): sessions are ASK/DELTA, not tokens; it registers the
    # whole model as layers 0:1 of 1.
    text_model: bool = wire(flag(), False)
    # Where the workers before and after it on a route may send it activations and steps
    # directly (peer_link.py; "": only through the broker).
    peer: str = wire(endpoint(empty=True), "")
    # What decides its numbers (worker/build_info.py): versions of zmqllm, the protocol,
    # Python, torch, numpy; the compiled kernel's key, the CPU features, quant, dtypes,
    # device. The broker refuses a replica whose quant or dtype differs from its pool's
    # and shows the other differences as drift.
    build: dict[str, Any] = wire(scalar_map(32), factory=dict)
    # What it measured before loading (--layers auto: PLACE; {}: nothing), shown in STATUS.
    measured: dict[str, Any] = wire(scalar_map(16, MEASURED_KEYS), factory=dict)
    proposes: bool = wire(flag(), False)  # it speculates (a last stage): OPEN gives it the prompt

    def _validate(self) -> None:
        if not self.start < self.end <= self.num_layers:
            raise ProtocolError(f"register: layers {self.start}:{self.end} not in [0, L)")
        if self.text_model and (self.start, self.end, self.num_layers) != (0, 1, 1):
            raise ProtocolError("register: a text model registers as layers 0:1 of 1")


@_register(MsgType.PLACE)
@dataclass(frozen=True, kw_only=True, slots=True)
class Place(Message):
    """--layers auto: which layers to load, given what it measured (weighted_split.Figures);
    ``hold``: the range answered counts as taken until it registers (else only a look)."""

    served: str = wire(name())
    num_layers: int = wire(integer(1, MAX_LAYERS))
    fingerprint: str = wire(text(128), "")
    figures: dict[str, Any] = wire(scalar_map(16, MEASURED_KEYS), factory=dict)
    hold: bool = wire(flag(), False)


@_register(MsgType.PLACED)
@dataclass(frozen=True, kw_only=True, slots=True)
class Placed(Message):
    start: int = wire(integer(0, MAX_LAYERS - 1))
    end: int = wire(integer(1, MAX_LAYERS))
    why: str = wire(text(MAX_TEXT), "")  # which rule chose it, for the worker's log

    def _validate(self) -> None:
        if not self.start < self.end:
            raise ProtocolError(f"placed: layers {self.start}:{self.end} are empty")


@_register(MsgType.REGISTERED)
@dataclass(frozen=True, kw_only=True, slots=True)
class Registered(Message):
    worker_id: str = wire(name())
    boot: str = wire(text(64), "")


@_register(MsgType.REFUSED)
@dataclass(frozen=True, kw_only=True, slots=True)
class Refused(Message):
    reason: str = wire(text(MAX_TEXT))


@_register(MsgType.DISCONNECT)
@dataclass(frozen=True, kw_only=True, slots=True)
class Disconnect(Message):
    reason: str = wire(text(MAX_TEXT))


@_register(MsgType.HEARTBEAT)
@dataclass(frozen=True, kw_only=True, slots=True)
class Heartbeat(Message):
    boot: str | None = wire(optional(text(64)), None)  # the broker's, so peers see restarts
    # A worker's figures (FIGURE_KEYS); "load" is the field's name on the wire.
    load: dict[str, Any] | None = wire(optional(scalar_map(64, FIGURE_KEYS)), None)
    draining: bool = wire(flag(), False)


@_register(MsgType.OPEN)
@dataclass(frozen=True, kw_only=True, slots=True)
class Open(SessionMessage):
    max_tokens: int = wire(integer(1, MAX_CONTEXT))
    prompt_len: int = wire(integer(1, MAX_CONTEXT))
    sampling: SamplingParams = wire(_sampling, factory=SamplingParams)
    stop_ids: tuple[int, ...] = wire(int_list(0, MAX_TOKEN_ID, 4096), ())
    # Set by the broker for each stage of the route:
    stage: int = wire(integer(0, MAX_LAYERS), 0)
    stages: int = wire(integer(0, MAX_LAYERS), 0)
    max_len: int = wire(integer(0, 2 * MAX_CONTEXT), 0)  # prompt + max_tokens
    next: str = wire(name(empty=True), "")  # where this stage's results go (the last: stage 0)
    tokens: Payload | None = wire(tensor(frozenset({"int32"}), 1), None, is_payload=True)
    # Set by the broker for each stage: the keys of the prompt's whole blocks
    # (prefix.prefix_chain), what a stage's prefix cache is keyed by.
    prefix: tuple[int, ...] = wire(int_list(0, MAX_PREFIX_KEY, MAX_PREFIX_BLOCKS), ())
    # Set by the broker for the last stage of a replayed stream whose sampling depends on
    # what came before (penalties, a grammar): its tokens so far, the end of its prompt.
    generated: tuple[int, ...] = wire(int_list(0, MAX_TOKEN_ID, MAX_GENERATED), ())
    # The model asked for ("": the broker's only model).
    model: str = wire(name(empty=True), "")
    # Set by the broker when every stage of the route has a peer link: where this
    # stage's results go directly (the next worker's peer endpoint and, with CURVE, its
    # public key), and who alone may send this session's work to this stage (the
    # previous worker's id and key; stage 0's previous is the last stage).
    next_peer: str = wire(endpoint(empty=True), "")
    next_key: str = wire(curve_key(empty=True), "")
    prev: str = wire(name(empty=True), "")
    prev_key: str = wire(curve_key(empty=True), "")
    build: tuple[str, ...] = wire(str_list(text(22), MAX_LAYERS), ())  # a replay's: route_build.py
    speculative: bool = wire(flag(), True)  # the last stage may speculate (STEP.draft)

    def _validate(self) -> None:
        if self.tokens is not None and self.tokens.array.shape != (self.prompt_len,):
            raise ProtocolError(f"open: token ids {self.tokens.array.shape} != prompt_len")
        if len(self.generated) > self.prompt_len:
            raise ProtocolError("open: field 'generated': more tokens than the prompt holds")
        if len(self.prefix) > prefix_blocks(self.prompt_len):
            raise ProtocolError(
                f"open: field 'prefix': {len(self.prefix)} keys for a prompt of {self.prompt_len}"
            )


class AskKind(str, enum.Enum):
    CHAT = "chat"  # the body holds "messages"
    COMPLETION = "completion"  # the body holds "prompt"


@_register(MsgType.ASK)
@dataclass(frozen=True, kw_only=True, slots=True)
class Ask(SessionMessage):
    """A text session (a remote model): the OpenAI request fields as JSON, which the
    text worker checks and forwards; the answer comes back as DELTAs."""

    model: str = wire(name(empty=True), "")
    kind: AskKind = wire(one_of(AskKind), AskKind.CHAT)
    max_tokens: int = wire(integer(1, MAX_CONTEXT))
    body: Payload = wire(tensor(frozenset({"uint8"}), 1), is_payload=True)

    def _validate(self) -> None:
        if self.body.array.size > MAX_ASK_BYTES:
            raise ProtocolError(
                f"ask: body of {self.body.array.size} bytes, at most {MAX_ASK_BYTES}"
            )


@_register(MsgType.CACHED)
@dataclass(frozen=True, kw_only=True, slots=True)
class Cached(SessionMessage):
    """How many of a new session's prompt tokens a later stage holds in its prefix cache;
    stage 0 starts the prompt after the least any stage holds."""

    tokens: int = wire(integer(0, MAX_CONTEXT))


_GROUP = optional(group(MAX_SESSIONS))


@_register(MsgType.STEP)
@dataclass(frozen=True, kw_only=True, slots=True)
class Step(SessionMessage):
    token: int = wire(integer(0, MAX_TOKEN_ID))
    group: tuple[str, int] | None = wire(_GROUP, None)
    # The last stage's proposals for the next steps: more rows of this step's pass.
    draft: tuple[int, ...] = wire(int_list(0, MAX_TOKEN_ID, MAX_DRAFT_TOKENS), ())

    @classmethod
    def following(cls, token: Token, request_id: str) -> Step:
        """Stage 0's next decode step after the last stage sampled ``token``: in its
        group, so the next forward at stage 0 waits for the whole group."""
        return cls(
            session=token.session,
            attempt=token.attempt,
            request_id=request_id,
            step=token.step + 1,
            token=token.token,
            group=token.group,
            draft=token.draft,
        )


@_register(MsgType.ACTIVATION)
@dataclass(frozen=True, kw_only=True, slots=True)
class Activation(SessionMessage):
    """Hidden states of one forward's rows for this session; ``group`` is ``(id, size)``:
    the forward it came from and how many of its results go to the same next worker."""

    final: bool = wire(flag(), True)  # the last prompt chunk or a decode step
    group: tuple[str, int] | None = wire(_GROUP, None)
    # The first prompt chunk only: the prompt tokens before its rows that every stage
    # takes from its prefix cache instead of computing.
    prefix: int = wire(integer(0, MAX_CONTEXT), 0)
    hidden: Payload = wire(
        tensor(frozenset({"float32", "float16", "bfloat16"}), 2, min_rows=1), is_payload=True
    )


class Finish(str, enum.Enum):
    STOP = "stop"  # a stop or EOS token
    LENGTH = "length"  # max_tokens reached


@_register(MsgType.TOKEN)
@dataclass(frozen=True, kw_only=True, slots=True)
class Token(SessionMessage):
    token: int = wire(integer(0, MAX_TOKEN_ID))
    finish: Finish | None = wire(optional(one_of(Finish)), None)
    # When the session asked for logprobs: the chosen token's log-probability first, then
    # the most likely tokens', most likely first (ids and values, the same length).
    logprob_ids: tuple[int, ...] | None = wire(
        optional(int_list(0, MAX_TOKEN_ID, MAX_LOGPROBS + 1)), None
    )
    logprobs: tuple[float, ...] | None = wire(
        optional(number_list(LOGPROB_FLOOR, 0.0, MAX_LOGPROBS + 1)), None
    )

    def _validate(self) -> None:
        if (self.logprob_ids is None) != (self.logprobs is None) or (
            self.logprobs is not None and len(self.logprobs) != len(self.logprob_ids or ())
        ):
            raise ProtocolError("token: 'logprob_ids' and 'logprobs' come together, alike long")
        if self.more and (self.finish is not None or self.draft or self.stepped):
            raise ProtocolError("token: one with 'more' to follow has no finish, draft or step")

    group: tuple[str, int] | None = wire(_GROUP, None)
    # The last stage sent the next STEP to stage 0 itself, over their peer link.
    stepped: bool = wire(flag(), False)
    # On the first token the broker sends a client: the route, its boot id and its build.
    route: tuple[str, ...] | None = wire(optional(str_list(name(), MAX_LAYERS)), None)
    boot: str | None = wire(optional(text(64)), None)
    build: tuple[str, ...] | None = wire(optional(str_list(text(22), MAX_LAYERS)), None)
    # A pass's tokens but its last say ``more``: no STEP follows them. The last's ``draft``:
    # the proposals its STEP carries (speculative decoding).
    more: bool = wire(flag(), False)
    draft: tuple[int, ...] = wire(int_list(0, MAX_TOKEN_ID, MAX_DRAFT_TOKENS), ())


# Checks made here: inside Delta its field ``text`` hides the function.
_DELTA_TEXT = text(MAX_DELTA)
_FINISH_TEXT = optional(text(32))
_BOOT = optional(text(64))


@_register(MsgType.DELTA)
@dataclass(frozen=True, kw_only=True, slots=True)
class Delta(SessionMessage):
    """The next piece of a text session's answer (``step`` counts pieces from 0); the
    last one has ``finish`` and, when the upstream said, the token counts."""

    text: str = wire(_DELTA_TEXT, "")
    finish: str | None = wire(_FINISH_TEXT, None)
    prompt_tokens: int | None = wire(optional(integer(0, MAX_CONTEXT)), None)
    completion_tokens: int | None = wire(optional(integer(0, MAX_CONTEXT)), None)
    # On the first piece the broker sends a client: the route and its boot id.
    route: tuple[str, ...] | None = wire(optional(str_list(name(), MAX_LAYERS)), None)
    boot: str | None = wire(_BOOT, None)


@_register(MsgType.CLOSE)
@dataclass(frozen=True, kw_only=True, slots=True)
class Close(SessionMessage):
    pass


@_register(MsgType.CANCEL)
@dataclass(frozen=True, kw_only=True, slots=True)
class Cancel(SessionMessage):
    pass


@_register(MsgType.ERROR)
@dataclass(frozen=True, kw_only=True, slots=True)
class Error(Message):
    code: ErrorCode = wire(one_of(ErrorCode))
    message: str = wire(text(MAX_TEXT))
    session: str = wire(ident(empty=True), "")  # "" when it names no session
    attempt: int = wire(integer(0, MAX_ATTEMPTS), 0)

    @classmethod
    def of(cls, code: ErrorCode, message: str, session: str = "", **kw: Any) -> Error:
        """An ERROR with its message cut to fit the wire."""
        return cls(code=code, message=message[:MAX_TEXT], session=session, **kw)


@_register(MsgType.STATUS)
@dataclass(frozen=True, kw_only=True, slots=True)
class Status(Message):
    pass


@_register(MsgType.STATUS_REPLY)
@dataclass(frozen=True, kw_only=True, slots=True)
class StatusReply(Message):
    """The broker's status, msgpack in a payload frame: it outgrows a header past ~60
    workers."""

    body: Payload = wire(tensor(frozenset({"uint8"}), 1), is_payload=True)

    @classmethod
    def of(cls, status: dict[str, Any], request_id: str = "") -> StatusReply:
        raw = msgpack.packb(status, use_bin_type=True)
        return cls(request_id=request_id, body=Payload(np.frombuffer(raw, np.uint8), "uint8"))

    def status(self) -> dict[str, Any]:
        """The status map, unpacked within limits (ProtocolError if it is not one)."""
        raw = self.body.array.tobytes()
        if len(raw) > MAX_STATUS_BYTES:
            raise ProtocolError(f"status of {len(raw)} bytes, at most {MAX_STATUS_BYTES}")
        try:
            out = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_ext_len=0)
        except Exception:
            raise ProtocolError("status is not valid msgpack") from None
        if not isinstance(out, dict):
            raise ProtocolError("status must be a map")
        return out
