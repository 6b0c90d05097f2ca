"""Multi-label classification: several 0/1 target columns, a logit each, trained with binary cross-entropy and
chosen by macro AUC."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bertforge.data.labelled import Table, TableConfig
from bertforge.errors import UserError
from bertforge.finetuning import regression, tables
from bertforge.finetuning.columns import numbers
from bertforge.train import metrics

NAME = "multilabel"
HEAD = "sequence"
PIPELINE_TAG = "text-classification"
AUTO_CLASS = "AutoModelForSequenceClassification"
DESCRIPTION = "sequence-classification model"
DEFAULT_LOSS = "bce"
LOSSES = ("bce", "mse", "mae")
DEFAULT_METRIC = "auc"


def read_targets(
    path: str, columns: list[str], rows: list[dict[str, Any]], cfg: TableConfig, known: Sequence[str] | None
) -> tuple[np.ndarray, list[str] | None]:
    """(N, L) float32 targets, each 0 or 1, no labels."""
    targets = regression.numeric_targets(path, columns, rows, cfg)
    bad = np.argwhere((targets != 0) & (targets != 1))
    if len(bad):
        i, j = bad[0]
        raise UserError(f"{path}: row {i + 1}: column '{cfg.target_columns[j]}' must be 0 or 1")
    return targets.astype(np.float32), None


def output_names(table: Table, cfg: TableConfig) -> list[str]:
    """A logit per target column."""
    return list(cfg.target_columns)


def strata(table: Table, bins: int) -> np.ndarray | None:
    """None: rows of several labels are not stratified."""
    return None


def scores(outputs: np.ndarray, targets: np.ndarray, names: Sequence[str], source: Any = None) -> dict[str, float]:
    return metrics.multilabel(outputs, targets)


def column_names(labels: list[str], run: dict[str, Any]) -> list[str]:
    return labels


def truth_columns(table: Table, cfg: TableConfig, rows: np.ndarray) -> tuple[list[str], list[list[str]]]:
    """The target columns' 0/1 values of `rows`."""
    return regression.truth_columns(table, cfg, rows)


def prediction_columns(
    names: Sequence[str], outputs: np.ndarray, beside_truth: bool
) -> tuple[list[str], list[list[Any]]]:
    """A logit per label, named logit_NAME; beside the targets, named as their predictions."""
    if beside_truth:
        return regression.prediction_columns(names, outputs, beside_truth)
    return [f"logit_{n}" for n in names], numbers(outputs)


read = tables.reader(read_targets)
rows = tables.rows
run_info = tables.run_info

out_of_fold = tables.out_of_fold(prediction_columns, truth_columns)
