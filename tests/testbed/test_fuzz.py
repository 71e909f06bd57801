"""The hostile message generator: reproducible, every category present, and each message
decodes the way its category says (a message, a ProtocolError, or either).

No torch here: the generator runs beside the front end.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter, defaultdict
from typing import Any

import msgpack
import numpy as np
import pytest

from testbed.fuzz import (
    CATEGORIES,
    EXPECTED,
    check_expected,
    hostile_messages,
    labelled_messages,
)
from zmqllm.bus.messages import (
    MESSAGE_TYPES,
    Activation,
    Cancel,
    Close,
    Message,
    Open,
    Register,
    Status,
    Step,
    Token,
)
from zmqllm.bus.protocol import MAX_FRAMES, decode
from zmqllm.bus.wire_types import MAX_TENSORS, ProtocolError

SESSIONS = ["victim-1", "victim_2"]


def _take(seed: int, n: int, sessions: list[str] = SESSIONS) -> list[tuple[str, list[bytes]]]:
    rng = np.random.default_rng(seed)
    return list(itertools.islice(labelled_messages(rng, sessions=sessions), n))


@pytest.fixture(scope="module")
def sample() -> list[tuple[str, list[bytes]]]:
    """Enough messages that every (type, field) pair gets a wrong value (seeded)."""
    return _take(seed=7, n=10_000)


def _decoded(sample: list[tuple[str, list[bytes]]], category: str) -> list[Message]:
    return [decode(frames) for cat, frames in sample if cat == category]


def test_same_seed_same_messages() -> None:
    assert _take(3, 300) == _take(3, 300)
    assert _take(3, 300) != _take(4, 300)


def test_hostile_messages_are_the_labelled_ones() -> None:
    rng = np.random.default_rng(5)
    got = list(itertools.islice(hostile_messages(rng, sessions=SESSIONS), 200))
    assert got == [frames for _, frames in _take(5, 200)]


def test_every_category_is_produced(sample: list[tuple[str, list[bytes]]]) -> None:
    counts = Counter(cat for cat, _ in sample)
    assert set(counts) == set(CATEGORIES) == set(EXPECTED)
    # Valid-looking messages are the largest share: they get furthest into a process.
    assert counts.most_common(1)[0][0] == "valid"


def test_frames_are_bytes_and_never_none(sample: list[tuple[str, list[bytes]]]) -> None:
    for _, frames in sample:
        assert frames
        assert all(type(f) is bytes for f in frames)
    assert max(len(frames) for _, frames in sample) > MAX_FRAMES


def test_each_message_decodes_as_its_category_says(
    sample: list[tuple[str, list[bytes]]],
) -> None:
    outcomes: defaultdict[str, Counter[bool]] = defaultdict(Counter)
    for category, frames in sample:
        check_expected(category, frames)  # nothing but a Message or a ProtocolError
        try:
            decode(frames)
            outcomes[category][True] += 1
        except ProtocolError:
            outcomes[category][False] += 1
    for category, expected in EXPECTED.items():
        if expected is not None:
            assert set(outcomes[category]) == {expected}, category


def test_check_expected_tells_a_wrong_category() -> None:
    (_, valid), *_ = [c for c in _take(1, 200) if c[0] == "valid"]
    check_expected("valid", valid)
    with pytest.raises(AssertionError, match="decoded"):
        check_expected("truncated", valid)
    with pytest.raises(AssertionError, match="refused"):
        check_expected("valid", [b"\xc1"])


def test_valid_messages_of_every_type(sample: list[tuple[str, list[bytes]]]) -> None:
    types = Counter(type(m) for m in _decoded(sample, "valid"))
    assert set(types) == set(MESSAGE_TYPES.values())
    assert types[Status] > 50  # STATUS spam


def test_messages_name_the_sessions_under_attack_and_others(
    sample: list[tuple[str, list[bytes]]],
) -> None:
    named: defaultdict[type, Counter[bool]] = defaultdict(Counter)
    for msg in _decoded(sample, "valid"):
        session = getattr(msg, "session", "")
        named[type(msg)][session in SESSIONS] += 1
    for cls in (Cancel, Close, Step, Token, Activation, Open):
        # Foreign CANCELs and CLOSEs, STEPs and TOKENs for the victims and for nobody's.
        assert named[cls][True] > 0 and named[cls][False] > 0, cls.__name__


def test_without_sessions_every_id_is_made_up() -> None:
    for cat, frames in _take(11, 500, sessions=[]):
        if cat == "valid":
            assert getattr(decode(frames), "session", "") not in SESSIONS


def test_register_variants(sample: list[tuple[str, list[bytes]]]) -> None:
    registers = [m for m in _decoded(sample, "valid") if isinstance(m, Register)]
    assert len({(r.start, r.end) for r in registers}) > 50  # many distinct ranges
    assert len({r.fingerprint for r in registers}) == len(registers)  # no real model's
    assert max(r.num_layers for r in registers) == 1024
    assert any(r.end - r.start == 1 for r in registers)


def test_open_with_absurd_sizes(sample: list[tuple[str, list[bytes]]]) -> None:
    opens = [m for m in _decoded(sample, "valid") if isinstance(m, Open)]
    assert max(o.prompt_len for o in opens) == 1 << 22
    assert max(o.max_tokens for o in opens) == 1 << 22
    assert max(len(o.stop_ids) for o in opens) == 4096
    ids = np.concatenate([o.tokens.array for o in opens if o.tokens is not None])
    assert ids.min() < 0 and ids.max() > 1 << 20  # ids no vocabulary has


def test_each_field_of_each_type_gets_a_wrong_value(
    sample: list[tuple[str, list[bytes]]],
) -> None:
    hit: set[tuple[str, str]] = set()
    for category, frames in sample:
        if category != "bad_field":
            continue
        with pytest.raises(ProtocolError) as err:
            decode(frames)
        named = re.search(r"field '(\w+)'", str(err.value))
        assert named is not None, err.value  # the error says which field
        hit.add((msgpack.unpackb(frames[0])["type"], named.group(1)))
    every = {
        (kind, name)
        for kind, cls in MESSAGE_TYPES.items()
        for name, spec in cls.wire_fields()
        if not spec.is_payload
    }
    assert hit == every


def _tensor_lists(sample: list[tuple[str, list[bytes]]]) -> list[Any]:
    return [
        msgpack.unpackb(frames[0], strict_map_key=False).get("tensors", [])
        for category, frames in sample
        if category == "lying_tensor"
    ]


def test_lying_tensor_specs(sample: list[tuple[str, list[bytes]]]) -> None:
    lists = _tensor_lists(sample)
    specs = [spec for specs in lists for spec in specs]
    shapes = [s[1] for s in specs if isinstance(s, list) and len(s) == 2]
    dims = {d for shape in shapes if isinstance(shape, list) for d in shape}
    assert [0, 2**64 - 1] in shapes  # the spec that used to kill the broker
    assert {2**64 - 1, 2**63, -1, -(2**63), 2**30} <= dims
    names = {s[0] for s in specs if isinstance(s, list) and len(s) == 2 and isinstance(s[0], str)}
    assert {"uint16", "complex64", "float64"} <= names
    assert any(isinstance(shape, list) and len(shape) > 4 for shape in shapes)
    assert max(len(specs) for specs in lists) > MAX_TENSORS


@pytest.mark.parametrize(
    ("category", "kind"),
    [("bad_version", "protocol version"), ("unknown_type", "message type")],
)
def test_versions_and_types(
    sample: list[tuple[str, list[bytes]]], category: str, kind: str
) -> None:
    errors = set()
    for cat, frames in sample:
        if cat == category:
            with pytest.raises(ProtocolError) as err:
                decode(frames)
            errors.add(str(err.value).split(",")[0])
    assert all(kind in e for e in errors), errors
    assert len(errors) > 5  # many different wrong values
