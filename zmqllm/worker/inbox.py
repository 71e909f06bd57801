"""What a worker's links hand its compute loop: each message decoded once, typed.

A link (the broker link's socket, read by the compute loop or its keeper thread; the
peer link's, read by the compute loop) turns a message's frames into an entry with
:func:`take_in`, the one place a worker calls the protocol's ``decode``; the shell
(``shell.py``) then dispatches each entry by its type through one table, as SGLang's
``TypeBasedDispatcher`` does. Nothing after ``take_in`` reads a header again.

An entry is one of:

- a decoded :class:`Message` (its payloads ``np.frombuffer`` views of the received
  frames, no copy: see the protocol module);
- :class:`Undecodable`: a message whose header decodes but whose body does not; it
  still names its session (if the header names a valid one), so that the session can
  fail now rather than wait for what never comes. Only such a failing message has its
  header read a second time (``decode`` does not say how far it got);
- :class:`Reset` or :class:`Refusal`: what the broker link itself has to say.

A message whose header does not decode names nothing: ``take_in`` counts it as
malformed and gives None, and the link drops it. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zmqllm.bus.messages import (
    MAX_ATTEMPTS,
    Activation,
    Ask,
    Cached,
    Cancel,
    Close,
    Message,
    Open,
    SessionMessage,
    Step,
)
from zmqllm.bus.protocol import decode, decode_header
from zmqllm.bus.wire_types import ProtocolError, SessionKey, is_valid_id
from zmqllm.worker.faults import Faults

__all__ = [
    "SESSION_TYPES",
    "Entry",
    "Refusal",
    "Reset",
    "Undecodable",
    "named_key",
    "session_of",
    "take_in",
]

# The messages a broker sends a worker about its sessions: for the compute loop. The
# rest (heartbeats, registration) the broker link answers itself.
SESSION_TYPES: frozenset[type[Message]] = frozenset(
    {Open, Ask, Cached, Step, Activation, Close, Cancel}
)


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A message of type ``kind`` whose body does not decode (``error`` says why);
    ``key`` and ``request_id``: the session its header names (None, "": no valid one)."""

    kind: type[Message]
    key: SessionKey | None
    request_id: str
    error: ProtocolError


@dataclass(frozen=True, slots=True)
class Reset:
    """The broker forgot this worker's sessions (it restarted, asked this worker to
    register again, or went quiet): drop them all."""

    reason: str


@dataclass(frozen=True, slots=True)
class Refusal:
    """The broker refused this worker (another model, or version): stop."""

    reason: str


Entry = Message | Undecodable | Reset | Refusal


def named_key(head: dict[str, Any]) -> tuple[SessionKey, str] | None:
    """The session key and request id ("" if not a valid one) a header names, if it
    names a valid session, even when the rest of its message is not valid."""
    session, attempt, rid = head.get("session"), head.get("attempt", 0), head.get("request_id")
    if not isinstance(session, str) or not is_valid_id(session):
        return None
    if type(attempt) is not int or not 0 <= attempt <= MAX_ATTEMPTS:
        return None
    return SessionKey(session, attempt), rid if isinstance(rid, str) and is_valid_id(rid) else ""


def session_of(entry: Entry) -> tuple[SessionKey, str] | None:
    """The session key and request id an entry names (None: it names none)."""
    if isinstance(entry, Undecodable):
        return None if entry.key is None else (entry.key, entry.request_id)
    if isinstance(entry, SessionMessage):
        return SessionKey.of(entry), entry.request_id
    return None


def take_in(frames: Sequence[Any], faults: Faults, source: str) -> Message | Undecodable | None:
    """One message from ``source`` (its routing envelope stripped) as the compute loop
    takes it; None, counted, when not even its header decodes."""
    try:
        return decode(frames)
    except ProtocolError as exc:
        error = exc
    try:
        kind, head = decode_header(frames[0])
    except (ProtocolError, IndexError) as exc:
        faults.report("malformed", f"malformed message from {source} dropped", exc)
        return None
    named = named_key(head)
    if named is None:
        return Undecodable(kind, None, "", error)
    return Undecodable(kind, named[0], named[1], error)
