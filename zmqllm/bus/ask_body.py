"""The fields of a text session's request (ASK): what a gateway may send for a remote
model and what a remote worker forwards to its upstream API, checked in one place.

The body travels as JSON; the worker takes only the fields named here, each checked for
type and range, so nothing a peer adds reaches the upstream. No torch, no HTTP here.
"""

from __future__ import annotations

import json
import math
from typing import Any

from zmqllm.bus.messages import Ask, AskKind
from zmqllm.bus.sampling_params import (
    MAX_PENALTY,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOPS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
)
from zmqllm.bus.wire_types import ProtocolError

__all__ = ["CHAT_ROLES", "MAX_MESSAGES", "AskBodyError", "ask_fields", "upstream_body"]

CHAT_ROLES = frozenset({"system", "user", "assistant", "developer"})
MAX_MESSAGES = 4096


class AskBodyError(ValueError):
    """A field of an ASK body that cannot be forwarded; the message names it."""


def ask_fields(msg: Ask) -> dict[str, Any]:
    """An ASK's request fields, as its body holds them (ProtocolError unless a JSON
    object)."""
    try:
        out = json.loads(msg.body.array.tobytes())
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError("ask: body is not JSON") from None
    if not isinstance(out, dict):
        raise ProtocolError("ask: body must be a JSON object")
    return out


def _number(fields: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    value = fields.get(key)
    if value is None:
        return None
    if type(value) not in (int, float) or not math.isfinite(value) or not lo <= value <= hi:
        raise AskBodyError(f"{key} must be a number in [{lo:g}, {hi:g}], got {value!r:.40}")
    return float(value)


def _integer(fields: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    value = fields.get(key)
    if value is None:
        return None
    if type(value) is not int or not lo <= value <= hi:
        raise AskBodyError(f"{key} must be an integer in [{lo}, {hi}], got {value!r:.40}")
    return value


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_MESSAGES:
        raise AskBodyError(f"messages must be a list of 1 to {MAX_MESSAGES} messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise AskBodyError(f"messages[{i}] needs a role of {', '.join(sorted(CHAT_ROLES))}")
        content = m.get("content")
        if not isinstance(content, str):
            raise AskBodyError(f"messages[{i}].content must be a string")
        out.append({"role": m["role"], "content": content})
    return out


def _stop(value: Any) -> list[str] | None:
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        raise AskBodyError(f"stop must be a string or a list of at most {MAX_STOPS} strings")
    return stops or None


def upstream_body(kind: AskKind, fields: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """The request for the upstream's /chat/completions (chat) or /completions: the
    prompt, ``max_tokens`` and the sampling fields given; AskBodyError if one is wrong."""
    body: dict[str, Any] = {"max_tokens": max_tokens}
    if kind is AskKind.CHAT:
        body["messages"] = _messages(fields.get("messages"))
    else:
        prompt = fields.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise AskBodyError("prompt must be a non-empty string")
        body["prompt"] = prompt
    for key, lo, hi in (
        ("temperature", 0.0, MAX_TEMPERATURE),
        ("top_p", 0.0, 1.0),
        ("presence_penalty", -MAX_PENALTY, MAX_PENALTY),
        ("frequency_penalty", -MAX_PENALTY, MAX_PENALTY),
    ):
        value = _number(fields, key, lo, hi)
        if value is not None:
            body[key] = value
    for key, ilo, ihi in (("seed", 0, MAX_SEED), ("top_k", 0, MAX_TOP_K)):
        integer = _integer(fields, key, ilo, ihi)
        if integer is not None:
            body[key] = integer
    stop = _stop(fields.get("stop"))
    if stop is not None:
        body["stop"] = stop
    response_format = fields.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise AskBodyError("response_format must be an object")
        body["response_format"] = response_format
    return body
