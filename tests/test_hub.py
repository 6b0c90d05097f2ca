"""Publishing to the Hub, against a stand-in for its HTTP API (tests/fake_hub.py): what arrives, that training goes
on while a push is slow or failing, that the token is written nowhere, and the model card."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fake_hub import FakeHub

from bertforge.card import model_card
from bertforge.cli import main as cli
from bertforge.model.config import preset
from bertforge.train.metrics_log import read_metrics

TOKEN = "hf_StandInToken0123456789"
MODEL_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"}


def hub_env(hub: FakeHub, home: Path) -> dict[str, str]:
    return {
        **os.environ,
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": TOKEN,
        "HF_HUB_OFFLINE": "0",
        "HF_HOME": str(home),  # no token or cache of the machine's user
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }


def bertforge(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bertforge.cli", *args], env=env, capture_output=True, text=True, timeout=600
    )


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def files_holding(root: Path, text: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


def pretrain_args(shards: Path, out: Path, *extra: str) -> list[str]:
    return [
        "pretrain", "--data", str(shards), "--out", str(out), "--model.preset=test", "--model.hidden_dropout=0",
        "--model.attention_dropout=0", "--train.global_batch=16", "--optim.lr=3e-3", "--optim.warmup_steps=2",
        "--eval.every=5", "--log.every=1", "--log.tensorboard=false", "--log.progress=false", *extra,
    ]  # fmt: skip


@pytest.mark.slow  # `make slow`; the fast suite keeps fine-tuning's pushes
def test_pretraining_pushes_in_the_background_through_a_slow_and_a_failed_push(shards, tmp_path):
    out = tmp_path / "run"

    def logged_step(commit) -> int:
        return max((r["step"] for r in read_metrics(out)), default=0)

    with FakeHub() as hub:
        hub.failures = [True]  # the first push is refused
        hub.delays = [0.0, 10.0]  # the second hangs for 10 s
        hub.on_commit = logged_step
        done = bertforge(
            *pretrain_args(shards, out, "--train.max_steps=40", "--checkpoint.every=5"),
            "--hub.repo=org/tiny-bert", "--hub.language=ja", "--hub.datasets=[wikitext]", "--hub.license=mit",
            env=hub_env(hub, tmp_path / "hf-home"),
        )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert [c.summary for c in hub.failed] == ["step 5"]
    assert "warning: the push of step 5 to org/tiny-bert failed" in output
    slow, last = hub.commits[0], hub.commits[-1]
    assert slow.summary == "step 10"
    # Training went on while the push of step 10 hung, to its last step, and then waited for the last push.
    assert slow.note < 40 and slow.note_after == 40, (slow.note, slow.note_after)
    assert last.summary == "step 40" and last.started >= slow.finished
    assert MODEL_FILES | {"curves.png", "bertforge.json"} <= set(last.files)
    meta = front_matter(last.files["README.md"].decode())
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "fill-mask"
    assert meta["language"] == ["ja"] and meta["datasets"] == ["wikitext"] and meta["license"] == "mit"
    assert {"bertforge", "bert", "fill-mask"} <= set(meta["tags"])
    assert last.files["curves.png"].startswith(b"\x89PNG")
    assert hub.repos == {"org/tiny-bert": {"private": False}}

    # What was pushed is what `bertforge export` writes for the same step.
    assert cli(["export", str(out), "--out", str(tmp_path / "export")]) == 0
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert last.files[name] == (tmp_path / "export" / name).read_bytes(), name
    assert not (out / ".hub").exists() or not any((out / ".hub").iterdir())

    # The token went to the Hub and nowhere else.
    assert hub.auth == {f"Bearer {TOKEN}"}
    assert TOKEN not in output
    assert files_holding(tmp_path, TOKEN) == []
    assert all(TOKEN.encode() not in data for c in hub.commits + hub.failed for data in c.files.values())


@pytest.fixture(scope="module")
def short_run(shards, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hub") / "run"
    assert cli(pretrain_args(shards, out, "--train.max_steps=6", "--checkpoint.every=3", "--mesh.num_devices=1")) == 0
    return out


def test_export_pushes_to_a_branch_of_a_private_repository(short_run, tmp_path):
    with FakeHub() as hub:
        done = bertforge(
            "export", str(short_run), "--push-to-hub", "org/mini", "--private", "--revision", "dev",
            "--message", "first model", "--step", "3", env=hub_env(hub, tmp_path / "hf-home"),
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "pushed" in done.stdout and "org/mini" in done.stdout
    assert hub.repos == {"org/mini": {"private": True}} and hub.branches == [("org/mini", "dev")]
    (commit,) = hub.commits
    assert (commit.repo, commit.revision, commit.summary) == ("org/mini", "dev", "first model")
    assert set(commit.files) >= MODEL_FILES
    assert "at step 3" in commit.files["README.md"].decode()
    assert files_holding(tmp_path, TOKEN) == []


def assert_half_of(half: Path, full: Path, dtype: str) -> None:
    """`half`'s weights are `full`'s rounded as torch rounds them to `dtype`, to the bit; config.json says so; and
    transformers loads the folder in that dtype."""
    import json

    import torch
    import transformers
    from safetensors.torch import load_file

    want, got = load_file(full / "model.safetensors"), load_file(half / "model.safetensors")
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == getattr(torch, dtype) and torch.equal(got[name], tensor.to(got[name].dtype)), name
    assert (half / "model.safetensors").stat().st_size < 0.55 * (full / "model.safetensors").stat().st_size
    assert json.loads((half / "config.json").read_text())["dtype"] == dtype
    assert transformers.AutoModel.from_pretrained(half).dtype == getattr(torch, dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_export_writes_the_weights_in_half_precision_and_reads_them_back(short_run, tmp_path, dtype):
    import numpy as np

    from bertforge.model.hf import load_pretrained, read_weights, save_pretrained, weight_files

    assert cli(["export", str(short_run), "--out", str(tmp_path / "full")]) == 0
    assert cli(["export", str(short_run), "--out", str(tmp_path / "half"), "--dtype", dtype]) == 0
    assert_half_of(tmp_path / "half", tmp_path / "full", dtype)
    # bertforge reads them back as float32 parameters: the rounded values, exactly.
    loaded = load_pretrained(str(tmp_path / "half")).model
    again = tmp_path / "again"
    save_pretrained(loaded, again)
    for name, value in read_weights(weight_files(again)).items():
        assert np.array_equal(value, read_weights(weight_files(tmp_path / "half"))[name]), name


def test_export_refuses_a_dtype_it_does_not_write(short_run, tmp_path, capsys):
    assert cli(["export", str(short_run), "--out", str(tmp_path / "x"), "--dtype", "int8"]) == 2
    assert "--dtype 'int8': one of float32, float16, bfloat16" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_failed_export_push_is_one_line_and_keeps_the_folder(short_run, tmp_path):
    with FakeHub() as hub:
        hub.failures = [True]
        done = bertforge(
            "export", str(short_run), "--out", str(tmp_path / "kept"), "--push-to-hub", "org/mini",
            env=hub_env(hub, tmp_path / "hf-home"),
        )  # fmt: skip
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: pushing to org/mini failed") and str(tmp_path / "kept") in line
    assert (tmp_path / "kept" / "config.json").exists()


@pytest.mark.parametrize("name", ["org/team/model", "bad--name", "org/-model", "x" * 97, "org/model.git"])
def test_names_the_hub_refuses_are_one_line_errors_before_anything_runs(shards, short_run, tmp_path, capsys, name):
    out = tmp_path / "run"
    assert cli(pretrain_args(shards, out, "--train.max_steps=2", f"--hub.repo={name}")) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "hub.repo" in err and "not a repository name the Hub accepts" in err
    assert not out.exists()
    assert cli(["export", str(short_run), "--push-to-hub", name]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--push-to-hub" in err


def test_finetuning_pushes_each_folds_model_into_its_folder(model_dir, tmp_path):
    from test_finetune import river_rows, write_table

    data = write_table(tmp_path / "train.csv", river_rows(64))
    with FakeHub() as hub:
        done = bertforge(
            "finetune", "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "run"),
            "--folds", "2", "--train.epochs=1", "--train.batch_size=16", "--train.evals_per_epoch=1",
            "--mesh.num_devices=1", "--log.progress=false", "--hub.repo=org/river", "--hub.every=1000",
            env=hub_env(hub, tmp_path / "hf-home"),
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    by_fold = {c.summary.split(",")[0]: c for c in hub.commits}
    assert set(by_fold) == {"fold 0", "fold 1"}
    for k in (0, 1):
        files = by_fold[f"fold {k}"].files
        assert {f"fold-{k}/{name}" for name in MODEL_FILES} <= set(files)
        written = tmp_path / "run" / f"fold-{k}" / "model" / "model.safetensors"
        assert files[f"fold-{k}/model.safetensors"] == written.read_bytes()
        meta = front_matter(files[f"fold-{k}/README.md"].decode())
        assert meta["pipeline_tag"] == "text-classification" and meta["metrics"] == ["rmse"]
        assert "base_model" not in meta  # a local folder is no Hub id
    assert files_holding(tmp_path, TOKEN) == []
    _export_of_a_finetuning_run(tmp_path / "run", tmp_path)


def _export_of_a_finetuning_run(run: Path, tmp_path: Path) -> None:
    """`bertforge export` of a fine-tuning run (the recovery a failed last push names): its finished folds' models,
    laid out as finetune pushes them; --step is refused in one line."""
    env = hub_env(FakeHub(), tmp_path / "hf-home")  # never started: nothing here may reach the Hub
    done = bertforge("export", str(run), "--out", str(tmp_path / "both"), env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"exported {run} (the best model of fold-0, fold-1) -> {tmp_path / 'both'}"
    for k in (0, 1):
        for name in MODEL_FILES:
            assert (tmp_path / "both" / f"fold-{k}" / name).read_bytes() == (
                run / f"fold-{k}" / "model" / name
            ).read_bytes()
    # A fold whose result.json is not written has not finished: only the finished one goes, as the folder itself.
    partial = tmp_path / "partial"
    shutil.copytree(run, partial)
    (partial / "fold-1" / "result.json").unlink()
    with FakeHub() as hub:
        done = bertforge("export", str(partial), "--push-to-hub", "org/river-0", env=hub_env(hub, tmp_path / "hf-home"))
    assert done.returncode == 0, done.stderr
    (commit,) = hub.commits
    assert commit.summary == "bertforge export of partial: the best model of fold-0"
    assert set(commit.files) >= MODEL_FILES and not any(name.startswith("fold-") for name in commit.files)
    assert commit.files["model.safetensors"] == (run / "fold-0" / "model" / "model.safetensors").read_bytes()
    done = bertforge("export", str(run), "--out", str(tmp_path / "half"), "--dtype", "float16", env=env)
    assert done.returncode == 0, done.stderr
    for k in (0, 1):
        assert_half_of(tmp_path / "half" / f"fold-{k}", run / f"fold-{k}" / "model", "float16")
    done = bertforge("export", str(run), "--out", str(tmp_path / "step"), "--step", "3", env=env)
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == f"error: {run}: --step 3 is for pretraining runs; a fine-tuning run exports its folds' models"
    )
    assert not (tmp_path / "step").exists()


def test_the_model_card_names_a_hub_base_model_and_shows_the_last_metrics():
    records = [
        {"step": 5, "loss": 4.0},
        {"step": 10, "valid_loss": 3.5, "valid_accuracy": 0.25},
        {"step": 20, "loss": 2.0, "valid_loss": 3.0, "valid_accuracy": 0.5},
    ]
    card = model_card(
        name="m", model=preset("test", vocab_size=100), head="sequence", kind="finetune",
        config={"optim": {"lr": 1e-3}}, records=records, step=10, metrics=("accuracy",), base_model="org/base",
    )  # fmt: skip
    meta = front_matter(card)
    assert meta["base_model"] == "org/base" and meta["metrics"] == ["accuracy"]
    assert "| valid_loss | 3.5 |" in card and "| loss | 4 |" in card  # the values up to step 10, not after
    assert "lr: 0.001" in card
