"""Downstream scores while pretraining (eval.suite): a suite fine-tunes exported checkpoints in processes of their own
and its scoreboards are logged beside the loss; a continued run logs what finished meanwhile and starts again what
did not; a mistake in the settings is one line before training starts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_finetune import river_rows, write_table

from bertforge.cli import main as cli
from bertforge.tasks.plot import pretrain_figure
from bertforge.tasks.pretrain_suites import FOLDER, SuiteRuns


def tiny_suite(root: Path) -> Path:
    """A suite of one regression task, one learning rate and one seed: one short fine-tuning run."""
    write_table(root / "train.csv", river_rows(48, seed=5))
    write_table(root / "valid.csv", river_rows(24, seed=6))
    path = root / "suite.yaml"
    path.write_text("name: rivers\nsource: here\nseeds: 1\nlrs: [3.0e-3]\nepochs: 1\nbatch_size: 16\nmax_length: 32\n"
                    "tasks:\n  rivers: {name: Rivers, task: regression, train: train.csv, valid: valid.csv, "
                    "text: text, target: target, metrics: [pearson, spearman]}\n")  # fmt: skip
    return path


def test_suite_scores_are_logged_beside_the_loss(shards, tmp_path):
    suite = tiny_suite(tmp_path)
    out = tmp_path / "run"  # one suite, of the last step's model: the run waits for it before it ends
    code = cli(["pretrain", "--data", str(shards), "--out", str(out), "--model.preset=test", "--train.max_steps=10",
                "--train.global_batch=16", "--checkpoint.every=5", "--eval.every=10", "--log.every=5",
                "--log.tensorboard=false", f"--eval.suite={suite}", f"--eval.suite_data={tmp_path}",
                "--eval.suite_every=10"])  # fmt: skip
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = sorted((r for r in records if "suite_average" in r), key=lambda r: r["suite_step"])
    assert [r["suite_step"] for r in logged] == [10]
    for r in logged:
        folder = out / FOLDER / f"step-{int(r['suite_step'])}"
        board = json.loads((folder / "scoreboard.json").read_text())
        assert r["suite_average"] == board["average"] and r["suite_rivers"] == board["tasks"]["rivers"]["score"]
        assert (folder / "model" / "config.json").exists()
    # The curves show the scores in a panel of their own.
    assert len(pretrain_figure("run", records).axes) == 4


def test_a_continued_run_logs_finished_suites_once_and_restarts_the_others(tmp_path):
    written, launched = [], []
    board = {"average": 61.5, "tasks": {"a": {"score": 61.5}}}
    for step in (10, 20, 30):
        (tmp_path / FOLDER / f"step-{step}" / "model").mkdir(parents=True)
    (tmp_path / FOLDER / "step-10" / "scoreboard.json").write_text(json.dumps(board))
    (tmp_path / FOLDER / "step-20" / "scoreboard.json").write_text(json.dumps(board))
    (tmp_path / FOLDER / "logged.json").write_text("[20]\n")
    runs = SuiteRuns("s.yaml", "data", tmp_path, lambda step, m: written.append((step, m)), lambda text: None)
    runs._launch = launched.append  # the suite of step 30 had not finished: started again
    runs.resume(35)
    assert written == [(35, {"suite_step": 10, "suite_average": 61.5, "suite_a": 61.5})] and launched == [30]
    again = SuiteRuns("s.yaml", "data", tmp_path, lambda step, m: written.append((step, m)), lambda text: None)
    again._launch = launched.append
    again.resume(40)
    assert len(written) == 1 and launched == [30, 30]
    # A step whose model is there already is not exported again (a continued run saves its first step again).
    runs.start(30, lambda folder: pytest.fail("exported twice"))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--eval.suite=glue"], r"eval.suite needs eval.suite_data \(the suite's data folder\) and eval.suite_every"),
        (
            ["--eval.suite=glue", "--eval.suite_data=D", "--eval.suite_every=15", "--checkpoint.every=10"],
            r"eval.suite_every \(15\) must be a multiple of checkpoint.every \(10\)",
        ),
        (
            ["--eval.suite=glue", "--eval.suite_data=nowhere", "--eval.suite_every=10", "--checkpoint.every=10"],
            r"nowhere/CoLA/train.tsv: no such file \(CoLA's train file; glue is published at",
        ),
    ],
)
def test_suite_settings_are_checked_before_training(shards, tmp_path, capsys, flags, message):
    code = cli(["pretrain", "--data", str(shards), "--out", str(tmp_path / "run"), "--model.preset=test", *flags])
    assert code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "run").exists()
