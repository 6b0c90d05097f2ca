"""Averages of weights: the moving average a pretraining run keeps (train.ema) against its closed form and across a
kill and resume, and `export --average` (the mean of checkpoints) against numpy's mean."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_pretrain import config

from bertforge.cli import main as cli
from bertforge.model.hf import load_pretrained
from bertforge.model.load import load_run
from bertforge.tasks import pretrain
from bertforge.train.ema import ema_weights, with_ema
from bertforge.train.optim import OptimConfig, make_optimizer
from bertforge.train.step import TrainState, apply_update


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_the_moving_average_is_its_debiased_closed_form_and_skips_a_non_finite_update():
    decay = 0.8
    tx = with_ema(make_optimizer(OptimConfig(lr=0.1, warmup_steps=0)), decay)
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), "b": jnp.asarray(rng.normal(size=4), jnp.float32)}
    state, seen = TrainState(jnp.int32(0), params, tx.init(params)), []
    for t in range(6):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
        loss = jnp.float32(np.nan if t == 3 else 1.0)  # update 4 is skipped: the average must not see it
        state, _, _ = apply_update(state, grads, loss, jnp.float32(0.1), tx)
        if t != 3:
            seen.append(state.params)
    # The weights after each applied update w_1..w_t: sum (1 - d) d^(t-i) w_i / (1 - d^t).
    t = len(seen)
    expected = jax.tree.map(
        lambda *ws: (
            sum((1 - decay) * decay ** (t - i) * np.asarray(w, np.float64) for i, w in enumerate(ws, 1))
            / (1 - decay**t)
        ),
        *seen,
    )
    got = ema_weights(state.opt_state, decay)
    for g, e in zip(leaves(got), leaves(expected), strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    assert ema_weights(tx.init(params), decay) is None  # nothing averaged yet
    assert with_ema(optax.sgd(0.1), 0.0).init(params) == optax.sgd(0.1).init(params)  # 0: no average kept


CONSTANT = {"schedule": "constant"}  # with test_pretrain's 2 warmup steps


@pytest.fixture(scope="module")
def ema_run(shards, tmp_path_factory):
    """20 steps with a moving average, checkpoints at 5, 10, 15 and 20, all four kept."""
    out = tmp_path_factory.mktemp("ema") / "run"
    cfg = config(shards, train={"max_steps": 20, "ema": 0.9}, checkpoint={"every": 5, "keep_last": 4}, optim=CONSTANT)
    pretrain.main(cfg, str(out))
    return out


def test_averaged_checkpoints_are_numpys_mean_of_them(ema_run, tmp_path):
    each = {s: leaves(nnx.state(load_run(ema_run, str(s)).model, nnx.Param)) for s in (5, 10, 15, 20)}
    for spec, steps in (("last:3", (10, 15, 20)), ("step:20,5", (5, 20))):
        assert cli(["export", str(ema_run), "--average", spec, "--out", str(tmp_path / spec.replace(":", "-"))]) == 0
        model = load_pretrained(tmp_path / spec.replace(":", "-"), head="mlm").model
        got = leaves(nnx.state(model, nnx.Param))
        for i, g in enumerate(got):
            np.testing.assert_allclose(g, np.mean([each[s][i] for s in steps], axis=0), rtol=1e-6, atol=1e-7)


def test_the_moving_average_exports_and_a_resumed_run_keeps_it_to_the_bit(ema_run, shards, tmp_path):
    # Stopped at step 10, then continued to 20: the learning rate of a constant schedule does not depend on the budget.
    for steps in (10, 20):
        cfg = config(
            shards, train={"max_steps": steps, "ema": 0.9}, checkpoint={"every": 5, "keep_last": 4}, optim=CONSTANT
        )
        pretrain.main(cfg, str(tmp_path / "run"))
    ema = leaves(nnx.state(load_run(ema_run, weights="ema").model, nnx.Param))
    resumed = leaves(nnx.state(load_run(tmp_path / "run", weights="ema").model, nnx.Param))
    for a, b in zip(resumed, ema, strict=True):
        np.testing.assert_array_equal(a, b)
    params = leaves(nnx.state(load_run(ema_run).model, nnx.Param))
    assert max(np.abs(a - b).max() for a, b in zip(ema, params, strict=True)) > 1e-4  # not the weights themselves
    assert cli(["export", str(ema_run), "--weights", "ema", "--out", str(tmp_path / "hf")]) == 0
    exported = leaves(nnx.state(load_pretrained(tmp_path / "hf", head="mlm").model, nnx.Param))
    for a, b in zip(exported, ema, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["--average", "last:5"],
            "the run kept 4 checkpoint(s) (steps 5, 10, 15, 20); checkpoint.keep_last is 4; "
            "set checkpoint.keep_last to 5 or more",
        ),
        (["--average", "step:5,7"], "--average step:5,7: no checkpoint at step 7 (there are 5, 10, 15, 20)"),
        (["--average", "first:2"], "--average 'first:2': last:N (the newest N checkpoints) or step:A,B,C"),
        (["--average", "last:2", "--step", "5"], "--average last:2 and --step 5: give one of them"),
        (["--weights", "mean"], "--weights 'mean': one of params, ema"),
    ],
)
def test_a_wrong_average_is_one_line(ema_run, tmp_path, capsys, args, line):
    assert cli(["export", str(ema_run), *args, "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert line in err and "Traceback" not in err, err
    assert not (tmp_path / "hf").exists()


def test_the_moving_average_of_a_run_that_kept_none_is_one_line(shards, tmp_path, capsys):
    pretrain.main(config(shards, train={"max_steps": 2}, checkpoint={"every": 2}), str(tmp_path / "run"))
    assert cli(["export", str(tmp_path / "run"), "--weights", "ema", "--out", str(tmp_path / "hf")]) == 2
    assert "kept no moving average of its weights (train.ema was not set)" in capsys.readouterr().err
