"""`bertforge plot RUN`: curves of a run as a PNG.

A pretraining run: loss, validation loss and learning rate against steps and tokens. A fine-tuning run: training
loss and the validation metric of every fold against steps, and out-of-fold predictions against the targets.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from bertforge.errors import UserError
from bertforge.train.logging import read_metrics


def plot_run(run: str | Path, out: str | Path | None = None) -> Path:
    run = Path(run)
    info = run / "run.json"
    if info.exists() and json.loads(info.read_text()).get("kind") == "finetune":
        return plot_finetune(run, out)
    records = read_metrics(run)
    if not records:
        raise UserError(f"{run}: no metrics.jsonl (has the run logged a step yet?)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if "loss" in r]
    valid = [r for r in records if "valid_loss" in r]
    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=(3, 1))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, label="train MLM loss")
    if valid:
        ax_loss.plot([r["step"] for r in valid], [r["valid_loss"] for r in valid], "o-", label="validation MLM loss")
    ax_loss.set_ylabel("loss (nats)")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    if train and "tokens" in train[-1]:
        top = ax_loss.secondary_xaxis(
            "top",
            functions=(
                lambda s: s * train[-1]["tokens"] / max(train[-1]["step"], 1) / 1e6,
                lambda t: t * 1e6 * max(train[-1]["step"], 1) / train[-1]["tokens"],
            ),
        )
        top.set_xlabel("tokens (millions)")
    if valid:
        last = valid[-1]
        fig.suptitle(
            f"{run.name}: validation loss {last['valid_loss']:.3f}, "
            f"perplexity {last.get('valid_perplexity', float('nan')):.1f}, "
            f"masked-token accuracy {100 * last.get('valid_accuracy', float('nan')):.1f}%",
            fontsize=9,
        )
    ax_lr.plot([r["step"] for r in train], [r.get("lr", float("nan")) for r in train], color="C2", lw=1)
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(out) if out else run / "curves.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_finetune(run: Path, out: str | Path | None = None) -> Path:
    folds = sorted(run.glob("fold-*/metrics.jsonl"), key=lambda p: int(p.parent.name.split("-")[1]))
    if not folds:
        raise UserError(f"{run}: no fold has logged a step yet")
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else None
    metric = summary["metric"] if summary else None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_oof) = plt.subplots(1, 2, figsize=(11, 4.5))
    ax_metric = ax_loss.twinx()
    for i, path in enumerate(folds):
        records = read_metrics(path.parent)
        train = [r for r in records if "loss" in r]
        found = (k[6:] for r in records for k in r if k.startswith("valid_") and k != "valid_loss")
        metric = metric or next(found, "loss")
        valid = [r for r in records if f"valid_{metric}" in r]
        name = path.parent.name
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], color=f"C{i}", lw=0.8, alpha=0.5)
        ax_metric.plot([r["step"] for r in valid], [r[f"valid_{metric}"] for r in valid], "o-", color=f"C{i}",
                       label=f"{name} validation {metric}")  # fmt: skip
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss (thin lines)")
    ax_metric.set_ylabel(f"validation {metric}")
    ax_metric.legend(fontsize=7)
    ax_loss.grid(alpha=0.3)
    oof = run / "oof.csv"
    if oof.exists():
        with open(oof, newline="", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
        if rows and "prediction" in rows[0]:
            target = [c for c in rows[0] if c not in ("id", "fold", "prediction")][0]
            xs, ys = [float(r[target]) for r in rows], [float(r["prediction"]) for r in rows]
            ax_oof.scatter(xs, ys, s=6, alpha=0.5, c=[int(r["fold"]) for r in rows], cmap="tab10", vmin=0, vmax=9)
            lo, hi = min(xs + ys), max(xs + ys)
            ax_oof.plot([lo, hi], [lo, hi], color="k", lw=0.8)
            ax_oof.set_xlabel(f"target ({target})")
            ax_oof.set_ylabel("out-of-fold prediction")
        elif rows:
            labels = sorted({r["target"] for r in rows})
            correct = [sum(r["prediction"] == r["target"] for r in rows if r["target"] == c) for c in labels]
            total = [sum(r["target"] == c for r in rows) for c in labels]
            ax_oof.bar(labels, [c / t for c, t in zip(correct, total, strict=True)])
            ax_oof.set_ylabel("out-of-fold accuracy per class")
        ax_oof.grid(alpha=0.3)
    if summary:
        fig.suptitle(
            f"{run.name}: {metric} {summary['mean']:.4f} ± {summary['std']:.4f} over {len(summary['folds'])} fold(s)",
            fontsize=9,
        )
    fig.tight_layout()
    path = Path(out) if out else run / "curves.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
