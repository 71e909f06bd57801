"""The API key set: the key file, the environment, reloading, and the constant-time check."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from zmqllm.config.settings import ConfigError
from zmqllm.gateway import api_keys as api_keys_module
from zmqllm.gateway.api_keys import ENV_VAR, ApiKeys, load_api_keys, parse_keys

KEY_A = "sk-alpha-0123456789"
KEY_B = "sk-bravo-9876543210"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def events(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def rewrite(path: Path, text: str) -> None:
    """Write ``text`` so the change shows even within one mtime tick (the size or inode
    could stay the same): a new file renamed over the old one, as editors and
    configuration tools do."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


# --- the file -------------------------------------------------------------------------


def test_keys_are_lines_without_blanks_comments_or_surrounding_space() -> None:
    text = f"# keys for the team\n\n  {KEY_A}  \r\n\t# {KEY_B} retired\n{KEY_B}\n"
    assert parse_keys(text, "keys.txt") == [KEY_A, KEY_B]


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n   \n"])
def test_a_file_without_keys_is_an_error_naming_it(text: str) -> None:
    with pytest.raises(ConfigError, match=r"keys\.txt holds no keys"):
        parse_keys(text, "keys.txt")


@pytest.mark.parametrize("line", [f"{KEY_A} # note", "sk-é-key", "a\x07b"])
def test_a_key_that_could_not_travel_in_a_header_is_an_error_without_its_text(line: str) -> None:
    with pytest.raises(ConfigError, match=r"keys\.txt, line 2") as info:
        parse_keys(f"{KEY_B}\n{line}\n", "keys.txt")
    assert KEY_A not in str(info.value) and KEY_B not in str(info.value)


def test_a_missing_or_unreadable_file_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'nope.txt'}: cannot read it")):
        ApiKeys.from_file(tmp_path / "nope.txt")
    with pytest.raises(ConfigError, match="cannot read it"):
        ApiKeys.from_file(tmp_path)  # a directory
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match=re.escape(f"{binary}: cannot read it")):
        ApiKeys.from_file(binary)


# --- where the keys come from ---------------------------------------------------------------


def test_the_file_wins_over_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(KEY_A + "\n")
    keys = load_api_keys(str(path), {ENV_VAR: KEY_B})
    assert keys is not None and keys.source == str(path) and keys.count == 1
    assert keys.matches(KEY_A) and not keys.matches(KEY_B)


def test_the_environment_gives_one_key_when_no_file_is_set() -> None:
    keys = load_api_keys("", {ENV_VAR: f"  {KEY_B}\n"})
    assert keys is not None and keys.source == f"${ENV_VAR}"
    assert keys.matches(KEY_B) and not keys.matches(KEY_A)


@pytest.mark.parametrize("environ", [{}, {ENV_VAR: ""}, {ENV_VAR: "   "}])
def test_no_file_and_no_variable_leaves_the_api_open(environ: dict[str, str]) -> None:
    assert load_api_keys("", environ) is None


def test_a_variable_with_a_space_inside_is_an_error() -> None:
    with pytest.raises(ConfigError, match=ENV_VAR):
        load_api_keys("", {ENV_VAR: "two words"})


# --- checking a request's header ------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "verdict"),
    [
        (None, (False, "missing")),
        ("", (False, "missing")),
        ("Basic dXNlcjpwYXNz", (False, "malformed")),
        ("Bearer", (False, "malformed")),
        ("Bearer   ", (False, "malformed")),
        (KEY_A, (False, "malformed")),  # the key without its scheme
        ("Bearer sk-alpha", (False, "invalid")),  # a prefix of a key
        (f"Bearer {KEY_A}x", (False, "invalid")),
        (f"Bearer {KEY_A}", (True, "")),
        (f"bearer {KEY_A}", (True, "")),  # the scheme is case-insensitive (RFC 7235)
        (f"  BEARER   {KEY_B} ", (True, "")),
    ],
)
def test_check_reads_a_bearer_header(header: str | None, verdict: tuple[bool, str]) -> None:
    keys = ApiKeys([KEY_A, KEY_B])
    result = keys.check(header)
    assert (result.allowed, result.reason) == verdict


def test_every_allowed_digest_is_compared_even_after_a_match(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = ApiKeys([KEY_A, KEY_B, "sk-charlie"])
    seen: list[tuple[bytes, bytes]] = []
    real = api_keys_module.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(api_keys_module.hmac, "compare_digest", counting)
    assert keys.matches(KEY_A)  # the first key matches: the other two are compared anyway
    assert len(seen) == 3
    # Digests of equal length are compared, never the key text.
    given = hashlib.sha256(KEY_A.encode()).digest()
    assert all(a == given and len(b) == 32 for a, b in seen)
    seen.clear()
    assert not keys.matches("wrong")
    assert len(seen) == 3


def test_the_key_text_is_not_kept() -> None:
    keys = ApiKeys([KEY_A])
    assert KEY_A not in repr(vars(keys))


# --- reloading ------------------------------------------------------------------------------


def test_a_changed_file_is_read_again_at_most_once_a_second(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(KEY_A + "\n")
    clock = Clock()
    keys = ApiKeys.from_file(path, clock=clock)
    rewrite(path, KEY_B + "\n")
    clock.now += 0.5
    assert keys.check(f"Bearer {KEY_A}").allowed  # not looked at yet
    clock.now += 0.6
    assert not keys.check(f"Bearer {KEY_A}").allowed
    assert keys.check(f"Bearer {KEY_B}").allowed


def test_an_edit_in_place_is_seen_too(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(KEY_A + "\n")
    clock = Clock()
    keys = ApiKeys.from_file(path, clock=clock)
    with path.open("a") as f:
        f.write(KEY_B + "\n")
    clock.now += 1.0
    assert keys.check(f"Bearer {KEY_B}").allowed and keys.count == 2


def test_a_failed_reload_keeps_the_keys_and_logs_without_them(
    tmp_path: Path, log_stream: io.StringIO
) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(KEY_A + "\n")
    clock = Clock()
    keys = ApiKeys.from_file(path, clock=clock)

    for broken in ("# emptied mid-write\n", f"{KEY_B} trailing words\n"):
        rewrite(path, broken)
        clock.now += 1.0
        assert keys.check(f"Bearer {KEY_A}").allowed
    path.unlink()
    clock.now += 1.0
    assert keys.check(f"Bearer {KEY_A}").allowed
    clock.now += 1.0
    assert keys.check(f"Bearer {KEY_A}").allowed  # still gone: not reported again

    failures = [e for e in events(log_stream) if e["event"].startswith("API keys not reloaded")]
    assert len(failures) == 3 and all(e["level"] == "error" for e in failures)
    assert str(path) in failures[0]["error"]
    assert KEY_A not in log_stream.getvalue() and KEY_B not in log_stream.getvalue()

    rewrite(path, KEY_B + "\n")  # fixed: read again
    clock.now += 1.0
    assert keys.check(f"Bearer {KEY_B}").allowed and not keys.check(f"Bearer {KEY_A}").allowed
    assert [e["keys"] for e in events(log_stream) if e["event"] == "API keys reloaded"] == [1]
