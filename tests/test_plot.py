"""`bertforge plot`: the figures show the numbers the run logged, and the CLI writes a readable PNG."""

from __future__ import annotations

import csv
import json

import matplotlib.image
import numpy as np
from sklearn.metrics import confusion_matrix

from bertforge.cli import main
from bertforge.tasks.plot import finetune_figure, pretrain_figure


def _pretrain_records() -> list[dict]:
    rng = np.random.default_rng(0)
    records = []
    for step in range(10, 201, 10):
        records.append({"step": step, "loss": float(9 - step / 50 + rng.normal()), "lr": 1e-3 * step / 200,
                        "tokens": step * 2048})  # fmt: skip
        if step % 50 == 0:
            records.append({"step": step, "valid_loss": 9 - step / 40, "valid_perplexity": 100.0,
                            "valid_accuracy": step / 1000})  # fmt: skip
    return records


def test_pretrain_figure_draws_the_logged_loss_accuracy_and_learning_rate():
    records = _pretrain_records()
    fig = pretrain_figure("run", records)
    ax_loss, ax_acc, ax_lr = fig.axes[:3]
    train = [r for r in records if "loss" in r]
    valid = [r for r in records if "valid_loss" in r]
    train_line, valid_line = ax_loss.get_lines()
    np.testing.assert_array_equal(train_line.get_xdata(), [r["step"] for r in train])
    np.testing.assert_array_equal(train_line.get_ydata(), [r["loss"] for r in train])
    np.testing.assert_array_equal(valid_line.get_ydata(), [r["valid_loss"] for r in valid])
    np.testing.assert_allclose(ax_acc.get_lines()[0].get_ydata(), [100 * r["valid_accuracy"] for r in valid])
    np.testing.assert_array_equal(ax_lr.get_lines()[0].get_ydata(), [r["lr"] for r in train])
    top = next(child for child in ax_loss.get_children() if type(child).__name__ == "SecondaryAxis")
    assert top.get_xlabel() == "tokens (millions)"


def test_finetune_figure_shows_out_of_fold_predictions_against_targets():
    rng = np.random.default_rng(1)
    labels = ["a", "b", "c"]
    targets = rng.choice(labels, 60)
    predictions = np.where(rng.random(60) < 0.7, targets, rng.choice(labels, 60))
    oof = [{"id": str(i), "fold": str(i % 2), "target": t, "prediction": p, "logit_a": "0", "logit_b": "0",
            "logit_c": "0"} for i, (t, p) in enumerate(zip(targets, predictions, strict=True))]  # fmt: skip
    curves = {f"fold-{f}": [{"step": 5, "loss": 1.0}, {"step": 10, "valid_accuracy": 0.5 + f / 10}] for f in (0, 1)}
    summary = {"metric": "accuracy", "mean": 0.55, "std": 0.05, "folds": [{}, {}]}
    fig = finetune_figure("run", curves, summary, oof)
    shown = fig.axes[1].get_images()[0].get_array()
    np.testing.assert_array_equal(shown, confusion_matrix(targets, predictions, labels=labels))
    np.testing.assert_array_equal(fig.axes[2].get_lines()[1].get_ydata(), [0.6])

    regression = [
        {"id": str(i), "fold": "0", "target": f"{i / 10}", "prediction": f"{i / 10 + 0.05}"} for i in range(9)
    ]
    scatter = finetune_figure("run", curves, summary, regression).axes[1].collections[0].get_offsets()
    np.testing.assert_allclose(scatter, [[i / 10, i / 10 + 0.05] for i in range(9)])


def test_the_out_of_fold_panel_of_choices_entities_and_answers():
    curves = {"fold-0": [{"step": 5, "loss": 1.0}, {"step": 10, "valid_f1": 0.5}]}
    rng = np.random.default_rng(2)
    labels, chosen = rng.integers(0, 4, 40), rng.integers(0, 4, 40)
    choices = [{"id": str(i), "fold": "0", "label": str(t), "prediction": str(p), "probability_choice0": "0.25"}
               for i, (t, p) in enumerate(zip(labels, chosen, strict=True))]  # fmt: skip
    summary = {"task": "multiple-choice", "metric": "accuracy", "mean": 0.3, "std": 0.0, "folds": [{}]}
    shown = finetune_figure("run", curves, summary, choices).axes[1].get_images()[0].get_array()
    np.testing.assert_array_equal(shown, confusion_matrix(labels, chosen, labels=[0, 1, 2, 3]))

    scores = {"f1": 0.4, "f1_PER": 0.6, "f1_LOC": 0.25, "f1_ORG": 0.0, "precision_PER": 0.9}
    summary = {"task": "token-classification", "metric": "f1", "mean": 0.4, "std": 0.0, "folds": [{}],
               "out_of_fold": scores}  # fmt: skip
    ax = finetune_figure("run", curves, summary, [{"id": "1", "fold": "0", "entities": "[]", "predicted": "[]"}]).axes[
        1
    ]
    bars = {t.get_text(): p.get_width() for t, p in zip(ax.get_yticklabels(), ax.patches, strict=True)}
    assert bars == {"LOC": 0.25, "ORG": 0.0, "PER": 0.6}
    assert ax.get_lines()[0].get_xdata()[0] == 0.4

    # Each question's F1 (oof.csv's; tests/test_question_answering.py holds it to the official script's).
    f1s = [100.0, 0.0, 50.0, 66.6667, 0.0, 100.0]
    answers = [{"id": str(i), "fold": "0", "answers": "[]", "prediction": "", "start": "0", "score": "0.5",
                "f1": f"{f:.6g}"} for i, f in enumerate(f1s)]  # fmt: skip
    summary = {"task": "question-answering", "metric": "f1", "mean": 50.0, "std": 0.0, "folds": [{}]}
    ax = finetune_figure("run", curves, summary, answers).axes[1]
    np.testing.assert_array_equal([p.get_height() for p in ax.patches],
                                  np.histogram(f1s, bins=np.linspace(0, 100, 21))[0])  # fmt: skip
    old_run = [{k: v for k, v in r.items() if k != "f1"} for r in answers]  # an oof.csv written before the column
    assert not finetune_figure("run", curves, summary, old_run).axes[1].axison


def test_the_out_of_fold_panel_of_an_embedding_model():
    curves = {"fold-0": [{"step": 5, "loss": 1.0}, {"step": 10, "valid_spearman": 0.5}]}
    summary = {"task": "embedding", "metric": "spearman", "mean": 0.5, "std": 0.0, "folds": [{}]}
    scored = [{"id": str(i), "fold": "0", "score": str(i / 2), "cosine": str(0.1 * i)} for i in range(6)]
    points = finetune_figure("run", curves, summary, scored).axes[1].collections[0].get_offsets()
    np.testing.assert_allclose(points, [[i / 2, 0.1 * i] for i in range(6)])
    positives = [{"id": str(i), "fold": "0", "score": "1", "cosine": str(c)} for i, c in enumerate([0.12, 0.13, 0.9])]
    ax = finetune_figure("run", curves, summary, positives).axes[1]
    counts = [p.get_height() for p in ax.patches]
    np.testing.assert_array_equal(counts, np.histogram([0.12, 0.13, 0.9], bins=np.linspace(-1, 1, 41))[0])


def test_plot_cli_writes_a_png_of_a_run(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _pretrain_records()))
    assert main(["plot", str(run)]) == 0
    image = matplotlib.image.imread(run / "curves.png")
    assert image.shape[0] > 500 and image.shape[1] > 500
    assert image[..., :3].std() > 0.05  # not a blank canvas

    finetune_run = tmp_path / "ft"
    (finetune_run / "fold-0").mkdir(parents=True)
    (finetune_run / "run.json").write_text(json.dumps({"kind": "finetune"}))
    (finetune_run / "fold-0" / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5, "valid_rmse": 0.7}\n')
    with open(finetune_run / "oof.csv", "w", newline="") as fh:
        csv.writer(fh).writerows([["id", "fold", "target", "prediction"], ["0", "0", "1.0", "0.9"]])
    assert main(["plot", str(finetune_run), "--out", str(tmp_path / "ft.png")]) == 0
    assert matplotlib.image.imread(tmp_path / "ft.png").shape[1] > 1000
    assert main(["plot", str(tmp_path / "empty")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_a_model_folder_drawn_in_a_thread_has_the_card_and_curves_drawn_in_line(tmp_path):
    """card_files with a pool (the curves drawn while the weights are written) writes the files it writes without."""
    import concurrent.futures

    from bertforge.card import CARD, CURVES, card_files
    from bertforge.model.architectures import build
    from bertforge.model.config import preset
    from bertforge.model.hf import save_pretrained

    model = build(preset("test"), "mlm", seed=0)
    card = dict(name="run", kind="pretrain", records=_pretrain_records(), model=model.config, head="mlm", config={})
    in_line = card_files(**card)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        drawn = card_files(**card, pool=pool)
        assert isinstance(drawn[CURVES], concurrent.futures.Future)
        save_pretrained(model, tmp_path / "model", extra_files=drawn)
    assert (tmp_path / "model" / CARD).read_text() == in_line[CARD]
    assert (tmp_path / "model" / CURVES).read_bytes() == in_line[CURVES]
    no_loss = card_files(**{**card, "records": [{"step": 1, "valid_accuracy": 0.5}]}, pool=pool)
    assert CURVES not in no_loss and "curves.png" not in no_loss[CARD]
