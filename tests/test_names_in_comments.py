"""Files and modules named in comments and docstrings exist: every Python or Markdown file
named (bare or with its folders) and every dotted name under ``zmqllm`` (a module, or what
a module binds) in the comments and docstrings of zmqllm/, tests/ and testbed/, read from
the source. A module that moves or is renamed fails this until the comments that name it
say its new name."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("zmqllm", "tests", "testbed")
# Files of other projects that comments name on purpose.
ELSEWHERE = {
    "MDP.py": "the ZeroMQ guide's Majordomo protocol",
    "mdwrkapi.py": "the ZeroMQ guide's Majordomo worker API",
    "mdworker.py": "the ZeroMQ guide's Majordomo worker",
    "quantize.py": "gpt-fast's weight quantizer",
}
FILE_NAME = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[A-Za-z_][\w-]*\.(?:py|md))\b")
DOTTED = re.compile(r"(?<![\w.])zmqllm(?:\.[A-Za-z_]\w*)+")


def sources(root: Path, trees: tuple[str, ...] = TREES) -> Iterator[Path]:
    for tree in trees:
        yield from sorted((root / tree).rglob("*.py"))


def prose(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of each comment and docstring of ``path``."""
    text = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc


def known_files(root: Path) -> tuple[set[str], set[str]]:
    """Paths (relative to ``root``) and bare names of the checkout's .py and .md files."""
    paths = {
        p.relative_to(root).as_posix()
        for pattern in ("*.py", "*.md")
        for p in root.rglob(pattern)
        if not any(part.startswith(".") for part in p.relative_to(root).parts)
    }
    return paths, {path.rpartition("/")[2] for path in paths}


def file_exists(name: str, here: Path, root: Path, paths: set[str], names: set[str]) -> bool:
    if "/" not in name:
        return name in names or name in ELSEWHERE
    if (here.parent / name).exists():
        return True
    return any(path == name or path.endswith(f"/{name}") for path in paths)


def defines(path: Path, name: str) -> bool:
    """Whether module ``path`` binds ``name`` at its top level (def, class, =, import)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == name:
                return True
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            if node.id == name:
                return True
        elif isinstance(node, ast.alias) and (node.asname or node.name) == name:
            return True
    return False


def module_exists(dotted: str, root: Path) -> bool:
    """Whether ``dotted`` is a package or module, or names what the last module in it binds."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:i])
        module = base.with_suffix(".py")
        if module.is_file() or base.is_dir():
            rest = parts[i:]
            if not rest:
                return True
            source = module if module.is_file() else base / "__init__.py"
            return source.is_file() and defines(source, rest[0])
    return False


def stale_names(root: Path, trees: tuple[str, ...] = TREES) -> list[str]:
    paths, names = known_files(root)
    found = []
    for path in sources(root, trees):
        where = path.relative_to(root)
        for line, text in prose(path):
            for name in FILE_NAME.findall(text):
                if not file_exists(name, path, root, paths, names):
                    found.append(f"{where}:{line}: {name}")
            for dotted in DOTTED.findall(text):
                if not module_exists(dotted, root):
                    found.append(f"{where}:{line}: {dotted}")
    return found


def test_names_in_comments_and_docstrings_exist() -> None:
    assert stale_names(ROOT) == []


def test_a_stale_name_is_found(tmp_path: Path) -> None:
    (tmp_path / "zmqllm" / "bus").mkdir(parents=True)
    (tmp_path / "zmqllm" / "__init__.py").write_text("")
    (tmp_path / "zmqllm" / "bus" / "__init__.py").write_text("")
    (tmp_path / "zmqllm" / "bus" / "codec.py").write_text(
        '"""Frames (see zmqllm.bus.codec.decode, not codec_old.py)."""\n'
        "def decode(): ...\n"
        "# bus/codec.py, zmqllm/bus/codec.py and MDP.py are fine; zmqllm.bus.gone is not,\n"
        "# nor zmqllm.bus.codec.encode, nor bus/wire.py, nor DESIGN.md\n"
    )
    assert sorted(stale_names(tmp_path, ("zmqllm",))) == [
        "zmqllm/bus/codec.py:1: codec_old.py",
        "zmqllm/bus/codec.py:3: zmqllm.bus.gone",
        "zmqllm/bus/codec.py:4: DESIGN.md",
        "zmqllm/bus/codec.py:4: bus/wire.py",
        "zmqllm/bus/codec.py:4: zmqllm.bus.codec.encode",
    ]
