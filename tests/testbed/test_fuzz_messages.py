"""The valid messages the hostile generator starts from: every type builds and decodes as
itself, the sessions under attack are named about half the time, and the random draws
keep to their bounds. No torch here."""

from __future__ import annotations

from collections import Counter

import numpy as np

from testbed.fuzz_messages import (
    chars,
    frames_of,
    pack_header,
    valid_message,
    valid_parts,
    weighted,
)
from zmqllm.bus.messages import MESSAGE_TYPES, Cancel, Open
from zmqllm.bus.protocol import PROTOCOL_VERSION, decode

SESSIONS = ["victim-1", "victim_2"]


def test_every_type_builds_messages_that_decode_as_themselves() -> None:
    rng = np.random.default_rng(0)
    for cls in MESSAGE_TYPES.values():
        for _ in range(50):
            assert type(decode(frames_of(valid_message(rng, SESSIONS, cls)))) is cls


def test_valid_parts_are_a_header_map_and_its_payload_frames() -> None:
    rng = np.random.default_rng(1)
    for _ in range(20):
        head, payloads = valid_parts(rng, SESSIONS, Open)
        assert head["v"] == PROTOCOL_VERSION and head["type"] == "open"
        assert isinstance(decode([pack_header(head), *payloads]), Open)


def test_the_sessions_under_attack_are_named_about_half_the_time() -> None:
    rng = np.random.default_rng(2)
    named = [valid_message(rng, SESSIONS, Cancel).session in SESSIONS for _ in range(400)]
    assert 120 < sum(named) < 280


def test_weighted_draws_follow_the_weights() -> None:
    rng = np.random.default_rng(3)
    cumulative = np.cumsum([1.0, 0.0, 3.0]) / 4.0
    counts = Counter(weighted(rng, cumulative) for _ in range(4000))
    assert counts[1] == 0
    assert 800 < counts[0] < 1200 and 2800 < counts[2] < 3200


def test_chars_keep_to_the_alphabet_and_the_length() -> None:
    rng = np.random.default_rng(4)
    for _ in range(200):
        text = chars(rng, "ab", 2, 5)
        assert 2 <= len(text) <= 5 and set(text) <= {"a", "b"}
