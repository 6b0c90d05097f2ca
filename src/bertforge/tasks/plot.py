"""`bertforge plot RUN`: curves of a run as a PNG.

A pretraining run: loss, validation loss and learning rate against steps and tokens. A fine-tuning run: training
loss and the validation metric of every fold against steps, and out-of-fold predictions against the targets.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from bertforge import runs
from bertforge.errors import UserError
from bertforge.train.metrics_log import METRICS, read_metrics


@dataclasses.dataclass(frozen=True)
class PlotConfig:
    run: str  # run folder
    out: str = ""  # PNG to write (default: RUN/curves.png)


def main(cfg: PlotConfig) -> Path:
    return plot_run(cfg.run, cfg.out or None)


def plot_run(run: str | Path, out: str | Path | None = None) -> Path:
    """Draw RUN's curves into `out` (default RUN/curves.png); a fine-tuning run gets plot_finetune's figure."""
    run = Path(run)
    if runs.kind(run) == "finetune":
        return plot_finetune(run, out)
    records = read_metrics(run)
    if not records:
        raise UserError(f"{run}: no metrics.jsonl (has the run logged a step yet?)")
    fig = pretrain_figure(run.name, records)
    path = Path(out) if out else run / "curves.png"
    save_figure(fig, path)
    return path


# Fonts with Japanese, Chinese and Korean glyphs: matplotlib falls back from DejaVu Sans to the first of these
# installed for each glyph it lacks (an entity type or a class named in Japanese, a run's name).
CJK_FONTS = ("Noto Sans CJK JP", "Noto Sans JP", "IPAexGothic", "IPAGothic", "Hiragino Sans", "Yu Gothic",
             "MS Gothic", "Noto Sans CJK SC", "Microsoft YaHei", "Arial Unicode MS")  # fmt: skip


def pyplot() -> Any:
    """matplotlib's pyplot without a display, with fonts for CJK labels after the first sans-serif one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fonts = list(matplotlib.rcParams["font.sans-serif"])
    matplotlib.rcParams["font.sans-serif"] = fonts[:1] + [f for f in CJK_FONTS if f not in fonts] + fonts[1:]
    return plt


def save_figure(fig: Any, target: Any, dpi: int = 120, **kwargs: Any) -> None:
    """fig.savefig, then the figure closed. Where no installed font has a label's glyphs they are drawn as boxes,
    without matplotlib's warning for each glyph."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from font", category=UserWarning)
            fig.savefig(target, dpi=dpi, **kwargs)
    finally:
        pyplot().close(fig)


def pretrain_figure(name: str, records: list[dict[str, Any]]) -> Any:
    """Training and validation MLM loss, masked-token accuracy and learning rate against steps (tokens on top). A
    replaced-token detection run shows its generator's MLM loss and its discriminator's loss, and the
    discriminator's validation accuracy against that of calling every token original. A run with eval.suite shows
    its downstream scores."""
    plt = pyplot()
    rtd = any("disc_loss" in r for r in records)
    loss, valid_loss = ("gen_loss", "valid_gen_loss") if rtd else ("loss", "valid_loss")
    train = [r for r in records if loss in r]
    valid = [r for r in records if valid_loss in r]
    suites = sorted((r for r in records if "suite_average" in r), key=lambda r: r["suite_step"])
    rows = (3, 1.5, 1.5, 1) if suites else (3, 1.5, 1)
    fig, axes = plt.subplots(len(rows), 1, figsize=(7, 7 * sum(rows) / 5.5), sharex=True, height_ratios=rows,
                             layout="constrained")  # fmt: skip
    ax_loss, ax_acc, ax_lr = axes[0], axes[1], axes[-1]
    if suites:
        _suite_scores(axes[2], suites)
    what = "generator MLM loss" if rtd else "MLM loss"
    ax_loss.plot([r["step"] for r in train], [r[loss] for r in train], lw=1, label=f"train {what}")
    if valid:
        ax_loss.plot([r["step"] for r in valid], [r[valid_loss] for r in valid], "o-", label=f"validation {what}")
    if rtd:
        steps, disc = [r["step"] for r in train], [r["disc_loss"] for r in train]
        ax_loss.plot(steps, disc, lw=1, label="train discriminator loss")
        steps, disc = [r["step"] for r in valid], [r["valid_disc_loss"] for r in valid]
        ax_loss.plot(steps, disc, "o-", label="validation discriminator loss")
    ax_loss.set_ylabel("loss (nats)")
    ax_loss.legend()
    if train and train[-1].get("tokens"):
        per_step = train[-1]["tokens"] / max(train[-1]["step"], 1) / 1e6
        top = ax_loss.secondary_xaxis("top", functions=(lambda s: s * per_step, lambda t: t / per_step))
        top.set_xlabel("tokens (millions)")
    if rtd:
        steps = [r["step"] for r in valid]
        ax_acc.plot(steps, [100 * r["valid_disc_accuracy"] for r in valid], "o-", color="C1", label="discriminator")
        ax_acc.plot(steps, [100 * (1 - r["valid_replaced"]) for r in valid], "--", color="C7", label="all original")
        ax_acc.legend(fontsize=7)
        ax_acc.set_ylabel("validation token\naccuracy (%)")
    else:
        accurate = [r for r in valid if "valid_accuracy" in r]
        ax_acc.plot([r["step"] for r in accurate], [100 * r["valid_accuracy"] for r in accurate], "o-", color="C1")
        ax_acc.set_ylabel("validation masked-\ntoken accuracy (%)")
    ax_lr.plot([r["step"] for r in train], [r.get("lr", float("nan")) for r in train], color="C2", lw=1)
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    for ax in axes:
        ax.grid(alpha=0.3)
    if valid:
        fig.suptitle(_pretrain_title(name, valid[-1], rtd), fontsize=9)
    return fig


def _pretrain_title(name: str, last: dict[str, Any], rtd: bool) -> str:
    """The last validation's numbers."""
    if rtd:
        return (f"{name}: discriminator accuracy {100 * last['valid_disc_accuracy']:.1f}% (all original: "
                f"{100 * (1 - last['valid_replaced']):.1f}%), AUC {last['valid_disc_auc']:.3f}; generator loss "
                f"{last['valid_gen_loss']:.3f}")  # fmt: skip
    return (f"{name}: validation loss {last['valid_loss']:.3f}, "
            f"perplexity {last.get('valid_perplexity', float('nan')):.1f}, "
            f"masked-token accuracy {100 * last.get('valid_accuracy', float('nan')):.1f}%")  # fmt: skip


def _suite_scores(ax: Any, suites: list[dict[str, Any]]) -> None:
    """The downstream scores of eval.suite against the step of the model each suite fine-tuned: every task's score
    and the suite's average."""
    steps = [r["suite_step"] for r in suites]
    tasks = list(dict.fromkeys(k for r in suites for k in r if k.startswith("suite_") and k not in _SUITE_KEYS))
    for i, key in enumerate(tasks):
        ax.plot(steps, [r.get(key, float("nan")) for r in suites], ".-", lw=1, color=f"C{i + 3}", label=key[6:])
    ax.plot(steps, [r["suite_average"] for r in suites], "o-", color="k", label="average")
    ax.set_ylabel("downstream\nscore (%)")
    ax.legend(fontsize=7, ncol=min(4, len(tasks) + 1))


_SUITE_KEYS = ("suite_step", "suite_average")


def plot_finetune(run: Path, out: str | Path | None = None) -> Path:
    """A fine-tuning run: each fold's training loss and validation metric, and out-of-fold predictions."""
    folds = [d for d in runs.fold_dirs(run) if (d / METRICS).exists()]
    if not folds:
        raise UserError(f"{run}: no fold has logged a step yet")
    curves = {d.name: read_metrics(d) for d in folds}
    fig = finetune_figure(run.name, curves, runs.read_summary(run), runs.read_oof(run))
    path = Path(out) if out else run / "curves.png"
    save_figure(fig, path)
    return path


def finetune_figure(
    name: str, curves: dict[str, list[dict[str, Any]]], summary: dict[str, Any] | None, oof: list[dict[str, str]]
) -> Any:
    """Left: training loss (thin) and validation metric (dots) of each fold against steps. Right: out-of-fold
    predictions against targets, as a scatter for regression or a confusion matrix for classification."""
    plt = pyplot()
    fig, (ax_loss, ax_oof) = plt.subplots(1, 2, figsize=(11, 4.5), layout="constrained")
    ax_metric = ax_loss.twinx()
    metric = summary["metric"] if summary else None
    for i, (fold, records) in enumerate(curves.items()):
        train = [r for r in records if "loss" in r]
        found = (k[6:] for r in records for k in r if k.startswith("valid_") and k != "valid_loss")
        metric = metric or next(found, "loss")
        valid = [r for r in records if f"valid_{metric}" in r]
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], color=f"C{i}", lw=0.8, alpha=0.5)
        ax_metric.plot([r["step"] for r in valid], [r[f"valid_{metric}"] for r in valid], "o-", color=f"C{i}",
                       label=f"{fold} validation {metric}")  # fmt: skip
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss (thin lines)")
    ax_metric.set_ylabel(f"validation {metric}")
    ax_metric.legend(fontsize=7)
    ax_loss.grid(alpha=0.3)
    _out_of_fold(ax_oof, summary, oof)
    if summary:
        fig.suptitle(
            f"{name}: {metric} {summary['mean']:.4f} ± {summary['std']:.4f} over {len(summary['folds'])} fold(s)",
            fontsize=9,
        )
    return fig


def _out_of_fold(ax: Any, summary: dict[str, Any] | None, oof: list[dict[str, str]]) -> None:
    """The right panel, by the run's task: the confusion matrix of a classification's or multiple choice's
    out-of-fold predictions, a regression's predictions against its targets, each entity type's F1, how the
    questions' F1 spreads, or an embedding model's cosines of its validation pairs; empty where there is none."""
    task = (summary or {}).get("task")
    columns = [c for c in (oof[0] if oof else {}) if c not in ("id", "fold", "prediction")]
    if task == "token-classification" and summary:
        _entity_f1(ax, summary.get("out_of_fold", {}))
    elif task == "question-answering" and oof and "f1" in oof[0]:
        _answer_f1(ax, oof)
    elif oof and "cosine" in oof[0]:
        _pair_cosines(ax, oof)
    elif oof and "prediction" in oof[0] and (task == "multiple-choice" or "logit_" in ",".join(columns)):
        _confusion(ax, oof, columns[0])
    elif oof and "prediction" in oof[0] and task in (None, "regression"):
        xs, ys = [float(r[columns[0]]) for r in oof], [float(r["prediction"]) for r in oof]
        ax.scatter(xs, ys, s=6, alpha=0.5, c=[int(r["fold"]) for r in oof], cmap="tab10", vmin=0, vmax=9)
        lo, hi = min(xs + ys), max(xs + ys)
        ax.plot([lo, hi], [lo, hi], color="k", lw=0.8)
        ax.set_xlabel(f"target ({columns[0]})")
        ax.set_ylabel("out-of-fold prediction")
        ax.grid(alpha=0.3)
    else:
        ax.set_axis_off()


def _entity_f1(ax: Any, scores: dict[str, float]) -> None:
    types = sorted(k[3:] for k in scores if k.startswith("f1_"))
    ax.barh(types, [scores[f"f1_{t}"] for t in types], color="C0")
    if "f1" in scores:
        ax.axvline(scores["f1"], color="k", lw=0.8, label=f"all types: {scores['f1']:.3f}")
        ax.legend(fontsize=7)
    ax.set_xlim(0, 1)
    ax.set_xlabel("out-of-fold entity F1")
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(alpha=0.3, axis="x")


def _pair_cosines(ax: Any, oof: list[dict[str, str]]) -> None:
    """An embedding model's validation pairs: the cosine of each against its score (scored pairs), or how the
    cosines of positive pairs spread (pairs of a text and its positive, each scored 1)."""
    cosines, scores = [float(r["cosine"]) for r in oof], [float(r["score"]) for r in oof]
    if len(set(scores)) > 1:
        ax.scatter(scores, cosines, s=6, alpha=0.5)
        ax.set_xlabel("score")
        ax.set_ylabel("out-of-fold cosine")
    else:
        ax.hist(cosines, bins=np.linspace(-1, 1, 41), color="C0")
        ax.set_xlabel("out-of-fold cosine of each pair")
        ax.set_ylabel("pairs")
    ax.grid(alpha=0.3)


def _answer_f1(ax: Any, oof: list[dict[str, str]]) -> None:
    """How each question's F1 (oof.csv's, in percent) spreads."""
    ax.hist([float(r["f1"]) for r in oof], bins=np.linspace(0, 100, 21), color="C0")
    ax.set_xlabel("out-of-fold F1 of each question")
    ax.set_ylabel("questions")
    ax.grid(alpha=0.3)


def _confusion(ax: Any, oof: list[dict[str, str]], target: str) -> None:
    labels = sorted({r[target] for r in oof} | {r["prediction"] for r in oof})
    index = {c: i for i, c in enumerate(labels)}
    counts = np.zeros((len(labels), len(labels)), np.int64)
    for r in oof:
        counts[index[r[target]], index[r["prediction"]]] += 1
    ax.imshow(counts, cmap="Blues")
    for (i, j), n in np.ndenumerate(counts):
        if n:
            dark = n > (counts.min() + counts.max()) / 2  # the colour scale runs from the least count to the most
            ax.text(j, i, str(n), ha="center", va="center", fontsize=7, color="w" if dark else "k")
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_xlabel("out-of-fold prediction")
    ax.set_ylabel("target" if target == "target" else f"target ({target})")
