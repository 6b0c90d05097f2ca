"""`bertforge evaluate`: a fine-tuned model's metrics on labelled data, against the metrics fine-tuning reported on
the same validation data, and against scikit-learn on what `predict` writes."""

from __future__ import annotations

import csv
import json
import random

import pytest
from test_finetune import FAST, write_table

from bertforge.cli import main as cli


def labelled_rows(n: int, seed: int) -> list[dict]:
    """Texts of 'river' and 'city', labelled by the word they hold more of: learnable from the words alone."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = [rng.choice(["river", "city", "river", "city", "the"]) for _ in range(rng.randint(3, 12))]
        label = "river" if words.count("river") > words.count("city") else "city"
        rows.append({"id": f"r{i}", "text": " ".join(words), "label": label})
    return rows


@pytest.fixture(scope="module")
def classified(model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("evaluate")
    train = write_table(work / "train.csv", labelled_rows(64, seed=1))
    valid = write_table(work / "valid.csv", labelled_rows(40, seed=2))
    run = work / "run"
    code = cli(["finetune", "--model", str(model_dir), "--data", str(train), "--valid-data", str(valid),
                "--out", str(run), "--task", "classification", "--target-column", "label", "--train.epochs=20",
                *FAST])  # fmt: skip
    assert code == 0
    return run, valid


def test_the_metrics_are_those_finetune_reported_on_the_same_validation_data(classified, tmp_path, capsys):
    run, valid = classified
    reported = json.loads((run / "fold-0" / "result.json").read_text())["metrics"]
    # The run (its one fold), and its model folder, which knows nothing of the run's columns.
    for model, extra in [(run, []), (run / "fold-0" / "model", ["--target-column", "label"])]:
        out = tmp_path / "metrics.json"
        assert cli(["evaluate", "--model", str(model), "--data", str(valid), "--out", str(out), *extra]) == 0
        found = json.loads(out.read_text())
        assert found["records"] == 40
        assert set(found) - {"records"} == set(reported) - {"loss"}
        for key in set(found) - {"records"}:
            assert found[key] == pytest.approx(reported[key], abs=1e-6), key
        assert f"accuracy {found['accuracy']:.4f}" in capsys.readouterr().out


def test_accuracy_equals_scikit_learns_on_the_predicted_labels(classified, tmp_path):
    from sklearn.metrics import accuracy_score

    run, _ = classified
    test = write_table(tmp_path / "test.csv", labelled_rows(50, seed=3))
    out, predicted = tmp_path / "metrics.json", tmp_path / "predicted.csv"
    assert cli(["evaluate", "--model", str(run), "--data", str(test), "--out", str(out)]) == 0
    assert cli(["predict", "--model", str(run), "--data", str(test), "--out", str(predicted)]) == 0
    with open(predicted, encoding="utf-8") as fh:
        labels = [r["label"] for r in csv.DictReader(fh)]
    truth = [r["label"] for r in labelled_rows(50, seed=3)]
    assert json.loads(out.read_text())["accuracy"] == pytest.approx(accuracy_score(truth, labels), abs=1e-12)


def test_the_python_api_gives_what_the_command_writes(classified, tmp_path):
    import bertforge

    run, valid = classified
    out = tmp_path / "metrics.json"
    assert cli(["evaluate", "--model", str(run), "--data", str(valid), "--out", str(out)]) == 0
    assert bertforge.evaluate(run, valid) == json.loads(out.read_text())


def test_a_class_the_model_lacks_and_a_task_its_head_is_not_are_one_line(classified, tmp_path, capsys):
    run, _ = classified
    rows = [*labelled_rows(3, seed=4), {"id": "x", "text": "a forest", "label": "forest"}]
    odd = write_table(tmp_path / "odd.csv", rows)
    for args, expected in [
        (["--data", str(odd)], "odd.csv: row 4: class 'forest' in column 'label'"),
        (["--data", str(odd), "--task", "token-classification"], "a sequence model, not one for token-classification"),
        (["--data", str(tmp_path / "missing.csv")], "missing.csv"),
    ]:
        assert cli(["evaluate", "--model", str(run), *args]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0] and "Traceback" not in err[0], err
