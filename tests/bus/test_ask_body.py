"""The fields of a text session's request (zmqllm/bus/ask_body.py): what passes to the
upstream, what is refused (naming the field) and what is dropped. No torch."""

from __future__ import annotations

from typing import Any

import pytest

from zmqllm.bus.ask_body import MAX_MESSAGES, AskBodyError, upstream_body
from zmqllm.bus.messages import AskKind
from zmqllm.bus.sampling_params import MAX_STOPS

CHAT = AskKind.CHAT
COMPLETION = AskKind.COMPLETION
HELLO = [{"role": "user", "content": "hello"}]


def chat(**fields: Any) -> dict[str, Any]:
    return upstream_body(CHAT, {"messages": HELLO, **fields}, 16)


def completion(**fields: Any) -> dict[str, Any]:
    return upstream_body(COMPLETION, {"prompt": "once upon", **fields}, 16)


def test_a_chat_passes_whole() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": ""},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    fields = {
        "messages": messages,
        "temperature": 0.7,
        "top_p": 1,
        "presence_penalty": -2,
        "frequency_penalty": 2.0,
        "seed": 42,
        "top_k": 0,
        "stop": ["\n\n", "END"],
        "response_format": {"type": "json_object"},
    }
    assert upstream_body(CHAT, fields, 99) == {
        "max_tokens": 99,
        "messages": messages,
        "temperature": 0.7,
        "top_p": 1.0,
        "presence_penalty": -2.0,
        "frequency_penalty": 2.0,
        "seed": 42,
        "top_k": 0,
        "stop": ["\n\n", "END"],
        "response_format": {"type": "json_object"},
    }


def test_a_completion_passes_whole() -> None:
    assert completion(temperature=0, stop="\n", seed=0) == {
        "max_tokens": 16,
        "prompt": "once upon",
        "temperature": 0.0,
        "stop": ["\n"],
        "seed": 0,
    }


def test_numbers_are_sent_as_floats() -> None:
    # The upstream sees one type per field, whichever a client wrote.
    body = chat(temperature=1, top_p=0)
    assert body["temperature"] == 1.0 and type(body["temperature"]) is float
    assert type(body["top_p"]) is float


def test_unknown_fields_and_message_extras_are_dropped() -> None:
    fields = {
        "messages": [{"role": "user", "content": "hi", "name": "bob", "tool_calls": []}],
        "model": "other",
        "stream": False,
        "n": 5,
        "logit_bias": {"1": 100},
        "tools": [{"type": "function"}],
        "user": "u",
        "prompt": "not for a chat",
    }
    assert upstream_body(CHAT, fields, 8) == {
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
    }
    assert "messages" not in upstream_body(COMPLETION, {"prompt": "p", "messages": HELLO}, 8)


def test_none_is_as_if_not_given() -> None:
    body = chat(temperature=None, top_p=None, seed=None, stop=None, response_format=None)
    assert body == {"max_tokens": 16, "messages": HELLO}


def test_an_empty_stop_list_is_no_stop() -> None:
    assert "stop" not in chat(stop=[])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "0.5"),
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", True),
        ("temperature", [1]),
        ("top_p", 1.5),
        ("top_p", -1),
        ("presence_penalty", 3),
        ("frequency_penalty", -2.01),
        ("seed", -1),
        ("seed", 1.0),
        ("seed", "1"),
        ("seed", 2**63),
        ("seed", False),
        ("top_k", -1),
        ("top_k", (1 << 20) + 1),
        ("top_k", 2.5),
    ],
)
def test_a_bad_number_is_refused_by_name(field: str, value: Any) -> None:
    for build in (chat, completion):
        with pytest.raises(AskBodyError, match=rf"^{field} must be"):
            build(**{field: value})


@pytest.mark.parametrize(
    "stop",
    [
        ["a"] * (MAX_STOPS + 1),
        [""],
        "",
        ["a", 1],
        [None],
        {"a": 1},
        7,
        ["x" * 257],
    ],
)
def test_a_bad_stop_is_refused(stop: Any) -> None:
    with pytest.raises(AskBodyError, match=r"^stop must be"):
        chat(stop=stop)


def test_stops_up_to_the_limit_pass() -> None:
    stops = [f"s{i}" for i in range(MAX_STOPS)]
    assert chat(stop=stops)["stop"] == stops


@pytest.mark.parametrize("response_format", ["json", ["json"], 1])
def test_a_response_format_must_be_an_object(response_format: Any) -> None:
    with pytest.raises(AskBodyError, match=r"^response_format must be an object"):
        chat(response_format=response_format)


@pytest.mark.parametrize(
    "messages",
    [None, "hello", {"role": "user", "content": "hi"}, [], [HELLO[0]] * (MAX_MESSAGES + 1)],
)
def test_messages_must_be_a_list_of_bounded_length(messages: Any) -> None:
    with pytest.raises(AskBodyError, match=r"^messages must be a list"):
        upstream_body(CHAT, {"messages": messages}, 8)


def test_as_many_messages_as_allowed_pass() -> None:
    body = upstream_body(CHAT, {"messages": [HELLO[0]] * MAX_MESSAGES}, 8)
    assert len(body["messages"]) == MAX_MESSAGES


@pytest.mark.parametrize(
    "message",
    [
        {"role": "tool", "content": "x"},
        {"role": "function", "content": "x"},
        {"role": "User", "content": "x"},
        {"content": "x"},
        {"role": None, "content": "x"},
        "user: x",
        ["user", "x"],
    ],
)
def test_a_bad_role_is_refused_by_index(message: Any) -> None:
    with pytest.raises(AskBodyError, match=r"^messages\[1\] needs a role of assistant, "):
        upstream_body(CHAT, {"messages": [HELLO[0], message]}, 8)


@pytest.mark.parametrize(
    "content", [None, 1, ["hi"], [{"type": "text", "text": "hi"}], {"text": "hi"}]
)
def test_content_must_be_a_string(content: Any) -> None:
    with pytest.raises(AskBodyError, match=r"^messages\[0\]\.content must be a string"):
        upstream_body(CHAT, {"messages": [{"role": "user", "content": content}]}, 8)


@pytest.mark.parametrize("prompt", [None, "", ["a", "b"], [1, 2], 5])
def test_a_completion_needs_a_non_empty_string_prompt(prompt: Any) -> None:
    fields = {} if prompt is None else {"prompt": prompt}
    with pytest.raises(AskBodyError, match=r"^prompt must be a non-empty string"):
        upstream_body(COMPLETION, fields, 8)


def test_a_long_bad_value_is_cut_in_the_message() -> None:
    with pytest.raises(AskBodyError) as caught:
        chat(temperature="x" * 10_000)
    assert len(str(caught.value)) < 120


def test_the_caller_s_fields_are_not_changed() -> None:
    messages = [{"role": "user", "content": "hi", "name": "bob"}]
    fields = {"messages": messages, "stop": "x", "extra": 1}
    upstream_body(CHAT, fields, 8)
    assert fields == {
        "messages": [{"role": "user", "content": "hi", "name": "bob"}],
        "stop": "x",
        "extra": 1,
    }
