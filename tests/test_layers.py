"""The package's layering, read from the source (every import, function-level ones included):

* ``artifact/`` is the bottom layer, the one contract between compiler and runtime: it imports
  nothing of the package but itself and the shared leaves (``errors``);
* the compiler (``frontend/``, ``ir/``, ``passes/``, ``codegen/``) and the runtime import nothing
  of each other, except that the runtime may run the IR (the reference target interprets it);
* ``ir/``, ``passes/`` and ``codegen/`` import nothing from ``frontend/``;
* no import cycles among modules;
* no source file outside ``tests/`` and ``bench/`` is over 600 lines;
* the repository is self-contained: nothing cites a specification or folder outside it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LEAVES = {"dsv4c", "dsv4c.errors", "dsv4c.threads"}
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = ["dsv4c", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).parts
        if rel[0] in ("tests", "bench", "scripts", "examples") or rel[0].startswith("."):
            continue
        out[_module_name(path)] = path
    return out


SOURCES = _sources()


def _imports(name: str, path: Path) -> set[str]:
    """The package modules ``name`` imports anywhere in its source (``from dsv4c.a import b``
    counts as dsv4c.a.b when that is a module, else dsv4c.a)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in SOURCES else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t == "dsv4c" or t.startswith("dsv4c."))
    out.discard(name)
    return out


GRAPH = {name: _imports(name, path) for name, path in SOURCES.items()}


def _layer(module: str) -> str:
    """The top-level folder a module lies in (artifact, frontend, ...), or a top-level module's own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (ROOT / parts[1]).is_dir() else module


def _offenders(importers: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, targets in GRAPH.items() for t in targets
                  if _layer(m) in importers and _layer(t) in forbidden)


def test_the_graph_was_read():
    assert len(GRAPH) > 40 and "dsv4c.artifact.manifest" in GRAPH["dsv4c.runtime.engine"]


def test_artifact_is_the_bottom_layer():
    bad = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() if _layer(m) == "artifact"
                 for t in targets if _layer(t) != "artifact" and t not in LEAVES)
    assert not bad, bad


@pytest.mark.parametrize("importers, forbidden", [
    (("frontend", "ir", "passes", "codegen"), ("runtime",)),
    (("runtime",), ("frontend", "passes", "codegen")),
    (("ir",), ("frontend",)),
    (("passes", "codegen"), ("frontend",)),  # what they share with it (row sources) lies in artifact/
])
def test_layers_import_only_downward(importers, forbidden):
    bad = _offenders(importers, forbidden)
    assert not bad, bad


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(GRAPH.get(m, ())):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(GRAPH):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, " -> ".join(cycle)


def test_every_package_is_installed():
    """A non-editable install ships only the packages pyproject.toml lists."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name if path.name == "__init__.py" else name.rpartition(".")[0] for name, path in SOURCES.items()}
    assert packages <= listed, sorted(packages - listed)


def test_no_source_file_is_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in SOURCES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


# What the project's sources once cited outside the repository; spelled apart so that this file
# does not cite them itself. docs/ (docs/v4.md for the model) holds what they pointed at.
OUTSIDE_CITATIONS = tuple("".join(parts) for parts in (("SPEC", " ", "\u00a7"), ("SPEC", " ", '"'), ("..", "/shared")))


def test_nothing_cites_documents_outside_the_repository():
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    found = []
    for name in tracked:
        path = ROOT / name
        if path.suffix not in (".py", ".md", ".toml", ".cc", ".h", ".txt", ".sh", "") or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        found += [f"{name}: {c}" for c in OUTSIDE_CITATIONS if c in text]
    assert not found, found
