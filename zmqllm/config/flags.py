"""Command-line flags made from the settings dataclasses of settings.py.

A setting is declared once, as a field of a section with its default and help text
(``[worker] packed_rows``, see ``settings.setting``). This module turns the fields a role
takes into flags (``--packed-rows N``) and a parsed namespace back into per-section
overrides. Every generated flag defaults to None, "not given", which ``with_overrides``
ignores, so the config file's value stands unless the flag is on the command line.

Torch-free: the broker and the gateway import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin, get_type_hints

from zmqllm.config.loading import with_overrides
from zmqllm.config.settings import Config

__all__ = [
    "ROLES",
    "SECTIONS",
    "Setting",
    "Take",
    "add_setting_flags",
    "apply_flags",
    "changed_flags",
    "flag_overrides",
    "role_settings",
    "section_settings",
]


@dataclass(frozen=True)
class Setting:
    """One field of one settings section, as a command-line flag."""

    section: str  # "worker"
    name: str  # "packed_rows"
    kind: type  # int, float, str or bool; ``str | None`` is str
    default: Any
    flag: str  # "--packed-rows"
    help: str
    metavar: str | None
    choices: tuple[str, ...] | None

    @property
    def dest(self) -> str:
        """The namespace attribute: the flag's name, as argparse would make it."""
        return self.flag[2:].replace("-", "_")

    @property
    def key(self) -> str:
        return f"[{self.section}] {self.name}"


@dataclass(frozen=True)
class Take:
    """The fields of one section a role takes: all, only some, or all but some."""

    section: str
    only: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()


BEATS = ("heartbeat_interval", "heartbeat_liveness")
# Every role logs; [log] dir is only where the launcher puts its children's logs.
LOG = Take("log", only=("level", "format"))

# The settings each role's command takes, in --help order. Within one role two fields
# must not share a flag (argparse refuses to build such a parser), so a role takes one of
# them explicitly: the gateway takes its own queue_timeout and not [broker]'s, a worker its
# own name and not [model] name.
ROLES: dict[str, tuple[Take, ...]] = {
    "broker": (Take("broker"), Take("security"), LOG),
    "worker": (
        Take("worker"),
        Take("model", skip=("name",)),  # the served name is the gateway's
        Take("broker", only=BEATS),
        Take("security"),
        LOG,
    ),
    "gateway": (
        Take("gateway"),
        Take("model", only=("path", "name")),  # the tokenizer and the served name
        Take("broker", only=BEATS),
        Take("security"),
        LOG,
    ),
    "status": (Take("gateway", only=("broker",)), Take("security"), LOG),
    # The launcher's own flags; plan() passes each on to the children that take it, in
    # this order.
    "up": (
        Take("model", only=("path", "quant")),
        Take("gateway", only=("port", "api_keys_file", "ssl_certfile", "ssl_keyfile")),
        Take("security"),
        Take("log", only=("level", "format", "dir")),
    ),
    # `zmqllm ticket` on the broker's host: its endpoints and keys, the model a worker
    # ticket is for.
    "ticket": (
        Take("broker", only=("frontend", "backend")),
        Take("model", only=("path",)),
        Take("security", only=("keys",)),
        LOG,
    ),
    # `zmqllm measure`: what a worker's probe depends on (launch/split.py, worker/self_measure.py).
    "measure": (
        Take("model", skip=("name",)),
        Take(
            "worker",
            only=("threads", "max_memory_mb", "packed_rows", "native_attention", "kv_dtype"),
        ),
        LOG,
    ),
    # `zmqllm plan`: the model and what the stages' probes run with.
    "plan": (
        Take("model", only=("path", "quant", "dtype")),
        Take("worker", only=("max_memory_mb",)),
        LOG,
    ),
    # `zmqllm ray up|status|down` (zmqllm/onray/): the Ray cluster, and what `up` takes.
    "ray": (
        Take("ray"),
        Take("model", only=("path", "quant")),
        Take("gateway", only=("port",)),
        Take("security"),
        Take("log", only=("level",)),
    ),
}

# How a value is named in --help when the field names nothing better. Every float
# setting is a duration in seconds; a string is named by argparse after its flag.
_METAVARS: dict[type, str] = {int: "N", float: "S"}


def _sections() -> dict[str, type]:
    hints = get_type_hints(Config)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(Config)
        if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name])
    }


SECTIONS: dict[str, type] = _sections()  # "model" -> ModelSettings, ...; not [[stages]]


def _kind(annotation: Any, key: str) -> type:
    if get_origin(annotation) in (Union, types.UnionType):
        (annotation,) = [arg for arg in get_args(annotation) if arg is not type(None)]
    if annotation not in (int, float, str, bool):
        raise TypeError(f"{key}: no command-line flag for a field of type {annotation!r}")
    kind: type = annotation
    return kind


@functools.cache
def section_settings(section: str) -> tuple[Setting, ...]:
    """Every field of a section, as flags."""
    cls = SECTIONS[section]
    hints = get_type_hints(cls)
    settings = []
    for f in dataclasses.fields(cls):
        key = f"[{section}] {f.name}"
        if "help" not in f.metadata:
            raise TypeError(f"{key} is not declared with config.setting(), so it has no help")
        settings.append(
            Setting(
                section=section,
                name=f.name,
                kind=_kind(hints[f.name], key),
                default=f.default,
                flag=f.metadata["flag"] or "--" + f.name.replace("_", "-"),
                help=f.metadata["help"],
                metavar=f.metadata["metavar"],
                choices=f.metadata["choices"],
            )
        )
    return tuple(settings)


@functools.cache
def role_settings(role: str) -> tuple[Setting, ...]:
    """The settings ``zmqllm ROLE`` takes as flags."""
    settings: list[Setting] = []
    for take in ROLES[role]:
        every = section_settings(take.section)
        unknown = sorted({*take.only, *take.skip} - {s.name for s in every})
        if unknown:  # a renamed field must not silently drop its flag from a role
            raise KeyError(f"role {role!r} names unknown [{take.section}] keys: {unknown}")
        settings += [
            s for s in every if (not take.only or s.name in take.only) and s.name not in take.skip
        ]
    return tuple(settings)


def _toml(value: object) -> str:
    # Defaults are shown as a config file would spell them.
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, str) else str(value)


def _help(setting: Setting) -> str:
    default = "" if setting.default is None else f" = {_toml(setting.default)}"
    # argparse %-formats help texts: a literal % must be doubled.
    return f"{setting.help} ({setting.key}{default})".replace("%", "%%")


def add_setting_flags(parser: argparse.ArgumentParser, role: str) -> None:
    """Add a flag for every setting ``role`` takes, grouped by section in --help."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for s in role_settings(role):
        if s.section not in groups:
            groups[s.section] = parser.add_argument_group(f"[{s.section}] settings")
        group = groups[s.section]
        if s.kind is bool:
            group.add_argument(
                s.flag,
                dest=s.dest,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=_help(s),
            )
        else:
            metavar = s.metavar or (None if s.choices else _METAVARS.get(s.kind))
            group.add_argument(
                s.flag,
                dest=s.dest,
                type=s.kind,
                choices=s.choices,
                metavar=metavar,
                default=None,
                help=_help(s),
            )


def flag_overrides(role: str, ns: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The settings given on the command line, by section: ``{"worker": {"layers": "1/2"}}``.

    A flag not given is None, or absent from a namespace built by hand; either way the
    config file's value stands.
    """
    given: dict[str, dict[str, Any]] = {}
    for s in role_settings(role):
        value = getattr(ns, s.dest, None)
        if value is not None:
            given.setdefault(s.section, {})[s.name] = value
    return given


def apply_flags(cfg: Config, role: str, ns: argparse.Namespace) -> Config:
    """``cfg`` with the flags of ``role`` given in ``ns`` applied, checked like the file."""
    for section, values in flag_overrides(role, ns).items():
        cfg = with_overrides(cfg, section, values)
    return cfg


def changed_flags(role: str, cfg: Config, base: Config, settings: Iterable[Setting]) -> list[str]:
    """Flags giving ``role`` the values of ``settings`` where ``cfg`` differs from ``base``.

    For the launcher: its children read ``base`` (the same config file) themselves, so only
    what its own flags changed is passed on, and only to the roles that take that setting.
    """
    takes = set(role_settings(role))
    argv: list[str] = []
    for s in settings:
        value = getattr(getattr(cfg, s.section), s.name)
        if s not in takes or value == getattr(getattr(base, s.section), s.name):
            continue
        if isinstance(value, bool):
            argv.append(s.flag if value else f"--no-{s.flag[2:]}")
        elif value is not None:  # no flag unsets a value; not reachable from `up`'s flags
            argv += [s.flag, str(value)]
    return argv
