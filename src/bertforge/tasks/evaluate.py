"""`bertforge evaluate`: a fine-tuned model's metrics on labelled data it was not trained on (a test set), the
metrics that fine-tuning reports on its validation data, computed the same way.

The data is read as the task reads it for fine-tuning (a table, CoNLL or JSONL tags, SQuAD JSON, choices, pairs),
with a fine-tuning run's own data settings (its config.yaml: columns, tag scheme, windows, question lengths) where
no flag replaces them. A run's fold models are averaged, as `predict` averages them, before the metrics are taken.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bertforge import runs
from bertforge.config import from_dict, read_yaml
from bertforge.data.labelled import Table, TableConfig
from bertforge.data.long_text import outputs_of_records, records_of
from bertforge.errors import UserError
from bertforge.fileio import finite, finite_json, write_atomic
from bertforge.finetuning import TASKS, FinetuneTask, classification, multilabel, regression, task_of, tokens
from bertforge.finetuning.pairs import distinct_texts
from bertforge.model.hf import Pretrained
from bertforge.model.load import load_models
from bertforge.tasks.model_outputs import forward_of, outputs_by_length, run_limit

# Tasks whose outputs are the model's labels (config.json's id2label), which a folder's data is read against.
_LABELLED = (classification.NAME, tokens.NAME)


@dataclasses.dataclass(frozen=True)
class EvaluateConfig:
    model: str  # a fine-tuning run (its fold models averaged) or a fine-tuned model folder
    # Labelled data as fine-tuning reads it: a table (CSV, TSV, JSONL, Parquet); tags as CoNLL, JSONL or JSON; SQuAD
    # JSON or question records; choices; pairs.
    data: str
    task: str | None = None  # the fine-tuning task (default: the run's; a folder's from its head)
    # Each column defaults to the run's data settings (its config.yaml), else to fine-tuning's default.
    text_column: str | None = None  # the text, or a pair's first (default: the run's, else 'text')
    text_pair_column: str | None = None  # a pair's second text (default: the run's)
    target_columns: tuple[str, ...] = ()  # the labels or scores (default: the run's, else 'target')
    context_column: str | None = None  # multiple choice: read before each question (default: the run's)
    format: str = ""  # token classification: conll, jsonl or json (default: from the file name)
    quoted_tsv: bool = False  # a .tsv table written with CSV quoting; by default a TSV has none and '"' is text
    max_length: int | None = None  # tokens per text (default: the fine-tuning run's, else the model's)
    stride: int | None = None  # the tokens a long text's windows overlap by (default: the run's, else 32)
    batch_size: int = 32  # texts per batch
    out: str | None = None  # a JSON file for the metrics

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"task {self.task!r} is not one of {', '.join(TASKS)}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")


def main(cfg: EvaluateConfig) -> dict[str, Any]:
    """The metrics (and the records scored, under 'records'), also written to cfg.out when given."""
    models, settings = load_models(cfg.model)
    task = task_for(models[0], settings, cfg.task)
    data_cfg = table_config(cfg, Path(cfg.model) if settings else None)
    names, data = _read(task, models[0], settings, data_cfg)
    limit = run_limit(models, settings, cfg.max_length)
    table = task.rows(data, models[0].tokenizer, data_cfg, limit)
    if not len(table):
        raise UserError(f"{cfg.data}: nothing to evaluate (no row of the task's data)")
    outputs = np.mean([record_outputs(task, pre, table, limit, cfg.batch_size) for pre in models], axis=0)
    scores = task.scores(outputs, records_of(table).targets, names, table.source)
    # A correlation of fewer than two records, or of outputs that do not vary, is undefined: None (JSON's null), as
    # JSON has no NaN.
    found: dict[str, Any] = finite(scores)
    found["records"] = records(data)
    if cfg.out:
        write_atomic(cfg.out, finite_json(found, indent=2) + "\n")
    return found


def records(data: Any) -> int:
    """The records a task's data holds as read: documents, questions, choice questions or table rows (not the
    model's rows, which windows multiply)."""
    for name in ("documents", "questions", "records"):
        if hasattr(data, name):
            return len(getattr(data, name))
    return len(data)


def task_for(pre: Pretrained, settings: dict[str, Any], given: str | None) -> FinetuneTask:
    """The task `given`, else the run's, else the one a folder's head and config.json imply; an error when the
    model's head is not that task's."""
    if given is not None:
        task = TASKS[given]
    elif settings.get("task"):
        task = TASKS[settings["task"]]
    elif pre.head != regression.HEAD:  # the first task of that head: 'embedding' before 'similarity'
        task = next(t for t in TASKS.values() if pre.head == t.HEAD)
    elif pre.problem_type == "multi_label_classification":
        task = TASKS[multilabel.NAME]
    else:  # a sequence head: regression with one output, else classification
        task = task_of({}, pre.model.num_labels)
    if pre.head != task.HEAD:
        raise UserError(f"{pre.folder}: a {pre.head} model, not one for {task.NAME}")
    return task


def table_config(cfg: EvaluateConfig, run: Path | None) -> TableConfig:
    """How cfg.data is read: the run's data settings (fine-tuning's defaults for a folder) with each flag given in
    their place; no group, id or error column, which only training reads."""
    base = TableConfig()
    if run is not None and (run / runs.CONFIG).is_file():
        base = from_dict(TableConfig, read_yaml(run / runs.CONFIG).get("data", {}), "data")
    given = {
        "text_column": cfg.text_column,
        "text_pair_column": cfg.text_pair_column,
        "target_columns": cfg.target_columns or None,
        "context_column": cfg.context_column,
        "format": cfg.format or None,
        "stride": cfg.stride,
    }
    changes = {key: value for key, value in given.items() if value is not None}
    return dataclasses.replace(base, train=cfg.data, valid="", id_column=None, group_column=None,
                               error_column=None, quoted_tsv=cfg.quoted_tsv or base.quoted_tsv, **changes)  # fmt: skip


def _read(task: FinetuneTask, pre: Pretrained, settings: dict[str, Any], cfg: TableConfig) -> tuple[list[str], Any]:
    """The names of the model's outputs and the data read against them: a run's (its training data's), a labelled
    folder's config.json labels, or else what the data itself gives (regression's target columns, choices)."""
    known = settings.get("labels")
    if not known and task.NAME in _LABELLED:
        known = pre.label_names()
    if known:
        return list(known), task.read(cfg.train, cfg, list(known))
    data = task.read(cfg.train, cfg, None)
    names = task.output_names(data, cfg)
    if task.NAME in (regression.NAME, multilabel.NAME) and len(names) != pre.model.num_labels:
        raise UserError(f"{cfg.train}: {len(names)} target column(s) ({', '.join(names)}) for a model of "
                        f"{pre.model.num_labels} outputs")  # fmt: skip
    return names, data


def record_outputs(task: FinetuneTask, pre: Pretrained, table: Table, limit: int, batch_size: int) -> np.ndarray:
    """One model's outputs for each of the table's records, as fine-tuning's evaluation computes them (padded by
    length): an embedding model's texts each embedded once, a record's windows pooled."""
    pre.model.eval()
    encs: Sequence[Any] = table.encs or []
    index = None
    if task.HEAD == "embedding":
        encs, index = distinct_texts(encs)
    outputs = outputs_by_length(forward_of(pre.model), encs, pre.tokenizer.pad_id, batch_size, limit)
    if index is not None:  # each row's N vectors, flat
        outputs = outputs[index].reshape(len(index), -1)
    return outputs_of_records(table, np.arange(len(table)), outputs)[1]
