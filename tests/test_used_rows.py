"""Fine-tuning over the word-embedding rows a run's texts use (model/used_rows.py): the same forward for every
family, the same steps as AdamW over the whole table (the unused rows to float32's rounding of their shared decay),
the same fine-tuning run end to end, and a resumed run whose data changed is refused."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file
from test_finetune import FAST, finetune, river_rows, write_table

from bertforge.model import dropout, used_rows
from bertforge.model.architectures import FAMILIES, build
from bertforge.model.config import ModelConfig, preset
from bertforge.runtime.devices import make_mesh
from bertforge.train.optim import OptimConfig, make_optimizer
from bertforge.train.sequence_step import SequenceStepConfig, compile_train_step
from bertforge.train.step import new_train_state

VOCAB = 1024  # the test preset's


def _used(rng: np.random.Generator, n: int = 40) -> np.ndarray:
    return np.union1d(rng.choice(np.arange(5, VOCAB), n, replace=False), [0, 1, 2, 3, 4])


def _batch(rng: np.random.Generator, ids: np.ndarray, b: int = 8, t: int = 12) -> dict[str, np.ndarray]:
    mask = np.zeros((b, t), np.int32)
    for i in range(b - 1):  # the last row is padding only
        mask[i, : rng.integers(3, t + 1)] = 1
    return {
        "input_ids": np.where(mask, rng.choice(ids[5:], (b, t)), 0).astype(np.int32),
        "attention_mask": mask,
        "token_type_ids": np.zeros((b, t), np.int32),
        "targets": rng.normal(size=(b, 1)).astype(np.float32),
        "weight": (np.arange(b) < b - 1).astype(np.float32),
    }


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_reads_the_same_vectors_from_the_used_rows_and_a_stray_id_reads_nan(family):
    fields = FAMILIES[family].apply(dataclasses.asdict(preset("test")))  # RoBERTa's padding id is 1: its positions
    fields.update(family=family, hidden_dropout=0.0, attention_dropout=0.0)
    model = build(ModelConfig(**fields), "sequence", num_labels=3, seed=2)
    rng = np.random.default_rng(0)
    ids = _used(rng)
    batch = _batch(rng, ids)
    args = [jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "token_type_ids")]
    full = np.asarray(model(*args))
    assert used_rows.shrink(model, ids) is not None
    assert model.encoder.embeddings.word.embedding[...].shape[0] == used_rows.ROWS
    np.testing.assert_array_equal(np.asarray(model(*args)), full)
    stray = np.setdiff1d(np.arange(VOCAB), ids)[0]
    args[0] = args[0].at[0, 1].set(stray)
    assert np.isnan(np.asarray(model(*args))[0]).all()


def _steps(model: nnx.Module, batches: list[dict], lrs: list[float]) -> tuple[dict, list[float]]:
    """The fine-tuning program's steps (gradients in 2 micro-batches, then clipped AdamW with decoupled decay):
    the parameters after them and each step's loss."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optim = OptimConfig(lr=1e-3, b2=0.999, eps=1e-8, weight_decay=0.1, clip_norm=0.5)
    tx = make_optimizer(optim, params, model.config.num_layers)
    state = new_train_state(params, tx, make_mesh(devices=jax.devices()[:1]))
    shardings = jax.tree.map(lambda x: x.sharding, state)
    step = compile_train_step(graphdef, rest, tx, SequenceStepConfig("mse", 2, dropout=dropout.draws(model)), shardings)
    losses = []
    for batch, lr in zip(batches, lrs, strict=True):
        state, metrics = step(state, {k: jnp.asarray(x) for k, x in batch.items()}, jnp.float32(lr), jax.random.key(3))
        losses.append(float(metrics["loss"]))
    nnx.update(model, state.params)
    return model, losses


def test_steps_on_the_used_rows_are_adamws_over_the_whole_table():
    cfg = preset("test", hidden_dropout=0.1, attention_dropout=0.1)  # dropout: its keys must not move
    rng = np.random.default_rng(1)
    ids = _used(rng)
    batches = [_batch(rng, ids) for _ in range(20)]
    lrs = list(np.linspace(3e-3, 1e-4, 20))
    start = np.asarray(build(cfg, "sequence", num_labels=1, seed=1).encoder.embeddings.word.embedding[...])
    whole, whole_losses = _steps(build(cfg, "sequence", num_labels=1, seed=1), batches, lrs)
    trimmed_model = build(cfg, "sequence", num_labels=1, seed=1)
    trimmed = used_rows.shrink(trimmed_model, ids)
    trimmed_model, losses = _steps(trimmed_model, batches, lrs)
    used_rows.expand(trimmed_model, trimmed)

    np.testing.assert_allclose(losses, whole_losses, rtol=1e-6)
    ours, theirs = nnx.to_pure_dict(nnx.state(trimmed_model, nnx.Param)), nnx.to_pure_dict(nnx.state(whole, nnx.Param))
    table, table_whole = (
        ours["encoder"]["embeddings"]["word"].pop("embedding"),
        theirs["encoder"]["embeddings"]["word"].pop("embedding"),
    )
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(theirs), strict=True):
        # 1e-6 against weights of about 0.02 and steps of up to 3e-3. Not tighter: the attention's key bias has a
        # zero gradient in exact arithmetic (the softmax does not see it), so AdamW scales its rounding noise to
        # steps of up to 1e-6 that another program's rounding moves.
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6, err_msg=str(path))
    np.testing.assert_allclose(table[ids], table_whole[ids], rtol=1e-6, atol=1e-6)
    unused = np.setdiff1d(np.arange(VOCAB), ids)
    assert not np.array_equal(table_whole[unused], start[unused])  # the decay moved them
    # Each step rounds the whole table's row twice (lr * decay * p, then the sum) and the factor as often: 20
    # steps, four roundings of at most 2^-24 each.
    np.testing.assert_allclose(table[unused], table_whole[unused], rtol=20 * 4 * 2.0**-24, atol=0)


def test_a_finetune_run_on_the_used_rows_is_the_run_over_the_whole_table(model_dir, tmp_path, capsys):
    data = write_table(tmp_path / "train.csv", river_rows(48, seed=4))
    extra = ("--folds", "2", "--fold", "0", "--train.epochs=3", "--head.hidden_dropout=0.1")
    assert finetune(model_dir, data, tmp_path / "used", *extra) == 0
    assert "training the word-embedding rows of the" in capsys.readouterr().err
    assert finetune(model_dir, data, tmp_path / "whole", *extra, "--train.trim_vocab=false") == 0
    assert "word-embedding rows" not in capsys.readouterr().err
    used = load_file(tmp_path / "used" / "fold-0" / "model" / "model.safetensors")
    whole = load_file(tmp_path / "whole" / "fold-0" / "model" / "model.safetensors")
    assert used.keys() == whole.keys()
    for name in used:
        np.testing.assert_allclose(used[name], whole[name], rtol=1e-5, atol=1e-7, err_msg=name)
    logs = [[json.loads(line) for line in (tmp_path / r / "fold-0" / "metrics.jsonl").read_text().splitlines()]
            for r in ("used", "whole")]  # fmt: skip
    clocks = ("step_time", "batch_time", "tokens_per_s", "eval_seconds", "elapsed")
    numbers = [[{k: v for k, v in r.items() if k not in clocks} for r in log] for log in logs]
    assert len(numbers[0]) == len(numbers[1]) > 3
    for a, b in zip(*numbers, strict=True):
        assert a == pytest.approx(b, rel=1e-6)


def test_a_run_resumed_on_other_texts_is_refused(model_dir, tmp_path):
    data = write_table(tmp_path / "train.csv", river_rows(64, seed=5))
    args = ["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "run"), *FAST]
    args += ["--train.epochs=4", "--train.evals_per_epoch=2"]
    killer = Path(__file__).parent / "faults" / "killer.py"
    # Killed as its third checkpoint starts: the earlier ones are whole.
    spec = "after:bertforge.tasks.finetune_fold:_save:3:0"
    killed = subprocess.run([sys.executable, str(killer), spec, "--", *args], capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-2000:]
    rows = river_rows(64, seed=5)
    rows[0]["text"] += " music"  # same settings and shapes, one more token: other rows in the table
    write_table(data, rows)
    rerun = subprocess.run([sys.executable, "-m", "bertforge.cli", *args], capture_output=True, text=True)
    assert rerun.returncode == 2
    assert rerun.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'run' / 'fold-0'}: its checkpoints hold the word-embedding rows of other texts than "
        "this run's data; was the data changed since they were saved? Use another --out"
    )
