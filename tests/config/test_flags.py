"""Flags made from the settings dataclasses: every key has one, and they override the file
(no torch needed: the broker and the gateway parse these too)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from zmqllm import cli
from zmqllm.config.flags import (
    ROLES,
    SECTIONS,
    flag_overrides,
    role_settings,
    section_settings,
)
from zmqllm.config.loading import load_config
from zmqllm.config.settings import Config, ConfigError

BEATS = {"heartbeat_interval", "heartbeat_liveness"}
ALL = None  # every field of the section, read off its dataclass

# What each role must take, written out here rather than read off ROLES, so a field added
# to a section without a flag on its roles fails below.
EXPECTED: dict[str, dict[str, set[str] | None]] = {
    "broker": {"broker": ALL, "security": ALL, "log": {"level", "format"}},
    "worker": {
        "worker": ALL,
        "model": {"path", "revision", "dtype", "device", "quant"},
        "broker": BEATS,
        "security": ALL,
        "log": {"level", "format"},
    },
    "gateway": {
        "gateway": ALL,
        "model": {"path", "name"},
        "broker": BEATS,
        "security": ALL,
        "log": {"level", "format"},
    },
    "status": {"gateway": {"broker"}, "security": ALL, "log": {"level", "format"}},
    "up": {
        "model": {"path", "quant"},
        "gateway": {"port", "api_keys_file", "ssl_certfile", "ssl_keyfile"},
        "security": ALL,
        "log": {"level", "format", "dir"},
    },
    "ray": {
        "ray": ALL,
        "model": {"path", "quant"},
        "gateway": {"port"},
        "security": ALL,
        "log": {"level"},
    },
    "ticket": {
        "broker": {"frontend", "backend"},
        "model": {"path"},
        "security": {"keys"},
        "log": {"level", "format"},
    },
    "measure": {
        "model": {"path", "revision", "dtype", "device", "quant"},
        "worker": {"threads", "max_memory_mb", "packed_rows", "native_attention", "kv_dtype"},
        "log": {"level", "format"},
    },
    "plan": {
        "model": {"path", "quant", "dtype"},
        "worker": {"max_memory_mb"},
        "log": {"level", "format"},
    },
}

# Flags users and scripts already type; they must keep working.
KEPT = {
    "broker": "--frontend --backend --queue-size --queue-timeout --heartbeat-interval "
    "--heartbeat-liveness",
    "worker": "--model --revision --layers --stage --device --dtype --broker --threads "
    "--batch-threads --cpu-lock --max-sessions --max-kv-tokens --max-memory-mb "
    "--prefill-chunk --name --heartbeat-interval --heartbeat-liveness",
    "gateway": "--host --port --broker --model --model-name --max-concurrent --max-queued "
    "--queue-timeout --first-token-timeout --inter-token-timeout --heartbeat-interval "
    "--heartbeat-liveness",
    "status": "--broker --json --timeout",
    "up": "--port --model --log-dir --ready-timeout",
    "ray": "",
    "ticket": "",
    "measure": "",
    "plan": "",
}
NEW = {
    "broker": "--keys --insecure --no-insecure --max-message-bytes --session-timeout --announce",
    "worker": "--keys --insecure --native-attention --no-native-attention --packed-rows "
    "--wire-dtype --quant --join --discover",
    "gateway": "--keys --insecure --api-key-file --ssl-certfile --ssl-keyfile --join "
    "--request-timeout --max-body-bytes --default-max-tokens",
    "status": "--keys --insecure",
    "up": "--keys --insecure --api-key-file --ssl-certfile --ssl-keyfile --quant",
    "ray": "--address --namespace --strategy --front-resource --ready-timeout --model --port",
    "ticket": "--frontend --backend --model --keys --layers --expires --name --client --address",
    "measure": "--model --quant --threads --max-memory-mb --json",
    "plan": "--model --quant --max-memory-mb --figures --ray --json",
}

# `zmqllm ray` has commands of its own; each takes the role's flags (here: `ray up`).
COMMAND = {"ray": ("ray", "up")}


def role_parser(role: str) -> argparse.ArgumentParser:
    found: argparse.ArgumentParser = cli.build_parser()
    for word in COMMAND.get(role, (role,)):
        (sub,) = [a for a in found._actions if isinstance(a, argparse._SubParsersAction)]
        found = sub.choices[word]
    return found


def parse(role: str, *argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args([*COMMAND.get(role, (role,)), *argv])


def sample(kind: type, choices: tuple[str, ...] | None) -> tuple[list[str], object]:
    """Command-line words for a value of this kind, and the value they parse to."""
    if kind is bool:
        return [], True
    if choices:
        return [choices[-1]], choices[-1]
    return {int: (["7"], 7), float: (["2.5"], 2.5), str: (["x"], "x")}[kind]


def test_every_role_has_a_table_and_every_table_a_parser() -> None:
    assert set(ROLES) == set(EXPECTED)
    for role in ROLES:
        role_parser(role)  # argparse would refuse two fields with one flag


@pytest.mark.parametrize("role", sorted(EXPECTED))
def test_every_field_a_role_takes_has_a_flag_that_reaches_its_key(role: str) -> None:
    options = role_parser(role)._option_string_actions
    for section, names in EXPECTED[role].items():
        fields = [f.name for f in dataclasses.fields(SECTIONS[section])]
        wanted = fields if names is ALL else sorted(names)
        by_name = {s.name: s for s in section_settings(section)}
        for name in wanted:
            setting = by_name[name]
            assert setting.flag in options, f"{role}: no flag for [{section}] {name}"
            words, value = sample(setting.kind, setting.choices)
            ns = parse(role, setting.flag, *words)
            assert flag_overrides(role, ns) == {section: {name: value}}, setting.flag
    # ...and nothing else: a role takes only the keys listed for it.
    taken = {(s.section, s.name) for s in role_settings(role)}
    listed = {
        (section, f.name)
        for section, names in EXPECTED[role].items()
        for f in dataclasses.fields(SECTIONS[section])
        if names is ALL or f.name in names
    }
    assert taken == listed


@pytest.mark.parametrize("role", sorted(EXPECTED))
def test_existing_and_new_flag_names(role: str) -> None:
    options = role_parser(role)._option_string_actions
    for flag in [*KEPT[role].split(), *NEW[role].split(), "--config", "--log-level"]:
        assert flag in options, f"zmqllm {role} has no {flag}"


def test_every_section_field_is_declared_with_help() -> None:
    assert set(SECTIONS) == {"model", "broker", "worker", "gateway", "log", "security", "ray"}
    for section in SECTIONS:
        for setting in section_settings(section):
            assert setting.help and setting.flag.startswith("--")


def test_absent_flags_are_none_and_leave_the_file() -> None:
    for role in ROLES:
        ns = parse(role)
        assert flag_overrides(role, ns) == {}
        assert all(getattr(ns, s.dest) is None for s in role_settings(role))


def test_a_flag_overrides_the_file_and_an_absent_one_does_not(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        "[worker]\npacked_rows = 8\nthreads = 2\nnative_attention = false\n"
        '[model]\ndtype = "bfloat16"\n',
        encoding="utf-8",
    )
    cfg = cli._load(parse("worker", "--config", str(path), "--packed-rows", "4"))
    assert cfg.worker.packed_rows == 4
    assert cfg.worker.threads == 2 and cfg.worker.native_attention is False
    assert cfg.model.dtype == "bfloat16"
    assert cfg.broker == load_config(path).broker


def test_bool_flags(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[security]\ninsecure = true\n", encoding="utf-8")
    on = cli._load(parse("worker", "--no-native-attention", "--insecure"))
    assert on.worker.native_attention is False and on.security.insecure is True
    off = cli._load(parse("broker", "--config", str(path), "--no-insecure"))
    assert off.security.insecure is False
    assert cli._load(parse("broker", "--config", str(path))).security.insecure is True


def test_flags_land_in_their_own_section() -> None:
    # Both [gateway] and [broker] have queue_timeout: the gateway takes its own.
    cfg = cli._load(parse("gateway", "--queue-timeout", "5", "--model", "tiny"))
    assert cfg.gateway.queue_timeout == 5.0
    assert cfg.broker.queue_timeout == Config().broker.queue_timeout
    assert cfg.model.path == "tiny"
    cfg = cli._load(parse("gateway", "--api-key-file", "/k", "--ssl-certfile", "/c"))
    assert (cfg.gateway.api_keys_file, cfg.gateway.ssl_certfile) == ("/k", "/c")
    assert cli._load(parse("status", "--broker", "tcp://h:1")).gateway.broker == "tcp://h:1"


def test_stage_is_the_alternative_to_layers() -> None:
    assert cli._load(parse("worker", "--stage", "2/3")).worker.layers == "2/3"
    assert cli._load(parse("worker", "--layers", "0:4")).worker.layers == "0:4"
    with pytest.raises(ConfigError, match="not both"):
        cli._load(parse("worker", "--stage", "1/2", "--layers", "0:4"))


def test_flag_values_are_checked_like_the_file() -> None:
    with pytest.raises(ConfigError, match="packed_rows in \\[worker\\] of command-line"):
        cli._load(parse("worker", "--packed-rows", "-1"))
    with pytest.raises(ConfigError, match="port in \\[gateway\\]"):
        cli._load(parse("gateway", "--port", "70000"))
    for bad in (["--dtype", "float64"], ["--threads", "two"], ["--log-level", "loud"]):
        with pytest.raises(SystemExit):
            parse("worker", *bad)


def test_main_reports_a_bad_flag_value(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--broker", "nowhere"]) == 2
    assert "broker in [gateway] of command-line overrides" in capsys.readouterr().err


def test_help_lists_each_key_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("worker", "--help")
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "[worker] settings:" in text and "[security] settings:" in text
    assert "--native-attention, --no-native-attention" in text
    assert "([worker] packed_rows = 16)" in text
    assert '([model] path = "default")' in text
