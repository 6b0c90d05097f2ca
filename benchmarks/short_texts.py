"""Short-text classification tasks every machine has, made from the docstrings of Python's standard library: which of
its 10 most documented public modules a text comes from.

- `docstrings`: whole docstrings (as one line), at most 300 per module; most under 40 tokens, one in ten over 128.
- `sentences`: the first sentence of each docstring, 4 to 40 words, at most 400 per module; a median of 14 tokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

TASKS = ("docstrings", "sentences")


def _first_sentences() -> Iterator[tuple[str, str]]:
    from bertforge.data.builtin import stdlib_docstrings

    for module, text in stdlib_docstrings(min_words=1):
        sentence = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0]
        if 4 <= len(sentence.split()) <= 40:
            yield module, sentence


def write_task(task: str, path: Path) -> None:
    """The task's rows (id, text, module) as a CSV table at `path`."""
    from bertforge.data import tabular
    from bertforge.data.builtin import stdlib_docstrings, stdlib_module_task

    texts, per_class = (stdlib_docstrings(), 300) if task == "docstrings" else (_first_sentences(), 400)
    rows, _ = stdlib_module_task(texts, classes=10, per_class=per_class, test_fraction=0.0)
    path.parent.mkdir(parents=True, exist_ok=True)
    tabular.write_csv(str(path), ["id", "text", "module"], [list(r.values()) for r in rows])
