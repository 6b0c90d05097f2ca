"""What the tasks with one output row per table row (regression, classification, multi-label) share: reading the
table, encoding each row's text (or text pair), and writing a predictions table."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bertforge.data import long_text
from bertforge.data.labelled import Table, TableConfig, TargetReader, read_table
from bertforge.tokenizer.load import Tokenizer

# A task's prediction columns: (names, outputs (N, L), beside_truth) -> (header, rows).
PredictionColumns = Callable[[Sequence[str], np.ndarray, bool], tuple[list[str], list[list[Any]]]]
# A task's true-value columns of some rows: (table, cfg, rows) -> (header, rows).
TruthColumns = Callable[[Table, TableConfig, np.ndarray], tuple[list[str], list[list[str]]]]
OutOfFold = Callable[..., tuple[list[str], list[list[Any]]]]


def reader(read_targets: TargetReader) -> Callable[[str, TableConfig, Sequence[str] | None], Table]:
    """A task's `read`: the table with every value checked, its targets read by `read_targets`."""

    def read(path: str, cfg: TableConfig, known: Sequence[str] | None) -> Table:
        return read_table(path, cfg, read_targets, known)

    return read


def rows(table: Table, tokenizer: Tokenizer, cfg: TableConfig, limit: int) -> Table:
    """The table with each row's text (and pair) encoded, truncated to `limit` tokens as data.truncation says; with
    data.long_text='windows' a row per window of each text (data.long_text.windowed)."""
    if cfg.long_text == "windows":
        return long_text.windowed(table, tokenizer, cfg, limit)
    table.encs = tokenizer.encode_batch(table.texts, table.pairs, max_length=limit, truncation=cfg.truncation)
    return table


def run_info(table: Table, cfg: TableConfig) -> dict[str, Any]:
    """A sequence task records nothing beyond run.json's common keys."""
    return {}


def prediction_table(
    columns: PredictionColumns,
    names: Sequence[str],
    outputs: np.ndarray,
    keys: Sequence[tuple[str, Sequence[Any]]] = (),
    targets: tuple[Sequence[str], Sequence[Sequence[str]]] | None = None,
) -> tuple[list[str], list[list[Any]]]:
    """Header and rows of a predictions CSV: the `keys` columns ((name, values), such as ids), then the true values
    when `targets` gives them ((header, rows): out-of-fold predictions), then a task's prediction `columns` of
    `outputs`, one per output of `names` or more.
    """
    predicted, values = columns(names, outputs, targets is not None)
    target_header, target_rows = targets if targets is not None else ((), [() for _ in values])
    header = [*(name for name, _ in keys), *target_header, *predicted]
    key_columns = [column for _, column in keys]
    body = [[*(c[i] for c in key_columns), *target_rows[i], *v] for i, v in enumerate(values)]
    return header, body


def out_of_fold(columns: PredictionColumns, truth: TruthColumns) -> OutOfFold:
    """A task's `out_of_fold`: oof.csv's header and rows, the keys, the true targets of the rows and the predictions
    beside them, from its prediction and truth columns."""

    def write(table: Table, cfg: TableConfig, names: Sequence[str], rows: np.ndarray, outputs: np.ndarray,
              keys: Sequence[tuple[str, Sequence[Any]]]) -> tuple[list[str], list[list[Any]]]:  # fmt: skip
        return prediction_table(columns, names, outputs, keys, truth(table, cfg, rows))

    return write
