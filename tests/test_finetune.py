"""Fine-tuning: folds, metrics, batching, the step, and `bertforge finetune` / `predict` end to end."""

from __future__ import annotations

import csv
import functools
import itertools
import json
import logging
import math
import random
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bertforge.cli import main as cli
from bertforge.data.batching import balanced_batches, bucket_length, epoch_batches, ladder, padded_length
from bertforge.data.folds import assign_folds, bin_targets, sturges_bins
from bertforge.data.text_packing import first_fit
from bertforge.model.architectures import build
from bertforge.model.config import preset
from bertforge.model.hf import load_pretrained, save_pretrained
from bertforge.runtime.devices import make_mesh
from bertforge.tokenizer.load import Tokenizer
from bertforge.train import metrics
from bertforge.train.optim import OptimConfig, make_optimizer
from bertforge.train.sequence_step import SequenceStepConfig, compile_train_step, predict_step, train_step
from bertforge.train.step import new_train_state


# ------------------------------------------------------------------------------------------------------ data
def write_table(path: Path, rows: list[dict], columns: list[str] | None = None) -> Path:
    columns = columns or list(rows[0])
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def river_rows(n: int, seed: int = 0) -> list[dict]:
    """Texts of 'river' and 'city'; the target is 4x the share of 'river': learnable from the words alone."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        q, k = rng.random(), rng.randint(3, 40)
        words = ["river" if rng.random() < q else "city" for _ in range(k)]
        rows.append({"id": f"r{i}", "text": " ".join(words), "target": 4 * words.count("river") / k})
    return rows


NAN = float("nan")
FAST = ["--optim.lr=3e-3", "--train.batch_size=16", "--mesh.num_devices=1", "--train.evals_per_epoch=1",
        "--log.progress=false"]  # fmt: skip


def finetune(model_dir: Path, data: Path, out: Path, *extra: str) -> int:
    return cli(["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(out), *FAST, *extra])


# ------------------------------------------------------------------------------------------------------ folds
def test_class_folds_are_disjoint_cover_every_row_and_are_stratified():
    rng = np.random.default_rng(0)
    labels = rng.choice(4, size=503, p=[0.55, 0.3, 0.1, 0.05])
    folds = assign_folds(len(labels), 5, seed=3, strata=labels)
    assert set(folds.tolist()) == set(range(5))  # every row has exactly one fold in range
    sizes = np.bincount(folds)
    assert sizes.max() - sizes.min() <= 1
    for c in range(4):
        per_fold = np.bincount(folds[labels == c], minlength=5)
        assert per_fold.max() - per_fold.min() <= 1, (c, per_fold)
    assert np.array_equal(folds, assign_folds(len(labels), 5, seed=3, strata=labels))
    assert not np.array_equal(folds, assign_folds(len(labels), 5, seed=4, strata=labels))


def test_regression_strata_are_pandas_cut_bins_by_sturges_rule():
    pd = pytest.importorskip("pandas")
    values = np.random.default_rng(1).normal(size=2834)
    bins = sturges_bins(len(values))
    assert bins == int(np.floor(1 + np.log2(2834)))
    expected = pd.cut(values, bins=bins, labels=False)
    assert np.array_equal(bin_targets(values, bins), expected)
    folds = assign_folds(len(values), 5, seed=0, strata=bin_targets(values, bins))
    for b in range(bins):
        per_fold = np.bincount(folds[expected == b], minlength=5)
        assert per_fold.max() - per_fold.min() <= 1


def test_grouped_folds_keep_each_group_in_one_fold():
    rng = np.random.default_rng(2)
    groups = rng.integers(0, 40, size=400).astype(str)
    folds = assign_folds(len(groups), 4, seed=0, groups=groups)
    for g in np.unique(groups):
        assert len(set(folds[groups == g].tolist())) == 1
    sizes = np.bincount(folds)
    assert sizes.min() > 0.7 * sizes.max()


def test_parquet_tables_and_error_weights(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from bertforge.data.labelled import TableConfig, read_table
    from bertforge.finetuning import TASKS
    from bertforge.tasks.finetune import FinetuneConfig

    errors = [0.5, 0.25, 0.0, 1.0]  # 0 marks an anchor row: it counts like the smallest error
    table = pa.table({"text": ["a b", "c d", "e", "f g h"], "target": [1.0, 2.0, 0.0, -1.0], "se": errors})
    path = tmp_path / "t.parquet"
    pq.write_table(table, path)
    cfg = FinetuneConfig(data=TableConfig(train=str(path), error_column="se"))
    got = read_table(str(path), cfg.data, TASKS[cfg.head.task].read_targets)
    assert got.texts == ["a b", "c d", "e", "f g h"] and got.targets[:, 0].tolist() == [1.0, 2.0, 0.0, -1.0]
    inverse = 1 / np.array([0.5, 0.25, 0.25, 1.0]) ** 2
    np.testing.assert_allclose(got.weights, inverse / inverse.mean(), rtol=1e-6)


def test_every_task_module_declares_the_task_interface():
    from bertforge.finetuning import TASKS, FinetuneTask

    for name, task in TASKS.items():
        assert isinstance(task, FinetuneTask) and name == task.NAME
        assert task.DEFAULT_LOSS in task.LOSSES and task.DEFAULT_METRIC in metrics.HIGHER_IS_BETTER


# ------------------------------------------------------------------------------------------------------ metrics
def test_metrics_match_scipy_and_sklearn():
    stats = pytest.importorskip("scipy.stats")
    skm = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    y = rng.normal(size=300)
    p = y + rng.normal(scale=0.5, size=300)
    p[:20] = np.round(p[:20])  # ties for the rank correlation
    got = metrics.regression(p, y)
    assert got["rmse"] == pytest.approx(np.sqrt(skm.mean_squared_error(y, p)), rel=1e-12)
    assert got["mae"] == pytest.approx(skm.mean_absolute_error(y, p), rel=1e-12)
    assert got["pearson"] == pytest.approx(stats.pearsonr(p, y)[0], rel=1e-9)
    assert got["spearman"] == pytest.approx(stats.spearmanr(p, y)[0], rel=1e-9)

    labels = rng.integers(0, 3, size=300)
    logits = rng.normal(size=(300, 3)) + 1.5 * np.eye(3)[labels]
    got = metrics.classification(logits, labels)
    assert got["accuracy"] == pytest.approx(skm.accuracy_score(labels, logits.argmax(1)))
    assert got["f1"] == pytest.approx(skm.f1_score(labels, logits.argmax(1), average="macro"))
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert got["auc"] == pytest.approx(skm.roc_auc_score(labels, probs, multi_class="ovr", average="macro"))
    assert got["matthews"] == pytest.approx(skm.matthews_corrcoef(labels, logits.argmax(1)), rel=1e-12)
    binary = labels % 2
    two = np.stack([-logits[:, 1], logits[:, 1]], axis=1)
    got = metrics.classification(two, binary)
    assert got["f1"] == pytest.approx(skm.f1_score(binary, two.argmax(1)))
    assert got["auc"] == pytest.approx(skm.roc_auc_score(binary, two[:, 1] - two[:, 0]))
    assert got["matthews"] == pytest.approx(skm.matthews_corrcoef(binary, two.argmax(1)), rel=1e-12)
    # One class predicted: undefined, 0 as sklearn gives it (CoLA's score of a model that says "acceptable").
    assert metrics.classification(np.tile([[0.0, 1.0]], (4, 1)), np.array([0, 1, 1, 0]))["matthews"] == 0.0


def test_ranks_and_tied_scores_match_scipy_and_sklearn():
    stats = pytest.importorskip("scipy.stats")
    skm = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(1)
    tied = rng.integers(0, 7, size=500).astype(float)  # every value shared by about 70 rows
    np.testing.assert_array_equal(metrics.ranks(tied), stats.rankdata(tied))
    np.testing.assert_array_equal(metrics.ranks(np.array([3.0])), [1.0])
    other = tied + rng.integers(0, 3, size=500)
    got = metrics.regression(tied, other)
    assert got["spearman"] == pytest.approx(stats.spearmanr(tied, other).statistic, rel=1e-9)
    assert got["pearson"] == pytest.approx(stats.pearsonr(tied, other).statistic, rel=1e-9)
    labels = (other > 4).astype(int)
    assert metrics.binary_auc(tied, labels == 1) == pytest.approx(skm.roc_auc_score(labels, tied), rel=1e-12)
    assert np.isnan(metrics.binary_auc(np.array([0.0, np.nan]), np.array([True, False])))
    assert np.isnan(metrics.regression(np.ones(5), np.arange(5.0))["spearman"])  # a constant column


# ------------------------------------------------------------------------------------------------------ batching
def padded_total(maxima: np.ndarray, rungs: tuple[int, ...]) -> int:
    return sum(padded_length(int(m), 128, 8, rungs) for m in maxima)


def test_the_ladder_is_the_least_padding_choice_of_at_most_k_lengths():
    rng = np.random.default_rng(3)
    limit, bucket = 128, 8
    for trial in range(20):
        k = int(rng.integers(1, 6))
        maxima = np.minimum(rng.lognormal(3, 0.6, size=int(rng.integers(5, 60))).astype(int) + 2, limit)
        rungs = ladder(maxima, limit, bucket, k)
        total = functools.partial(padded_total, maxima)

        # Every subset of the rounded maxima that holds the longest batch, by brute force.
        values = sorted({bucket_length(int(m), limit, bucket) for m in maxima})
        best = min(
            total((*lower, values[-1]))
            for r in range(min(k, len(values)))
            for lower in itertools.combinations(values[:-1], r)
        )
        assert len(rungs) <= k and rungs[-1] == values[-1] and all(r % bucket == 0 or r == limit for r in rungs)
        assert total(rungs) == best, (trial, rungs)
    assert padded_length(20, 128, 8, (16, 32)) == 32 and padded_length(33, 128, 8, (16, 32)) == 40
    assert ladder(np.array([5, 70, 300]), 256, 0, 3) == (256,)  # bucket 0: everything padded to the limit


def test_epoch_batches_cover_every_row_once_group_lengths_and_start_with_the_longest():
    lengths = np.random.default_rng(0).integers(10, 250, size=1003)

    def padded_tokens(batches):
        return sum(16 * bucket_length(lengths[b].max(), 256) for b in batches)

    def neighbours(batches):
        return {(a, c) for b in batches for a in b for c in b if a < c}

    by_length = np.argsort(-lengths)
    sorted_batches = [by_length[i : i + 16] for i in range(0, len(lengths), 16)]
    for epoch in range(3):
        batches = epoch_batches(lengths, 16, 32, seed=5, epoch=epoch)
        rows = np.concatenate(batches)
        assert sorted(rows.tolist()) == list(range(1003))
        assert sorted(len(b) for b in batches)[1:] == [16] * (len(batches) - 1)  # one short batch at most
        assert lengths[batches[0]].max() == lengths.max()
        spread = np.mean([np.ptp(lengths[b]) for b in batches])
        assert spread < 40  # random batches spread over about 200 tokens
        assert padded_tokens(batches) < 1.05 * padded_tokens(sorted_batches)
        again = epoch_batches(lengths, 16, 32, 5, epoch)
        assert all(np.array_equal(a, b) for a, b in zip(batches, again, strict=True))
    # Rows meet different neighbours from epoch to epoch (sorting the whole set would pair the same ones).
    first, second = (neighbours(epoch_batches(lengths, 16, 32, 5, e)) for e in (0, 1))
    assert len(first & second) < 0.5 * len(first)


def test_a_pool_of_one_batch_gives_the_random_batches_longest_first():
    lengths = np.random.default_rng(1).integers(10, 250, size=1003)
    random = epoch_batches(lengths, 16, 0, seed=5, epoch=2)  # bucket 0: plain random batches
    pooled = epoch_batches(lengths, 16, 32, seed=5, epoch=2, pool=1)
    assert {frozenset(b.tolist()) for b in pooled} == {frozenset(b.tolist()) for b in random}
    assert lengths[pooled[0]].max() == lengths.max()  # still the longest first
    assert np.mean([np.ptp(lengths[b]) for b in pooled]) > 150  # not grouped by length


def test_balanced_batches_are_random_draws_of_about_equal_tokens():
    """Packed steps' batches: every row once, full batches but the last, a pure function of (seed, epoch), new
    neighbours every epoch, and within each pool no full batch more than one text's tokens from another, where
    random batches of the same rows spread over three times that and more; so they pack into fewer rows."""
    rng = np.random.default_rng(3)
    for lengths in (rng.integers(3, 129, 1003), rng.geometric(0.03, 1003).clip(1, 128)):
        batches = balanced_batches(lengths, 16, seed=5, epoch=0, pool=8)
        assert sorted(np.concatenate(batches).tolist()) == list(range(1003))
        assert [len(b) for b in batches] == [16] * 62 + [11]
        again = balanced_batches(lengths, 16, 5, 0, pool=8)
        assert all(np.array_equal(a, b) for a, b in zip(batches, again, strict=True))
        for i in range(0, 62, 8):
            totals = [lengths[b].sum() for b in batches[i : i + 8] if len(b) == 16]
            assert np.ptp(totals) <= lengths.max()
        random = epoch_batches(lengths, 16, 0, seed=5, epoch=0)
        assert np.ptp([lengths[b].sum() for b in random[:-1]]) > 3 * lengths.max()
        needs = [max(len(first_fit(lengths[b].tolist(), 128)) for b in x[:-1]) for x in (batches, random)]
        assert needs[0] < needs[1], needs
        epochs = (balanced_batches(lengths, 16, 5, e, 8) for e in (0, 1))
        pairs = [{(a, c) for b in epoch for a in b for c in b if a < c} for epoch in epochs]
        assert len(pairs[0] & pairs[1]) < 0.1 * len(pairs[0])


# ------------------------------------------------------------------------------------------------------ the step
def _batch(rng: np.random.Generator, b: int, t: int, real: int) -> dict[str, np.ndarray]:
    mask = np.zeros((b, t), np.int32)
    for i in range(real):
        mask[i, : rng.integers(4, t + 1)] = 1
    return {
        "input_ids": np.where(mask, rng.integers(5, 900, (b, t)), 0).astype(np.int32),
        "attention_mask": mask,
        "token_type_ids": np.zeros((b, t), np.int32),
        "targets": rng.normal(size=(b, 1)).astype(np.float32),
        "weight": np.where(np.arange(b) < real, rng.uniform(0.5, 2.0, b), 0.0).astype(np.float32),
    }


def _state(pooling: str = "cls", **optim):
    cfg = preset("test", hidden_dropout=0.0, attention_dropout=0.0, pooling=pooling)
    model = build(cfg, "sequence", num_labels=1, seed=1)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = make_optimizer(OptimConfig(**{"lr": 1e-3, "clip_norm": None, **optim}), params, cfg.num_layers)
    return graphdef, rest, tx, new_train_state(params, tx, make_mesh(devices=jax.devices()[:1]))


def test_loss_is_the_weighted_mean_over_real_rows_and_accumulation_gives_the_full_batch_update():
    batch = _batch(np.random.default_rng(0), 8, 24, real=6)
    graphdef, rest, tx, state = _state()
    outputs = np.asarray(predict_step(graphdef, rest, state.params, batch))
    expected = np.sum(batch["weight"] * (outputs[:, 0] - batch["targets"][:, 0]) ** 2) / 6
    results = []
    for accum in (1, 2, 4):
        _, _, _, fresh = _state()
        step = jax.jit(functools.partial(train_step, graphdef, rest, tx=tx, cfg=SequenceStepConfig("mse", accum)))
        new, m = step(fresh, batch, jnp.float32(1e-3), jax.random.key(0))
        assert float(m["loss"]) == pytest.approx(expected, rel=1e-5)
        results.append(new.params)
    for other in results[1:]:
        diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), results[0], other)
        assert max(jax.tree.leaves(diff)) < 1e-5


@pytest.mark.slow  # `make slow`; the fast suite keeps dropout's own tests (test_dropout.py)
def test_dropout_keys_drawn_in_their_own_program_give_the_gradients_of_pretrainings_dropout():
    # The fine-tuning step draws its dropout keys apart from the gradients' program (compiled once, not per
    # length). Reference: jax.grad of the loss with the model keyed as pretraining keys it, with_dropout_key(rest,
    # k) for micro-batch k of split(fold_in(key, step), A), summed over the 2 micro-batches.
    from bertforge.train.sequence_step import dropout_keys, gradients
    from bertforge.train.step import micro_batches, with_dropout_key

    cfg = preset("test", hidden_dropout=0.2, attention_dropout=0.2)
    model = build(cfg, "sequence", num_labels=1, seed=1)
    model.train()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = {k: jnp.asarray(v) for k, v in _batch(np.random.default_rng(0), 8, 16, real=8).items()}
    step, key = jnp.int32(3), jax.random.key(11)

    def loss(params, b, k):
        out = nnx.merge(graphdef, params, with_dropout_key(rest, k))(
            b["input_ids"], b["attention_mask"], b["token_type_ids"]
        )
        return jnp.sum(b["weight"] * (out[:, 0] - b["targets"][:, 0]) ** 2) / 8

    micro = {k: micro_batches(v, 2) for k, v in batch.items()}
    ks = jax.random.split(jax.random.fold_in(key, step), 2)
    per_micro = [jax.grad(loss)(params, {k: v[a] for k, v in micro.items()}, ks[a]) for a in range(2)]
    expected = jax.tree.map(jnp.add, *per_micro)
    cfg2 = SequenceStepConfig("mse", grad_accum=2)
    ours, _, _ = jax.jit(functools.partial(gradients, graphdef, rest, cfg=cfg2))(
        params, jax.jit(functools.partial(dropout_keys, rest, grad_accum=2))(step, key), batch
    )
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), ours, expected)
    # and dropout is on: another step's keys give other gradients
    other, _, _ = gradients(graphdef, rest, params, dropout_keys(rest, step + 1, key, 2), batch, cfg2)
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), other, ours)
    assert max(jax.tree.leaves(moved)) > 1e-4


@pytest.mark.parametrize("sparse", [False, True], ids=["adamw", "sparse_embeddings"])
def test_three_steps_equal_adamw_written_out_and_sparse_embeddings_leave_untouched_rows_alone(sparse):
    # AdamW with global-norm clipping and decoupled decay, written out in numpy over gradients from jax.grad of the
    # plain loss. With sparse_embeddings, the word table's rows of the batch's tokens (padding included) follow
    # it and its other rows keep their weights and moments; without, every row follows it. The program is the one
    # fine-tuning runs (gradients, then the update), with 2 micro-batches.
    b1, b2, eps, wd, clip = 0.9, 0.999, 1e-8, 0.1, 0.05
    graphdef, rest, tx, state = _state(b2=b2, eps=eps, weight_decay=wd, clip_norm=clip)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    step = compile_train_step(graphdef, rest, tx, SequenceStepConfig("mse", 2, sparse, row_capacity=200), shardings)
    start = nnx.to_pure_dict(state.params)
    table0 = np.asarray(start["encoder"]["embeddings"]["word"]["embedding"])
    ref = jax.tree.map(lambda x: np.asarray(x, np.float64), start)
    m, v = jax.tree.map(np.zeros_like, ref), jax.tree.map(np.zeros_like, ref)

    def loss(params, batch):
        model = nnx.merge(graphdef, nnx.State(params), rest)
        out = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        return jnp.sum(batch["weight"] * (out[:, 0] - batch["targets"][:, 0]) ** 2) / jnp.sum(batch["weight"] > 0)

    rng = np.random.default_rng(7)
    touched = set()
    for t, lr in enumerate([3e-3, 2e-3, 1e-3], start=1):
        batch = _batch(rng, 8, 12, real=7)
        batch["input_ids"] = np.where(batch["attention_mask"], rng.integers(5, 60, (8, 12)), 0).astype(np.int32)
        rows = np.unique(batch["input_ids"])
        touched |= set(rows.tolist())
        grads = jax.tree.map(np.asarray, jax.grad(loss)(jax.tree.map(jnp.float32, ref), batch))
        norm = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in jax.tree.leaves(grads)))
        scale = min(1.0, clip / norm)

        def adamw(path, p, g, m_, v_, t=t, lr=lr, rows=rows, scale=scale):
            names = [k.key for k in path]
            table = names == ["encoder", "embeddings", "word", "embedding"]
            at = rows if sparse and table else slice(None)
            g = g[at] * scale
            m_[at] = b1 * m_[at] + (1 - b1) * g
            v_[at] = b2 * v_[at] + (1 - b2) * g * g
            step_ = (m_[at] / (1 - b1**t)) / (np.sqrt(v_[at] / (1 - b2**t)) + eps)
            p[at] -= lr * (step_ + (wd * p[at] if names[-1] in ("kernel", "embedding") else 0))
            return p

        ref = jax.tree_util.tree_map_with_path(adamw, ref, grads, m, v)
        state, metrics = step(state, {k: jnp.asarray(x) for k, x in batch.items()}, jnp.float32(lr), jax.random.key(0))
        assert float(metrics["grad_norm"]) == pytest.approx(norm, rel=1e-4)
    ours = nnx.to_pure_dict(state.params)
    for path, a in jax.tree_util.tree_leaves_with_path(ours):
        expected = ref
        for k in path:
            expected = expected[k.key]
        np.testing.assert_allclose(np.asarray(a), expected, rtol=2e-4, atol=1e-6, err_msg=str(path))
    table = np.asarray(ours["encoder"]["embeddings"]["word"]["embedding"])
    untouched = np.setdiff1d(np.arange(len(table)), sorted(touched))
    # Exactly: the rows no batch held are the starting ones with sparse_embeddings, moved by AdamW without.
    assert np.array_equal(table[untouched], table0[untouched]) == sparse


def test_sparse_embeddings_on_8_devices_equal_1_device():
    # data 2 x fsdp 4: the table's rows are sharded, the batch split; the lazy update must not depend on either.
    from bertforge.runtime.devices import param_shardings

    cfg = preset("test", hidden_dropout=0.0, attention_dropout=0.0)
    results = []
    for mesh in (make_mesh(devices=jax.devices()[:1]), make_mesh(data=2, fsdp=4)):
        model = build(cfg, "sequence", num_labels=1, seed=1)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        tx = make_optimizer(OptimConfig(lr=1e-3, clip_norm=0.05), params, cfg.num_layers)
        state = new_train_state(jax.device_put(params, param_shardings(model, mesh)), tx, mesh)
        shardings = jax.tree.map(lambda x: x.sharding, state)
        step = compile_train_step(graphdef, rest, tx, SequenceStepConfig("mse", sparse_embeddings=True), shardings)
        rng = np.random.default_rng(3)
        for _ in range(2):
            state, _ = step(state, _batch(rng, 8, 16, real=8), jnp.float32(1e-3), jax.random.key(0))
        results.append(jax.device_get(nnx.to_pure_dict(state.params)))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), *results)


def test_a_registered_loss_is_used_by_name():
    from bertforge.train.sequence_step import LOSSES, register_loss

    @register_loss("test_abs_cubed")
    def abs_cubed(outputs, targets):
        return jnp.mean(jnp.abs(outputs - targets) ** 3, axis=-1)

    try:
        batch = _batch(np.random.default_rng(4), 8, 16, real=5)
        graphdef, rest, tx, state = _state()
        outputs = np.asarray(predict_step(graphdef, rest, state.params, batch))[:, 0]
        expected = np.sum(batch["weight"] * np.abs(outputs - batch["targets"][:, 0]) ** 3) / 5
        step = functools.partial(train_step, graphdef, rest, tx=tx, cfg=SequenceStepConfig("test_abs_cubed"))
        _, m = jax.jit(step)(state, batch, jnp.float32(1e-3), jax.random.key(0))
        assert float(m["loss"]) == pytest.approx(expected, rel=1e-5)
    finally:
        LOSSES.pop("test_abs_cubed")


def test_layer_decay_and_head_lr_scale_each_parameter_group():
    batch = _batch(np.random.default_rng(1), 8, 16, real=8)
    updates = {}
    for name, optim in {"plain": {}, "decayed": {"layer_decay": 0.5, "head_lr": 4e-3}}.items():
        graphdef, rest, tx, state = _state(weight_decay=0.0, **optim)
        step = jax.jit(functools.partial(train_step, graphdef, rest, tx=tx, cfg=SequenceStepConfig("mse")))
        new, _ = step(state, batch, jnp.float32(1e-3), jax.random.key(0))
        updates[name] = jax.tree.map(lambda a, b: a - b, nnx.to_pure_dict(new.params), nnx.to_pure_dict(state.params))
    plain, decayed = updates["plain"], updates["decayed"]

    def ratio(*path):
        a, b = plain, decayed
        for p in path:
            a, b = a[p], b[p]
        return float(jnp.sum(b * a) / jnp.sum(a * a))

    # Two layers: the top layer keeps lr, layer 0 gets 0.5, the embeddings 0.25; the head gets head_lr / lr = 4.
    assert ratio("encoder", "layers", 1, "mlp_in", "kernel") == pytest.approx(1.0, rel=1e-4)
    assert ratio("encoder", "layers", 0, "mlp_in", "kernel") == pytest.approx(0.5, rel=1e-4)
    assert ratio("encoder", "embeddings", "norm", "scale") == pytest.approx(0.25, rel=1e-4)
    assert ratio("head", "out", "kernel") == pytest.approx(4.0, rel=1e-4)


def test_cls_head_computes_only_the_first_token_of_the_last_layer_exactly():
    batch = _batch(np.random.default_rng(2), 4, 20, real=4)
    model = build(preset("test"), "sequence", num_labels=3, seed=0)
    model.eval()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    full = model.encoder(ids, mask)[:, 0]
    first = model.encoder(ids, mask, first_only=True)[:, 0]
    np.testing.assert_allclose(np.asarray(first), np.asarray(full), atol=1e-6)


def test_mean_and_attention_pooling_round_trip_through_a_saved_folder(tmp_path, wordpiece_dir):
    tok = Tokenizer.load(wordpiece_dir)
    batch = _batch(np.random.default_rng(3), 4, 20, real=4)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    for pooling in ("mean", "attention"):
        model = build(preset("test", vocab_size=tok.vocab_size, pooling=pooling), "sequence", num_labels=2, seed=0)
        model.eval()
        if pooling == "mean":
            hidden = np.asarray(model.encoder(ids, mask))
            pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
            np.testing.assert_allclose(np.asarray(model.head.pool(jnp.asarray(hidden), mask)), pooled, atol=1e-6)
        back = load_pretrained(save_pretrained(model, tmp_path / pooling, tok), require_head=True)
        assert back.model.config.pooling == pooling
        back.model.eval()
        np.testing.assert_array_equal(np.asarray(back.model(ids, mask)), np.asarray(model(ids, mask)))


# ------------------------------------------------------------------------------------------------------ end to end
def test_regression_learns_a_learnable_target_and_writes_its_outputs(model_dir, tmp_path, capsys):
    data = write_table(tmp_path / "train.csv", river_rows(256))
    out = tmp_path / "run"
    code = finetune(model_dir, data, out, "--folds", "2", "--fold", "0", "--train.epochs=25", "--head.pooling=mean")
    printed = capsys.readouterr().out
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    targets = np.array([r["target"] for r in river_rows(256)])
    with open(out / "folds.csv") as fh:
        folds = np.array([int(r["fold"]) for r in csv.DictReader(fh)])
    baseline = targets[folds == 0].std()
    assert summary["folds"][0]["score"] < 0.25 * baseline, (summary, baseline)
    assert "| 0 |" in printed and "rmse" in printed
    with open(out / "oof.csv") as fh:
        oof = list(csv.DictReader(fh))
    assert len(oof) == int((folds == 0).sum()) and set(oof[0]) == {"id", "fold", "target", "prediction"}
    assert (out / "fold-0" / "model" / "model.safetensors").exists()
    assert not (out / "fold-0" / "checkpoints").exists()


@pytest.mark.parametrize("pack", ["true", "false"])
def test_the_log_counts_the_tokens_of_the_texts_each_window_trained_on(model_dir, tmp_path, pack):
    """tokens_per_s x step_time x the window's steps gives the tokens of the texts it trained on, padding left out:
    over one epoch in one window, every training text's once, as transformers' tokenizer counts them."""
    from transformers import AutoTokenizer

    rows = river_rows(48, seed=6)
    train, valid = write_table(tmp_path / "train.csv", rows), write_table(tmp_path / "valid.csv", river_rows(16, 7))
    out = tmp_path / "run"
    extra = ("--valid-data", str(valid), "--train.epochs=1", "--log.every=3", "--max-length=32", f"--data.pack={pack}")
    assert finetune(model_dir, train, out, *extra) == 0
    lines = [json.loads(line) for line in (out / "fold-0" / "metrics.jsonl").read_text().splitlines()]
    windows = [line for line in lines if "tokens_per_s" in line]
    assert [line["step"] for line in windows] == [3], lines
    encoded = AutoTokenizer.from_pretrained(str(model_dir))([r["text"] for r in rows], truncation=True, max_length=32)
    expected = sum(len(ids) for ids in encoded["input_ids"])
    assert expected > 48 * 32 // 2  # most texts are long: padding would show
    assert windows[0]["tokens_per_s"] * windows[0]["step_time"] * 3 == pytest.approx(expected, rel=1e-9)


def compiled_programs(caplog, *args: str) -> list[str]:
    """The names of the programs a finetune run with `args` compiled, in order."""
    caplog.clear()
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING):
            assert finetune(*args) == 0
    finally:
        jax.config.update("jax_log_compiles", False)
    found = (re.search(r"Compiling jit\((\w+)\)", r.getMessage()) for r in caplog.records)
    return [m.group(1) for m in found if m]


def test_batches_compile_the_gradients_once_per_padded_length_and_the_update_once(model_dir, tmp_path, caplog):
    rows = river_rows(96, seed=1)
    data = write_table(tmp_path / "train.csv", rows)
    tok = Tokenizer.load(model_dir)
    lengths = [len(e.ids) for e in tok.encode_batch([r["text"] for r in rows])]
    buckets = {-(-n // 16) * 16 for n in lengths}
    run = (model_dir, data, tmp_path / "run", "--fold", "0", "--train.epochs=3", "--data.pack=false")
    names = compiled_programs(caplog, *run, "--data.bucket=16", "--data.shapes=0")  # every multiple of 16
    assert 2 <= names.count("gradients") <= len(buckets) and names.count("update") == 1, (names, buckets)

    # A ladder of two lengths: two gradient programs whatever the lengths, every batch padded to one of them.
    names = compiled_programs(caplog, *run[:2], tmp_path / "run2", *run[3:], "--data.shapes=2")
    assert names.count("gradients") == 2 and names.count("update") == 1, names


@pytest.mark.parametrize(
    "ranks",
    [(0.5, 0.3, 0.4), (0.5, 0.3, 0.3), (0.5, 0.3, 0.2), (None, 0.4), (0.4, None, 0.6), (0.7,), (0.1, NAN), (NAN, 0.2)],
)
def test_the_best_step_with_the_last_kept_in_memory_is_the_one_orbax_picks_with_every_step_saved(ranks, tmp_path):
    # The fold saves every evaluated step but the last, whose state it still holds; its choice must be the one the
    # checkpoints made when the last step was saved too (ties to the later step).
    from types import SimpleNamespace

    from bertforge.tasks.finetune_fold import _best_step
    from bertforge.train.checkpoint import Checkpoints

    state, last = {"w": jnp.zeros(2)}, len(ranks)
    everything = Checkpoints(tmp_path / "all", keep_last=1, keep_best=1)
    kept = Checkpoints(tmp_path / "kept", keep_last=1, keep_best=1)
    for step, rank in enumerate(ranks, start=1):
        everything.save(step, state, {"step": step}, valid_loss=rank)
        if step < last:
            kept.save(step, state, {"step": step}, valid_loss=rank)
    everything.wait()
    kept.wait()
    expected = everything.best_step() or everything.latest_step()
    evaluations = SimpleNamespace(ranks={} if ranks[-1] is None else {last: ranks[-1]})
    if not any(math.isnan(r or 0.0) for r in ranks):
        assert _best_step(kept, evaluations, last) == expected
    else:  # orbax ranks an undefined score where sorting leaves it; the fold prefers any defined one
        assert _best_step(kept, evaluations, last) == (1 if math.isnan(ranks[-1]) else last)
    everything.close()
    kept.close()


def test_predict_on_a_run_averages_the_best_fold_models(model_dir, tmp_path):
    rows = river_rows(64, seed=2)
    data = write_table(tmp_path / "train.csv", rows)
    out = tmp_path / "run"
    assert finetune(model_dir, data, out, "--folds", "2", "--train.epochs=2") == 0
    texts = [r["text"] for r in rows]
    per_fold = []
    for f in (0, 1):
        result = json.loads((out / f"fold-{f}" / "result.json").read_text())
        pred = tmp_path / f"fold{f}.csv"
        assert cli(["predict", "--model", str(out / f"fold-{f}" / "model"), "--data", str(data), "--out", str(pred),
                    "--max-length", "256"]) == 0  # fmt: skip
        with open(pred) as fh:
            values = np.array([float(r["prediction"]) for r in csv.DictReader(fh)])
        # The fold model is the best checkpoint: its predictions on the fold's rows are the out-of-fold outputs.
        np.testing.assert_allclose(values[result["rows"]], np.array(result["outputs"])[:, 0], atol=1e-5)
        logged = [json.loads(line) for line in (out / f"fold-{f}" / "metrics.jsonl").read_text().splitlines()]
        evaluated = {r["step"]: r["valid_rmse"] for r in logged if "valid_rmse" in r}
        assert result["best_step"] == min(evaluated, key=evaluated.get)
        assert result["score"] == pytest.approx(evaluated[result["best_step"]], abs=1e-5)
        per_fold.append(values)
    pred = tmp_path / "run.csv"
    assert cli(["predict", "--model", str(out), "--data", str(data), "--out", str(pred)]) == 0
    with open(pred) as fh:
        got = list(csv.DictReader(fh))
    assert [r["id"] for r in got] == [r["id"] for r in rows]
    np.testing.assert_allclose([float(r["prediction"]) for r in got], np.mean(per_fold, axis=0), atol=1e-5)
    import bertforge

    np.testing.assert_allclose(bertforge.predict(out, texts)[:, 0], np.mean(per_fold, axis=0), atol=1e-5)


def test_finished_folds_are_kept_and_the_rest_run_when_the_command_is_repeated(model_dir, tmp_path, capsys):
    data = write_table(tmp_path / "train.csv", river_rows(48, seed=3))
    out = tmp_path / "run"
    assert finetune(model_dir, data, out, "--folds", "2", "--fold", "0", "--train.epochs=1") == 0
    first = (out / "fold-0" / "result.json").read_text()
    capsys.readouterr()
    assert finetune(model_dir, data, out, "--folds", "2", "--train.epochs=1") == 0
    printed = capsys.readouterr().out
    assert "fold 0:" not in printed and "fold 1:" in printed  # fold 0 was not trained again
    assert (out / "fold-0" / "result.json").read_text() == first
    assert len(json.loads((out / "summary.json").read_text())["folds"]) == 2


def test_a_repeated_command_with_other_settings_is_refused_before_it_trains(model_dir, tmp_path, capsys):
    # A finished fold reflects its settings: another learning rate or number of epochs into the same folder would
    # report the old fold as if it were the new command's, or mix folds of two settings in one summary.
    data = write_table(tmp_path / "train.csv", river_rows(48, seed=3))
    out = tmp_path / "run"
    assert finetune(model_dir, data, out, "--folds", "2", "--fold", "0", "--train.epochs=1") == 0
    config = (out / "config.yaml").read_text()
    capsys.readouterr()
    assert finetune(model_dir, data, out, "--folds", "2", "--train.epochs=2", "--optim.lr=1e-3") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(out) in err
    assert "train.epochs: 1" in err and "gives 2" in err and "also optim.lr" in err
    assert not (out / "fold-1").exists() and (out / "config.yaml").read_text() == config
    # where it logs and which folds it runs may change: fold 1 trains, fold 0 is kept
    assert finetune(model_dir, data, out, "--folds", "2", "--train.epochs=1", "--log.every=5") == 0
    assert "fold 1:" in capsys.readouterr().out


def test_undefined_scores_are_written_as_null_and_a_repeated_command_reads_them_back(model_dir, tmp_path):
    # A validation table of one row: its Pearson and Spearman correlations are undefined (NaN). JSON has no NaN:
    # metrics.jsonl, result.json and summary.json hold null there, and the repeated command, which reads the
    # finished fold back to summarise, still ends well.
    data = write_table(tmp_path / "train.csv", river_rows(32, seed=1))
    valid = write_table(tmp_path / "valid.csv", river_rows(1, seed=2))
    out = tmp_path / "run"
    for _ in range(2):
        assert finetune(model_dir, data, out, "--valid-data", str(valid), "--train.epochs=1") == 0
    summary, result = (strict_loads((out / f).read_text()) for f in ("summary.json", "fold-0/result.json"))
    logged = [strict_loads(line) for line in (out / "fold-0" / "metrics.jsonl").read_text().splitlines()]
    assert result["metrics"]["pearson"] is None and math.isfinite(result["score"])  # rmse: defined
    assert summary["out_of_fold"]["spearman"] is None and summary["folds"][0]["score"] == result["score"]
    assert [r["valid_pearson"] for r in logged if "valid_rmse" in r] == [None]


def strict_loads(text: str):
    """json.loads refusing NaN and Infinity, as JSON's grammar (and parsers outside Python) does."""

    def refuse(name: str):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_classification_and_multilabel_runs(model_dir, tmp_path):
    rng = random.Random(4)
    rows = []
    for i in range(96):
        cls = ["river", "city", "music"][i % 3]
        words = [cls if rng.random() < 0.6 else rng.choice(["the", "of", "and"]) for _ in range(rng.randint(4, 20))]
        rows.append({"id": i, "text": " ".join(words), "label": cls, "has_the": int("the" in words),
                     "has_of": int("of" in words)})  # fmt: skip
    data = write_table(tmp_path / "train.csv", rows)
    out = tmp_path / "cls"
    assert finetune(model_dir, data, out, "--task", "classification", "--target-column", "label", "--folds", "3",
                    "--fold", "0", "--train.epochs=40", "--head.pooling=mean") == 0  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metric"] == "accuracy" and summary["folds"][0]["score"] > 0.6
    with open(out / "oof.csv") as fh:
        oof = list(csv.DictReader(fh))
    assert {"target", "prediction", "logit_city", "logit_music", "logit_river"} <= set(oof[0])
    out = tmp_path / "multi"
    assert finetune(model_dir, data, out, "--task", "multilabel", "--target-column", "has_the,has_of", "--folds", "3",
                    "--fold", "1", "--train.epochs=1") == 0  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metric"] == "auc" and set(summary["out_of_fold"]) >= {"accuracy", "f1", "auc"}


# ------------------------------------------------------------------------------------------------------ bad input
def _refused(model_dir: Path, data: Path, out: Path, capsys, *extra: str) -> str:
    code = finetune(model_dir, data, out, *extra)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert not out.exists(), "nothing may be written for a refused run"
    return err.strip().splitlines()[-1]


def test_bad_tables_are_refused_naming_the_row_or_column(model_dir, tmp_path, capsys):
    good = river_rows(12)
    out = tmp_path / "run"
    data = write_table(tmp_path / "a.csv", good)
    assert "no column 'excerpt'" in _refused(model_dir, data, out, capsys, "--text-column", "excerpt")
    rows = [dict(r) for r in good]
    rows[2]["text"] = "  "
    data = write_table(tmp_path / "b.csv", rows)
    assert "row 3 has an empty text in column 'text'" in _refused(model_dir, data, out, capsys)
    for bad, expected in (("nan", "row 2: column 'target' is 'nan'"), ("high", "row 2: column 'target' holds 'high'")):
        rows = [dict(r) for r in good]
        rows[1]["target"] = bad
        data = write_table(tmp_path / f"c-{bad}.csv", rows)
        assert expected in _refused(model_dir, data, out, capsys)
    data = write_table(tmp_path / "d.csv", good[:3])
    assert "3 rows cannot make 5 folds" in _refused(model_dir, data, out, capsys)


@pytest.mark.parametrize("pack", ["true", "false"])
def test_weights_that_give_nan_stop_the_first_step_naming_its_cures(model_dir, tmp_path, capsys, pack):
    """A NaN in the starting weights makes the first step's loss NaN, before any update: the error says so and
    names what may cure that (the weights, float32, padded rows for a packed run), not a smaller learning rate."""
    import shutil

    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "nan-model"
    shutil.copytree(model_dir, bad)
    weights = load_file(bad / "model.safetensors")
    name = next(k for k in sorted(weights) if k.endswith("attention.self.query.weight"))
    weights[name][0, 0] = np.nan
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    data = write_table(tmp_path / "train.csv", river_rows(12))
    code = finetune(bad, data, tmp_path / "run", "--fold", "0", f"--data.pack={pack}")
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err, err
    assert err.startswith("error: fold 0: the loss became NaN or infinite at step 1; no update came before it")
    assert "check the model's weights" in err and "optim.lr" not in err
    assert err.endswith("train.dtype=float32" + (" or data.pack=false" if pack == "true" else ""))


def test_a_class_never_seen_in_training_is_refused(model_dir, tmp_path, capsys):
    rows = [{"text": f"text number {i}", "label": "a" if i % 2 else "b"} for i in range(20)]
    train = write_table(tmp_path / "train.csv", rows)
    valid = write_table(tmp_path / "valid.csv", [*rows[:3], {"text": "something new", "label": "c"}])
    err = _refused(model_dir, train, tmp_path / "run", capsys, "--task", "classification", "--target-column",
                   "label", "--valid-data", str(valid))  # fmt: skip
    assert "valid.csv: row 4: class 'c' in column 'label' never occurs in the training data" in err
    lonely = write_table(tmp_path / "lonely.csv", [*rows, {"text": "only one", "label": "z"}])
    err = _refused(model_dir, lonely, tmp_path / "run", capsys, "--task", "classification", "--target-column", "label")
    assert "row 21: class 'z' is in the validation rows of fold" in err and "never in its training rows" in err


def test_a_model_folder_without_a_tokenizer_is_refused(model_dir, tmp_path, capsys):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        (bare / name).unlink(missing_ok=True)
    data = write_table(tmp_path / "a.csv", river_rows(12))
    err = _refused(bare, data, tmp_path / "run", capsys)
    assert str(bare) in err and "tokenizer" in err


def test_steps_equal_torch_adamw_with_clipping_and_decay_mask(wordpiece_dir, tmp_path):
    # The reference: transformers' BertForSequenceClassification under torch's AdamW, weight decay on everything but
    # biases and LayerNorm (what the Trainer does), global-norm clipping, the same lr each step.
    import torch
    from hf_models import save_hf_model
    from transformers import BertForSequenceClassification

    from bertforge.data.batching import pad_batch

    folder = save_hf_model(BertForSequenceClassification, "bert", wordpiece_dir, tmp_path / "hf", num_labels=1)
    overrides = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "classifier_dropout": 0.0}
    pre = load_pretrained(folder, head="sequence", num_labels=1, overrides=overrides)
    ref = BertForSequenceClassification.from_pretrained(folder, num_labels=1, **{
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "classifier_dropout": 0.0})  # fmt: skip
    optim = OptimConfig(lr=3e-3, b2=0.999, eps=1e-8, weight_decay=0.1, clip_norm=0.5)
    graphdef, params, rest = nnx.split(pre.model, nnx.Param, ...)
    tx = make_optimizer(optim, params, pre.model.config.num_layers)
    state = new_train_state(jax.device_put(params), tx, make_mesh(devices=jax.devices()[:1]))
    # The program fine-tuning runs: the gradients, then the update, as two compiled programs.
    step = compile_train_step(graphdef, rest, tx, SequenceStepConfig("mse"), jax.tree.map(lambda x: x.sharding, state))
    no_decay = [n.endswith("bias") or "LayerNorm" in n for n, _ in ref.named_parameters()]
    groups = [[p for (_, p), nd in zip(ref.named_parameters(), no_decay, strict=True) if nd == flag] for flag in (0, 1)]
    adamw = torch.optim.AdamW(
        [{"params": groups[0], "weight_decay": 0.1}, {"params": groups[1], "weight_decay": 0.0}],
        lr=3e-3, betas=(0.9, 0.999), eps=1e-8,
    )  # fmt: skip
    with torch.no_grad():  # the same starting head (ours is (in, out), theirs (out, in))
        ref.classifier.weight.copy_(torch.tensor(np.asarray(pre.model.head.out.kernel[...]).T))
    rng = np.random.default_rng(0)
    words = "the river city had a music school and the army league season church king".split()
    for i, lr in enumerate([3e-3, 2e-3, 1e-3, 3e-3]):
        texts = [" ".join(rng.choice(words, rng.integers(3, 12))) for _ in range(8)]
        batch = pad_batch(pre.tokenizer.encode_batch(texts, max_length=32), pre.tokenizer.pad_id, 32)
        targets = rng.normal(size=(8, 1)).astype(np.float32)
        ours = {**batch, "targets": targets, "weight": np.ones(8, np.float32)}
        state, m = step(state, {k: jnp.asarray(v) for k, v in ours.items()}, jnp.float32(lr), jax.random.key(0))
        for g in adamw.param_groups:
            g["lr"] = lr
        logits = ref(**{k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}).logits
        loss = torch.nn.functional.mse_loss(logits, torch.tensor(targets))
        adamw.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        adamw.step()
        assert float(m["loss"]) == pytest.approx(loss.item(), rel=1e-5), i
        assert float(m["grad_norm"]) == pytest.approx(norm.item(), rel=1e-4), i
        assert norm.item() > 0.5  # clipping really acted
    nnx.update(pre.model, state.params)
    pre.model.eval()
    ref.eval()
    with torch.no_grad():
        theirs = ref(**{k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}).logits.numpy()
    np.testing.assert_allclose(np.asarray(pre.model(*(jnp.asarray(batch[k]) for k in batch))), theirs, atol=1e-4)
