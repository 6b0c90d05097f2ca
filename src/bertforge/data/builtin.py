"""A corpus every machine has: the docstrings of the installed Python standard library (several MB of English)."""

from __future__ import annotations

import ast
import random
import sysconfig
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

from bertforge.fileio import write_atomic


def stdlib_docstrings(min_words: int = 8) -> Iterator[tuple[str, str]]:
    """(top-level module, docstring as one line) for every module, class and function docstring in the stdlib."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("test", "idlelib", "site-packages", "lib2to3") or "tests" in rel.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = rel.parts[0].removesuffix(".py")
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    text = " ".join(doc.split())
                    if len(text.split()) >= min_words:
                        yield module, text


def write_stdlib_corpus(
    path: str | Path, docstrings: Iterable[tuple[str, str]], exclude: Collection[str] = ()
) -> tuple[int, int]:
    """One docstring of stdlib_docstrings() per line into `path`, leaving out those in `exclude`; returns
    (documents, bytes)."""
    lines = [text for _, text in docstrings if text not in exclude]
    data = "\n".join(lines) + "\n"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)
    return len(lines), len(data.encode("utf-8"))


def stdlib_module_task(
    docstrings: Iterable[tuple[str, str]],
    classes: int = 8,
    per_class: int = 150,
    test_fraction: float = 0.1,
    seed: int = 0,
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """A classification task on stdlib_docstrings(): which top-level module a docstring comes from.

    The `classes` public modules with the most docstrings, at most `per_class` of each; a docstring found in two
    modules is dropped (its label would be ambiguous). Returns (train, test) rows {id, text, module}, the test rows
    `test_fraction` of each class.
    """
    by_text: dict[str, set[str]] = {}
    for module, text in docstrings:
        by_text.setdefault(text, set()).add(module)
    by_module: dict[str, list[str]] = {}
    for text, modules in by_text.items():
        if len(modules) == 1:
            by_module.setdefault(next(iter(modules)), []).append(text)
    public = sorted((m for m in by_module if not m.startswith("_")), key=lambda m: (-len(by_module[m]), m))
    rng = random.Random(seed)
    train: list[dict[str, str]] = []
    test: list[dict[str, str]] = []
    for module in sorted(public[:classes]):
        texts = sorted(by_module[module])
        rng.shuffle(texts)
        texts = texts[:per_class]
        held = max(1, round(test_fraction * len(texts)))
        for i, text in enumerate(texts):
            (test if i < held else train).append({"id": f"{module}-{i}", "text": text, "module": module})
    rng.shuffle(train)
    rng.shuffle(test)
    return train, test
