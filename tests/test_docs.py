"""The README and docs/ stay true to the tree and to the command line: every relative link
points at a file (and heading) that exists, every ``zmqllm ...`` / ``bin/worker ...`` line
shown parses with the current parser, and the README stays a front door. Torch-free and
fast: the parser is only built and asked to parse, never run."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from zmqllm.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted([README, *(ROOT / "docs").glob("*.md")])
README_MAX_LINES = 400

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
# Fenced blocks in these languages hold no shell command lines.
NOT_SHELL = {"python", "py", "toml", "json", "js", "javascript", "html", "css", "yaml"}
# The wrappers in bin/ and the sub-command each one runs.
BIN_ROLES = {"broker", "worker", "gateway", "up"}
SHELL_OPERATORS = {"&", "&&", "|", "||", ";", "(", ")"}
REDIRECTIONS = {">", ">>", "<", "2>", "&>", "2>&1"}
# A span with one of these shows a command's shape, not a command: only its flags are checked.
SYNOPSIS = re.compile(r"[\[\]|…]|\.\.\.|<[A-Za-z][^>]*>")
WORD = re.compile(r"^[a-z][a-z0-9-]*$")


def doc_name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


# ---------------------------------------------------------------------------------------
# links


def heading_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = heading_slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def prose_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Lines outside fenced code blocks, with their numbers."""
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def broken_links(path: Path) -> list[str]:
    bad = []
    for number, line in prose_lines(path):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{doc_name(path)}:{number}: ({target})"
            if not dest.exists():
                bad.append(f"{where} no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where} no heading with that anchor in {dest.name}")
    return bad


@pytest.mark.parametrize("path", DOCS, ids=doc_name)
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


def test_docs_exist() -> None:
    assert len(DOCS) > 5, DOCS


# ---------------------------------------------------------------------------------------
# command lines


@dataclass(frozen=True)
class Shown:
    """A command line as a page shows it."""

    where: str
    text: str
    inline: bool  # in `inline code`, where a bare mention (`zmqllm keys add`) is fine


def code_spans(text: str) -> Iterator[tuple[int, str]]:
    """(line, content) of each `inline code` span; a span may run over a line break, never
    over a blank line."""
    number = 1
    for paragraph in re.split(r"(\n[ \t]*\n)", text):
        for m in re.finditer(r"(`+)(.+?)\1", paragraph, re.S):
            yield number + paragraph.count("\n", 0, m.start()), " ".join(m.group(2).split())
        number += paragraph.count("\n")


def shown_commands(path: Path) -> Iterator[Shown]:
    lines = path.read_text(encoding="utf-8").splitlines()
    prose: list[str] = []
    fence_lang: str | None = None
    pending = ""
    start = 0
    for number, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if m:
            fence_lang = None if fence_lang is not None else m.group(2).lower()
            prose.append("")
            continue
        if fence_lang is None:
            prose.append(line)
            continue
        prose.append("")
        if fence_lang in NOT_SHELL:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield Shown(f"{doc_name(path)}:{start}", pending + line, inline=False)
        pending = ""
    for number, span in code_spans("\n".join(prose)):
        yield Shown(f"{doc_name(path)}:{number}", span.replace("\\|", "|"), inline=True)


def command_argv(words: list[str]) -> list[str] | None:
    """The zmqllm arguments of one simple command, or None when it runs something else."""
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # FOO=1 zmqllm ...
        words = words[1:]
    if words and words[0] == "$":  # a prompt
        words = words[1:]
    if not words:
        return None
    head = words[0]
    name = head.rsplit("/", 1)[-1]
    if head.endswith("bin/" + name) and name in BIN_ROLES:
        args = [name, *words[1:]]
    elif name == "zmqllm" and (head == "zmqllm" or head.endswith("bin/zmqllm")):
        args = words[1:]
    else:
        return None
    # Output that starts with the name ("zmqllm gateway: cannot read ...") is no command.
    if args and not (args[0].startswith("-") or WORD.match(args[0])):
        return None
    return args


def simple_commands(text: str) -> Iterator[list[str]]:
    """Shell words of each simple command on a line: split at ; & | && ||, without
    redirections and comments."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|<>()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words: list[str] = []
    skip_next = False
    for token in lexer:
        if skip_next:
            skip_next = False
        elif token in SHELL_OPERATORS:
            yield words
            words = []
        elif token in REDIRECTIONS or re.fullmatch(r"[0-9]?[<>]+&?", token):
            skip_next = True
        else:
            words.append(token)
    yield words


def strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """No abbreviated flags: a doc that says `--no-native` must not pass for
    `--no-native-attention`."""
    parser.allow_abbrev = False
    for sub in subparsers(parser).values():
        strict(sub)
    return parser


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def parse_error(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    """What argparse says is wrong with ``args`` (None when they parse). Only parses."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            parser.parse_args(args)
        except SystemExit as exc:
            if exc.code not in (0, None):  # --help and --version exit 0
                return err.getvalue().strip().splitlines()[-1]
    return None


def synopsis_error(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    """A command's shape (`zmqllm up [--port N] [--keys DIR | --insecure]`): its
    sub-commands must exist and each flag must be one the sub-command takes."""
    for i, word in enumerate(args):
        word = word.strip("[]()")
        if word.startswith("-"):
            break
        choices = subparsers(parser)
        if not choices:
            break
        if word not in choices:
            if i == 0 or WORD.match(word):
                return f"no sub-command {word!r} (of {sorted(choices)})"
            break
        parser = choices[word]
    known = parser._option_string_actions
    for word in args:
        for part in re.split(r"[|/]", word):
            flag = part.strip("[](),").split("=", 1)[0]
            if re.match(r"^--?[A-Za-z]", flag) and flag not in known:
                return f"{parser.prog}: no flag {flag}"
    return None


def command_error(parser: argparse.ArgumentParser, shown: Shown) -> str | None:
    """None when ``shown`` is no zmqllm command or one the parser takes; else why not."""
    text = shown.text.strip()
    if shown.inline and SYNOPSIS.search(text):
        try:
            words = shlex.split(text.replace("|", " | "))
        except ValueError:
            words = text.split()
        args = command_argv(words)
        return None if args is None else synopsis_error(parser, args)
    try:
        commands = list(simple_commands(text))
    except ValueError:  # an unbalanced quote: prose, not a command
        return None
    for words in commands:
        args = command_argv(words)
        if args is None:
            continue
        if any(SYNOPSIS.search(w) for w in args):
            error = synopsis_error(parser, args)
        else:
            error = parse_error(parser, args)
            # A mention in prose (`zmqllm keys add`) may leave out what a run must give.
            if error and shown.inline and "arguments are required" in error:
                error = None
        if error:
            return error
    return None


def offenders(paths: list[Path]) -> list[str]:
    parser = strict(build_parser())
    out = []
    for path in paths:
        for shown in shown_commands(path):
            error = command_error(parser, shown)
            if error:
                out.append(f"{shown.where}: {shown.text!r}: {error}")
    return out


def test_every_command_line_parses() -> None:
    assert offenders(DOCS) == []


def test_commands_are_found() -> None:
    """The extraction sees what the pages show, so the test above checks something."""
    shown = [s.text for p in DOCS for s in shown_commands(p)]
    parser = strict(build_parser())
    found = [s for s in shown if any(command_argv(w) for w in simple_commands_or_none(s))]
    assert len(found) > 20, found
    assert any(s.startswith("bin/up") for s in found)
    assert parse_error(parser, ["worker", "--stage", "2/2", "--quant", "int4"]) is None


def simple_commands_or_none(text: str) -> list[list[str]]:
    try:
        return list(simple_commands(text))
    except ValueError:
        return []


def test_a_gone_flag_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Start one with `zmqllm worker --stage 1/2 --made-up-flag 3`.\n\n"
        "```bash\n"
        "ZMQLLM_HOME=/tmp/h bin/worker --broker tcp://127.0.0.1:5556 \\\n"
        "    --no-such-thing &   # a comment\n"
        "zmqllm status --json | jq .workers\n"
        "```\n\n"
        "| `zmqllm up [--port N] [--bogus-flag]` | a shape |\n"
        "| `bin/worker --no-native` | an abbreviation is not the flag |\n"
        "| `zmqllm frobnicate` | no such sub-command |\n",
        encoding="utf-8",
    )
    found = offenders([page])
    assert len(found) == 5, found
    for needle in ("--made-up-flag", "--no-such-thing", "--bogus-flag", "--no-native"):
        assert sum(needle in line for line in found) == 1, (needle, found)
    assert any("frobnicate" in line for line in found)


def test_output_and_mentions_are_not_commands(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Made by `zmqllm keys add`; see `zmqllm worker --help` and `zmqllm/bus/keys.py`.\n\n"
        "```\n"
        "zmqllm gateway: API key file /etc/zmqllm/api-keys: cannot read it\n"
        "[zmqllm] broker started again (pid 48213)\n"
        "$ zmqllm worker --help\n"
        "```\n\n"
        "```python\nzmqllm --not-a-shell-line\n```\n",
        encoding="utf-8",
    )
    assert offenders([page]) == []


# ---------------------------------------------------------------------------------------
# the front door


def test_readme_is_a_front_door() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    text = "\n".join(lines)
    for command in ("bin/up", "bin/test"):
        assert f"\n{command} " in text, command
    for page in (ROOT / "docs").glob("*.md"):
        assert f"(docs/{page.name})" in text, f"README does not link {page.name}"
