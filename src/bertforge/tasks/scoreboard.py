"""A suite's scoreboard from its units' results: per task the learning rate whose seeds' mean main metric is the
best, that rate's seeds (mean, standard deviation, each seed), each metric's mean, and the task's score (the mean of
its metrics' means); the suite's average, the mean of its tasks' scores. Scores are in percent, as the suites'
leaderboards write them."""

from __future__ import annotations

import io
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bertforge.data.suites import Suite
from bertforge.fileio import finite_json, write_atomic

# A task's entries besides its metrics' means.
_NOT_METRICS = {"name", "metric", "mean", "std", "seeds", "lr", "score", "by_lr"}


def _percent(value: float, already: bool) -> float:
    return float(value) if already else 100.0 * float(value)


def _spread(values: Sequence[float]) -> float:
    """The sample standard deviation; 0 for one seed."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def task_entry(suite: Suite, short: str, results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One task's line of the scoreboard from its units' results ({"lr", "seed", "metrics"}), every unit finished."""
    task = suite.tasks[short]
    main = task.metrics[0]
    by_lr: dict[float, list[dict[str, Any]]] = {}
    for r in sorted(results, key=lambda r: (r["lr"], r["seed"])):
        by_lr.setdefault(r["lr"], []).append(r)
    mean_of = lambda rs, m: statistics.mean(_percent(r["metrics"][m], task.percent) for r in rs)  # noqa: E731
    # The first of equally good rates (the smallest) wins.
    lr = max(by_lr, key=lambda rate: (mean_of(by_lr[rate], main), -rate))
    chosen = by_lr[lr]
    seeds = [_percent(r["metrics"][main], task.percent) for r in chosen]
    means = {m: mean_of(chosen, m) for m in task.metrics}
    entry = {"name": task.name, "metric": main, "mean": statistics.mean(seeds), "std": _spread(seeds),
             "seeds": seeds, "lr": lr, **means, "score": statistics.mean(means.values())}  # fmt: skip
    entry["by_lr"] = {f"{rate:g}": mean_of(rs, main) for rate, rs in by_lr.items()}
    return entry


def scoreboard(suite: Suite, model: str, results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The scoreboard of the tasks in `results` (short name -> its units' results)."""
    tasks = {short: task_entry(suite, short, rs) for short, rs in results.items()}
    average = statistics.mean(t["score"] for t in tasks.values()) if tasks else float("nan")
    every = set(tasks) == set(suite.tasks)
    return {"suite": suite.name, "model": model, "tasks": tasks, "average": average, "all_tasks": every}


def markdown(board: dict[str, Any]) -> str:
    """The scoreboard as a Markdown table, the average last."""
    lines = [f"{board['suite']}: {board['model']}", "",
             "| task | metrics | score | main metric: mean ± std over seeds | learning rate | seeds |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for t in board["tasks"].values():
        metrics = [m for m in t if m not in _NOT_METRICS]
        shown = " / ".join(f"{m} {t[m]:.2f}" for m in metrics)
        lines.append(f"| {t['name']} | {shown} | {t['score']:.2f} | {t['metric']} {t['mean']:.2f} ± {t['std']:.2f} "
                     f"| {t['lr']:g} | {len(t['seeds'])} |")  # fmt: skip
    which = "every task" if board["all_tasks"] else "the tasks run"
    lines.append(f"| average ({which}) | | {board['average']:.2f} | | | |")
    return "\n".join(lines) + "\n"


def plot(board: dict[str, Any], path: Path) -> None:
    """Each task's main metric: its seeds' mean with their spread (a bar and its standard deviation), each seed a
    dot."""
    from bertforge.tasks import plot as plots

    tasks = list(board["tasks"].values())
    fig, ax = plots.pyplot().subplots(figsize=(max(4.0, 1.1 * len(tasks) + 1.5), 3.6))
    x = range(len(tasks))
    ax.bar(x, [t["mean"] for t in tasks], yerr=[t["std"] for t in tasks], color="C0", alpha=0.7, capsize=4)
    for i, t in enumerate(tasks):
        ax.plot([i] * len(t["seeds"]), t["seeds"], "k.", ms=4)
    ax.set_xticks(list(x), [f"{t['name']}\n{t['metric']}" for t in tasks], fontsize=8)
    ax.set_ylabel("main metric (%), mean ± std over seeds")
    ax.set_title(f"{board['suite']}: {Path(board['model']).name or board['model']}, average {board['average']:.2f}",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    png = io.BytesIO()
    plots.save_figure(fig, png, format="png")
    write_atomic(path, png.getvalue())


def write(board: dict[str, Any], out: Path) -> None:
    """scoreboard.json, scoreboard.md and scoreboard.png in `out`, each written whole or not at all."""
    write_atomic(out / "scoreboard.json", finite_json(board, indent=2) + "\n")
    write_atomic(out / "scoreboard.md", markdown(board))
    plot(board, out / "scoreboard.png")
