"""One import path per name, read from the source (nothing is imported): a name of ours is
imported from the module that defines it, never from one that imports it in turn (as
``zmqllm.bus.protocol`` once passed on every message class), and a module's ``__all__``
lists only what it defines."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ("zmqllm", "tests", "benchmarks", "testbed")


def module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The module's own statements, those under a top-level if or try included."""
    for node in body:
        if isinstance(node, ast.If):
            yield from top_level(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            handlers = [n for h in node.handlers for n in h.body]
            yield from top_level(node.body + handlers + node.orelse + node.finalbody)
        else:
            yield node


def defined_and_imported(path: Path) -> tuple[set[str], set[str], list[str]]:
    """Names ``path`` defines, names it imports, and its ``__all__``."""
    defined: set[str] = set()
    imported: set[str] = set()
    exported: list[str] = []
    for node in top_level(ast.parse(path.read_text(), str(path)).body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            defined |= names
            if "__all__" in names and isinstance(node.value, ast.List | ast.Tuple):
                exported = [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
        elif isinstance(node, ast.Import | ast.ImportFrom):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return defined, imported, exported


def second_paths(root: Path, trees: tuple[str, ...] = TREES) -> list[str]:
    """``file:line: module.name`` for every ``from zmqllm... import name`` whose module
    imports ``name`` rather than defining it. A name the module neither defines nor imports
    is left to mypy (benchmarks/compare_revisions.py imports old revisions' layouts)."""
    seen: dict[Path, tuple[set[str], set[str], list[str]]] = {}
    found = []
    for tree in trees:
        for path in sorted((root / tree).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                    continue
                source = module_file(root, node.module)
                if not node.module.startswith("zmqllm") or source is None:
                    continue
                if source not in seen:
                    seen[source] = defined_and_imported(source)
                defined, imported, _ = seen[source]
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    passed_on = alias.name in imported and alias.name not in defined
                    if passed_on and module_file(root, name) is None:
                        found.append(f"{path.relative_to(root)}:{node.lineno}: {name}")
    return found


def foreign_exports(root: Path) -> list[str]:
    """``module: name`` for every name in an ``__all__`` that its module does not define."""
    found = []
    for path in sorted((root / "zmqllm").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        defined, _, exported = defined_and_imported(path)
        for name in exported:
            if name in defined:
                continue
            if module_file(root, f"{module}.{name}") is None:
                found.append(f"{module}: {name}")
    return found


def test_every_name_is_imported_from_where_it_is_defined() -> None:
    assert second_paths(ROOT) == []


def test_every_all_lists_only_names_its_module_defines() -> None:
    assert foreign_exports(ROOT) == []


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    files = {
        "zmqllm/bus/wire.py": "class ProtocolError(Exception): ...\n",
        "zmqllm/bus/codec.py": (
            "from zmqllm.bus.wire import ProtocolError\n"
            "try:\n    import fast\nexcept ImportError:\n    SLOW = True\n"
            "def decode(): ...\n"
            '__all__ = ["ProtocolError", "decode"]\n'
        ),
        "zmqllm/bus/__init__.py": "",
        "zmqllm/user.py": "from zmqllm.bus.codec import ProtocolError, decode\n",
        "zmqllm/ok.py": "from zmqllm.bus.codec import SLOW, decode\nfrom zmqllm.bus import codec\n",
        "tests/test_user.py": "def f():\n    from zmqllm.bus.codec import ProtocolError\n",
        "tests/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_a_second_path_is_found(tree: Path) -> None:
    assert second_paths(tree, ("zmqllm", "tests")) == [
        "zmqllm/user.py:1: zmqllm.bus.codec.ProtocolError",
        "tests/test_user.py:2: zmqllm.bus.codec.ProtocolError",
    ]
    assert foreign_exports(tree) == ["zmqllm.bus.codec: ProtocolError"]
