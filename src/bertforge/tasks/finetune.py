"""`bertforge finetune`: a sequence head on a pretrained encoder, with k-fold cross-validation, and its outputs.

RUN holds folds.csv (the fold of every row), then per fold fold-K/ with its metrics, checkpoints while it trains,
the best model as a Hugging Face folder (model/) and result.json, written last: a fold without result.json is not
finished, and the same command run again continues it from its newest checkpoint. When the folds are done, RUN gets
oof.csv (out-of-fold predictions) and summary.json.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from bertforge import version
from bertforge.config import to_dict
from bertforge.data import tabular
from bertforge.data.batching import BUCKET, bucket_length, epoch_batches, pad_batch
from bertforge.data.folds import assign_folds, bin_targets, sturges_bins
from bertforge.errors import UserError
from bertforge.fileio import read_json_object, write_atomic
from bertforge.model.hf import Pretrained, load_pretrained, save_pretrained
from bertforge.parallel import fetch, global_array, param_shardings
from bertforge.tasks.export import RUN_FILE
from bertforge.tasks.infer import INPUTS, outputs_by_length
from bertforge.tasks.pretrain import LogConfig, MeshConfig, build_mesh
from bertforge.tokenizer import TRUNCATIONS, Encoded
from bertforge.train import loop, metrics
from bertforge.train.checkpoint import DAMAGED, Checkpoints, RunLock
from bertforge.train.logging import MetricsLog
from bertforge.train.optim import OptimConfig, learning_rate, make_optimizer, warmup_fraction
from bertforge.train.sequence_step import DEFAULT_LOSS, LOSSES, SequenceStepConfig, predict_step, train_step
from bertforge.train.step import TrainState, new_train_state

TASKS = ("regression", "classification", "multilabel")
DEFAULT_METRIC = {"regression": "rmse", "classification": "accuracy", "multilabel": "auc"}
RESULT = "result.json"


@dataclasses.dataclass(frozen=True)
class DataConfig:
    train: str = ""
    valid: str = ""  # a separate validation table instead of folds
    text_column: str = "text"
    text_pair_column: str | None = None
    target_columns: tuple[str, ...] = ("target",)  # one per output; several 0/1 columns for multilabel
    id_column: str | None = None  # default: 'id' when the table has it
    group_column: str | None = None  # rows sharing a value stay in one fold
    error_column: str | None = None  # standard error of the target: rows weighted by 1 / error^2
    max_length: int = 256
    truncation: str = "head"
    bucket: int = BUCKET  # pad batches to a multiple of this; 0 pads every batch to max_length
    quoted_tsv: bool = False  # .tsv tables written with CSV quoting; by default a TSV has none and '"' is text

    def __post_init__(self) -> None:
        if self.truncation not in TRUNCATIONS:
            raise ValueError(f"truncation {self.truncation!r} is not one of {', '.join(TRUNCATIONS)}")
        if not self.target_columns:
            raise ValueError("target_columns is empty")
        if self.max_length < 2 or self.bucket < 0:
            raise ValueError("max_length must be at least 2 and bucket at least 0")


@dataclasses.dataclass(frozen=True)
class FoldsConfig:
    k: int = 5
    run: str = "all"  # 'all', or fold numbers such as '0' or '0,2'
    seed: int = 42
    bins: int = 0  # bins of a regression target for stratification; 0: Sturges' rule

    def __post_init__(self) -> None:
        if self.k < 2:
            raise ValueError(f"k must be at least 2, got {self.k}")


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    task: str = "regression"
    loss: str = ""  # default: mse, cross_entropy or bce by task; more with train.sequence_step.register_loss
    metric: str = ""  # picks the best checkpoint; default: rmse, accuracy or auc by task
    pooling: str = "cls"  # cls, mean or attention
    hidden_dropout: float | None = None  # None keeps the pretrained model's
    attention_dropout: float | None = None
    classifier_dropout: float | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task {self.task!r} is not one of {', '.join(TASKS)}")
        if self.loss and self.loss not in LOSSES:
            raise ValueError(f"loss {self.loss!r} is not one of {', '.join(LOSSES)}")
        if self.metric and self.metric not in metrics.HIGHER_IS_BETTER:
            raise ValueError(f"metric {self.metric!r} is not one of {', '.join(metrics.HIGHER_IS_BETTER)}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 16
    grad_accum: int = 1
    epochs: float = 3.0
    evals_per_epoch: int = 2
    eval_batch_size: int = 64
    seed: int = 0  # data order and dropout
    dtype: str = "float32"  # compute dtype (bfloat16: mixed precision over float32 parameters)
    remat: bool = False  # recompute each layer's activations in the backward pass: less memory, ~1/3 more compute

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.grad_accum < 1 or self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size {self.batch_size} must be a positive multiple of grad_accum")
        if self.epochs <= 0 or self.evals_per_epoch < 1 or self.eval_batch_size < 1:
            raise ValueError("epochs, evals_per_epoch and eval_batch_size must be positive")


def _finetune_optim() -> OptimConfig:
    return OptimConfig(lr=5e-5, b2=0.999, eps=1e-8, weight_decay=0.01, warmup_fraction=0.1)


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    model: str = ""  # Hugging Face folder, hub id, or a bertforge pretraining run
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    folds: FoldsConfig = dataclasses.field(default_factory=FoldsConfig)
    head: HeadConfig = dataclasses.field(default_factory=HeadConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    optim: OptimConfig = dataclasses.field(default_factory=_finetune_optim)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    log: LogConfig = dataclasses.field(default_factory=lambda: LogConfig(every=10, tensorboard=False))


# ------------------------------------------------------------------------------------------------------ the table
@dataclasses.dataclass
class Table:
    path: str
    texts: list[str]
    pairs: list[str] | None
    targets: np.ndarray  # (N, L) float32, or (N,) int32 class indices
    labels: list[str] | None  # classification: each row's class as written
    weights: np.ndarray  # (N,) float32
    ids: list[str] | None
    groups: list[str] | None

    def __len__(self) -> int:
        return len(self.texts)

    def row_ids(self) -> list[str]:
        """The id column's values, or row numbers from 0 when the table has none."""
        return self.ids or [str(i) for i in range(len(self))]


def read_table(cfg: FinetuneConfig, path: str, classes: Sequence[str] | None = None) -> Table:
    """A training or validation table with every value checked; errors name the file, row and column."""
    d, task = cfg.data, cfg.head.task
    columns, rows = tabular.read_table(path, quoted_tsv=d.quoted_tsv)
    if not rows:
        raise UserError(f"{path}: no rows")
    texts = tabular.text_column(path, columns, rows, d.text_column)
    pairs = tabular.text_column(path, columns, rows, d.text_pair_column) if d.text_pair_column else None
    labels = None
    if task == "classification":
        if len(d.target_columns) != 1:
            raise UserError(f"classification takes one target column, got {', '.join(d.target_columns)}")
        labels = tabular.label_column(path, columns, rows, d.target_columns[0])
        known = list(classes) if classes is not None else _sorted_classes(labels)
        index = {c: i for i, c in enumerate(known)}
        for i, label in enumerate(labels):
            if label not in index:
                raise UserError(
                    f"{path}: row {i + 1}: class '{label}' in column '{d.target_columns[0]}' never occurs in the "
                    f"training data ({', '.join(known)})"
                )
        targets = np.array([index[label] for label in labels], np.int32)
    else:
        targets = np.stack([tabular.numeric_column(path, columns, rows, c) for c in d.target_columns], axis=1)
        if task == "multilabel":
            bad = np.argwhere((targets != 0) & (targets != 1))
            if len(bad):
                i, j = bad[0]
                raise UserError(f"{path}: row {i + 1}: column '{d.target_columns[j]}' must be 0 or 1")
        targets = targets.astype(np.float32)
    weights = np.ones(len(rows), np.float32)
    if d.error_column:
        errors = tabular.numeric_column(path, columns, rows, d.error_column)
        if np.any(errors < 0):
            raise UserError(f"{path}: row {int(np.argmax(errors < 0)) + 1}: column '{d.error_column}' is negative")
        floor = errors[errors > 0].min() if np.any(errors > 0) else 1.0
        inverse = 1.0 / np.maximum(errors, floor) ** 2  # an error of 0 (an anchor row) counts like the smallest
        weights = (inverse / inverse.mean()).astype(np.float32)
    id_column = d.id_column or ("id" if "id" in columns else None)
    ids = tabular.plain_column(path, columns, rows, id_column) if id_column else None
    groups = tabular.plain_column(path, columns, rows, d.group_column) if d.group_column else None
    return Table(path, texts, pairs, targets, labels, weights, ids, groups)


def _sorted_classes(labels: Sequence[str]) -> list[str]:
    unique = sorted(set(labels))
    try:
        return sorted(unique, key=float)
    except ValueError:
        return unique


def _fold_plan(cfg: FinetuneConfig, table: Table) -> np.ndarray:
    """(N,) fold of every row, stratified on the class or the binned target, or grouped."""
    n, k = len(table), cfg.folds.k
    if n < k:
        raise UserError(f"{table.path}: {n} rows cannot make {k} folds (folds.k)")
    strata = None
    if cfg.head.task == "classification":
        strata = table.targets
    elif cfg.head.task == "regression":
        strata = bin_targets(table.targets[:, 0], cfg.folds.bins or sturges_bins(n))
    try:
        return assign_folds(n, k, cfg.folds.seed, strata, None if table.groups is None else np.array(table.groups))
    except ValueError as e:
        raise UserError(f"{table.path}: {e}") from None


def _folds_to_run(cfg: FinetuneConfig) -> list[int]:
    if cfg.data.valid:
        return [0]
    if cfg.folds.run == "all":
        return list(range(cfg.folds.k))
    try:
        chosen = sorted({int(x) for x in cfg.folds.run.split(",")})
    except ValueError:
        chosen = []
    if not chosen or not all(0 <= f < cfg.folds.k for f in chosen):
        raise UserError(f"folds.run={cfg.folds.run!r}: give 'all' or fold numbers from 0 to {cfg.folds.k - 1}")
    return chosen


def _check_classes(cfg: FinetuneConfig, table: Table, folds: np.ndarray, run: list[int]) -> None:
    if table.labels is None:
        return
    for f in run:
        seen = set(table.targets[folds != f].tolist())
        for i in np.flatnonzero(folds == f):
            if int(table.targets[i]) not in seen:
                raise UserError(
                    f"{table.path}: row {i + 1}: class '{table.labels[i]}' is in the validation rows of fold {f} "
                    f"but never in its training rows; give it more rows or fewer folds (folds.k)"
                )


# ------------------------------------------------------------------------------------------------------ one fold
@dataclasses.dataclass
class Job:
    """What every fold shares."""

    cfg: FinetuneConfig
    run_dir: Path
    pre: Pretrained
    graphdef: Any
    rest: Any
    pristine: Any  # host copy of the starting parameters
    mesh: Any
    encs: list[Encoded]  # training table
    table: Table
    valid_encs: list[Encoded] | None
    valid_table: Table | None
    limit: int
    loss: str
    metric: str
    # Made once, so that every fold runs the programs the first one compiled.
    tx: Any = None
    param_shardings: Any = None
    step_jit: Any = None
    forward_jit: Any = None


def _batch(job: Job, table: Table, encs: list[Encoded], rows: np.ndarray, length: int) -> dict[str, np.ndarray]:
    """A training batch of exactly train.batch_size rows; filler rows get weight 0."""
    size = job.cfg.train.batch_size
    batch = pad_batch([encs[i] for i in rows], job.pre.tokenizer.pad_id, length, size)
    targets = np.zeros((size, *table.targets.shape[1:]), table.targets.dtype)
    targets[: len(rows)] = table.targets[rows]
    weight = np.zeros(size, np.float32)
    weight[: len(rows)] = table.weights[rows]
    return {**batch, "targets": targets, "weight": weight}


def _scores(job: Job, outputs: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    task = job.cfg.head.task
    if task == "regression":
        found = metrics.regression(outputs, targets)
    elif task == "classification":
        found = metrics.classification(outputs, targets)
    else:
        found = metrics.multilabel(outputs, targets)
    found["loss"] = float(jnp.mean(LOSSES[job.loss](jnp.asarray(outputs), jnp.asarray(targets))))
    return found


def _train_fold(job: Job, fold: int, train_rows: np.ndarray, valid_rows: np.ndarray, resume: str) -> dict[str, Any]:
    cfg, mesh = job.cfg, job.mesh
    fold_dir = job.run_dir / f"fold-{fold}"
    fold_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    valid_table = job.valid_table or job.table
    valid_encs = [(job.valid_encs or job.encs)[i] for i in valid_rows]
    valid_targets = valid_table.targets[valid_rows]

    state = new_train_state(jax.device_put(job.pristine, job.param_shardings), job.tx, mesh)
    checkpoints = Checkpoints(fold_dir / "checkpoints", keep_last=1, keep_best=1)
    start_step, elapsed = 0, 0.0
    if checkpoints.latest_step() is not None:
        if resume == "never":
            raise UserError(f"{fold_dir}: already has checkpoints; use another --out, or --resume auto to continue")
        found = checkpoints.restore_newest_good(state, fold_dir / DAMAGED)
        if found is not None:
            _, state, meta = found
            start_step, elapsed = int(state.step), float(meta.get("elapsed", 0.0))

    size = cfg.train.batch_size
    per_epoch = math.ceil(len(train_rows) / size)
    steps = max(1, round(cfg.train.epochs * per_epoch))
    every = max(1, per_epoch // cfg.train.evals_per_epoch)
    lengths = np.array([len(job.encs[i].ids) for i in train_rows])
    plans: dict[int, list[np.ndarray]] = {}
    cursor = [start_step]

    def next_batch() -> dict[str, jax.Array]:
        epoch, i = divmod(cursor[0], per_epoch)
        cursor[0] += 1
        if epoch not in plans:
            plans.clear()
            plans[epoch] = epoch_batches(lengths, size, cfg.data.bucket, cfg.train.seed, epoch)
        local = plans[epoch][i]
        length = bucket_length(int(lengths[local].max()), job.limit, cfg.data.bucket)
        batch = _batch(job, job.table, job.encs, train_rows[local], length)
        return {k: global_array(v, mesh) for k, v in batch.items()}

    step_jit, forward_jit = job.step_jit, job.forward_jit
    key = jax.random.key(cfg.train.seed + fold)

    def outputs_of(params: Any) -> np.ndarray:
        forward = lambda b: forward_jit(params, {k: global_array(b[k], mesh) for k in INPUTS})  # noqa: E731
        return outputs_by_length(
            forward, valid_encs, job.pre.tokenizer.pad_id, cfg.train.eval_batch_size, job.limit, cfg.data.bucket
        )

    log = MetricsLog(
        fold_dir, steps, start_step, cfg.log.tensorboard, cfg.log.wandb, cfg.log.wandb_project, to_dict(cfg),
        cfg.log.progress,
    )  # fmt: skip
    evaluated: dict[str, Any] = {}
    better = metrics.HIGHER_IS_BETTER[job.metric]

    def write(step: int, values: dict[str, float]) -> None:
        log.write(step, {"epoch": step / per_epoch, **values})
        shown = {k: f"{values[k]:.4g}" for k in ("loss", "lr", f"valid_{job.metric}") if k in values}
        log.progress(step, shown)

    def evaluate(step: int, state: TrainState) -> dict[str, float]:
        found = _scores(job, outputs_of(state.params), valid_targets)
        evaluated.update(step=step, score=-found[job.metric] if better else found[job.metric])
        return {f"valid_{k}": v for k, v in found.items()}

    def save(step: int, state: TrainState) -> None:
        if step in checkpoints.all_steps():
            return  # a resumed fold that had already reached its end
        meta = {"elapsed": time.perf_counter() - started + elapsed, "step": step}
        score = evaluated["score"] if evaluated.get("step") == step else None
        checkpoints.save(step, state, meta, valid_loss=score)

    log.message(
        f"fold {fold}: {len(train_rows)} training rows, {len(valid_rows)} validation rows; {steps} steps of "
        f"{size} ({per_epoch} per epoch), evaluating every {every}"
        + (f"; resuming from step {start_step}" if start_step else "")
    )
    warmup = warmup_fraction(cfg.optim, steps)
    try:
        with loop.StopFlag() as stop:
            state, step, _ = loop.run(
                state,
                lambda s, b, lr: step_jit(s, b, jnp.float32(lr), key),
                next_batch,
                lambda p: learning_rate(cfg.optim, p, warmup),
                loop.Budget(max_steps=steps),
                start_step,
                [loop.Hook(every, evaluate), loop.Hook(every, save)],
                write,
                cfg.log.every,
                stop_flag=stop,
                on_stop=lambda s, st: (save(s, st), checkpoints.wait()),
            )
        checkpoints.wait()
        best = checkpoints.best_step() or checkpoints.latest_step()
        state, _ = checkpoints.restore(best, state)
    except loop.NonFiniteLoss as e:
        raise UserError(f"fold {fold}: {e}; lower optim.lr or set optim.clip_norm") from None
    finally:
        log.close()
        checkpoints.close()
    outputs = outputs_of(state.params)
    found = _scores(job, outputs, valid_targets)
    params = fetch(state.params)  # every process takes part when the parameters are split over hosts
    if jax.process_index() == 0:
        model = nnx.merge(job.graphdef, params, job.rest)
        save_pretrained(model, fold_dir / "model", job.pre.tokenizer, job.pre.id2label)
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
        write_atomic(fold_dir / RESULT, json.dumps(result) + "\n")
        shutil.rmtree(fold_dir / "checkpoints", ignore_errors=True)  # the best model is in model/
    return result


# ------------------------------------------------------------------------------------------------------ main
def _setup(cfg: FinetuneConfig) -> tuple[Pretrained, Table, Table | None, list[int], np.ndarray | None]:
    """Read and check everything before anything is written."""
    if not cfg.model:
        raise UserError("no model given (--model HF_DIR_OR_HUB_ID_OR_RUN)")
    if not cfg.data.train:
        raise UserError("no training data given (--data TABLE)")
    table = read_table(cfg, cfg.data.train)
    valid = None
    classes = _sorted_classes(table.labels) if table.labels is not None else None
    if cfg.data.valid:
        valid = read_table(cfg, cfg.data.valid, classes)
    run = _folds_to_run(cfg)
    folds = None if valid is not None else _fold_plan(cfg, table)
    if folds is not None:
        _check_classes(cfg, table, folds, run)
    num_labels = len(classes) if classes is not None else len(cfg.data.target_columns)
    h = cfg.head
    overrides: dict[str, Any] = {"pooling": h.pooling, "dtype": cfg.train.dtype, "remat": cfg.train.remat}
    for name in ("hidden_dropout", "attention_dropout", "classifier_dropout"):
        if getattr(h, name) is not None:
            overrides[name] = getattr(h, name)
    pre = load_pretrained(cfg.model, head="sequence", num_labels=num_labels, seed=cfg.train.seed, overrides=overrides)
    pre.id2label = dict(enumerate(classes if classes is not None else cfg.data.target_columns))
    return pre, table, valid, run, folds


def main(cfg: FinetuneConfig, out: str, resume: str = "auto") -> dict[str, Any]:
    """Fine-tune the folds of `cfg`; returns the summary (also in RUN/summary.json)."""
    pre, table, valid, run, folds = _setup(cfg)
    run_dir = Path(out)
    lock = RunLock(run_dir) if jax.process_index() == 0 else None
    if lock is not None:
        lock.acquire()
    try:
        return _main(cfg, run_dir, resume, pre, table, valid, run, folds)
    finally:
        if lock is not None:
            lock.release()


def _main(
    cfg: FinetuneConfig,
    run_dir: Path,
    resume: str,
    pre: Pretrained,
    table: Table,
    valid: Table | None,
    run: list[int],
    folds: np.ndarray | None,
) -> dict[str, Any]:
    if resume == "never" and any((run_dir / f"fold-{f}" / RESULT).exists() for f in run):
        raise UserError(f"{run_dir}: already has finished folds; use another --out, or --resume auto to continue")
    limit = min(cfg.data.max_length, pre.model.config.max_seq_len)
    tok = pre.tokenizer
    encs = tok.encode_batch(table.texts, table.pairs, max_length=limit, truncation=cfg.data.truncation)
    valid_encs = None
    if valid is not None:
        valid_encs = tok.encode_batch(valid.texts, valid.pairs, max_length=limit, truncation=cfg.data.truncation)
    mesh = build_mesh(cfg.mesh, cfg.train.batch_size, cfg.train.grad_accum, "train.batch_size")
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.train.eval_batch_size % shards:
        raise UserError(f"train.eval_batch_size={cfg.train.eval_batch_size} does not split over {shards} devices")
    graphdef, params, rest = nnx.split(pre.model, nnx.Param, ...)
    job = Job(
        cfg=cfg,
        run_dir=run_dir,
        pre=pre,
        graphdef=graphdef,
        rest=rest,
        pristine=jax.device_get(params),
        mesh=mesh,
        encs=encs,
        table=table,
        valid_encs=valid_encs,
        valid_table=valid,
        limit=limit,
        loss=cfg.head.loss or DEFAULT_LOSS[cfg.head.task],
        metric=cfg.head.metric or DEFAULT_METRIC[cfg.head.task],
    )
    job.param_shardings = param_shardings(pre.model, mesh)
    job.tx = make_optimizer(cfg.optim, params, pre.model.config.num_layers)
    probe = new_train_state(jax.device_put(job.pristine, job.param_shardings), job.tx, mesh)
    state_shardings = jax.tree.map(lambda x: x.sharding, probe)
    del probe
    step_cfg = SequenceStepConfig(loss=job.loss, grad_accum=cfg.train.grad_accum)
    job.step_jit = jax.jit(
        functools.partial(train_step, graphdef, rest, tx=job.tx, cfg=step_cfg),
        donate_argnums=(0,),
        out_shardings=(state_shardings, None),
    )
    # Outputs replicated: every process reads the whole batch's predictions (metrics are global).
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    job.forward_jit = jax.jit(functools.partial(predict_step, graphdef, rest), out_shardings=replicated)
    if jax.process_index() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
        info = {
            "kind": "finetune",
            "bertforge_version": version(),
            "task": cfg.head.task,
            "targets": list(cfg.data.target_columns),
            "labels": [pre.id2label[i] for i in range(len(pre.id2label))],
            "text_column": cfg.data.text_column,
            "text_pair_column": cfg.data.text_pair_column,
            "max_length": limit,
            "truncation": cfg.data.truncation,
            "folds": [] if folds is None else list(range(cfg.folds.k)),
        }
        write_atomic(run_dir / RUN_FILE, json.dumps(info, indent=2) + "\n")
        if folds is not None:
            ids = table.ids or [str(i) for i in range(len(table))]
            body = [[i + 1, ids[i], int(folds[i])] for i in range(len(table))]
            tabular.write_csv(str(run_dir / "folds.csv"), ["row", "id", "fold"], body)

    results = []
    for f in run:
        done = run_dir / f"fold-{f}" / RESULT
        if done.exists():
            results.append(read_json_object(done))
            continue
        if folds is None:
            train_rows, valid_rows = np.arange(len(table)), np.arange(len(valid))  # type: ignore[arg-type]
        else:
            train_rows, valid_rows = np.flatnonzero(folds != f), np.flatnonzero(folds == f)
        result = _train_fold(job, f, train_rows, valid_rows, resume)
        print(f"fold {f}: {job.metric} {result['score']:.4f} in {result['seconds']:.0f} s", flush=True)
        results.append(result)
    return _summarise(job, results)


def _summarise(job: Job, results: list[dict[str, Any]]) -> dict[str, Any]:
    """oof.csv and summary.json from the folds' results."""
    table = job.valid_table or job.table
    rows = np.concatenate([np.array(r["rows"], np.int64) for r in results])
    outputs = np.concatenate([np.array(r["outputs"], np.float32) for r in results])
    fold_of = np.concatenate([np.full(len(r["rows"]), r["fold"]) for r in results])
    order = np.argsort(rows, kind="stable")
    rows, outputs, fold_of = rows[order], outputs[order], fold_of[order]
    pooled = _scores(job, outputs, table.targets[rows])
    scores = np.array([r["score"] for r in results])
    summary = {
        "task": job.cfg.head.task,
        "metric": job.metric,
        "folds": [
            {k: r[k] for k in ("fold", "score", "best_step", "steps", "seconds", "train_rows", "valid_rows")}
            for r in results
        ],
        "mean": float(scores.mean()),
        "std": float(scores.std()),
        "out_of_fold": pooled,
        "seconds": float(sum(r["seconds"] for r in results)),
    }
    if jax.process_index() == 0:
        ids = table.row_ids()
        names = [job.pre.id2label[i] for i in range(len(job.pre.id2label))]
        if job.cfg.head.task == "classification":
            header = ["id", "fold", "target", "prediction", *(f"logit_{n}" for n in names)]
            body = [
                [ids[r], int(f), table.labels[r], names[int(np.argmax(o))], *(f"{x:.7g}" for x in o)]  # type: ignore[index]
                for r, f, o in zip(rows, fold_of, outputs, strict=True)
            ]
        else:
            targets = job.cfg.data.target_columns
            predicted = [f"prediction_{t}" for t in targets] if len(targets) > 1 else ["prediction"]
            header = ["id", "fold", *targets, *predicted]
            body = [
                [ids[r], int(f), *(f"{x:.7g}" for x in table.targets[r]), *(f"{x:.7g}" for x in o)]
                for r, f, o in zip(rows, fold_of, outputs, strict=True)
            ]
        tabular.write_csv(str(job.run_dir / "oof.csv"), header, body)
        write_atomic(job.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as the table `bertforge finetune` prints."""
    m = summary["metric"]
    lines = [f"| fold | {m} | best step | seconds |", "|---|---|---|---|"]
    for f in summary["folds"]:
        lines.append(f"| {f['fold']} | {f['score']:.4f} | {f['best_step']}/{f['steps']} | {f['seconds']:.0f} |")
    if len(summary["folds"]) > 1:
        lines.append(f"| mean ± std | {summary['mean']:.4f} ± {summary['std']:.4f} | | {summary['seconds']:.0f} |")
        lines.append(f"| out-of-fold | {summary['out_of_fold'][m]:.4f} | | |")
    return "\n".join(lines)


def fold_models(name: str | Path) -> tuple[list[Path], dict[str, Any]] | None:
    """A fine-tuning run's finished fold models and its text settings; None when `name` is not such a run."""
    run = Path(name)
    info_path = run / RUN_FILE
    if not info_path.exists():
        return None
    info = read_json_object(info_path)
    if info.get("kind") != "finetune":
        return None
    folders = sorted(
        (p.parent / "model" for p in run.glob(f"fold-*/{RESULT}") if (p.parent / "model").is_dir()),
        key=lambda p: int(p.parent.name.split("-")[1]),
    )
    if not folders:
        raise UserError(f"{run}: no finished fold yet")
    return folders, info
