"""The name rule (config/names.py) is one rule: every place that checks a name a setting
or a peer picks (settings, the wire, the broker's routing ids) accepts and refuses the same
strings."""

from __future__ import annotations

import dataclasses

import pytest

from tests.broker.test_registry import VERSION, register
from zmqllm.broker.registry import Registry
from zmqllm.bus.protocol import decode, encode
from zmqllm.bus.wire_types import ProtocolError, name
from zmqllm.config.loading import with_overrides
from zmqllm.config.names import MAX_NAME_LEN, NAME_RULE, is_name
from zmqllm.config.paths import checked_model_name
from zmqllm.config.settings import Config, ConfigError

NAMES = ["a", "x" * MAX_NAME_LEN, "mistralai/Mistral-7B-v0.3", "!~", "model:v1@host"]
NOT_NAMES = [
    "x" * (MAX_NAME_LEN + 1),
    "has space",
    "tab\there",
    "new\nline",
    "caf\u00e9",
    "del\x7f",
    "nul\x00",
    "\u2028",
]
CASES = [(s, True) for s in NAMES] + [(s, False) for s in NOT_NAMES]


def test_the_rule() -> None:
    assert all(is_name(s) for s in NAMES)
    assert not any(is_name(s) for s in NOT_NAMES)
    assert not is_name("") and not is_name(b"") and not is_name(None) and not is_name(7)
    assert "255" in NAME_RULE


@pytest.mark.parametrize(("text", "ok"), CASES)
def test_bytes_keep_the_rule_of_their_text(text: str, ok: bool) -> None:
    assert is_name(text.encode()) is ok


@pytest.mark.parametrize(("text", "ok"), CASES)
def test_settings_take_what_the_rule_takes(text: str, ok: bool) -> None:
    if ok:
        assert checked_model_name(text) == text
        assert with_overrides(Config(), "worker", {"served_name": text}).worker.served_name == text
        assert with_overrides(Config(), "model", {"name": text}).model.name == text
    else:
        with pytest.raises(ConfigError, match=NAME_RULE):
            checked_model_name(text)
        with pytest.raises(ConfigError, match=NAME_RULE):
            with_overrides(Config(), "worker", {"served_name": text})
        with pytest.raises(ConfigError, match=NAME_RULE):
            with_overrides(Config(), "model", {"name": text})


@pytest.mark.parametrize(("text", "ok"), CASES)
def test_the_wire_takes_what_the_rule_takes(text: str, ok: bool) -> None:
    reg = dataclasses.replace(register(0, 4), served=text, host=text)
    if ok:
        assert name()("served", text) == text
        with pytest.raises(ProtocolError):
            name()("served", text.encode())  # a name travels as text, never bytes
        decoded = decode(encode(reg))
        assert decoded.served == text and decoded.host == text  # type: ignore[attr-defined]
    else:
        with pytest.raises(ProtocolError, match=NAME_RULE):
            name()("served", text)
        with pytest.raises(ProtocolError, match=NAME_RULE):
            decode(encode(reg))


@pytest.mark.parametrize(("text", "ok"), CASES)
def test_the_broker_takes_routing_ids_the_rule_takes(text: str, ok: bool) -> None:
    reason = Registry().refusal(register(0, 4), VERSION, text.encode())
    if ok:
        assert reason is None
    else:
        assert reason == f"the routing id must be {NAME_RULE}"
