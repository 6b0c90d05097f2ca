"""`bertforge finetune --task multiple-choice` then `predict`, end to end on a tiny model: each choice's probability
in oof.csv equals the softmax of transformers' BertForMultipleChoice logits on the exported fold model, accuracy is
what oof.csv gives, `predict` on the run and on the folder repeats them, and the model learns the task."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import numpy as np
import pytest

from bertforge.cli import main as cli
from bertforge.data.batching import EncodedChoices, pad_batch, tokens_of
from bertforge.tokenizer.load import Encoded

NAMES = ["anna", "boris", "clara", "dmitri", "elena", "fyodor", "river", "city"]
FILLER = "the old town near water and then over a bridge".split()


def choice_records(n: int, seed: int, choices: int = 4) -> list[dict]:
    """Questions of filler words whose right choice is the one name among filler words."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        label = rng.randrange(choices)
        offered = rng.sample(FILLER, choices)
        offered[label] = rng.choice(NAMES)
        question = " ".join(rng.choice(FILLER) for _ in range(rng.randint(2, 5)))
        records.append({"id": f"q{i}", "question": question, "choices": offered, "label": label})
    return records


def write_csv(path: Path, records: list[dict]) -> Path:
    """JCommonsenseQA's columns: q_id, question, choice0..N-1, label."""
    n = len(records[0]["choices"])
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["q_id", "question", *(f"choice{i}" for i in range(n)), "label"])
        for r in records:
            w.writerow([r["id"], r["question"], *r["choices"], r["label"]])
    return path


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


FAST = ["--task", "multiple-choice", "--optim.lr=3e-3", "--train.batch_size=16", "--mesh.num_devices=1",
        "--train.evals_per_epoch=1", "--log.progress=false", "--max-length", "40"]  # fmt: skip


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_choice_rows_pad_to_questions_by_choices_by_tokens():
    rows = [EncodedChoices((Encoded([1, 5], [0, 0]), Encoded([1, 6, 7], [0, 1, 1]))),
            EncodedChoices((Encoded([1], [0]), Encoded([1, 8], [0, 0])))]  # fmt: skip
    assert [tokens_of(r) for r in rows] == [3, 2]
    batch = pad_batch(rows, 0, 4, rows=3)
    assert batch["input_ids"].shape == (3, 2, 4)
    np.testing.assert_array_equal(batch["input_ids"][0], [[1, 5, 0, 0], [1, 6, 7, 0]])
    np.testing.assert_array_equal(batch["token_type_ids"][0, 1], [0, 1, 1, 0])
    np.testing.assert_array_equal(batch["attention_mask"][1], [[1, 0, 0, 0], [1, 1, 0, 0]])
    assert not batch["attention_mask"][2].any()  # the filler row
    assert pad_batch([], 0, 4, rows=2, choices=5)["input_ids"].shape == (2, 5, 4)


@pytest.fixture(scope="module")
def choice_run(model_dir, tmp_path_factory) -> tuple[list[dict], Path]:
    work = tmp_path_factory.mktemp("choices")
    records = choice_records(64, seed=1)
    data = write_csv(work / "train.csv", records)
    out = work / "run"
    code = cli(["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(out), *FAST,
                "--folds", "2", "--fold", "0", "--train.epochs=6"])  # fmt: skip
    assert code == 0
    return records, out


def _hf_probabilities(folder: Path, records: list[dict]) -> np.ndarray:
    """Each record's choice probabilities by transformers' own model and tokenizer on the exported folder."""
    import torch
    from transformers import AutoModelForMultipleChoice, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForMultipleChoice.from_pretrained(folder).eval()
    n = len(records[0]["choices"])
    firsts = [r["question"] for r in records for _ in range(n)]
    seconds = [c for r in records for c in r["choices"]]
    enc = tok(firsts, seconds, padding=True, return_tensors="pt")
    assert enc["input_ids"].shape[1] <= 40  # nothing truncated
    with torch.no_grad():
        logits = model(**{k: v.view(len(records), n, -1) for k, v in enc.items()}).logits
    return torch.softmax(logits, dim=-1).numpy()


def test_out_of_fold_probabilities_are_transformers_multiple_choice_softmax(choice_run):
    records, out = choice_run
    oof = _csv(out / "oof.csv")
    folds = {r["id"]: r["fold"] for r in _csv(out / "folds.csv")}
    assert sorted(r["id"] for r in oof) == sorted(i for i, f in folds.items() if f == "0") and len(folds) == 64
    assert list(oof[0]) == ["id", "fold", "label", "prediction", *(f"probability_choice{i}" for i in range(4))]
    by_id = {r["id"]: r for r in records}
    held = [by_id[r["id"]] for r in oof]
    want = _hf_probabilities(out / "fold-0" / "model", held)
    got = np.array([[float(r[f"probability_choice{i}"]) for i in range(4)] for r in oof])
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert [int(r["prediction"]) for r in oof] == list(np.argmax(want, axis=1))
    assert [int(r["label"]) for r in oof] == [r["label"] for r in held]
    summary = json.loads((out / "summary.json").read_text())
    accuracy = np.mean([int(r["prediction"]) == int(r["label"]) for r in oof])
    assert summary["metric"] == "accuracy" and summary["out_of_fold"]["accuracy"] == pytest.approx(accuracy)
    assert accuracy >= 0.5  # four choices: chance is 0.25
    run = json.loads((out / "run.json").read_text())
    assert run["task"] == "multiple-choice" and run["choices"] == 4


def test_predict_writes_the_chosen_index_and_each_choices_probability(choice_run, tmp_path):
    records, out = choice_run
    oof = {r["id"]: r for r in _csv(out / "oof.csv")}
    unlabelled = [{k: v for k, v in r.items() if k != "label"} for r in records]
    data = write_jsonl(tmp_path / "questions.jsonl", unlabelled)  # the other form: a 'choices' list
    for model in (out, out / "fold-0" / "model"):  # the run's one fold, and its folder
        pred = tmp_path / "choices.csv"
        assert cli(["predict", "--model", str(model), "--data", str(data), "--out", str(pred)]) == 0
        got = {r["id"]: r for r in _csv(pred)}
        assert list(got) == [r["id"] for r in records]
        assert list(next(iter(got.values()))) == ["id", "label", *(f"probability_choice{i}" for i in range(4))]
        for qid, r in oof.items():
            assert got[qid]["label"] == r["prediction"]
            for i in range(4):
                key = f"probability_choice{i}"
                assert float(got[qid][key]) == pytest.approx(float(r[key]), abs=1e-5)


def test_validation_data_must_offer_as_many_choices(model_dir, tmp_path):
    train = write_csv(tmp_path / "train.csv", choice_records(8, seed=2))
    valid = write_csv(tmp_path / "valid.csv", choice_records(8, seed=3, choices=3))
    code = cli(["finetune", "--model", str(model_dir), "--data", str(train), "--valid-data", str(valid),
                "--out", str(tmp_path / "run"), *FAST])  # fmt: skip
    assert code != 0


def test_evaluate_on_the_held_out_questions_gives_the_accuracy_finetune_reported(choice_run, tmp_path):
    records, out = choice_run
    held_out = {r["id"] for r in _csv(out / "folds.csv") if r["fold"] == "0"}
    test = write_jsonl(tmp_path / "held-out.jsonl", [r for r in records if r["id"] in held_out])
    metrics = tmp_path / "metrics.json"
    assert cli(["evaluate", "--model", str(out / "fold-0" / "model"), "--data", str(test), "--max-length", "40",
                "--out", str(metrics)]) == 0  # fmt: skip
    found = json.loads(metrics.read_text())
    reported = json.loads((out / "fold-0" / "result.json").read_text())["metrics"]
    assert found["records"] == len(held_out) and found["accuracy"] == pytest.approx(reported["accuracy"], abs=1e-9)
    oof = {r["id"]: r for r in _csv(out / "oof.csv")}  # the same model's choices: its accuracy, counted here
    right = [int(oof[r["id"]]["prediction"]) == r["label"] for r in records if r["id"] in held_out]
    assert found["accuracy"] == pytest.approx(np.mean(right), abs=1e-12)
