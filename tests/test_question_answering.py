"""`bertforge finetune --task question-answering` then `predict`, end to end on a tiny model: the span loss against
its closed form, out-of-fold answers that are the fold model's own best spans and slice out of their contexts,
scores equal to the official SQuAD formulas on those answers, and predictions as JSONL with the n-best."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from test_questions import _official_f1, _official_normalize

from bertforge.cli import main as cli
from bertforge.train.sequence_step import LOSSES

WORDS = "the river city walked over a bridge into old town near water and then".split()
NAMES = ["anna", "boris", "clara", "dmitri", "elena", "fyodor"]


def _squad(path: Path, n: int, seed: int, impossible: int = 0) -> Path:
    """SQuAD JSON: contexts of filler words, longer than one window, holding '<name> lives here'; the question asks
    who lives here. The last `impossible` questions have no answer (v2.0)."""
    rng = random.Random(seed)
    articles = []
    for a in range(n // 2):
        paragraphs = []
        for p in range(2):
            name = rng.choice(NAMES)
            before = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))
            after = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))
            context = f"{before} {name} lives here {after}."
            qid = f"a{a}p{p}"
            qa = {
                "id": qid,
                "question": "who lives here?",
                "answers": [{"text": name, "answer_start": len(before) + 1}],
            }
            if 2 * a + p >= n - impossible:
                qa = {"id": qid, "question": "who sails here?", "answers": [], "is_impossible": True}
            paragraphs.append({"context": context, "qas": [qa]})
        articles.append({"title": f"article {a}", "paragraphs": paragraphs})
    path.write_text(json.dumps({"version": "v2.0", "data": articles}), encoding="utf-8")
    return path


FAST = ["--task", "question-answering", "--optim.lr=3e-3", "--train.batch_size=16", "--mesh.num_devices=1",
        "--train.evals_per_epoch=1", "--log.progress=false", "--max-length", "32", "--stride", "8"]  # fmt: skip


def test_the_span_loss_is_the_mean_of_the_start_and_end_cross_entropies_over_the_rows_tokens():
    rng = np.random.default_rng(0)
    outputs = rng.normal(size=(3, 6, 2)).astype(np.float32)
    targets = np.array([[1, 2, 0, 6], [0, 0, 1, 4], [3, 3, 2, 5]], np.int32)
    got = np.asarray(LOSSES["span_cross_entropy"](jnp.asarray(outputs), jnp.asarray(targets)))
    for b, (s, e, _, n) in enumerate(targets):
        start, end = outputs[b, :n, 0], outputs[b, :n, 1]  # padding past n is no candidate
        ce = lambda x, k: np.log(np.exp(x - x.max()).sum()) + x.max() - x[k]  # noqa: E731
        assert got[b] == pytest.approx((ce(start, s) + ce(end, e)) / 2, rel=1e-5)


@pytest.fixture(scope="module")
def qa_run(model_dir, tmp_path_factory) -> tuple[Path, Path]:
    work = tmp_path_factory.mktemp("qa")
    data = _squad(work / "train.json", 24, seed=1)
    out = work / "run"
    code = cli(["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(out), *FAST,
                "--folds", "2", "--fold", "0", "--train.epochs=2"])  # fmt: skip
    assert code == 0
    return data, out


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_out_of_fold_answers_slice_out_of_their_contexts_and_score_as_squad_does(qa_run):
    data, out = qa_run
    paragraphs = [p for art in json.loads(data.read_text())["data"] for p in art["paragraphs"]]
    contexts = {qa["id"]: (p["context"], [a["text"] for a in qa["answers"]]) for p in paragraphs for qa in p["qas"]}
    folds = {r["id"]: r["fold"] for r in _csv(out / "folds.csv")}
    oof = _csv(out / "oof.csv")
    assert sorted(r["id"] for r in oof) == sorted(i for i, f in folds.items() if f == "0")
    assert len(folds) == 24 and set(oof[0]) == {"id", "fold", "answers", "prediction", "start", "score", "f1"}
    em, f1 = [], []
    for r in oof:
        context, truth = contexts[r["id"]]
        start = int(r["start"])
        assert context[start : start + len(r["prediction"])] == r["prediction"] and r["prediction"]
        assert json.loads(r["answers"]) == truth
        em.append(max(float(_official_normalize(r["prediction"]) == _official_normalize(t)) for t in truth))
        f1.append(max(_official_f1(r["prediction"], t) for t in truth))
        assert float(r["f1"]) == pytest.approx(100 * f1[-1], rel=1e-5)  # each question's, as the official script
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metric"] == "f1"
    assert summary["out_of_fold"]["exact_match"] == pytest.approx(100 * np.mean(em))
    assert summary["out_of_fold"]["f1"] == pytest.approx(100 * np.mean(f1))
    run = json.loads((out / "run.json").read_text())
    assert run["task"] == "question-answering" and run["null_threshold"] is None and run["max_answer_length"] == 30


def test_predict_gives_the_fold_models_answers_as_csv_and_jsonl_with_the_n_best(qa_run, tmp_path):
    data, out = qa_run
    oof = {r["id"]: r for r in _csv(out / "oof.csv")}
    pred = tmp_path / "answers.csv"
    assert cli(["predict", "--model", str(out / "fold-0" / "model"), "--data", str(data), "--out", str(pred),
                "--max-length", "32", "--stride", "8"]) == 0  # a folder: the run's windows given  # fmt: skip
    got = {r["id"]: r for r in _csv(pred)}
    assert len(got) == 24
    for qid, r in oof.items():  # the fold model's answers are its out-of-fold ones
        assert (got[qid]["answer"], got[qid]["start"]) == (r["prediction"], r["start"])
        assert float(got[qid]["score"]) == pytest.approx(float(r["score"]), rel=1e-4)
    lines = tmp_path / "answers.jsonl"
    assert cli(["predict", "--model", str(out), "--data", str(data), "--out", str(lines), "--n-best", "3"]) == 0
    records = [json.loads(line) for line in lines.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in records] == list(got) and all(len(r["n_best"]) == 3 for r in records)
    assert all(r["n_best"][0]["answer"] == r["answer"] for r in records)
    assert all(r["n_best"][0]["score"] >= r["n_best"][1]["score"] for r in records)


def test_questions_without_an_answer_train_the_null_answer(model_dir, tmp_path):
    data = _squad(tmp_path / "v2.json", 12, seed=2, impossible=4)
    valid = _squad(tmp_path / "valid.json", 8, seed=3, impossible=4)
    out = tmp_path / "run"
    assert cli(["finetune", "--model", str(model_dir), "--data", str(data), "--valid-data", str(valid),
                "--out", str(out), *FAST, "--train.epochs=1"]) == 0  # fmt: skip
    run = json.loads((out / "run.json").read_text())
    assert run["null_threshold"] == 0.0
    summary = json.loads((out / "summary.json").read_text())["out_of_fold"]
    assert {"has_answer_f1", "no_answer_f1", "has_answer_exact_match", "no_answer_exact_match"} <= set(summary)
    oof = _csv(out / "oof.csv")
    assert all((r["prediction"] == "") == (r["start"] == "-1") for r in oof)


def test_evaluate_on_the_held_out_questions_scores_as_squad_does_and_as_finetune_reported(qa_run, tmp_path):
    data, out = qa_run
    held_out = {r["id"] for r in _csv(out / "folds.csv") if r["fold"] == "0"}
    squad = json.loads(data.read_text())
    for article in squad["data"]:
        for p in article["paragraphs"]:
            p["qas"] = [qa for qa in p["qas"] if qa["id"] in held_out]
    test = tmp_path / "held-out.json"
    test.write_text(json.dumps(squad), encoding="utf-8")
    metrics = tmp_path / "metrics.json"
    assert cli(["evaluate", "--model", str(out), "--data", str(test), "--out", str(metrics)]) == 0
    found = json.loads(metrics.read_text())
    reported = json.loads((out / "fold-0" / "result.json").read_text())["metrics"]
    assert found["records"] == len(held_out)
    assert found["f1"] == pytest.approx(reported["f1"], abs=1e-9)
    assert found["exact_match"] == pytest.approx(reported["exact_match"], abs=1e-9)
    # The official SQuAD formulas over the out-of-fold answers (the same model on the same questions).
    oof = _csv(out / "oof.csv")
    truth = {
        qa["id"]: [a["text"] for a in qa["answers"]] for a in squad["data"] for p in a["paragraphs"] for qa in p["qas"]
    }
    f1 = [max(_official_f1(r["prediction"], t) for t in truth[r["id"]]) for r in oof]
    em = [
        max(float(_official_normalize(r["prediction"]) == _official_normalize(t)) for t in truth[r["id"]]) for r in oof
    ]
    assert found["f1"] == pytest.approx(100 * np.mean(f1)) and found["exact_match"] == pytest.approx(100 * np.mean(em))
