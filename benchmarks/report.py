"""Saving a benchmark's results: a Markdown table, the raw rows as JSON, and a horizontal bar chart."""

from __future__ import annotations

import json
import re
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


# ---------------------------------------------------------------------------------------- tables from the index
# The README's results: (benchmark, recipe, what the row is). Each is shown for every machine the index has it on,
# from the latest run there. A recipe changes its name when its work changes, so a row never mixes the two.
README_ROWS = (
    ("finetune_end_to_end", "sentences-64-defaults-1ep-1eval", "fine-tune short texts with the defaults, 1 epoch"),
    ("finetune_end_to_end", "jnli-128-defaults-1ep-1eval", "fine-tune JNLI sentence pairs with the defaults, 1 epoch"),
    ("questions_and_choices", "jcommonsenseqa_frac0.1", "fine-tune JCommonsenseQA (a tenth), 2 epochs"),
    ("questions_and_choices", "jsquad_frac0.1", "fine-tune JSQuAD question answering (a tenth), 2 epochs"),
    ("embedding_models", "128_frac0.5", "train an embedding model on JSQuAD (half), 1 epoch"),
)
BEGIN = "<!-- results: rendered by benchmarks/report.py from benchmarks/results/index.jsonl; do not edit -->"
END = "<!-- results: end -->"
MACHINES = {"family 25 model 1,": "Zen 3", "family 25 model 17,": "Zen 4", "family 26 ": "Zen 5"}


def machine_name(machine: str) -> str:
    """A machine as a table names it: an AMD EPYC's generation from its CPU family and model."""
    for key, generation in MACHINES.items():
        if key in machine:
            name, _, rest = machine.partition(",")
            cores = rest.rsplit(",", 1)[-1].strip()
            return f"{name} {generation}, {cores}"
    return machine


def latest_runs(lines: list[dict], benchmark: str, recipe: str) -> dict[str, list[dict]]:
    """machine -> the lines of the latest run of (benchmark, recipe) there that has a bertforge line, preferring a
    first run (cache cold) to a warm one of the same day."""
    runs: dict[str, dict[str, list[dict]]] = {}
    for entry in lines:
        if entry["benchmark"] == benchmark and entry["recipe"] == recipe:
            runs.setdefault(entry["machine"], {}).setdefault(entry["run"], []).append(entry)
    out = {}
    for machine, by_run in runs.items():
        timed = [rs for rs in by_run.values() if any(r["system"] == "bertforge" and r["wall_s"] for r in rs)]
        if timed:
            out[machine] = max(timed, key=lambda rs: (rs[0]["date"], rs[0]["cache"] == "cold"))  # stable: last wins
    return out


def comparison(run: list[dict]) -> tuple[dict, dict | None]:
    """(bertforge's line, the faster reference's line or None) of one run."""
    ours = next(r for r in run if r["system"] == "bertforge")
    references = [r for r in run if r["system"] != "bertforge" and r["wall_s"]]
    return ours, min(references, key=lambda r: r["wall_s"], default=None)


def _quality(value: float) -> str:
    return f"{value:.4f}" if abs(value) < 10 else f"{value:.1f}"


def _compared(ours: dict, ref: dict | None) -> str:
    """The cells both tables give a comparison: the reference, both times, "x the time", the metric, both scores,
    the seeds."""
    name = "-" if ref is None else f"{ref['system']}, {ref['variant']}"
    time = "-" if ref is None else f"{ref['wall_s']:.0f} s"
    ratio = "-" if ref is None else f"{ours['wall_s'] / ref['wall_s']:.2f}x"
    quality = "-" if ref is None else _quality(ref["value"])
    return (f"{name} | {ours['wall_s']:.0f} s | {time} | {ratio} | {ours['metric']} | {_quality(ours['value'])} "
            f"| {quality} | {len(ours['seeds'])}")  # fmt: skip


def render_table(lines: list[dict], rows: tuple[tuple[str, str, str], ...] = README_ROWS) -> str:
    """The results table: one row per (benchmark, recipe) and machine, one number per cell, the ratio against the
    faster reference as "x the time"."""
    out = [
        "| task | machine | cache | reference | bertforge | reference's time | x the time | metric | bertforge "
        "| reference | seeds | date, commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for benchmark, recipe, label in rows:
        for machine, run in sorted(latest_runs(lines, benchmark, recipe).items()):
            ours, ref = comparison(run)
            out.append(f"| {label} | {machine_name(machine)} | {ours['cache']} | {_compared(ours, ref)} "
                       f"| {ours['date']}, {ours['commit']} |")  # fmt: skip
    return "\n".join(out)


def render_readme(lines: list[dict], rows: tuple[tuple[str, str, str], ...] = README_ROWS) -> str:
    """The README's results: per machine, a caption naming it, the cache, the dates and the commits, then a row per
    (benchmark, recipe) with one number per cell and the ratio against the faster reference as "x the time"."""
    by_machine: dict[str, list[tuple[str, dict, dict | None]]] = {}
    for benchmark, recipe, label in rows:
        for machine, run in latest_runs(lines, benchmark, recipe).items():
            by_machine.setdefault(machine, []).append((label, *comparison(run)))
    out = []
    for machine, found in sorted(by_machine.items()):
        caches = sorted({ours["cache"] for _, ours, _ in found})
        dates = ", ".join(sorted({ours["date"] for _, ours, _ in found}))
        commits = ", ".join(sorted({ours["commit"] for _, ours, _ in found}))
        cache = "first runs (compile cache empty)" if caches == ["cold"] else f"cache {', '.join(caches)}"
        label = "commit" if "," not in commits else "commits"
        out += [f"{machine_name(machine)}; {cache}; medians over the seeds; {dates}; {label} {commits}:", "",
                "| task | reference | bertforge | reference's time | x the time | metric | bertforge | reference "
                "| seeds |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for label, ours, ref in found:
            out.append(f"| {label} | {_compared(ours, ref)} |")
        out.append("")
    return "\n".join(out).rstrip("\n")


def begin(benchmark: str | None = None, kind: str = "results") -> str:
    """The line a rendered table starts after: the README's, or a benchmark's `kind` of table ("results",
    "scoreboards") on the results page."""
    return BEGIN if benchmark is None else BEGIN.replace("<!-- results:", f"<!-- {kind} of {benchmark}:")


def rendered(text: str, table: str, benchmark: str | None = None, kind: str = "results") -> str:
    """`text` with the part between begin(benchmark, kind) and the END after it replaced by `table`."""
    start = text.index(begin(benchmark, kind)) + len(begin(benchmark, kind))
    end = text.index(END, start)
    return text[:start] + "\n" + table + "\n" + text[end:]


def all_rows(lines: list[dict]) -> tuple[tuple[str, str, str], ...]:
    """Every (benchmark, recipe) of the index with a timed bertforge line and a timed reference."""
    timed = {(r["benchmark"], r["recipe"], r["system"] == "bertforge") for r in lines if r["wall_s"]}
    pairs = sorted({(b, rc) for b, rc, ours in timed if ours and (b, rc, False) in timed})
    return tuple((b, rc, f"{b}: {rc}") for b, rc in pairs)


def benchmark_rows(lines: list[dict], benchmark: str) -> tuple[tuple[str, str, str], ...]:
    """Every recipe of `benchmark` with a timed bertforge line and a timed reference, named by its recipe."""
    return tuple((b, recipe, recipe) for b, recipe, _ in all_rows(lines) if b == benchmark)


def scoreboards(text: str) -> list[str]:
    """The benchmarks whose suite scoreboards a page holds."""
    return re.findall(r"<!-- scoreboards of (\S+): rendered", text)


def render_scoreboards(lines: list[dict], benchmark: str) -> str:
    """Each task's score on both sides of `benchmark`'s latest run per recipe and machine, from the scoreboards its
    lines carry (a suite's: per task its name, main metric, mean and standard deviation over the seeds, score)."""
    out = ["| recipe | machine | task | bertforge: score | main metric, mean ± std | reference: score "
           "| main metric, mean ± std |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for _, recipe, _ in benchmark_rows(lines, benchmark):
        for machine, run in sorted(latest_runs(lines, benchmark, recipe).items()):
            ours, ref = comparison(run)
            if ref is None or "scoreboard" not in ours or "scoreboard" not in ref:
                continue
            mine, theirs = ours["scoreboard"], ref["scoreboard"]
            for task, t in mine["tasks"].items():
                r = theirs["tasks"][task]
                out.append(f"| {recipe} | {machine_name(machine)} | {t['name']} | {t['score']:.2f} | {t['metric']} "
                           f"{t['mean']:.2f} ± {t['std']:.2f} | {r['score']:.2f} | {r['metric']} {r['mean']:.2f} ± "
                           f"{r['std']:.2f} |")  # fmt: skip
            out.append(f"| {recipe} | {machine_name(machine)} | average | {mine['average']:.2f} | "
                       f"| {theirs['average']:.2f} | |")  # fmt: skip
    return "\n".join(out)


def speed_tables(text: str) -> list[str]:
    """The benchmarks whose speeds (lines with no wall time, a speed as their metric) a page holds."""
    return re.findall(r"<!-- speeds of (\S+): rendered", text)


def render_speeds(lines: list[dict], benchmark: str) -> str:
    """The latest speed of each recipe of `benchmark` per machine: one row each, the number as measured."""
    latest: dict[tuple[str, str], dict] = {}
    for entry in lines:
        if entry["benchmark"] == benchmark and entry["wall_s"] is None:
            latest[(entry["recipe"], entry["machine"])] = entry  # the index is in the order written: last wins
    out = ["| recipe | machine | variant | metric | value | seeds | date, commit |", "|---|---|---|---|---|---|---|"]
    for (recipe, machine), e in sorted(latest.items()):
        out.append(f"| {recipe} | {machine_name(machine)} | {e['variant']} | {e['metric']} | {e['value']:,.0f} "
                   f"| {len(e['seeds'])} | {e['date']}, {e['commit']} |")  # fmt: skip
    return "\n".join(out)


def page_benchmarks(text: str) -> list[str]:
    """The benchmarks whose tables a page holds."""
    return re.findall(r"<!-- results of (\S+): rendered", text)


def pages(lines: list[dict]) -> dict[Path, str]:
    """Each page with rendered tables -> its text with every table rendered from `lines`: README.md's results, and
    each benchmark's table on the results pages (docs/benchmarks.md, docs/gpu.md)."""
    root = Path(__file__).resolve().parent.parent
    readme = root / "README.md"
    out = {readme: rendered(readme.read_text(encoding="utf-8"), render_readme(lines))}
    for results in (root / "docs/benchmarks.md", root / "docs/gpu.md"):
        text = results.read_text(encoding="utf-8")
        for benchmark in page_benchmarks(text):
            text = rendered(text, render_table(lines, benchmark_rows(lines, benchmark)), benchmark)
        for kind, found, render in (("scoreboards", scoreboards, render_scoreboards),
                                    ("speeds", speed_tables, render_speeds)):  # fmt: skip
            for benchmark in found(text):
                marker = f"<!-- {kind} of {benchmark}: rendered"
                start = text.index(marker) + text[text.index(marker) :].index("\n") + 1
                end = text.index(END, start)
                text = text[:start] + render(lines, benchmark) + "\n" + text[end:]
        out[results] = text
    return out


def main() -> None:
    import argparse

    from results_index import read

    p = argparse.ArgumentParser(description="Render the results tables of README.md and docs/benchmarks.md from "
                                "the results index.")  # fmt: skip
    p.add_argument("--check", action="store_true", help="exit 1 when a page is not what the index renders")
    args = p.parse_args()
    for page, new in pages(read()).items():
        text = page.read_text(encoding="utf-8")
        if args.check and new != text:
            raise SystemExit(f"{page.name}'s results table is not what the index renders: run benchmarks/report.py")
        if not args.check:
            page.write_text(new, encoding="utf-8")


if __name__ == "__main__":
    main()
