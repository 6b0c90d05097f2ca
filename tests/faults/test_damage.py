"""Damaged files: a checkpoint with a flipped byte, a truncated or missing file is detected, named and skipped for
the previous whole one, and the run then ends exactly as if nothing had happened; damaged shards are refused by
their checksums before training reads them."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_pretrain import losses, params_of

from bertforge.cli import main as cli
from bertforge.train.checkpoint import CHECKSUMS

ARGS = ["--model.preset=test", "--train.global_batch=16", "--train.max_steps=30", "--optim.lr=3e-3",
        "--checkpoint.every=10", "--checkpoint.keep_last=3", "--eval.every=10", "--log.every=1",
        "--log.tensorboard=false", "--log.progress=false"]  # fmt: skip


def pretrain(shards: Path, out: Path) -> int:
    return cli(["pretrain", "--data", str(shards), "--out", str(out), *ARGS])


@pytest.fixture(scope="module")
def finished(shards, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    assert pretrain(shards, out) == 0
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [10, 20, 30]
    return out


def state_files(step_dir: Path) -> list[Path]:
    return sorted(p for p in (step_dir / "state").rglob("*") if p.is_file())


def flip_byte(path: Path, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def damage_step(step_dir: Path, how: str, rng: random.Random) -> None:
    victim = rng.choice(state_files(step_dir))
    if how == "flipped byte":
        flip_byte(victim, rng)
    elif how == "truncated file":
        victim.write_bytes(victim.read_bytes()[: rng.randrange(victim.stat().st_size)])
    elif how == "missing file":
        victim.unlink()
    elif how == "flipped byte in the metadata":
        flip_byte(step_dir / "meta" / "metadata", rng)
    elif how == "checksums missing":
        (step_dir / CHECKSUMS).unlink()
    elif how == "checksums not JSON":
        (step_dir / CHECKSUMS).write_text("{")
    elif how == "emptied":
        shutil.rmtree(step_dir)
        step_dir.mkdir()


HOW = ["flipped byte", "truncated file", "missing file", "flipped byte in the metadata", "checksums missing",
       "checksums not JSON", "emptied"]  # fmt: skip


@pytest.mark.parametrize("how", [pytest.param(h, marks=() if i < 3 else pytest.mark.slow) for i, h in enumerate(HOW)])
def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_used(shards, finished, tmp_path, capsys, tally, how):
    tally("corruption")
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    damage_step(run / "checkpoints" / "30", how, random.Random(how))
    capsys.readouterr()
    assert pretrain(shards, run) == 0
    err = capsys.readouterr().err
    assert "warning: checkpoint 30 is damaged (" in err and "trying checkpoint 20" in err, err
    assert "resuming from step 20" in err
    assert [p.name.split("-")[1] for p in (run / "damaged").iterdir()] == ["30"]  # set aside, not deleted
    for key in ("loss", "valid_loss"):
        assert losses(run, key) == losses(finished, key)
    for x, y in zip(params_of(finished), params_of(run), strict=True):
        np.testing.assert_array_equal(y, x)


def test_every_checkpoint_damaged_starts_over_and_export_refuses_a_damaged_step(
    shards, finished, tmp_path, capsys, tally
):
    tally("corruption", 4)
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    rng = random.Random(0)
    flip_byte(rng.choice(state_files(run / "checkpoints" / "30")), rng)
    capsys.readouterr()
    # export: the latest whole checkpoint, with a warning; a named damaged step is refused
    assert cli(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert "warning: checkpoint 30 is damaged" in capsys.readouterr().err
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "bert"
    assert cli(["export", str(run), "--out", str(tmp_path / "hf30"), "--step", "30"]) == 2
    assert "checkpoints/30: checkpoint damaged (state/" in capsys.readouterr().err
    assert not (tmp_path / "hf30").exists()

    for step in (10, 20):
        flip_byte(rng.choice(state_files(run / "checkpoints" / str(step))), rng)
    assert pretrain(shards, run) == 0
    err = capsys.readouterr().err
    assert "checkpoint 10 is damaged" in err and "no older checkpoint" in err and "resuming" not in err
    for x, y in zip(params_of(finished), params_of(run), strict=True):
        np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("split", ["train", "valid"])
@pytest.mark.parametrize("how", ["truncated", "flipped byte", "bytes appended"])
def test_a_damaged_shard_is_refused_before_training_reads_it(shards, tmp_path, capsys, tally, split, how):
    tally("corruption")
    data = tmp_path / "shards"
    shutil.copytree(shards, data)
    victim = data / f"{split}-00000.npy"
    if how == "truncated":
        victim.write_bytes(victim.read_bytes()[:-7])
    elif how == "flipped byte":
        flip_byte(victim, random.Random(split))
    else:
        victim.write_bytes(victim.read_bytes() + b"\0")
    capsys.readouterr()
    assert pretrain(data, tmp_path / "run") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: {data}/{split}-00000.npy: sha256 does not match manifest.json (damaged or altered)"
    assert losses(tmp_path / "run") == {}  # not one step trained on it
