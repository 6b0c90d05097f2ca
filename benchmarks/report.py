"""Saving a benchmark's results: a Markdown table, the raw rows as JSON, and a horizontal bar chart."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def save(name: str, title: str, table: str, rows: list[dict], bars: list[tuple[str, float, str]], xlabel: str) -> None:
    """Print and write results/<name>.md, .json and .png; `bars` are (label, value, matplotlib colour)."""
    text = f"{title}\n\n{table}\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text)
    (RESULTS / f"{name}.json").write_text(json.dumps({"title": title, "rows": rows}, indent=2) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.45 * len(bars)))
    ax.barh([b[0] for b in bars], [b[1] for b in bars], color=[b[2] for b in bars])
    # Wrapped, and the title over the whole figure: long ones ran off it.
    ax.set_xlabel("\n".join(textwrap.wrap(xlabel, 55)))
    fig.suptitle("\n".join(textwrap.wrap(title, 105)), fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=120)
