"""The package-by-role layout and its dependency rules, read from the source (nothing is
imported): what each package of ``zmqllm/`` may import of ours and of the ML stack, and
no import cycle, type-only imports included. docs/architecture.md ("Layout") says why."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The packages of zmqllm/ each package (or loose module) may import, itself aside.
ALLOWED: dict[str, set[str]] = {
    "log": set(),
    "version": set(),
    "config": {"log"},
    "bus": {"config", "log", "version"},
    "models": {"config", "log"},
    "broker": {"bus", "config", "log", "version"},
    "client": {"bus", "config", "log", "version"},
    # The gateway reaches the broker through client/ only.
    "gateway": {"client", "bus", "config", "log", "models", "version"},
    "engine": {"bus", "config", "log", "models"},
    "worker": {"engine", "bus", "config", "log", "models", "version"},
    # The remote worker runs on the pipeline worker's shell (worker/'s link, loop, faults).
    "remote": {"worker", "bus", "config", "log", "version"},
    # The launcher starts the roles as processes: it imports none of them.
    "launch": {"client", "bus", "config", "log", "models", "version"},
    # The roles as Ray actors: command lines as the launcher makes them (launch.plan).
    "onray": {"launch", "config", "log", "version"},
    # The command line starts every role, in the process it runs in.
    "cli": {"broker", "bus", "client", "config", "engine", "gateway", "launch"}
    | {"log", "models", "onray", "remote", "version", "worker"},
    "__init__": set(),
    "__main__": {"cli"},
}
ML_STACK = {"torch", "transformers", "safetensors", "accelerate"}
# Outside packages each package must not import.
FORBIDDEN: dict[str, set[str]] = {
    "bus": ML_STACK,
    "config": ML_STACK | {"zmq"},
    "broker": ML_STACK,
    "client": ML_STACK,
    "gateway": ML_STACK | {"zmq"},
    "launch": ML_STACK,
    "onray": ML_STACK,
    "remote": ML_STACK,
    "log": ML_STACK | {"zmq"},
}
# Ray is an optional extra that only zmqllm/onray/ uses: no role depends on it.
for _package in ALLOWED:
    if _package != "onray":
        FORBIDDEN[_package] = FORBIDDEN.get(_package, set()) | {"ray"}
# Never imported from the runtime package: test and benchmark code.
NEVER = {"testbed", "tests", "benchmarks"}


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(root: Path, path: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every import in ``path``: inside functions and under
    TYPE_CHECKING too; ``from a import b`` gives ``a.b`` when that is a module."""
    mod = module_name(root, path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join([*base, *([node.module] if node.module else [])])
            else:
                name = node.module or ""
            for alias in node.names:
                sub = f"{name}.{alias.name}"
                as_file = root / Path(*sub.split("."))
                if as_file.with_suffix(".py").is_file() or (as_file / "__init__.py").is_file():
                    yield node.lineno, sub
                else:
                    yield node.lineno, name


def graph(root: Path) -> dict[str, dict[str, int]]:
    """Each module of ``root/zmqllm`` -> {imported name: first line}."""
    out: dict[str, dict[str, int]] = {}
    for path in sorted((root / "zmqllm").rglob("*.py")):
        edges: dict[str, int] = {}
        for line, name in imported(root, path):
            edges.setdefault(name, line)
        out[module_name(root, path)] = edges
    return out


def role(module: str) -> str:
    """The package (or loose module) of zmqllm that ``module`` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def rule_breaks(root: Path) -> list[str]:
    """Every import that breaks a rule above, as "module:line imports name (why)"."""
    out = []
    for mod, edges in graph(root).items():
        pkg = role(mod)
        allowed = ALLOWED.get(pkg)
        if allowed is None:
            out.append(f"{mod}: zmqllm/{pkg} is no package of the layout")
            continue
        for name, line in edges.items():
            top = name.split(".")[0]
            where = f"{mod}:{line} imports {name}"
            if top == "zmqllm" and name != "zmqllm":
                other = role(name)
                if other != pkg and other not in allowed:
                    out.append(f"{where} ({pkg} may not import {other})")
            elif top in FORBIDDEN.get(pkg, set()):
                out.append(f"{where} ({pkg} may not import {top})")
            elif top in NEVER:
                out.append(f"{where} (the runtime never imports {top})")
    return out


def cycles(root: Path) -> list[list[str]]:
    """The import cycles among zmqllm's modules (Tarjan's strongly connected components)."""
    g = graph(root)
    succ = {m: [n for n in edges if n in g and n != m] for m, edges in g.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_zmqllm_holds_only_the_role_packages_and_few_loose_modules() -> None:
    top = sorted(p.name for p in (ROOT / "zmqllm").iterdir() if p.name != "__pycache__")
    loose = [n for n in top if n.endswith(".py")]
    assert set(loose) <= {"__init__.py", "__main__.py", "cli.py", "log.py", "version.py"}
    packages = [n for n in top if (ROOT / "zmqllm" / n / "__init__.py").is_file()]
    assert set(packages) == {p for p in ALLOWED if p not in {"log", "version", "cli"}} - {
        "__init__",
        "__main__",
    }


def test_every_package_init_is_empty() -> None:
    # One import path for each name: nothing is re-exported by a package.
    inits = sorted((ROOT / "zmqllm").glob("*/__init__.py"))
    assert inits and [p for p in inits if p.read_text().strip()] == []


def test_the_imports_keep_the_layout_rules() -> None:
    assert rule_breaks(ROOT) == []


def test_no_import_cycles_type_only_ones_included() -> None:
    assert cycles(ROOT) == []


def test_no_module_is_over_600_lines() -> None:
    long = {
        p.relative_to(ROOT).as_posix(): n
        for p in (ROOT / "zmqllm").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert long == {}


def plant(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def planted(tmp_path: Path) -> Path:
    """A small tree that keeps the rules, for tests that then break one."""
    plant(
        tmp_path,
        {
            "zmqllm/__init__.py": "",
            "zmqllm/log.py": "",
            "zmqllm/bus/__init__.py": "",
            "zmqllm/bus/protocol.py": "from zmqllm.log import x\n",
            "zmqllm/engine/__init__.py": "",
            "zmqllm/engine/model.py": "import torch\nfrom zmqllm.bus import protocol\n",
            "zmqllm/worker/__init__.py": "",
            "zmqllm/worker/pipeline.py": "from zmqllm.engine.model import Model\n",
            "zmqllm/gateway/__init__.py": "",
            "zmqllm/gateway/app.py": "from zmqllm.bus.protocol import decode\n",
        },
    )
    return tmp_path


def test_the_planted_tree_keeps_the_rules(planted: Path) -> None:
    assert rule_breaks(planted) == [] and cycles(planted) == []


@pytest.mark.parametrize(
    ("rel", "text", "why"),
    [
        ("zmqllm/bus/bad.py", "import torch\n", "bus may not import torch"),
        ("zmqllm/bus/bad.py", "from zmqllm.worker import pipeline\n", "bus may not import worker"),
        ("zmqllm/gateway/bad.py", "import zmq\n", "gateway may not import zmq"),
        ("zmqllm/gateway/bad.py", "from zmqllm.engine.model import M\n", "may not import engine"),
        ("zmqllm/gateway/bad.py", "def f():\n    import torch\n", "gateway may not import torch"),
        ("zmqllm/bus/bad.py", "from . import protocol\nfrom ..engine import model\n", "engine"),
        ("zmqllm/bus/bad.py", "import testbed.fuzz\n", "the runtime never imports testbed"),
        ("zmqllm/stray/bad.py", "", "no package of the layout"),
    ],
)
def test_a_planted_forbidden_import_is_found(planted: Path, rel: str, text: str, why: str) -> None:
    plant(planted, {rel: text})
    breaks = rule_breaks(planted)
    assert len(breaks) == 1 and why in breaks[0], breaks


def test_a_planted_type_only_cycle_is_found(planted: Path) -> None:
    plant(
        planted,
        {
            "zmqllm/bus/a.py": "from zmqllm.bus.b import B\n",
            "zmqllm/bus/b.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from zmqllm.bus.a import A\n"
            ),
        },
    )
    assert cycles(planted) == [["zmqllm.bus.a", "zmqllm.bus.b"]]
