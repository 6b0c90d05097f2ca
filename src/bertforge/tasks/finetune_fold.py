"""One fold of `bertforge finetune`: train the sequence head and encoder from the pretrained weights, evaluate a few
times an epoch, keep the best checkpoint, and leave FOLD/model (a Hugging Face folder) and FOLD/result.json."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bertforge import hub, runs
from bertforge.card import card_files
from bertforge.data.batching import (
    Row,
    balanced_batches,
    by_length,
    epoch_batches,
    packed_tokens,
    pad_batch,
    padded_length,
    tokens_of,
)
from bertforge.data.labelled import Table
from bertforge.data.long_text import record_of, records_of
from bertforge.data.text_packing import PackShape
from bertforge.errors import UserError
from bertforge.finetuning import FinetuneTask
from bertforge.finetuning.pairs import distinct_texts
from bertforge.hub import HubConfig, Publisher
from bertforge.model import sentence_folder, used_rows
from bertforge.model.hf import Pretrained, save_pretrained
from bertforge.runtime.devices import fetch, global_array
from bertforge.tasks.fold_eval import Evaluations, eval_batch, rank, scores
from bertforge.tasks.fold_steps import checkpoint_hook, evaluation_hook, fold_steps
from bertforge.tasks.model_outputs import INPUTS
from bertforge.tasks.packed_batches import WHOLE, job_step_batch, packed_ahead, shapes_line
from bertforge.train import loop
from bertforge.train.checkpoint import Checkpoints
from bertforge.train.metrics_log import LogConfig, MetricsLog, read_metrics
from bertforge.train.optim import OptimConfig, learning_rate, warmup_fraction
from bertforge.train.step import TrainState, new_train_state


@dataclasses.dataclass(frozen=True)
class FinetuneTrainConfig:
    batch_size: int = 16
    grad_accum: int = 1
    epochs: float = 3.0
    evals_per_epoch: int = 2
    eval_batch_size: int = 64
    seed: int = 0  # data order and dropout
    dtype: str = "float32"  # compute dtype (bfloat16, or float16 with a loss scale: over float32 parameters)
    remat: bool = False  # recompute each layer's activations in the backward pass: less memory, ~1/3 more compute
    attention: str = "auto"  # one of model.attention's: the attention implementation (model/attention.py)
    # Lazy AdamW on the word-embedding table: only the rows of each batch's tokens are updated (faster on short
    # texts; changes the numbers, see train/sequence_step.py).
    sparse_embeddings: bool = False
    # Train the word-embedding rows of the tokens the run's texts hold; the others, whose gradient is zero, only
    # decay, by one shared factor (model/used_rows.py). The same numbers; the model folder has the whole table.
    # Not with sparse_embeddings, which finds the table's rows by token id.
    trim_vocab: bool = True

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.grad_accum < 1 or self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size {self.batch_size} must be a positive multiple of grad_accum")
        if self.epochs <= 0 or self.evals_per_epoch < 1 or self.eval_batch_size < 1:
            raise ValueError("epochs, evals_per_epoch and eval_batch_size must be positive")


@dataclasses.dataclass(frozen=True)
class Job:
    """What every fold shares. The programs are made once, so that every fold runs the ones the first compiled."""

    run_dir: Path
    train: FinetuneTrainConfig
    optim: OptimConfig
    log: LogConfig
    config: dict[str, Any]  # the run's whole config, for W&B
    task: FinetuneTask
    loss: str
    metric: str
    bucket: int  # padded lengths are multiples of this
    pool: int  # batches per pool of rows sorted by length; 1: random batches
    rungs: tuple[int, ...]  # the padded lengths (data.shapes of them at most); () for every multiple of bucket
    limit: int  # tokens per text
    pre: Pretrained  # the tokenizer and label names go with every fold's model
    names: list[str]  # the task's outputs' names (a multiple-choice model's choices, its one label aside)
    table: Table  # training rows
    encs: list[Row]
    valid_table: Table | None  # a separate validation table, or None: folds of `table`
    valid_encs: list[Row] | None
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
    choices: int = 0  # a multiple-choice row's choices (its batches are (B, N, T)); 0 for texts
    pack: PackShape | None = None  # the shape of packed batches (tasks/packed_batches.py); None: padded rows
    trimmed: used_rows.Trimmed | None = None  # the word-embedding rows the programs train, or None: all


def write_model(job: Job, fold_dir: Path, params: Any, out: Path, step: int) -> None:
    """The fold's model with `params` (its state at `step`) as a Hugging Face folder `out`, with a model card whose
    curves run to the last step logged (process 0 only)."""
    model = nnx.merge(job.graphdef, params, job.rest)
    if job.trimmed is not None:
        used_rows.expand(model, job.trimmed)
    config = {k: v for k, v in job.config.items() if k != "hub"}
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="curves") as pool:  # drawn while weights go
        card = card_files(
            name=job.hub.repo if job.hub.repo else f"{job.run_dir.name}-{fold_dir.name}",
            kind="finetune",
            records=read_metrics(fold_dir),
            pool=pool,
            model=model.config,
            head=job.task.HEAD,
            config=config,
            step=step,
            metrics=(job.metric,),
            base_model=job.base_model,
            task=job.task.NAME,
            **job.hub.card(),
        )
        if job.task.HEAD == "embedding":  # sentence-transformers cuts texts where the run did
            card = {**sentence_folder.files(model.config, job.limit), **card}
        save_pretrained(model, out, job.pre.tokenizer, job.pre.id2label, extra_files=card, base=job.pre.folder)


def _batch(job: Job, rows: np.ndarray, length: int) -> dict[str, np.ndarray]:
    """A training batch of exactly train.batch_size rows; filler rows get weight 0."""
    size, table = job.train.batch_size, job.table
    batch = pad_batch([job.encs[i] for i in rows], job.pre.tokenizer.pad_id, length, size, job.choices)
    targets = np.zeros((size, *table.targets.shape[1:]), table.targets.dtype)
    targets[: len(rows)] = table.targets[rows]
    weight = np.zeros(size, np.float32)
    weight[: len(rows)] = table.weights[rows]
    return {**batch, "targets": targets, "weight": weight}


def compile_ahead(job: Job, state: TrainState, key: jax.Array, lengths: np.ndarray, valid_lengths: np.ndarray,
                  first_step: int, steps: int) -> None:  # fmt: skip
    """Start compiling, in background threads (train/ahead.py), the gradients' program of every length the fold's
    batches from `first_step` on are padded to, in the order the steps first need them, then the evaluation's of
    every length its batches take; nothing else. `lengths`: the training rows' token counts."""
    if job.pack is not None:  # one training program and one evaluation program
        return packed_ahead(job, state, key)
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
    size, choices = eval_batch(job)
    evaluated = {padded_length(int(valid_lengths[idx].max()), job.limit, job.bucket, job.rungs)
                 for idx in by_length(valid_lengths, size)}  # fmt: skip
    for n in sorted(evaluated, reverse=True):  # the evaluation runs longest first
        batch = pad_batch([], job.pre.tokenizer.pad_id, n, size, choices)
        job.forward_jit.ahead(state.params, {k: global_array(batch[k], job.mesh) for k in INPUTS})


@dataclasses.dataclass(frozen=True)
class Fold:
    """One fold's rows and the schedule of its steps."""

    number: int
    dir: Path
    train_rows: np.ndarray
    valid_rows: np.ndarray
    lengths: np.ndarray  # the training rows' token counts
    sizes: np.ndarray  # the tokens of the training rows' texts packed (batching.packed_tokens)
    eval_encs: list[Row]  # what evaluation computes: the validation rows, or their distinct texts (eval_index)
    eval_index: np.ndarray | None  # (R, N): where each validation row's texts are among eval_encs, or None
    valid_records: np.ndarray  # (D,) the records of the validation rows: the rows, or the texts of their windows
    valid_targets: np.ndarray  # the records' targets
    per_epoch: int  # steps per epoch
    steps: int
    every: int  # steps between evaluations, and between checkpoints
    started: float  # time.perf_counter() when this run of the fold started
    elapsed: float  # seconds the fold ran before a resume

    def seconds(self) -> float:
        """Seconds the fold has run, earlier runs included."""
        return time.perf_counter() - self.started + self.elapsed


def train_fold(job: Job, fold: int, train_rows: np.ndarray, valid_rows: np.ndarray, resume: str) -> dict[str, Any]:
    """Train fold `fold` (continuing from its newest checkpoint when it has one); returns its result.json."""
    fold_dir = runs.fold_dir(job.run_dir, fold)
    fold_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if jax.process_index() == 0:
        hub.clear_staging(fold_dir)
    state = new_train_state(jax.device_put(job.pristine, job.param_shardings), job.tx, job.mesh)
    checkpoints = Checkpoints(fold_dir / runs.CHECKPOINTS, keep_last=1, keep_best=1)
    state, meta = runs.resume(checkpoints, state, fold_dir, resume)
    if meta is not None and job.trimmed is not None and meta.get("vocab") != job.trimmed.fingerprint():
        raise UserError(f"{fold_dir}: its checkpoints hold the word-embedding rows of other texts than this run's "
                        "data; was the data changed since they were saved? Use another --out")  # fmt: skip
    start_step, elapsed = (0, 0.0) if meta is None else (int(state.step), float(meta.get("elapsed", 0.0)))
    plan = _plan(job, fold, fold_dir, train_rows, valid_rows, started, elapsed)
    state, best, outputs = _train(job, plan, state, checkpoints, start_step)
    return _finish(job, plan, state, best, outputs)


def _plan(job: Job, fold: int, fold_dir: Path, train_rows: np.ndarray, valid_rows: np.ndarray, started: float,
          elapsed: float) -> Fold:  # fmt: skip
    """The fold's validation rows and its steps: train.epochs over the training rows, evaluated
    train.evals_per_epoch times an epoch."""
    per_epoch, steps, every = fold_steps(
        len(train_rows), job.train.batch_size, job.train.epochs, job.train.evals_per_epoch
    )
    valid = job.valid_table or job.table
    records = np.unique(record_of(valid)[valid_rows])
    valid_encs = [(job.valid_encs or job.encs)[i] for i in valid_rows]
    flat = job.task.HEAD == "embedding" or (job.pack is not None and job.task.HEAD in WHOLE)
    eval_encs, eval_index = distinct_texts(valid_encs) if flat else (valid_encs, None)
    return Fold(
        number=fold,
        dir=fold_dir,
        train_rows=train_rows,
        valid_rows=valid_rows,
        lengths=np.array([tokens_of(job.encs[i]) for i in train_rows]),
        sizes=np.array([packed_tokens(job.encs[i]) for i in train_rows]),
        eval_encs=eval_encs,
        eval_index=eval_index,
        valid_records=records,
        valid_targets=records_of(valid).targets[records],
        per_epoch=per_epoch,
        steps=steps,
        every=every,
        started=started,
        elapsed=elapsed,
    )


def _train(job: Job, fold: Fold, state: TrainState, checkpoints: Checkpoints, start_step: int
           ) -> tuple[TrainState, int, np.ndarray]:  # fmt: skip
    """Run the fold's steps from `start_step`, evaluating and checkpointing as they go; returns the state of the
    best checkpoint, its step and its validation outputs."""
    key = jax.random.key(job.train.seed + fold.number)
    log = MetricsLog(fold.dir, job.log, fold.steps, start_step, job.config)
    evaluations = Evaluations(job, fold)
    log.message(_describe(job, fold, start_step))
    warmup = warmup_fraction(job.optim, fold.steps)
    valid_lengths = np.array([tokens_of(e) for e in fold.eval_encs])
    compile_ahead(job, state, key, fold.lengths, valid_lengths, start_step, fold.steps)
    batches = _training_batches(job, fold, start_step)
    counted: list[int] = []  # the last batch's text tokens, for the throughput the log shows

    def next_batch(_progress: float) -> dict[str, jax.Array]:
        batch, tokens = next(batches)
        counted.append(tokens)
        return batch

    save = functools.partial(_save, job, fold, checkpoints, evaluations)
    try:
        state, _, _ = loop.run(
            state,
            lambda s, b, lr: job.step_jit(s, b, jnp.float32(lr), key),
            next_batch=next_batch,
            tokens_in=lambda _batch: counted.pop(),
            lr_at=lambda p: learning_rate(job.optim, p, warmup),
            budget=loop.Budget(max_steps=fold.steps),
            log=lambda step, values: log.record(
                step, {"epoch": step / fold.per_epoch, **values}, ("loss", "lr", f"valid_{job.metric}")
            ),
            log_every=job.log.every,
            start_step=start_step,
            evaluate=evaluation_hook(fold.steps, fold.every, evaluations.evaluate),
            checkpoint=checkpoint_hook(fold.steps, fold.every, save),
            preemptible=True,
        )
        checkpoints.wait()
        best = _best_step(checkpoints, evaluations, int(state.step))
        if best != int(state.step):
            state, _ = checkpoints.restore(best, state)
    except loop.NonFiniteLoss as e:
        first = ("data.pack=false",) if job.pack is not None else ()
        raise loop.non_finite_error(e, before=f"fold {fold.number}: ", first=first) from None
    finally:
        log.close()
        checkpoints.close()
    return state, best, evaluations.of_step(best, state)


def _best_step(checkpoints: Checkpoints, evaluations: Evaluations, last: int) -> int:
    """The step of the fold's best model: the best checkpoint's, or the last step's (in memory, not saved) when this
    process evaluated it and it ranks at least as well (a tie goes to the later step, as among checkpoints; an
    undefined score ranks below any other)."""
    saved = checkpoints.best_step()
    final = evaluations.ranks.get(last)
    if final is None:
        return saved or checkpoints.latest_step() or last
    if saved is None:
        return last
    score = checkpoints.score(saved)
    return last if score is None or math.isnan(score) or final <= score else saved


def _describe(job: Job, fold: Fold, start_step: int) -> str:
    """The line the fold's log starts with."""
    texts = len(fold.valid_records)
    return (
        f"fold {fold.number}: {len(fold.train_rows)} training rows, {len(fold.valid_rows)} validation rows"
        + (f" (windows of {texts} texts); " if texts < len(fold.valid_rows) else "; ")
        + f"{fold.steps} steps of {job.train.batch_size} ({fold.per_epoch} per epoch), evaluating every "
        f"{fold.every}; "
        + shapes_line(job.pack, job.rungs, job.bucket, whole=job.task.HEAD in WHOLE)
        + (f"; {used_rows.describe(job.trimmed)}" if job.trimmed is not None else "")
        + (f"; resuming from step {start_step}" if start_step else "")
    )


def _training_batches(job: Job, fold: Fold, first_step: int) -> Iterator[tuple[dict[str, jax.Array], int]]:
    """The fold's training batches from step `first_step` on, epoch after epoch, each padded to its length, or
    packed: then batches of about equal tokens (nothing to save by sorting by length; the one shape holds the
    fullest step); each with the number of its texts' tokens (padding left out)."""
    size, seed = job.train.batch_size, job.train.seed
    epoch, skip = divmod(first_step, fold.per_epoch)
    while True:
        if job.pack is not None:
            for local in balanced_batches(fold.sizes, size, seed, epoch, job.pool)[skip:]:
                yield job_step_batch(job, fold.train_rows[local]), int(fold.sizes[local].sum())
        else:
            for local in epoch_batches(fold.lengths, size, job.bucket, seed, epoch, job.pool)[skip:]:
                length = padded_length(int(fold.lengths[local].max()), job.limit, job.bucket, job.rungs)
                batch = _batch(job, fold.train_rows[local], length)
                yield {k: global_array(v, job.mesh) for k, v in batch.items()}, int(fold.sizes[local].sum())
        epoch, skip = epoch + 1, 0


def _save(job: Job, fold: Fold, checkpoints: Checkpoints, evaluations: Evaluations, step: int, state: TrainState,
          evaluation: dict[str, float] | None) -> None:  # fmt: skip
    """The loop's checkpoint, kept by the evaluation's score, and every hub.every-th one pushed to the Hub."""
    meta = {"elapsed": fold.seconds(), "step": step}
    if job.trimmed is not None:  # the rows of the saved table are those of this run's texts
        meta["vocab"] = job.trimmed.fingerprint()
    score = None if evaluation is None else rank(job, evaluation)  # checkpoints keep the lowest
    checkpoints.save(step, state, meta, valid_loss=score)
    evaluations.keep({*checkpoints.all_steps(), step})
    if job.hub.due(step, fold.every):
        params = fetch(state.params)  # every process takes part when the parameters are split over hosts
        if job.publisher is not None:
            write = functools.partial(write_model, job, fold.dir, params, step=step)
            where = job.hub_folder.format(fold=fold.number)
            hub.stage(job.publisher, fold.dir, f"step-{step}", write, f"fold {fold.number}, step {step}", where)


def _finish(job: Job, fold: Fold, state: TrainState, best: int, outputs: np.ndarray) -> dict[str, Any]:
    """The fold's model folder (and its push), then its result.json; the checkpoints go."""
    found = scores(job, outputs, fold.valid_targets)
    params = fetch(state.params)  # every process takes part when the parameters are split over hosts
    if jax.process_index() == 0:
        write_model(job, fold.dir, params, fold.dir / runs.MODEL, int(best))
        if job.publisher is not None:
            message = f"fold {fold.number}, best model (step {best})"
            copy = hub.copy_of(fold.dir / runs.MODEL)
            hub.stage(job.publisher, fold.dir, "final", copy, message, job.hub_folder.format(fold=fold.number))
    result = {
        "fold": fold.number,
        "metric": job.metric,
        "score": found[job.metric],
        "metrics": found,
        "best_step": int(best),
        "steps": fold.steps,
        "train_rows": len(fold.train_rows),
        "valid_rows": len(fold.valid_rows),
        "seconds": fold.seconds(),
        "rows": [int(i) for i in fold.valid_records],
        "outputs": outputs.tolist(),
    }
    if jax.process_index() == 0:
        runs.write_result(job.run_dir, fold.number, result)
        shutil.rmtree(fold.dir / runs.CHECKPOINTS, ignore_errors=True)  # the best model is in model/
    return result
