"""Regression: one real value per target column, trained with mean squared error and chosen by RMSE."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bertforge.data import tabular
from bertforge.data.folds import bin_targets, sturges_bins
from bertforge.data.labelled import Table, TableConfig
from bertforge.finetuning import tables
from bertforge.finetuning.columns import numbers, prediction_header
from bertforge.train import metrics

NAME = "regression"
HEAD = "sequence"
PIPELINE_TAG = "text-classification"  # the Hub files regression under sequence classification too
AUTO_CLASS = "AutoModelForSequenceClassification"
DESCRIPTION = "sequence-classification model"
DEFAULT_LOSS = "mse"
LOSSES = ("mse", "mae", "bce")
DEFAULT_METRIC = "rmse"


def numeric_targets(path: str, columns: list[str], rows: list[dict[str, Any]], cfg: TableConfig) -> np.ndarray:
    """(N, L) float64 values of the target columns, each checked."""
    return np.stack([tabular.numeric_column(path, columns, rows, c) for c in cfg.target_columns], axis=1)


def read_targets(
    path: str, columns: list[str], rows: list[dict[str, Any]], cfg: TableConfig, known: Sequence[str] | None
) -> tuple[np.ndarray, list[str] | None]:
    """(N, L) float32 targets, no labels."""
    return numeric_targets(path, columns, rows, cfg).astype(np.float32), None


def output_names(table: Table, cfg: TableConfig) -> list[str]:
    """One output per target column."""
    return list(cfg.target_columns)


def strata(table: Table, bins: int) -> np.ndarray | None:
    """Equal-width bins of the first target (Sturges' rule when `bins` is 0)."""
    return bin_targets(table.targets[:, 0], bins or sturges_bins(len(table)))


def scores(outputs: np.ndarray, targets: np.ndarray, names: Sequence[str], source: Any = None) -> dict[str, float]:
    return metrics.regression(outputs, targets)


def column_names(labels: list[str], run: dict[str, Any]) -> list[str]:
    """The run's target columns, else the model's labels."""
    return run.get("targets", labels)


def truth_columns(table: Table, cfg: TableConfig, rows: np.ndarray) -> tuple[list[str], list[list[str]]]:
    """The target columns' values of `rows`."""
    return list(cfg.target_columns), numbers(table.targets[rows])


def prediction_columns(
    names: Sequence[str], outputs: np.ndarray, beside_truth: bool
) -> tuple[list[str], list[list[Any]]]:
    """A value per target."""
    return prediction_header(names), numbers(outputs)


read = tables.reader(read_targets)
rows = tables.rows
run_info = tables.run_info

out_of_fold = tables.out_of_fold(prediction_columns, truth_columns)
