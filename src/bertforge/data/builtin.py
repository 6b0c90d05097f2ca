"""A corpus every machine has: the docstrings of the installed Python standard library (several MB of English)."""

from __future__ import annotations

import ast
import sysconfig
from collections.abc import Iterator
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


def write_stdlib_corpus(path: str | Path) -> tuple[int, int]:
    """One docstring per line into `path`; returns (documents, bytes)."""
    lines = [text for _, text in stdlib_docstrings()]
    data = "\n".join(lines) + "\n"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)
    return len(lines), len(data.encode("utf-8"))
