"""Fine-tuning tasks: what differs between regression, classification and multi-label fine-tuning, one module each.

A task module declares, as module-level names, what `FinetuneTask` lists: how its targets are read from the
labelled table, how folds are stratified, its head and outputs, its losses and metric, and how its predictions are
written. The fine-tuning driver, `predict`, the model card and the `--task` choices read `TASKS`; adding a task is
adding a module and its line there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from bertforge.data.labelled import Table, TableConfig
from bertforge.finetuning import classification, multilabel, regression


@runtime_checkable
class FinetuneTask(Protocol):
    """A fine-tuning task: a module of this package."""

    NAME: str  # what head.task and --task call it, and run.json records
    HEAD: str  # the model head it trains (load_model's head)
    PIPELINE_TAG: str  # the Hub's pipeline tag of its models
    AUTO_CLASS: str  # the transformers class that loads its models
    DESCRIPTION: str  # what its model is, in the model card's first sentence
    DEFAULT_LOSS: str  # the loss when head.loss is not given
    LOSSES: tuple[str, ...]  # the built-in losses that fit its targets (a registered loss is taken as given)
    DEFAULT_METRIC: str  # the metric that picks the best checkpoint when head.metric is not given

    def read_targets(
        self, path: str, columns: list[str], rows: list[dict[str, Any]], cfg: TableConfig, known: Sequence[str] | None
    ) -> tuple[np.ndarray, list[str] | None]:
        """The targets of a table's rows, each checked, and their labels as written when it has labels. `known`:
        the training table's output names, given when a validation table is read."""
        ...

    def output_names(self, table: Table, cfg: TableConfig) -> list[str]:
        """The name of each of the head's outputs (its id2label), from the training table."""
        ...

    def strata(self, table: Table, bins: int) -> np.ndarray | None:
        """The stratum of every row that folds are balanced over (folds.bins for a binned target), or None."""
        ...

    def scores(self, outputs: np.ndarray, targets: np.ndarray) -> dict[str, float]:
        """Its metrics of (N, L) outputs against the targets."""
        ...

    def column_names(self, labels: list[str], run: dict[str, Any]) -> list[str]:
        """The names `predict` gives the outputs, from the model's labels and the run's run.json ({} for a folder)."""
        ...

    def truth_columns(self, table: Table, cfg: TableConfig, rows: np.ndarray) -> tuple[list[str], list[list[str]]]:
        """Header and values of the true targets of `rows`, which oof.csv writes beside the predictions."""
        ...

    def prediction_columns(
        self, names: Sequence[str], outputs: np.ndarray, beside_truth: bool
    ) -> tuple[list[str], list[list[Any]]]:
        """Header and values of the prediction columns of (N, L) outputs named `names`; `beside_truth` in oof.csv."""
        ...


TASKS: dict[str, FinetuneTask] = {
    regression.NAME: regression,
    classification.NAME: classification,
    multilabel.NAME: multilabel,
}


def task_of(run: dict[str, Any], num_labels: int) -> FinetuneTask:
    """The task a fine-tuning run's run.json names; a model folder without one is taken as regression when it has
    one output, else as classification."""
    name = run.get("task") or (regression.NAME if num_labels == 1 else classification.NAME)
    return TASKS[name]
