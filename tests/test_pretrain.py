"""Pretraining: loss falls, sharding and accumulation change nothing, kill -9 and SIGTERM lose nothing."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from bertforge import version
from bertforge.cli import main as cli
from bertforge.config import from_dict
from bertforge.model.load import load_run
from bertforge.runs import RunLock
from bertforge.tasks import pretrain
from bertforge.train.metrics_log import read_metrics
from bertforge.train.optim import OptimConfig, decay_mask, learning_rate, warmup_fraction

ROOT = Path(__file__).resolve().parents[1]


def config(shards, **sections):
    data = {
        "model": {"preset": "test", "hidden_dropout": 0.0, "attention_dropout": 0.0},
        "data": {"shards": str(shards)},
        "train": {"global_batch": 16, "max_steps": 20},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "eval": {"every": 10},
        "checkpoint": {"every": 10},
        "log": {"every": 1, "tensorboard": False, "progress": False},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return from_dict(pretrain.PretrainConfig, data)


def losses(run_dir, key="loss"):
    return {m["step"]: m[key] for m in read_metrics(run_dir) if key in m}


def params_of(run_dir, which="latest", part=""):
    model = load_run(run_dir, which, part).model
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_loss_falls_and_the_run_exports(shards, tmp_path, capsys, monkeypatch):
    cfg = config(shards, train={"max_steps": 60}, eval={"every": 20}, checkpoint={"every": 20})
    last = pretrain.main(cfg, str(tmp_path / "run"))
    train = losses(tmp_path / "run")
    valid = losses(tmp_path / "run", "valid_loss")
    assert train[1] > np.log(700) - 0.5  # starts near uniform over the vocabulary
    assert np.mean([train[s] for s in range(51, 61)]) < train[1] - 1.0
    assert valid[60] < valid[20] and last["valid_loss"] == valid[60]
    assert 0 < last["valid_accuracy"] < 1 and last["valid_perplexity"] == pytest.approx(np.exp(valid[60]))

    # An export into --out makes no temporary folder elsewhere (a kill -9 would leave it behind).
    monkeypatch.setattr(tempfile, "TemporaryDirectory", None)
    assert cli(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    monkeypatch.undo()
    from transformers import AutoModelForMaskedLM

    assert AutoModelForMaskedLM.from_pretrained(tmp_path / "hf").config.num_hidden_layers == 2
    capsys.readouterr()
    assert cli(["fill-mask", "--model", str(tmp_path / "run"), "--json", "the [MASK] city"]) == 0
    assert len(json.loads(capsys.readouterr().out)[0]["masks"][0]) == 5


# A test-sized ModernBERT: pre-norm, rotary positions, local (8 tokens) and global attention, no biases.
MODERNBERT = {"preset": "test", "family": "modernbert", "intermediate_size": 48, "local_attention": 8,
              "global_attn_every_n_layers": 2}  # fmt: skip


# BERT with dropout on: its masks are a function of the step's key, not of how the batch is laid out.
@pytest.mark.parametrize(
    "model",
    [{"hidden_dropout": 0.1, "attention_dropout": 0.1}, pytest.param(MODERNBERT, marks=pytest.mark.slow)],
    ids=["bert", "modernbert"],  # modernbert: `make slow`
)
def test_eight_devices_give_the_losses_of_one(shards, tmp_path, model):
    one = config(shards, model=model, mesh={"num_devices": 1})
    eight = config(shards, model=model, mesh={"num_devices": 8})
    assert jax.device_count() == 8
    pretrain.main(one, str(tmp_path / "one"))
    pretrain.main(eight, str(tmp_path / "eight"))
    a, b = losses(tmp_path / "one"), losses(tmp_path / "eight")
    assert sorted(a) == sorted(b) == list(range(1, 21))
    np.testing.assert_allclose([b[s] for s in a], [a[s] for s in a], rtol=0, atol=1e-5)
    for x, y in zip(params_of(tmp_path / "one"), params_of(tmp_path / "eight"), strict=True):
        np.testing.assert_allclose(y, x, atol=1e-5)


def test_fsdp_gives_the_losses_of_data_parallel(shards, tmp_path):
    # Parameters and optimizer moments split over 4 devices along 'embed'; the arithmetic is the same.
    pretrain.main(config(shards, train={"max_steps": 8}), str(tmp_path / "dp"))
    pretrain.main(config(shards, train={"max_steps": 8}, mesh={"data": 2, "fsdp": 4}), str(tmp_path / "fsdp"))
    np.testing.assert_allclose(
        list(losses(tmp_path / "fsdp").values()), list(losses(tmp_path / "dp").values()), atol=1e-5
    )


def test_out_of_memory_at_the_first_step_names_the_knobs():
    from bertforge.errors import UserError

    def exhausted(state, batch, lr):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes.")

    with pytest.raises(UserError, match=r"out of device memory at the first step: lower train.global_batch, raise "
                                        r"train.grad_accum, shard parameters with mesh.fsdp"):  # fmt: skip
        run_loop(exhausted, steps=3, log_every=1)


def run_loop(step_fn, steps: int, log_every: int, **kwargs):
    """loop.run over `steps` steps of `step_fn` with no state, no batches, a constant learning rate and no log."""
    from bertforge.train import loop

    budget = loop.Budget(max_steps=steps)
    return loop.run(None, step_fn, next_batch=lambda _: None, lr_at=lambda p: 1.0, budget=budget,
                    log=lambda s, m: None, log_every=log_every, **kwargs)  # fmt: skip


@pytest.mark.parametrize(
    ("steps", "every", "offset", "expected"),
    [
        (10, 4, 0, [4, 8, 10]),  # every 4th step, and the last
        (10, 4, 10 % 4, [6, 10]),  # counted back from the last step: nothing a few steps before it
        (3, 4, 3 % 4, [3]),  # fewer steps than `every`: only the last
        (12, 4, 12 % 4, [4, 8, 12]),
    ],
)
def test_periodic_work_falls_on_the_steps_offset_plus_multiples(steps, every, offset, expected):
    from bertforge.train import loop

    evaluated, saved = [], []
    run_loop(
        lambda state, batch, lr: (state, {"finite": True, "loss": 1.0}),
        steps,
        log_every=5,
        evaluate=loop.Every(every, lambda step, state: evaluated.append(step), offset=offset),
        checkpoint=loop.Every(every, lambda step, state, evaluation: saved.append(step), offset=offset),
    )
    assert evaluated == saved == expected


@pytest.mark.parametrize("stop_at", [None, 10, 7])
def test_a_checkpoint_that_skips_the_last_step_is_still_taken_when_a_signal_stops_the_run_there(stop_at):
    from bertforge.train import loop

    saved: list[int] = []

    def step(state, batch, lr, n=[0]):  # noqa: B006 - counts the steps run
        n[0] += 1
        if n[0] == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return state, {"finite": True, "loss": 1.0}

    run = functools.partial(
        run_loop,
        step,
        10,
        log_every=5,
        checkpoint=loop.Every(4, lambda step, state, evaluation: saved.append(step), offset=2, last=False),
        preemptible=True,
    )
    if stop_at is None:
        run()
    else:
        with pytest.raises(loop.Preempted):
            run()
    assert saved == {None: [6], 10: [6, 10], 7: [6, 7]}[stop_at]


def test_each_log_line_says_how_much_of_a_step_went_to_making_its_batch():
    # A batch that takes 30 ms to make, a step of 10 ms: batch_time is the first, step_time both.
    from bertforge.train import loop

    def next_batch(_):
        time.sleep(0.03)

    def step_fn(state, batch, lr):
        time.sleep(0.01)
        return state, {"finite": True, "loss": 1.0}

    lines = []
    loop.run(None, step_fn, next_batch=next_batch, lr_at=lambda p: 1.0, budget=loop.Budget(max_steps=4),
             log=lambda s, m: lines.append(m), log_every=2)  # fmt: skip
    assert len(lines) == 2
    for line in lines:  # sleeps may overrun under load, never fall short
        assert line["batch_time"] >= 0.03 and 0.01 <= line["step_time"] - line["batch_time"] < 0.03, line


def test_with_a_shared_clock_a_time_budget_ends_alike_whatever_the_local_clock():
    # As the processes of one run see it: their own clocks run apart, and process 0's is shared at each log boundary.
    from bertforge.train import loop

    def steps_and_rates(step_seconds: float) -> tuple[int, list[float]]:
        shared = iter(range(1, 100))  # process 0's elapsed seconds at the log boundaries: 1, 2, 3, ...
        rates = []

        def step_fn(state, batch, lr):
            time.sleep(step_seconds)
            rates.append(lr)
            return state, {"finite": True, "loss": 1.0}

        budget = loop.Budget(seconds=4.5)
        clock = lambda local: float(next(shared))  # noqa: E731
        _, step, _ = loop.run(
            None,
            step_fn,
            next_batch=lambda _: None,
            lr_at=lambda p: p,
            budget=budget,
            log=lambda s, m: None,
            log_every=3,
            clock=clock,
        )
        return step, rates

    # Boundaries every 3 steps share 1, 2, 3, 4, 5 s: the rate (here the progress) holds for 3 steps at a time, and
    # the run ends at the boundary that passes 4.5 s.
    expected = (15, [k / 4.5 for k in range(5) for _ in range(3)])
    assert steps_and_rates(0.01) == expected
    assert steps_and_rates(0.0) == expected


@pytest.mark.slow  # `make slow`; the fast suite keeps fine-tuning's accumulation test
def test_accumulation_gives_the_update_of_the_large_batch(shards, tmp_path):
    # Without dropout, 4 micro-batches of 8 are the batch of 32 cut in four.
    big = config(shards, train={"global_batch": 32, "max_steps": 6})
    accumulated = config(shards, train={"global_batch": 32, "grad_accum": 4, "max_steps": 6})
    pretrain.main(big, str(tmp_path / "big"))
    pretrain.main(accumulated, str(tmp_path / "acc"))
    np.testing.assert_allclose(
        list(losses(tmp_path / "acc").values()), list(losses(tmp_path / "big").values()), atol=1e-5
    )
    for x, y in zip(params_of(tmp_path / "big"), params_of(tmp_path / "acc"), strict=True):
        np.testing.assert_allclose(y, x, atol=1e-5)


def test_sparse_head_gives_the_losses_of_the_dense_head(shards, tmp_path):
    pretrain.main(config(shards, train={"max_steps": 5, "sparse_head": False}), str(tmp_path / "dense"))
    pretrain.main(config(shards, train={"max_steps": 5, "sparse_head": True}), str(tmp_path / "sparse"))
    np.testing.assert_allclose(
        list(losses(tmp_path / "sparse").values()), list(losses(tmp_path / "dense").values()), atol=1e-5
    )


def _command(shards, out, *extra):
    return [
        sys.executable, "-m", "bertforge.cli", "pretrain", "--data", str(shards), "--out", str(out),
        "--model.preset=test", "--train.global_batch=16", "--train.max_steps=30", "--optim.lr=3e-3",
        "--checkpoint.every=4", "--eval.every=10", "--log.every=1", "--log.tensorboard=false", *extra,
    ]  # fmt: skip


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            out = out.decode() if isinstance(out, bytes) else out
            raise AssertionError(f"trainer exited early: {out[-2000:]}")
        if max(losses(run_dir), default=0) >= step:
            return
        time.sleep(0.05)
    raise AssertionError("trainer too slow")


def test_sigterm_saves_a_checkpoint_before_exit(shards, tmp_path):
    out = tmp_path / "run"
    cmd = _command(shards, out, "--train.max_steps=200", "--checkpoint.every=1000")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _wait_for_step(out, 3, proc)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 143, output
    assert "checkpoint saved; run the same command to continue" in output
    saved = [int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(saved) == 1 and 3 <= saved[0] < 200
    assert saved[0] == max(losses(out))  # the step it stopped at


def test_a_second_trainer_is_refused_naming_the_first(shards, tmp_path, capsys):
    out = tmp_path / "run"
    with RunLock(out):
        code = cli(["pretrain", "--data", str(shards), "--out", str(out), "--model.preset=test", "--train.max_steps=2"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"another trainer is using this run (host {os.uname().nodename}, pid {os.getpid()})" in err


def test_batch_that_does_not_split_over_devices_suggests_values(shards, tmp_path, capsys):
    code = cli(["pretrain", "--data", str(shards), "--out", str(tmp_path / "r"), "--model.preset=test",
                "--train.max_steps=2", "--train.global_batch=12"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "do not split over 8 devices (mesh data x fsdp); use train.global_batch 8 or 16" in err


def test_nan_loss_stops_the_run_naming_the_step_and_the_last_good_checkpoint(shards, tmp_path, capsys):
    out = tmp_path / "run"
    code = cli(["pretrain", "--data", str(shards), "--out", str(out), "--model.preset=test", "--train.max_steps=20",
                "--optim.lr=1e30", "--optim.clip_norm=null", "--optim.warmup_steps=0", "--optim.warmup_fraction=0",
                "--checkpoint.every=1", "--log.tensorboard=false"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert err.startswith("error: the loss became NaN or infinite at step ")
    bad = int(err.split("at step ")[1].split(";")[0])
    assert f"the last good checkpoint is {out / 'checkpoints' / str(bad - 1)}" in err
    for x in params_of(out):
        assert np.all(np.isfinite(x))  # no NaN was ever written


def test_time_budget_stops_the_run(shards, tmp_path):
    cfg = config(shards, train={"max_steps": None, "time_budget_minutes": 0.1}, eval={"every": 10**6})
    start = time.time()
    last = pretrain.main(cfg, str(tmp_path / "run"))
    assert 6 <= time.time() - start < 60
    assert last["elapsed"] >= 6 and last["lr"] < 3e-3  # the schedule was laid over the time budget


def test_schedules_in_closed_form():
    for schedule in ("linear", "polynomial", "cosine", "constant"):
        cfg = OptimConfig(lr=1.0, schedule=schedule, end_lr_ratio=0.1, power=2.0)
        assert learning_rate(cfg, 0.05, 0.1) == pytest.approx(0.5)  # halfway through warmup
        assert learning_rate(cfg, 0.1, 0.1) == pytest.approx(1.0)
    end = 0.1
    assert learning_rate(OptimConfig(lr=1.0, schedule="linear", end_lr_ratio=end), 0.55, 0.1) == pytest.approx(0.55)
    poly = OptimConfig(lr=1.0, schedule="polynomial", end_lr_ratio=end, power=2.0)
    assert learning_rate(poly, 0.55, 0.1) == pytest.approx(end + 0.9 * 0.25)
    cos = OptimConfig(lr=1.0, schedule="cosine", end_lr_ratio=end)
    assert learning_rate(cos, 0.55, 0.1) == pytest.approx(end + 0.9 * 0.5)
    assert learning_rate(cos, 1.0, 0.1) == pytest.approx(end)
    wsd = OptimConfig(lr=1.0, schedule="wsd", end_lr_ratio=end, decay_fraction=0.2)
    assert learning_rate(wsd, 0.05, 0.1) == pytest.approx(0.5)
    assert learning_rate(wsd, 0.5, 0.1) == learning_rate(wsd, 0.8, 0.1) == 1.0  # the stable phase
    assert learning_rate(wsd, 0.85, 0.1) == pytest.approx(end + 0.9 * (1 - 0.25**0.5))  # 1 - sqrt of the decay
    assert learning_rate(wsd, 1.0, 0.1) == pytest.approx(end)


@pytest.mark.parametrize("steps,ratio", [(3, 0.1), (30, 0.1), (426, 0.1), (7, 0.5), (100, 0.06), (50, 0.0)])
def test_step_schedules_are_the_trainers(steps, ratio):
    """Step by step, the learning rate a fine-tuning run of `steps` steps takes (progress step/steps, as the loop
    gives it) is what transformers' Trainer takes with the same warmup_ratio: the warmup rounded up to whole steps."""
    from transformers import TrainingArguments
    from transformers.optimization import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    torch = pytest.importorskip("torch")
    warmup = TrainingArguments(output_dir="unused", warmup_steps=ratio, use_cpu=True).get_warmup_steps(steps)
    for schedule, make in (("linear", get_linear_schedule_with_warmup), ("cosine", get_cosine_schedule_with_warmup)):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-5)
        theirs = make(optimizer, num_warmup_steps=warmup, num_training_steps=steps)
        cfg = OptimConfig(lr=2e-5, schedule=schedule, warmup_fraction=ratio)
        for step in range(steps):
            ours = learning_rate(cfg, step / steps, warmup_fraction(cfg, steps))
            assert ours == pytest.approx(theirs.get_last_lr()[0], rel=1e-9, abs=1e-15), (schedule, step)
            optimizer.step()
            theirs.step()


@pytest.mark.slow  # `make slow`
def test_a_wsd_run_continued_from_its_stable_phase_with_a_larger_budget_is_the_run_of_that_budget(shards, tmp_path):
    """Until the decay the lr does not depend on the budget: a run of 20 steps, continued from its checkpoint at step
    10 with a budget of 40, is the run of 40 steps, step for step (a linear decay would differ from the start)."""
    optim = {"schedule": "wsd", "decay_fraction": 0.4, "warmup_steps": 2}
    first, later, whole = tmp_path / "first", tmp_path / "later", tmp_path / "whole"
    pretrain.main(config(shards, optim=optim, train={"max_steps": 20}), str(first))
    pretrain.main(
        config(shards, optim=optim, train={"max_steps": 40}), str(later), resume=str(first / "checkpoints" / "10")
    )
    pretrain.main(config(shards, optim=optim, train={"max_steps": 40}), str(whole))
    a, b = losses(later), losses(whole)
    assert min(a) == 11 and all(a[s] == b[s] for s in a)
    for x, y in zip(params_of(later), params_of(whole), strict=True):
        np.testing.assert_array_equal(x, y)


def test_weight_decay_skips_biases_and_layernorm():
    from bertforge.model.architectures import build
    from bertforge.model.config import preset

    model = build(preset("test"), "mlm")
    mask = nnx.to_pure_dict(decay_mask(nnx.state(model, nnx.Param)))
    layer = mask["encoder"]["layers"][0]
    assert layer["query"]["kernel"] and not layer["query"]["bias"]
    assert not layer["attn_norm"]["scale"] and not layer["attn_norm"]["bias"]
    assert mask["encoder"]["embeddings"]["word"]["embedding"] and not mask["mlm"]["bias"]
    assert sum(jax.tree.leaves(mask)) == 2 * 6 + 3 + 1  # 6 kernels per layer, 3 embeddings, the MLM dense


def test_adamw_decays_matrices_only():
    from bertforge.model.architectures import build
    from bertforge.model.config import preset
    from bertforge.train.optim import make_optimizer, set_learning_rate

    params = nnx.state(build(preset("test"), "mlm"), nnx.Param)
    tx = make_optimizer(OptimConfig(lr=0.5, weight_decay=0.1, clip_norm=None))
    state = set_learning_rate(tx.init(params), jax.numpy.float32(0.5))
    zero = jax.tree.map(jax.numpy.zeros_like, params)
    updates, _ = tx.update(zero, state, params)
    p, u = nnx.to_pure_dict(params), nnx.to_pure_dict(updates)
    kernel = p["encoder"]["layers"][0]["mlp_in"]["kernel"]
    np.testing.assert_allclose(u["encoder"]["layers"][0]["mlp_in"]["kernel"], -0.5 * 0.1 * kernel, rtol=1e-6)
    assert not np.any(u["encoder"]["layers"][0]["mlp_in"]["bias"])
    assert not np.any(u["encoder"]["layers"][0]["mlp_norm"]["scale"])


@pytest.mark.parametrize("scale", [0.01, 10.0])
def test_clipping_is_the_closed_form_global_norm_clip(scale):
    from bertforge.train.optim import clip_by_global_norm

    rng = np.random.default_rng(0)
    grads = {"a": rng.normal(size=(30, 8)) * scale, "b": rng.normal(size=(5,)) * scale}
    grads = jax.tree.map(lambda g: jax.numpy.asarray(g, jax.numpy.float32), grads)
    norm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in grads.values()))
    tx = clip_by_global_norm(1.0)
    clipped, _ = jax.jit(tx.update)(grads, tx.init(grads))
    factor = min(1.0, 1.0 / norm)  # g * max_norm / ||g|| when the norm is over max_norm, else g
    assert (factor < 1.0) == (scale == 10.0)
    for name, g in grads.items():
        np.testing.assert_allclose(clipped[name], np.asarray(g, np.float64) * factor, rtol=1e-6)
    # optax's own state, so that checkpoints written with optax's clip restore
    assert jax.tree.structure(tx.init(grads)) == jax.tree.structure(optax.clip_by_global_norm(1.0).init(grads))


def test_resume_from_another_runs_checkpoint_and_never(shards, tmp_path):
    from bertforge.errors import UserError

    pretrain.main(config(shards, train={"max_steps": 10}), str(tmp_path / "a"))
    with pytest.raises(UserError, match="already has checkpoints"):
        pretrain.main(config(shards), str(tmp_path / "a"), resume="never")
    pretrain.main(config(shards), str(tmp_path / "b"), resume=str(tmp_path / "a" / "checkpoints" / "10"))
    with pytest.raises(UserError, match=r"a: this run has optim.lr: 0.003, this command gives 0.001;"):
        pretrain.main(config(shards, optim={"lr": 1e-3}), str(tmp_path / "a"))
    pretrain.main(config(shards), str(tmp_path / "a"))  # the same run, continued to step 20
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert min(b) == 11 and all(b[s] == a[s] for s in b)
    with pytest.raises(UserError, match="no checkpoint to resume from"):
        pretrain.main(config(shards), str(tmp_path / "c"), resume=str(tmp_path / "nowhere"))


def test_pretrain_refuses_another_tokenizer_and_too_long_sequences(shards, tmp_path, bpe_dir, capsys):
    base = ["pretrain", "--data", str(shards), "--model.preset=test", "--train.max_steps=2"]
    code = cli([*base, "--out", str(tmp_path / "a"), "--tokenizer", str(bpe_dir)])
    err = capsys.readouterr().err
    assert code == 2 and "manifest.json was made with another tokenizer than" in err and "Traceback" not in err
    code = cli([*base, "--out", str(tmp_path / "b"), "--model.max_position_embeddings=16"])
    err = capsys.readouterr().err
    assert code == 2 and "sequences of 32 tokens do not fit the position table" in err and "Traceback" not in err


def test_best_step_is_the_lowest_validation_loss_not_the_latest(tmp_path):
    from bertforge.train.checkpoint import Checkpoints

    state = {"w": jax.numpy.zeros(3)}
    checkpoints = Checkpoints(tmp_path / "c", keep_last=1, keep_best=1)
    for step, loss in [(1, 0.5), (2, 0.3), (3, None), (4, 0.4)]:
        checkpoints.save(step, {"w": state["w"] + step}, {"step": step}, valid_loss=loss)
    checkpoints.wait()
    assert checkpoints.best_step() == 2
    assert checkpoints.all_steps() == [2, 4]  # the best and the latest stay on disk
    checkpoints.close()
    reopened = Checkpoints(tmp_path / "c", keep_last=1, keep_best=1)
    assert reopened.best_step() == 2  # also for a resumed run, from the metrics saved with each step
    restored, _ = reopened.restore(2, state)
    np.testing.assert_array_equal(restored["w"], np.full(3, 2.0))
    reopened.close()
    latest_only = Checkpoints(tmp_path / "l", keep_last=2, keep_best=0)
    latest_only.save(1, state, {"step": 1})
    latest_only.wait()
    assert latest_only.best_step() is None  # `export --step best` then says that no step has a validation loss
    for step, loss in [(2, 0.3), (3, None)]:
        latest_only.save(step, state, {"step": step}, valid_loss=loss)
    latest_only.wait()
    assert latest_only.all_steps() == [2, 3]
    assert latest_only.best_step() == 2  # the best of the steps kept, not the latest
    latest_only.close()


@pytest.mark.slow  # `make slow`
def test_a_moved_or_uploaded_shard_folder_pretrains_without_tokenizer(wordpiece_dir, tmp_path):
    import shutil

    import fsspec
    from test_preprocess import make_documents, run

    given = shutil.copytree(wordpiece_dir, tmp_path / "tok")
    run(tmp_path, given, make_documents(n_docs=200, seed=3), name="made", seq_len=32, valid_fraction=0.05)
    shutil.rmtree(given)  # the tokenizer folder named to preprocess is not on this machine
    moved = tmp_path / "elsewhere" / "shards"
    shutil.move(tmp_path / "made", moved)
    fsspec.filesystem("memory").put(str(moved), "/bucket/shards", recursive=True)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(
        "model: {preset: test}\ntrain: {global_batch: 8, max_steps: 2}\neval: {every: 2}\n"
        "log: {every: 1, tensorboard: false, progress: false}\n"
    )
    for name, data in (("moved", str(moved)), ("bucket", "memory://bucket/shards")):
        assert cli(["pretrain", "--config", str(cfg), "--data", data, "--out", str(tmp_path / name)]) == 0
        assert sorted(losses(tmp_path / name)) == [1, 2]
        assert json.loads((tmp_path / name / "run.json").read_text())["bertforge_version"] == version()
        assert (tmp_path / name / "tokenizer" / "tokenizer.json").read_bytes() == (
            wordpiece_dir / "tokenizer.json"
        ).read_bytes()
