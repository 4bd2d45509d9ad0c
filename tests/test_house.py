"""The house rules a review holds the tree to, checked from the source alone (no import runs):
no import circle among tritonkit's modules (lazy imports inside functions included), kernels and
ops never import the inspection tool, a family reaches another family only through its public
names, ops never import the layers above them, and every file stays under the line cap."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "tritonkit"
MAX_LINES = 800  # formatted (ruff format): the cap is on the code as it reads, not packed to fit


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import in the file, at any depth."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def _graph() -> dict[str, set[str]]:
    """tritonkit module -> the tritonkit modules it imports (a ``from package import module`` counts
    as importing the module)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        edges = set()
        for module, names in _imports(path):
            if not module.startswith("tritonkit"):
                continue
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in files] or [module]
            edges |= {t for t in targets if t in files and t != name}
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles, each as the path that closes it (depth-first, one report per circle)."""
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_no_import_circle_anywhere_in_the_package():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_nothing_under_ops_imports_the_inspection_tool_or_the_layers_above():
    above = (
        "tritonkit.asm",
        "tritonkit.bench",
        "tritonkit.cli",
        "tritonkit.nn",
        "tritonkit.distributed",
        "tritonkit.integrations",
    )
    offending = {
        name: sorted(t for t in targets if t.startswith(above))
        for name, targets in _graph().items()
        if name.startswith("tritonkit.ops")
    }
    assert {name: t for name, t in offending.items() if t} == {}


def _family(module: str) -> str | None:
    """The family a module of tritonkit.ops belongs to (its package, or itself for a one-file family)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "ops" else None


def test_a_family_takes_only_public_names_from_another():
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    private = []
    for name, path in files.items():
        for module, names in _imports(path):
            theirs, mine = _family(module), _family(name)
            if theirs and theirs != mine:
                private += [f"{name} takes {module}.{n}" for n in names if n.startswith("_")]
    assert private == []


@pytest.mark.parametrize("folder", ["src", "tests", "benchmarks"])
def test_every_file_is_under_the_line_cap(folder):
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / folder).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
