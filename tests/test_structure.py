"""The shape of the source tree: no import cycles (imports inside functions count), no module over 400 lines, no
function over 60, no module named after a standard library module, every model family module satisfying the family
interface, every stage's config and main in tasks/, and docs/architecture.md's layout written from the modules.

`python tests/test_structure.py` writes the layout into docs/architecture.md again after modules change."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "bertforge"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_LINES = 400
MAX_FUNCTION_LINES = 60


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {_module_name(p, package): p for p in sorted(package.rglob("*.py"))}


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


def long_modules(modules: dict[str, Path]) -> dict[str, int]:
    """module -> its line count, for every module over MAX_LINES."""
    counts = {name: len(p.read_text(encoding="utf-8").splitlines()) for name, p in modules.items()}
    return {name: n for name, n in counts.items() if n > MAX_LINES}


def long_functions(modules: dict[str, Path]) -> dict[str, int]:
    """module:function -> its length in lines, for every function (nested ones too) over MAX_FUNCTION_LINES."""
    found = {}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found[f"{name}:{node.name}"] = length
    return found


def stray_mains(modules: dict[str, Path]) -> list[str]:
    """Modules outside tasks/ that define a stage's `main` at top level (cli.py's is the command's entry point)."""
    stray = []
    for name, path in modules.items():
        if ".tasks." in name or name.endswith(".cli"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            stray.append(name)
    return stray


def test_no_module_is_over_400_lines():
    long = long_modules(_modules())
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_function_is_over_60_lines():
    long = long_functions(_modules())
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def shadowing(modules: dict[str, Path]) -> list[str]:
    """Modules named after a standard library module: `import logging` beside one reads as the wrong one."""
    return [name for name in modules if name.rpartition(".")[2] in sys.stdlib_module_names]


def test_no_module_is_named_after_a_standard_library_module():
    assert shadowing(_modules()) == []


def test_every_stage_has_its_config_and_main_in_tasks():
    from bertforge.cli import COMMANDS

    assert len(COMMANDS) >= 10
    for name, command in COMMANDS.items():
        module = command.config.partition(":")[0]
        assert module.startswith("bertforge.tasks."), f"`bertforge {name}`: its config is in {module}, not tasks/"
    assert stray_mains(_modules()) == []


def test_every_family_module_satisfies_the_family_interface():
    from bertforge.model.architectures import FAMILY_MODULES, satisfies

    assert len(FAMILY_MODULES) >= 5
    for module in FAMILY_MODULES:
        assert satisfies(module) == [], f"{module.__name__} lacks {satisfies(module)}"
    assert "key_table" in satisfies(ast) and "FAMILIES" in satisfies(ast)  # the check sees a module that is none


def test_the_rules_see_a_long_module_a_long_function_a_stray_main_and_a_shadowing_name(tmp_path):
    pkg = tmp_path / "bertforge"
    (pkg / "tasks").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))  # one line more with the def
    (pkg / "data.py").write_text(f"def main(cfg):\n{body}")
    (pkg / "tasks" / "stage.py").write_text("def main(cfg):\n    return cfg\n" + "\n" * MAX_LINES)
    (pkg / "tasks" / "logging.py").write_text("")
    modules = _modules(pkg)
    assert shadowing(modules) == ["bertforge.tasks.logging"]
    assert long_functions(modules) == {"bertforge.data:main": MAX_FUNCTION_LINES + 1}
    assert long_modules(modules) == {"bertforge.tasks.stage": MAX_LINES + 2}
    assert stray_mains(modules) == ["bertforge.data"]


# ------------------------------------------------------------------------------------------- docs/architecture.md
LAYOUT_START = "<!-- layout: written by `python tests/test_structure.py` from each module's docstring -->"
LAYOUT_END = "<!-- /layout -->"


def _summary(path: Path) -> str:
    """The first sentence of a module's docstring, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    text = " ".join(doc.split())
    end = re.search(r"(?<!\bal)(?<!e\.g)(?<!i\.e)\.\s", text)  # not at "et al." or "e.g."
    return (text if end is None else text[: end.start() + 1]).replace("|", "\\|")


def render_layout(package: Path = PACKAGE) -> str:
    """docs/architecture.md's module table: every module of the package, by folder, with its docstring's first
    sentence."""
    rows = ["| module | what it is |", "| --- | --- |"]
    for path in sorted(package.rglob("*.py"), key=lambda p: (len(p.relative_to(package).parts), str(p))):
        rel = path.relative_to(package)
        if rel.name == "__init__.py" and rel.parent == Path("."):
            continue
        shown = f"{rel.parent}/" if rel.name == "__init__.py" else str(rel)
        rows.append(f"| `{shown}` | {_summary(path)} |")
    return "\n".join([LAYOUT_START, *rows, LAYOUT_END])


def _written_layout(text: str) -> str:
    start, end = text.find(LAYOUT_START), text.find(LAYOUT_END)
    assert 0 <= start < end, f"{ARCHITECTURE}: no layout block ({LAYOUT_START})"
    return text[start : end + len(LAYOUT_END)]


def test_the_layout_in_architecture_md_is_the_packages():
    assert _written_layout(ARCHITECTURE.read_text(encoding="utf-8")) == render_layout(), (
        "docs/architecture.md's layout is stale: run `python tests/test_structure.py`"
    )


def named_files(text: str) -> set[str]:
    """The .py files a page names: `model/hf.py`, `cli.py`, `tests/test_structure.py`."""
    return set(re.findall(r"(?<![\w./-])((?:[a-z_]+/)*[a-z_0-9]+\.py)\b", text))


def missing_files(names: set[str]) -> list[str]:
    """The named files that exist neither under src/bertforge, nor (by their path) from the repository's root, nor,
    for a bare name, anywhere in the package, tests/ or benchmarks/."""
    basenames = {p.name for folder in (PACKAGE, ROOT / "tests", ROOT / "benchmarks") for p in folder.rglob("*.py")}
    return sorted(
        n for n in names if not ((PACKAGE / n).exists() or (ROOT / n).exists() or ("/" not in n and n in basenames))
    )


def test_every_file_architecture_md_names_exists():
    names = named_files(ARCHITECTURE.read_text(encoding="utf-8"))
    assert len(names) > 20
    assert missing_files(names) == []
    assert missing_files({"model/nowhere.py", "tokenizer.py", "tests/conftest.py"}) == ["model/nowhere.py"]


if __name__ == "__main__":
    page = ARCHITECTURE.read_text(encoding="utf-8")
    ARCHITECTURE.write_text(page.replace(_written_layout(page), render_layout()), encoding="utf-8")
    print(f"wrote the layout of {ARCHITECTURE}")
