"""The shape of the source tree: no import cycles (imports inside functions count), no module over 400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "bertforge"
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the bertforge modules it imports anywhere in its source (top level, functions, type-checking)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from bertforge.data import preprocess` imports a module; `from bertforge.fileio import x` a name.
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names
                ]
            else:
                continue
            found.update(t for t in targets if t in modules and t != name)
        graph[name] = found
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph(_modules())
    assert len(graph) > 30 and sum(map(len, graph.values())) > 50  # the graph was read, not empty
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "bertforge"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from bertforge.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from bertforge import a\n    return a\n")
    modules = {"bertforge": pkg / "__init__.py", "bertforge.a": pkg / "a.py", "bertforge.b": pkg / "b.py"}
    assert find_cycle(import_graph(modules)) == ["bertforge.a", "bertforge.b", "bertforge.a"]


def test_no_module_is_over_400_lines():
    long = {
        name: n for name, p in _modules().items() if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_every_family_module_satisfies_the_family_interface():
    from bertforge.model.architectures import FAMILY_MODULES, satisfies

    assert len(FAMILY_MODULES) >= 5
    for module in FAMILY_MODULES:
        assert satisfies(module) == [], f"{module.__name__} lacks {satisfies(module)}"
    assert "key_table" in satisfies(ast) and "FAMILIES" in satisfies(ast)  # the check sees a module that is none
