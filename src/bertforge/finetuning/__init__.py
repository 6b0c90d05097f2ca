"""Fine-tuning tasks: what differs between regression, classification, multi-label, token classification, question
answering, multiple choice and embedding models (for retrieval and for similarity), one module each.

A task module declares, as module-level names, what `FinetuneTask` lists: how its data is read and made into the
model's rows, how folds are stratified, its head and outputs, its losses and metric, and how its predictions are
written. The fine-tuning driver, `predict`, the model card and the `--task` choices read `TASKS`; adding a task is
adding a module and its line there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from bertforge.data.labelled import Table, TableConfig
from bertforge.finetuning import (
    classification,
    embedding,
    multilabel,
    multiple_choice,
    questions,
    regression,
    similarity,
    tokens,
)
from bertforge.tokenizer.load import Tokenizer


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

    def read(self, path: str, cfg: TableConfig, known: Sequence[str] | None) -> Any:
        """The training or validation data at `path`, every value checked. `known`: the training data's output
        names, given when validation data is read."""
        ...

    def output_names(self, data: Any, cfg: TableConfig) -> list[str]:
        """The name of each of the head's outputs (its id2label), from the training data."""
        ...

    def rows(self, data: Any, tokenizer: Tokenizer, cfg: TableConfig, limit: int) -> Table:
        """The model's rows of what `read` gave, each encoded in at most `limit` tokens (Table.encs)."""
        ...

    def strata(self, table: Table, bins: int) -> np.ndarray | None:
        """The stratum of every row that folds are balanced over (folds.bins for a binned target), or None."""
        ...

    def scores(
        self, outputs: np.ndarray, targets: np.ndarray, names: Sequence[str], source: Any = None
    ) -> dict[str, float]:
        """Its metrics of (N, L) outputs (a token task's (N, T, L)) against the targets; `names`: the outputs',
        `source`: the table's (Table.source), which a task whose rows are windows reads."""
        ...

    def run_info(self, table: Table, cfg: TableConfig) -> dict[str, Any]:
        """What run.json records beyond the common keys, for `predict` to use as the run did."""
        ...

    def column_names(self, labels: list[str], run: dict[str, Any]) -> list[str]:
        """The names `predict` gives the outputs, from the model's labels and the run's run.json ({} for a folder)."""
        ...

    def out_of_fold(
        self,
        table: Table,
        cfg: TableConfig,
        names: Sequence[str],
        rows: np.ndarray,
        outputs: np.ndarray,
        keys: Sequence[tuple[str, Sequence[Any]]],
    ) -> tuple[list[str], list[list[Any]]]:
        """oof.csv's header and rows, from the `outputs` of the table's `rows` and their `keys` columns."""
        ...

    def prediction_columns(
        self, names: Sequence[str], outputs: np.ndarray, beside_truth: bool
    ) -> tuple[list[str], list[list[Any]]]:
        """Header and values of the prediction columns of (N, L) outputs named `names`; `beside_truth` in oof.csv.
        A token task's rows are units (words or tokens)."""
        ...


TASKS: dict[str, FinetuneTask] = {
    regression.NAME: regression,
    classification.NAME: classification,
    multilabel.NAME: multilabel,
    tokens.NAME: tokens,
    questions.NAME: questions,
    multiple_choice.NAME: multiple_choice,
    embedding.NAME: embedding,
    similarity.NAME: similarity,
}


def task_of(run: dict[str, Any], num_labels: int) -> FinetuneTask:
    """The task a fine-tuning run's run.json names; a model folder without one is taken as regression when it has
    one output, else as classification."""
    name = run.get("task") or (regression.NAME if num_labels == 1 else classification.NAME)
    return TASKS[name]
