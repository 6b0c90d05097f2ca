"""Classification: one class per row from a single label column, trained with cross-entropy over a logit per class
and chosen by accuracy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bertforge.data import tabular
from bertforge.data.labelled import Table, TableConfig, sorted_classes
from bertforge.errors import UserError
from bertforge.finetuning import tables
from bertforge.finetuning.columns import numbers
from bertforge.train import metrics

NAME = "classification"
HEAD = "sequence"
PIPELINE_TAG = "text-classification"
AUTO_CLASS = "AutoModelForSequenceClassification"
DESCRIPTION = "sequence-classification model"
DEFAULT_LOSS = "cross_entropy"
LOSSES = ("cross_entropy",)
DEFAULT_METRIC = "accuracy"


def read_targets(
    path: str, columns: list[str], rows: list[dict[str, Any]], cfg: TableConfig, known: Sequence[str] | None
) -> tuple[np.ndarray, list[str] | None]:
    """(N,) int32 class indices into `known` (a validation table takes the training table's classes), else into
    the table's own sorted classes, and each row's class as written."""
    if len(cfg.target_columns) != 1:
        raise UserError(f"classification takes one target column, got {', '.join(cfg.target_columns)}")
    labels = tabular.label_column(path, columns, rows, cfg.target_columns[0])
    classes = list(known) if known is not None else sorted_classes(labels)
    index = {c: i for i, c in enumerate(classes)}
    for i, label in enumerate(labels):
        if label not in index:
            raise UserError(
                f"{path}: row {i + 1}: class '{label}' in column '{cfg.target_columns[0]}' never occurs in the "
                f"training data ({', '.join(classes)})"
            )
    return np.array([index[label] for label in labels], np.int32), labels


def output_names(table: Table, cfg: TableConfig) -> list[str]:
    """A logit per class of the training table."""
    assert table.labels is not None
    return sorted_classes(table.labels)


def strata(table: Table, bins: int) -> np.ndarray | None:
    """The class of every row."""
    return table.targets


def scores(outputs: np.ndarray, targets: np.ndarray, names: Sequence[str], source: Any = None) -> dict[str, float]:
    return metrics.classification(outputs, targets)


def column_names(labels: list[str], run: dict[str, Any]) -> list[str]:
    return labels


def truth_columns(table: Table, cfg: TableConfig, rows: np.ndarray) -> tuple[list[str], list[list[str]]]:
    """The class of `rows` as written, under 'target'."""
    assert table.labels is not None
    return ["target"], [[table.labels[r]] for r in rows]


def prediction_columns(
    names: Sequence[str], outputs: np.ndarray, beside_truth: bool
) -> tuple[list[str], list[list[Any]]]:
    """The predicted class ('label', or 'prediction' beside the target) and a logit per class."""
    header = ["prediction" if beside_truth else "label", *(f"logit_{n}" for n in names)]
    values = numbers(outputs)
    return header, [[names[int(np.argmax(o))], *v] for o, v in zip(outputs, values, strict=True)]


read = tables.reader(read_targets)
rows = tables.rows
run_info = tables.run_info

out_of_fold = tables.out_of_fold(prediction_columns, truth_columns)
