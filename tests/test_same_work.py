"""The benchmarks' comparisons do the same work on both sides (benchmarks/same_work.py): bertforge's fine-tuning
evaluates and checkpoints after the steps its work plan names, and a transformers Trainer given that plan evaluates
and saves after exactly those steps, for every recipe of every benchmark script, and writes its model once."""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
# The training rows of each recipe's split of its public set, as the scripts make them (JSQuAD: its questions, of
# one window or more).
ROWS = {"commonlit": 2267, "sentences": 1996, "jsts": 12451, "ner": 4818, "jsquad": 3769, "jcommonsenseqa": 894,
        "retrieval": 2454}  # fmt: skip
# jglue_suite.py's training rows with a tenth of each training file (JSQuAD: its questions).
JGLUE_ROWS = {"jsts": 1245, "jnli": 195, "jsquad": 1168, "jcommonsenseqa": 894}


def _benchmark(name: str):
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def recipes() -> list:
    """Every recipe of every benchmark script with a reference, from the scripts' own settings."""
    same_work, e2e = _benchmark("same_work"), _benchmark("finetune_end_to_end")
    tc, qc = _benchmark("token_classification"), _benchmark("questions_and_choices")
    em, jglue = _benchmark("embedding_models"), _benchmark("jglue_suite")
    r = same_work.Recipe
    e2e_args = lambda recipe: e2e.parser().parse_args(["--recipe", recipe])  # noqa: E731
    tuned, defaults = e2e._evals(e2e_args("tuned")), e2e._evals(e2e_args("defaults"))
    batch, epochs = e2e.SETTINGS["batch_size"], e2e.SETTINGS["epochs"]
    em_args = em._parser().parse_args([])
    return [
        r("finetune_end_to_end", "commonlit", ROWS["commonlit"], batch, epochs, tuned),
        r("finetune_end_to_end", "sentences", ROWS["sentences"], batch, epochs, tuned),
        r("finetune_end_to_end", "sentences defaults 1 epoch", ROWS["sentences"], batch, 1.0, defaults),
        r("finetune_end_to_end", "jsts defaults 1 epoch", ROWS["jsts"], batch, 1.0, defaults),
        r("token_classification", "ner", ROWS["ner"], tc.DEFAULTS["batch_size"], tc.DEFAULTS["epochs"], 1),
        *(
            r(
                "questions_and_choices",
                task,
                ROWS[name],
                qc.DEFAULTS[task]["batch_size"],
                qc.DEFAULTS[task]["epochs"],
                1,
            )
            for task, name in ((qc.QA, "jsquad"), (qc.MC, "jcommonsenseqa"))
        ),  # fmt: skip
        r("embedding_models", "retrieval", ROWS["retrieval"], em_args.batch_size, em_args.epochs, 1),
        *(
            r("jglue_suite", f"{task} a tenth", rows, s["batch_size"], s["epochs"], 1)
            for task, rows in JGLUE_ROWS.items()
            for s in [jglue.suite_settings(task, None)]
        ),  # fmt: skip
    ]


RECIPES = recipes()


class Rows:
    """`n` rows of four tokens with a label, for a sequence classifier."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": [2, 5 + i % 7, 6, 3], "attention_mask": [1, 1, 1, 1], "labels": i % 2}


@pytest.mark.parametrize("recipe", RECIPES, ids=[f"{r.benchmark}-{r.name}" for r in RECIPES])
def test_the_trainer_evaluates_and_saves_after_bertforges_steps_and_writes_its_model_once(recipe, model_dir, tmp_path):
    import numpy as np
    import torch
    from transformers import BertForSequenceClassification, Trainer, TrainingArguments, default_data_collator

    same_work = _benchmark("same_work")
    work = same_work.recipe_plan(recipe)
    torch.manual_seed(0)
    model = BertForSequenceClassification.from_pretrained(str(model_dir), num_labels=2)
    training = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=recipe.batch_size,
                                 per_device_eval_batch_size=8, report_to="none", use_cpu=True, disable_tqdm=True,
                                 logging_steps=10**6, **same_work.trainer_arguments(work))  # fmt: skip
    same = same_work.trainer_callback(work)
    accuracy = lambda p: {"accuracy": float(np.mean(p.predictions.argmax(-1) == p.label_ids))}  # noqa: E731
    trainer = Trainer(model=model, args=training, train_dataset=Rows(recipe.train_rows), eval_dataset=Rows(8),
                      data_collator=default_data_collator, compute_metrics=accuracy, callbacks=[same])  # fmt: skip
    trainer.train()
    best = same_work.finish(trainer, "accuracy", True, tmp_path / "model")

    assert trainer.state.global_step == work["steps"]
    assert same.evaluated == work["evaluations"] and same.saved == work["checkpoints"], (same.evaluated, same.saved)
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "out").glob("checkpoint-*"))
    assert saved == work["checkpoints"]
    logged = [h for h in trainer.state.log_history if "eval_accuracy" in h]
    assert [h["step"] for h in logged] == work["evaluations"]  # finish evaluated nothing more
    assert best["score"] == max(h["eval_accuracy"] for h in logged)
    assert (tmp_path / "model" / "config.json").exists() and (tmp_path / "model" / "model.safetensors").exists()


def test_every_recipe_evaluates_its_final_model_and_checkpoints_before_it():
    # A plan that skipped the final model or saved it as a checkpoint would make one side's work differ from the
    # other's in kind; the plans above all end on an evaluation of the final state.
    for recipe in RECIPES:
        work = _benchmark("same_work").recipe_plan(recipe)
        assert work["evaluations"][-1] == work["steps"], recipe
        assert work["checkpoints"] == work["evaluations"][:-1], recipe


def test_bertforges_fold_evaluates_and_checkpoints_after_its_work_plans_steps(model_dir, tmp_path, monkeypatch):
    from bertforge.cli import main as cli
    from bertforge.tasks.fold_steps import work_plan
    from bertforge.train import checkpoint

    saved: list[int] = []
    save = checkpoint.Checkpoints.save
    monkeypatch.setattr(
        checkpoint.Checkpoints, "save", lambda self, step, *a, **k: (saved.append(step), save(self, step, *a, **k))[1]
    )
    rows = [f"{'river ' * (1 + i % 5)}city" for i in range(46)]
    table = tmp_path / "train.csv"
    table.write_text("text,label\n" + "".join(f"{t},{i % 2}\n" for i, t in enumerate(rows)), encoding="utf-8")
    valid = tmp_path / "valid.csv"
    valid.write_text("text,label\nriver city,0\ncity city,1\n", encoding="utf-8")
    out = tmp_path / "run"
    code = cli(["finetune", "--model", str(model_dir), "--data", str(table), "--valid-data", str(valid),
                "--out", str(out), "--target-column", "label", "--task", "classification", "--mesh.num_devices=1",
                "--train.batch_size=4", "--train.epochs=1.25", "--train.evals_per_epoch=2",
                "--log.progress=false"])  # fmt: skip
    assert code == 0
    work = work_plan(46, 4, 1.25, 2)
    assert work == {"steps": 15, "evaluations": [9, 15], "checkpoints": [9]}  # 12 steps an epoch, counted back
    lines = [json.loads(x) for x in (out / "fold-0" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "eval_seconds" in x] == work["evaluations"]
    assert saved == work["checkpoints"]
    assert (out / "fold-0" / "model" / "model.safetensors").exists()


def test_no_reference_evaluates_or_saves_on_a_schedule_of_its_own():
    # Every Trainer in the benchmarks takes its evaluations and saves from same_work: none sets a strategy of its
    # own, keeps the best model on its own, or evaluates again after training.
    own = re.compile(r"eval_strategy=\"(epoch|steps)\"|save_strategy=\"(epoch|steps)\"|load_best_model_at_end=True|"
                     r"trainer\.evaluate\(")  # fmt: skip
    # pretrain_quality.py is no fine-tuning: both its systems save every --checkpoint-every steps, scored offline.
    scripts = [p for p in sorted(BENCHMARKS.glob("*.py")) if p.name != "pretrain_quality.py"]
    found = [f"{p.name}:{n}" for p in scripts
             for n, text in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if own.search(text)]  # fmt: skip
    assert not found, found


def test_both_processes_get_the_allocator_environment_bertforge_runs_in():
    same_work = _benchmark("same_work")
    from bertforge.runtime.allocator import tunables

    env = same_work.environment({"PATH": "/usr/bin", "JAX_PLATFORMS": "cpu"})
    if sys.platform.startswith("linux"):
        assert env["GLIBC_TUNABLES"] == ":".join(f"{k}={v}" for k, v in tunables("finetune").items())
    assert env["PATH"] == "/usr/bin"


def test_the_order_of_the_systems_alternates_from_seed_to_seed():
    order = _benchmark("same_work").order
    assert [order(["a", "b", "c"], i) for i in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]


def test_the_best_evaluation_is_picked_as_bertforge_picks_it():
    best = _benchmark("same_work").best_evaluation
    history = [{"step": 5, "eval_f1": 0.5}, {"step": 9, "loss": 1.0}, {"step": 10, "eval_f1": 0.5},
               {"step": 15, "eval_f1": float("nan")}]  # fmt: skip
    assert best(history, "f1", True)["step"] == 10  # a tie goes to the later step; undefined ranks last
    assert best([{"step": 3, "eval_rmse": 0.7}, {"step": 6, "eval_rmse": 0.6}], "rmse", False)["step"] == 6


def test_an_earlier_best_evaluation_is_loaded_from_its_checkpoint_before_the_model_is_written(model_dir, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import BertForSequenceClassification, Trainer, TrainingArguments, default_data_collator

    same_work = _benchmark("same_work")
    work = same_work.plan(24, 4, 2.0, 2)  # 12 steps, evaluations after 3, 6, 9 and 12
    assert work == {"steps": 12, "evaluations": [3, 6, 9, 12], "checkpoints": [3, 6, 9]}
    scores = iter([0.5, 0.9, 0.7, 0.8])  # the second evaluation ranks best

    torch.manual_seed(0)
    model = BertForSequenceClassification.from_pretrained(str(model_dir), num_labels=2)
    training = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, learning_rate=1e-2,
                                 report_to="none", use_cpu=True, disable_tqdm=True, logging_steps=10**6,
                                 **same_work.trainer_arguments(work))  # fmt: skip
    trainer = Trainer(model=model, args=training, train_dataset=Rows(24), eval_dataset=Rows(4),
                      data_collator=default_data_collator, compute_metrics=lambda _p: {"f1": next(scores)},
                      callbacks=[same_work.trainer_callback(work)])  # fmt: skip
    trainer.train()
    best = same_work.finish(trainer, "f1", True, tmp_path / "model")

    assert (best["best_step"], best["score"]) == (6, 0.9)
    written = load_file(tmp_path / "model" / "model.safetensors")
    at_six = load_file(tmp_path / "out" / "checkpoint-6" / "model.safetensors")
    at_nine = load_file(tmp_path / "out" / "checkpoint-9" / "model.safetensors")
    assert written.keys() == at_six.keys()
    assert all(torch.equal(written[k], at_six[k]) for k in at_six)
    assert not all(torch.equal(written[k], at_nine[k]) for k in at_nine)  # the weights moved after step 6
