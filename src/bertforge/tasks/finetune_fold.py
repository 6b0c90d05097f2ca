"""One fold of `bertforge finetune`: train the sequence head and encoder from the pretrained weights, evaluate a few
times an epoch, keep the best checkpoint, and leave FOLD/model (a Hugging Face folder) and FOLD/result.json."""

from __future__ import annotations

import dataclasses
import functools
import math
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bertforge import hub, runs
from bertforge.card import card_files
from bertforge.data.batching import by_length, epoch_batches, pad_batch, padded_length
from bertforge.data.labelled import Table
from bertforge.hub import HubConfig, Publisher
from bertforge.model.hf import Pretrained, save_pretrained
from bertforge.runtime.devices import fetch, global_array
from bertforge.tasks.infer import INPUTS, outputs_by_length
from bertforge.tokenizer.load import Encoded
from bertforge.train import loop, metrics
from bertforge.train.checkpoint import Checkpoints
from bertforge.train.metrics_log import LogConfig, MetricsLog, read_metrics
from bertforge.train.optim import OptimConfig, learning_rate, warmup_fraction
from bertforge.train.sequence_step import LOSSES
from bertforge.train.step import TrainState, new_train_state


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 16
    grad_accum: int = 1
    epochs: float = 3.0
    evals_per_epoch: int = 2
    eval_batch_size: int = 64
    seed: int = 0  # data order and dropout
    dtype: str = "float32"  # compute dtype (bfloat16, or float16 with a loss scale: over float32 parameters)
    remat: bool = False  # recompute each layer's activations in the backward pass: less memory, ~1/3 more compute
    attention: str = "auto"  # auto, custom, xla, cudnn or explicit: the attention implementation (model.attention)
    # Lazy AdamW on the word-embedding table: only the rows of each batch's tokens are updated (faster on short
    # texts; changes the numbers, see train/sequence_step.py).
    sparse_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.grad_accum < 1 or self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size {self.batch_size} must be a positive multiple of grad_accum")
        if self.epochs <= 0 or self.evals_per_epoch < 1 or self.eval_batch_size < 1:
            raise ValueError("epochs, evals_per_epoch and eval_batch_size must be positive")


@dataclasses.dataclass(frozen=True)
class Job:
    """What every fold shares. The programs are made once, so that every fold runs the ones the first compiled."""

    run_dir: Path
    train: TrainConfig
    optim: OptimConfig
    log: LogConfig
    config: dict[str, Any]  # the run's whole config, for W&B
    task: str
    loss: str
    metric: str
    bucket: int  # padded lengths are multiples of this
    pool: int  # batches per pool of rows sorted by length; 1: random batches
    rungs: tuple[int, ...]  # the padded lengths (data.shapes of them at most); () for every multiple of bucket
    limit: int  # tokens per text
    pre: Pretrained  # the tokenizer and label names go with every fold's model
    table: Table  # training rows
    encs: list[Encoded]
    valid_table: Table | None  # a separate validation table, or None: folds of `table`
    valid_encs: list[Encoded] | None
    mesh: jax.sharding.Mesh
    graphdef: Any
    rest: Any
    pristine: Any  # host copy of the starting parameters
    param_shardings: Any
    tx: Any
    step_jit: Any
    forward_jit: Any
    base_model: str = ""  # what `--model` named: the model card's base model
    hub: HubConfig = dataclasses.field(default_factory=HubConfig)
    publisher: Publisher | None = None  # process 0's pushes to hub.repo
    hub_folder: str = ""  # where in the Hub repository this run's models go: fold-K/ when it trains several


def write_model(job: Job, fold_dir: Path, params: Any, out: Path, step: int) -> None:
    """The fold's model with `params` (its state at `step`) as a Hugging Face folder `out`, with a model card whose
    curves run to the last step logged (process 0 only)."""
    model = nnx.merge(job.graphdef, params, job.rest)
    config = {k: v for k, v in job.config.items() if k != "hub"}
    records = read_metrics(fold_dir)
    card = card_files(
        name=job.hub.repo if job.hub.repo else f"{job.run_dir.name}-{fold_dir.name}",
        kind="finetune",
        records=records,
        model=model.config,
        head="sequence",
        config=config,
        step=step,
        metrics=(job.metric,),
        base_model=job.base_model,
        **job.hub.card(),
    )
    save_pretrained(model, out, job.pre.tokenizer, job.pre.id2label, extra_files=card)


def _batch(job: Job, rows: np.ndarray, length: int) -> dict[str, np.ndarray]:
    """A training batch of exactly train.batch_size rows; filler rows get weight 0."""
    size, table = job.train.batch_size, job.table
    batch = pad_batch([job.encs[i] for i in rows], job.pre.tokenizer.pad_id, length, size)
    targets = np.zeros((size, *table.targets.shape[1:]), table.targets.dtype)
    targets[: len(rows)] = table.targets[rows]
    weight = np.zeros(size, np.float32)
    weight[: len(rows)] = table.weights[rows]
    return {**batch, "targets": targets, "weight": weight}


def scores(job: Job, outputs: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """The task's metrics and the loss of `outputs` against `targets`."""
    if job.task == "regression":
        found = metrics.regression(outputs, targets)
    elif job.task == "classification":
        found = metrics.classification(outputs, targets)
    else:
        found = metrics.multilabel(outputs, targets)
    found["loss"] = float(_mean_loss(outputs, targets, job.loss))
    return found


@functools.partial(jax.jit, static_argnums=2)
def _mean_loss(outputs: jax.Array, targets: jax.Array, loss: str) -> jax.Array:
    # One program: run op by op, the loss would compile a dozen (0.3-0.5 s on a first run, with their tracing).
    return jnp.mean(LOSSES[loss](outputs, targets))


def compile_ahead(job: Job, state: TrainState, key: jax.Array, lengths: np.ndarray, valid_lengths: np.ndarray,
                  first_step: int, steps: int) -> None:  # fmt: skip
    """Start compiling, in background threads (train/ahead.py), the gradients' program of every length the fold's
    batches from `first_step` on are padded to, in the order the steps first need them, then the evaluation's of
    every length its batches take; nothing else. `lengths`: the training rows' token counts."""
    size = job.train.batch_size
    per_epoch = math.ceil(len(lengths) / size)
    needed: list[int] = []
    for epoch in range(first_step // per_epoch, math.ceil(steps / per_epoch)):
        for local in epoch_batches(lengths, size, job.bucket, job.train.seed, epoch, job.pool):
            n = padded_length(int(lengths[local].max()), job.limit, job.bucket, job.rungs)
            needed += [] if n in needed else [n]
    for n in needed:  # all-filler batches of each shape: only their shapes and layouts matter
        batch = _batch(job, np.zeros(0, np.int64), n)
        job.step_jit.ahead(state, {k: global_array(v, job.mesh) for k, v in batch.items()}, key)
    evaluated = {padded_length(int(valid_lengths[idx].max()), job.limit, job.bucket, job.rungs)
                 for idx in by_length(valid_lengths, job.train.eval_batch_size)}  # fmt: skip
    for n in sorted(evaluated, reverse=True):  # the evaluation runs longest first
        batch = pad_batch([], job.pre.tokenizer.pad_id, n, job.train.eval_batch_size)
        job.forward_jit.ahead(state.params, {k: global_array(batch[k], job.mesh) for k in INPUTS})


def train_fold(job: Job, fold: int, train_rows: np.ndarray, valid_rows: np.ndarray, resume: str) -> dict[str, Any]:
    """Train fold `fold` (continuing from its newest checkpoint when it has one); returns its result.json."""
    train, mesh = job.train, job.mesh
    fold_dir = runs.fold_dir(job.run_dir, fold)
    fold_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    valid_encs = [(job.valid_encs or job.encs)[i] for i in valid_rows]
    valid_targets = (job.valid_table or job.table).targets[valid_rows]

    if jax.process_index() == 0:
        hub.clear_staging(fold_dir)
    state = new_train_state(jax.device_put(job.pristine, job.param_shardings), job.tx, mesh)
    checkpoints = Checkpoints(fold_dir / runs.CHECKPOINTS, keep_last=1, keep_best=1)
    state, meta = runs.resume(checkpoints, state, fold_dir, resume)
    start_step, elapsed = (0, 0.0) if meta is None else (int(state.step), float(meta.get("elapsed", 0.0)))

    size = train.batch_size
    per_epoch = math.ceil(len(train_rows) / size)
    steps = max(1, round(train.epochs * per_epoch))
    every = max(1, per_epoch // train.evals_per_epoch)
    lengths = np.array([len(job.encs[i].ids) for i in train_rows])
    plans: dict[int, list[np.ndarray]] = {}
    cursor = [start_step]

    def next_batch(_progress: float) -> dict[str, jax.Array]:
        epoch, i = divmod(cursor[0], per_epoch)
        cursor[0] += 1
        if epoch not in plans:
            plans.clear()
            plans[epoch] = epoch_batches(lengths, size, job.bucket, train.seed, epoch, job.pool)
        local = plans[epoch][i]
        length = padded_length(int(lengths[local].max()), job.limit, job.bucket, job.rungs)
        batch = _batch(job, train_rows[local], length)
        return {k: global_array(v, mesh) for k, v in batch.items()}

    key = jax.random.key(train.seed + fold)

    def outputs_of(params: Any) -> np.ndarray:
        forward = lambda b: job.forward_jit(params, {k: global_array(b[k], mesh) for k in INPUTS})  # noqa: E731
        return outputs_by_length(
            forward, valid_encs, job.pre.tokenizer.pad_id, train.eval_batch_size, job.limit, job.bucket, rungs=job.rungs
        )

    log = MetricsLog(fold_dir, job.log, steps, start_step, job.config)
    sign = -1.0 if metrics.HIGHER_IS_BETTER[job.metric] else 1.0  # checkpoints keep the lowest

    evaluated: dict[int, np.ndarray] = {}  # step -> validation outputs: the best step's are the fold's outputs

    def evaluate(step: int, state: TrainState) -> dict[str, float]:
        began = time.perf_counter()
        evaluated[step] = outputs_of(state.params)
        found = {f"valid_{k}": v for k, v in scores(job, evaluated[step], valid_targets).items()}
        return {**found, "eval_seconds": time.perf_counter() - began}

    def save(step: int, state: TrainState, evaluation: dict[str, float] | None) -> None:
        meta = {"elapsed": time.perf_counter() - started + elapsed, "step": step}
        score = None if evaluation is None else sign * evaluation[f"valid_{job.metric}"]
        checkpoints.save(step, state, meta, valid_loss=score)
        kept = {*checkpoints.all_steps(), step}
        for gone in [s for s in evaluated if s not in kept]:
            del evaluated[gone]  # its checkpoint is gone: it can no longer be the best
        if job.hub.due(step, every):
            params = fetch(state.params)  # every process takes part when the parameters are split over hosts
            if job.publisher is not None:
                write = functools.partial(write_model, job, fold_dir, params, step=step)
                where = job.hub_folder.format(fold=fold)
                hub.stage(job.publisher, fold_dir, f"step-{step}", write, f"fold {fold}, step {step}", where)

    log.message(
        f"fold {fold}: {len(train_rows)} training rows, {len(valid_rows)} validation rows; {steps} steps of "
        f"{size} ({per_epoch} per epoch), evaluating every {every}; texts padded to "
        + (", ".join(map(str, job.rungs)) if job.rungs else f"multiples of {job.bucket}")
        + " tokens"
        + (f"; resuming from step {start_step}" if start_step else "")
    )
    warmup = warmup_fraction(job.optim, steps)
    compile_ahead(job, state, key, lengths, np.array([len(e.ids) for e in valid_encs]), start_step, steps)
    try:
        state, _, _ = loop.run(
            state,
            lambda s, b, lr: job.step_jit(s, b, jnp.float32(lr), key),
            next_batch=next_batch,
            lr_at=lambda p: learning_rate(job.optim, p, warmup),
            budget=loop.Budget(max_steps=steps),
            log=lambda step, values: log.record(
                step, {"epoch": step / per_epoch, **values}, ("loss", "lr", f"valid_{job.metric}")
            ),
            log_every=job.log.every,
            start_step=start_step,
            # Counted back from the last step, so that the last evaluation is of the final model, with none just
            # before it (a few steps earlier) to pay for.
            evaluate=loop.Every(every, evaluate, offset=steps % every),
            checkpoint=loop.Every(every, save, offset=steps % every),
            preemptible=True,
        )
        checkpoints.wait()
        best = checkpoints.best_step() or checkpoints.latest_step()
        if best != int(state.step):
            state, _ = checkpoints.restore(best, state)
    except loop.NonFiniteLoss as e:
        raise loop.non_finite_error(e, before=f"fold {fold}: ") from None
    finally:
        log.close()
        checkpoints.close()
    outputs = evaluated[best] if best in evaluated else outputs_of(state.params)  # else: evaluated before a resume
    found = scores(job, outputs, valid_targets)
    params = fetch(state.params)  # every process takes part when the parameters are split over hosts
    if jax.process_index() == 0:
        write_model(job, fold_dir, params, fold_dir / runs.MODEL, int(best))
        if job.publisher is not None:
            message = f"fold {fold}, best model (step {best})"
            copy = hub.copy_of(fold_dir / runs.MODEL)
            hub.stage(job.publisher, fold_dir, "final", copy, message, job.hub_folder.format(fold=fold))
    result = {
        "fold": fold,
        "metric": job.metric,
        "score": found[job.metric],
        "metrics": found,
        "best_step": int(best),
        "steps": steps,
        "train_rows": len(train_rows),
        "valid_rows": len(valid_rows),
        "seconds": time.perf_counter() - started + elapsed,
        "rows": [int(i) for i in valid_rows],
        "outputs": outputs.tolist(),
    }
    if jax.process_index() == 0:
        runs.write_result(job.run_dir, fold, result)
        shutil.rmtree(fold_dir / runs.CHECKPOINTS, ignore_errors=True)  # the best model is in model/
    return result
