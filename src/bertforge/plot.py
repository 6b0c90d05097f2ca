"""`bertforge plot RUN`: loss, validation metrics and learning rate of a run against steps and tokens (PNG)."""

from __future__ import annotations

from pathlib import Path

from bertforge.errors import UserError
from bertforge.train.logging import read_metrics


def plot_run(run: str | Path, out: str | Path | None = None) -> Path:
    run = Path(run)
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
