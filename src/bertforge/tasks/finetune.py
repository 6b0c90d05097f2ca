"""`bertforge finetune`: a sequence head on a pretrained encoder, with k-fold cross-validation, and its outputs.

RUN holds folds.csv (the fold of every row), then per fold fold-K/ with its metrics, checkpoints while it trains,
the best model as a Hugging Face folder (model/) and result.json, written last: a fold without result.json is not
finished, and the same command run again continues it from its newest checkpoint. When the folds are done, RUN gets
oof.csv (out-of-fold predictions) and summary.json.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx

from bertforge import hub, runs
from bertforge.config import to_dict
from bertforge.data.batching import Row, choices_of, epoch_batches, ladder, tokens_of
from bertforge.data.folds import FoldsConfig, check_classes, fold_plan, folds_to_run
from bertforge.data.labelled import Table, TableConfig
from bertforge.data.long_text import record_of, records_of
from bertforge.data.text_packing import PackShape
from bertforge.errors import UserError
from bertforge.finetuning import TASKS, pairs
from bertforge.model import attention, dropout, used_rows
from bertforge.model.hf import Pretrained
from bertforge.model.load import load_model
from bertforge.runtime.devices import MeshConfig, build_mesh, param_shardings, run_mesh
from bertforge.tasks import packed_batches
from bertforge.tasks.finetune_fold import FinetuneTrainConfig, Job, train_fold
from bertforge.tasks.fold_eval import scores
from bertforge.train import metrics
from bertforge.train.ahead import Ahead
from bertforge.train.contrastive import DISTILLED, ContrastiveConfig
from bertforge.train.loss_scale import with_loss_scale
from bertforge.train.metrics_log import LogConfig
from bertforge.train.optim import OptimConfig, make_optimizer
from bertforge.train.packed_step import compile_packed_step
from bertforge.train.sequence_step import LOSSES, SequenceStepConfig, compile_train_step, predict_step
from bertforge.train.step import new_train_state

# The registry's task names, as a Literal: the `--task` flag's choices and the config's check come from it.
Task = Literal[tuple(TASKS)]  # type: ignore[valid-type]


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    task: Task = "regression"  # what the head learns from the targets
    loss: str = ""  # default: the task's (mse, cross_entropy, mnrl, ...); more with sequence_step.register_loss
    metric: str = ""  # picks the best checkpoint; default: the task's (rmse, accuracy, ndcg@10, ...)
    # cls, mean, max or attention; default: cls, and for an embedding model the folder's own (a sentence-transformers
    # folder's pooling), else mean.
    pooling: str = ""
    normalize: bool | None = None  # embedding: unit-length vectors (default: the folder's own, else not)
    scale: float = 20.0  # embedding losses: the multiplier of the cosine similarities
    symmetric: bool = False  # mnrl: also find each positive's anchor among the anchors
    matryoshka: tuple[int, ...] = ()  # embedding: the loss summed over the vectors cut to these sizes
    temperature: float = 1.0  # kl: the teacher's and the student's scores are divided by it
    hidden_dropout: float | None = None  # None keeps the pretrained model's
    attention_dropout: float | None = None
    classifier_dropout: float | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task {self.task!r} is not one of {', '.join(TASKS)}")
        embedding = TASKS[self.task].HEAD == "embedding"
        known = TASKS[self.task].LOSSES if embedding else tuple(LOSSES)
        if self.loss and self.loss not in known:
            raise ValueError(f"loss {self.loss!r} is not one of {', '.join(known)}")
        if embedding and self.pooling == "attention":
            raise ValueError("an embedding model pools by cls, mean or max")
        if not embedding and (self.normalize is not None or self.matryoshka or self.symmetric):
            raise ValueError("normalize, symmetric and matryoshka are options of the embedding tasks")
        self.contrastive(TASKS[self.task].LOSSES[0] if embedding else "mnrl")
        if self.metric and self.metric not in metrics.HIGHER_IS_BETTER:
            raise ValueError(f"metric {self.metric!r} is not one of {', '.join(metrics.HIGHER_IS_BETTER)}")

    def contrastive(self, loss: str) -> ContrastiveConfig:
        return ContrastiveConfig(loss, self.scale, self.symmetric, self.matryoshka, self.temperature)


def _finetune_optim() -> OptimConfig:
    return OptimConfig(lr=5e-5, b2=0.999, eps=1e-8, weight_decay=0.01, warmup_fraction=0.1)


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    model: str = ""  # Hugging Face folder, hub id, or a bertforge pretraining run
    data: TableConfig = dataclasses.field(default_factory=TableConfig)
    folds: FoldsConfig = dataclasses.field(default_factory=FoldsConfig)
    head: HeadConfig = dataclasses.field(default_factory=HeadConfig)
    train: FinetuneTrainConfig = dataclasses.field(default_factory=FinetuneTrainConfig)
    optim: OptimConfig = dataclasses.field(default_factory=_finetune_optim)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    log: LogConfig = dataclasses.field(default_factory=lambda: LogConfig(every=10, tensorboard=False))
    hub: hub.HubConfig = dataclasses.field(default_factory=hub.HubConfig)


Setup = tuple[Pretrained, list[str], Table, Table | None, list[int], np.ndarray | None]


def _setup(cfg: FinetuneConfig) -> Setup:
    """Read and check everything before anything is written: the model, the names of the task's outputs, the
    training and validation tables, the folds to run and the fold of every record."""
    if not cfg.model:
        raise UserError("no model given (--model HF_DIR_OR_HUB_ID_OR_RUN)")
    if not cfg.data.train:
        raise UserError("no training data given (--data TABLE)")
    if why := attention.unavailable(cfg.train.attention, jax.default_backend()):
        raise UserError(f"train.attention={cfg.train.attention}: {why}")
    task = TASKS[cfg.head.task]
    data = task.read(cfg.data.train, cfg.data, None)
    if cfg.head.loss in DISTILLED:
        pairs.check_teacher(data, cfg.head.loss)
    names = task.output_names(data, cfg.data)
    valid_data = task.read(cfg.data.valid, cfg.data, names) if cfg.data.valid else None
    run = [0] if cfg.data.valid else folds_to_run(cfg.folds)
    h = cfg.head
    t = cfg.train
    overrides: dict[str, Any] = {"dtype": t.dtype, "remat": t.remat, "attention": t.attention}
    for name in ("hidden_dropout", "attention_dropout", "classifier_dropout", "normalize"):
        if getattr(h, name) is not None:
            overrides[name] = getattr(h, name)
    if h.pooling or task.HEAD != "embedding":  # an embedding model keeps its folder's pooling unless told
        overrides["pooling"] = h.pooling or "cls"
    # A choice head scores each choice with one output; an embedding model's outputs are its vectors.
    outputs = 1 if task.HEAD in ("choice", "embedding") else len(names)
    pre = load_model(cfg.model, head=task.HEAD, num_labels=outputs, seed=cfg.train.seed, overrides=overrides)
    if any(d > pre.model.config.hidden_size for d in h.matryoshka):
        raise UserError(f"head.matryoshka: {max(h.matryoshka)} is more than the model's {pre.model.config.hidden_size} "
                        "values per vector")  # fmt: skip
    why = _not_packed(cfg, pre)
    if cfg.data.pack and why:
        raise UserError(f"data.pack=true: {why}; leave data.pack unset (packed where it is exact) or false")
    if outputs == len(names):
        pre.id2label = dict(enumerate(names))
    limit = min(cfg.data.max_length, pre.model.config.max_seq_len)
    table = task.rows(data, pre.tokenizer, cfg.data, limit)
    valid = None if valid_data is None else task.rows(valid_data, pre.tokenizer, cfg.data, limit)
    # Folds are of the records as read, so that a text's windows stay in one and the folds do not depend on them.
    folds = None if valid is not None else fold_plan(cfg.folds, records_of(table), task.strata)
    if folds is not None:
        check_classes(records_of(table), folds, run)
    return pre, names, table, valid, run, folds


def main(cfg: FinetuneConfig, out: str, resume: str = "auto") -> dict[str, Any]:
    """Fine-tune the folds of `cfg`; returns the summary (also in RUN/summary.json)."""
    run_dir = Path(out)
    if resume == "auto" and runs.fold_dirs(run_dir):  # before the model and the tables are read
        runs.check_settings(run_dir, cfg)
    pre, names, table, valid, run, folds = _setup(cfg)
    with runs.locked(run_dir):
        return _main(cfg, run_dir, resume, pre, names, table, valid, run, folds)


def _ladder(encs: list[Row], cfg: FinetuneConfig, limit: int) -> tuple[int, ...]:
    """The padded lengths every fold uses, chosen from the longest text of each batch of a first epoch over the
    whole table (a fold's batches are alike), so that the folds share their compiled programs."""
    lengths = np.array([tokens_of(e) for e in encs])
    plan = epoch_batches(lengths, cfg.train.batch_size, max(cfg.data.bucket, 1), cfg.train.seed, 0, cfg.data.pool)
    maxima = np.array([lengths[rows].max() for rows in plan])
    return ladder(maxima, limit, cfg.data.bucket, cfg.data.shapes)


def _job(cfg: FinetuneConfig, run_dir: Path, pre: Pretrained, names: list[str], table: Table, valid: Table | None,
         fold_rows: list[np.ndarray]) -> Job:  # fmt: skip
    """The encoded tables, the mesh, the optimizer and the compiled programs every fold shares."""
    limit = min(cfg.data.max_length, pre.model.config.max_seq_len)
    assert table.encs is not None and (valid is None or valid.encs is not None)
    mesh, shards = _mesh(cfg)
    task, t, h = TASKS[cfg.head.task], cfg.train, cfg.head
    trimmed = _trimmed(cfg.train, pre, table, valid)
    graphdef, params, rest = nnx.split(pre.model, nnx.Param, ...)
    pristine = jax.device_get(params)
    shardings = param_shardings(pre.model, mesh)
    tx = with_loss_scale(make_optimizer(cfg.optim, params, pre.model.config.num_layers), pre.model.config.dtype)
    state_shardings = jax.tree.map(lambda x: x.sharding, new_train_state(jax.device_put(pristine, shardings), tx, mesh))
    loss = h.loss or task.DEFAULT_LOSS
    contrastive = h.contrastive(loss) if task.HEAD == "embedding" else None
    step_cfg = SequenceStepConfig(loss, t.grad_accum, t.sparse_embeddings, row_capacity=t.batch_size * limit,
                                  dropout=dropout.draws(pre.model), contrastive=contrastive)  # fmt: skip
    rungs = _ladder(table.encs, cfg, limit)
    pack = _pack_shape(cfg, pre, table, valid, fold_rows, limit, shards, rungs)
    # Outputs replicated: every process reads the whole batch's predictions (metrics are global).
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return Job(
        run_dir=run_dir,
        train=cfg.train,
        optim=cfg.optim,
        log=cfg.log,
        config=to_dict(cfg),
        task=task,
        loss=loss,
        metric=cfg.head.metric or task.DEFAULT_METRIC,
        bucket=cfg.data.bucket,
        pool=cfg.data.pool,
        limit=limit,
        pre=pre,
        names=names,
        table=table,
        encs=table.encs,
        rungs=rungs,
        valid_table=valid,
        valid_encs=None if valid is None else valid.encs,
        mesh=mesh,
        graphdef=graphdef,
        rest=rest,
        pristine=pristine,
        param_shardings=shardings,
        tx=tx,
        step_jit=(compile_packed_step if pack and task.HEAD not in packed_batches.WHOLE else compile_train_step)(
            graphdef, rest, tx, step_cfg, state_shardings
        ),
        forward_jit=Ahead(jax.jit(functools.partial(predict_step, graphdef, rest), out_shardings=replicated)),
        base_model=cfg.model,
        hub=cfg.hub,
        publisher=hub.open_publisher(cfg.hub),
        hub_folder="fold-{fold}" if len(fold_rows) > 1 else "",
        choices=choices_of(table.encs),
        pack=pack,
        trimmed=trimmed,
    )


def _trimmed(t: FinetuneTrainConfig, pre: Pretrained, table: Table, valid: Table | None) -> used_rows.Trimmed | None:
    """The word-embedding rows the run trains (model/used_rows.py), or None where it trains the whole table."""
    if not t.trim_vocab or t.sparse_embeddings:
        return None
    return used_rows.shrink(pre.model, used_rows.used_ids(pre.tokenizer, table.encs, valid and valid.encs))


def _mesh(cfg: FinetuneConfig) -> tuple[jax.sharding.Mesh, int]:
    """The run's mesh and the devices a batch's rows are split over."""
    mesh = build_mesh(cfg.mesh, cfg.train.batch_size, cfg.train.grad_accum, "train.batch_size")
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.train.eval_batch_size % shards:
        raise UserError(f"train.eval_batch_size={cfg.train.eval_batch_size} does not split over {shards} devices")
    return mesh, shards


def _main(
    cfg: FinetuneConfig,
    run_dir: Path,
    resume: str,
    pre: Pretrained,
    names: list[str],
    table: Table,
    valid: Table | None,
    run: list[int],
    folds: np.ndarray | None,
) -> dict[str, Any]:
    if resume == "never" and any((runs.fold_dir(run_dir, f) / runs.RESULT).exists() for f in run):
        raise UserError(f"{run_dir}: already has finished folds; use another --out, or --resume auto to continue")
    fold_rows = [_fold_rows(table, valid, folds, f)[0] for f in run]
    job = _job(cfg, run_dir, pre, names, table, valid, fold_rows)
    try:
        summary = _folds(cfg, run_dir, resume, job, table, valid, run, folds)
    finally:
        hub.abandon(job.publisher)
    return summary


def _folds(
    cfg: FinetuneConfig,
    run_dir: Path,
    resume: str,
    job: Job,
    table: Table,
    valid: Table | None,
    run: list[int],
    folds: np.ndarray | None,
) -> dict[str, Any]:
    if jax.process_index() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        runs.write_config(run_dir, cfg)
        info = {
            "task": cfg.head.task,
            "targets": list(cfg.data.target_columns),
            "labels": job.names,
            "text_column": cfg.data.text_column,
            "text_pair_column": cfg.data.text_pair_column,
            "max_length": job.limit,
            "truncation": cfg.data.truncation,
            "stride": cfg.data.stride,
            "long_text": cfg.data.long_text,
            "window_pool": cfg.data.window_pool,
            "folds": [] if folds is None else list(range(cfg.folds.k)),
            **job.task.run_info(table, cfg.data),
        }
        runs.write_info(run_dir, "finetune", info)
        if folds is not None:
            runs.write_folds(run_dir, records_of(table).row_ids(), folds)

    results = []
    for f in run:
        done = runs.read_result(run_dir, f)
        if done is not None:
            results.append(done)
            continue
        with run_mesh(job.mesh):
            result = train_fold(job, f, *_fold_rows(table, valid, folds, f), resume)
        print(f"fold {f}: {job.metric} {result['score']:.4f} in {result['seconds']:.0f} s", flush=True)
        results.append(result)
    hub.finish(job.publisher, functools.partial(print, flush=True))
    return _summarise(cfg, job, results)


def _fold_rows(table: Table, valid: Table | None, folds: np.ndarray | None, f: int) -> tuple[np.ndarray, np.ndarray]:
    """Fold f's training rows (of `table`) and validation rows (of `valid`, else of `table`)."""
    if folds is None:
        return np.arange(len(table)), np.arange(len(valid))  # type: ignore[arg-type]
    of_row = folds[record_of(table)]
    return np.flatnonzero(of_row != f), np.flatnonzero(of_row == f)


def _not_packed(cfg: FinetuneConfig, pre: Pretrained) -> str:
    """Why the run cannot pack its texts ('' when it can): packed_batches.why_not, the lazy table update, or
    gradient accumulation over questions' choices (an embedding model's cached loss packs each mini-batch)."""
    model, head = pre.model.config, TASKS[cfg.head.task].HEAD
    why = packed_batches.why_not(head, model.family, model.pooling)
    if not why and cfg.train.sparse_embeddings:
        why = "train.sparse_embeddings updates each batch's rows"
    if not why and head == "choice" and cfg.train.grad_accum > 1:
        why = f"a {head} step's texts are packed whole (train.grad_accum > 1)"
    return why


def _pack_shape(cfg: FinetuneConfig, pre: Pretrained, table: Table, valid: Table | None, fold_rows: list[np.ndarray],
                limit: int, shards: int, rungs: tuple[int, ...]) -> PackShape | None:  # fmt: skip
    """The shape of the run's packed batches, or None where it does not pack (packed_batches)."""
    model = pre.model.config
    if cfg.data.pack is False or _not_packed(cfg, pre):
        return None
    t, head = cfg.train, TASKS[cfg.head.task].HEAD
    whole = head in packed_batches.WHOLE  # rows of N texts, packed a whole step at once
    lengths, valid_lengths = (packed_batches.text_lengths(x, whole) for x in (table, valid))
    per_row = lengths.shape[1] if whole else 1
    settings = {"batch_size": t.batch_size, "grad_accum": t.grad_accum, "epochs": t.epochs, "seed": t.seed,
                "eval_batch_size": t.eval_batch_size * per_row, "bucket": cfg.data.bucket,
                "pool": cfg.data.pool}  # fmt: skip
    shape = (packed_batches.whole_plan if whole else packed_batches.plan)(
        lengths, valid_lengths, fold_rows, limit, settings, shards
    )
    if cfg.data.pack:
        return shape
    longest = lengths.max(axis=1) if whole else lengths
    padded = packed_batches.ladder_work(longest, t.batch_size, limit, cfg.data.bucket, rungs, t.seed, model, per_row,
                                        head)  # fmt: skip
    packed = packed_batches.packed_work(shape, len(lengths), t.batch_size, model, per_row, head)
    return shape if packed <= packed_batches.margin(jax.default_backend()) * padded else None


def _summarise(cfg: FinetuneConfig, job: Job, results: list[dict[str, Any]]) -> dict[str, Any]:
    """oof.csv and summary.json from the folds' results."""
    table = records_of(job.valid_table or job.table)
    rows = np.concatenate([np.array(r["rows"], np.int64) for r in results])
    outputs = np.concatenate([np.array(r["outputs"], np.float32) for r in results])
    fold_of = np.concatenate([np.full(len(r["rows"]), r["fold"]) for r in results])
    order = np.argsort(rows, kind="stable")
    rows, outputs, fold_of = rows[order], outputs[order], fold_of[order]
    pooled = scores(job, outputs, table.targets[rows])
    fold_scores = np.array([r["score"] for r in results])
    summary = {
        "task": cfg.head.task,
        "metric": job.metric,
        "folds": [
            {k: r[k] for k in ("fold", "score", "best_step", "steps", "seconds", "train_rows", "valid_rows")}
            for r in results
        ],
        "mean": float(fold_scores.mean()),
        "std": float(fold_scores.std()),
        "out_of_fold": pooled,
        "seconds": float(sum(r["seconds"] for r in results)),
    }
    if jax.process_index() == 0:
        ids = table.row_ids()
        names = job.names
        keys = [("id", [ids[r] for r in rows]), ("fold", [int(f) for f in fold_of])]
        header, body = job.task.out_of_fold(table, cfg.data, names, rows, outputs, keys)
        runs.write_outcome(job.run_dir, header, body, summary)
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
