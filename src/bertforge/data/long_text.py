"""Long texts of the sequence tasks as overlapping windows (data.long_text='windows'), instead of truncation: each
window is a row that trains with its text's target, and a text's output is the mean or the max of its windows'
outputs, at evaluation and at prediction alike."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from bertforge.data.labelled import WINDOW_POOLS, Table, TableConfig
from bertforge.data.windows import window_ranges
from bertforge.errors import UserError
from bertforge.tokenizer.load import Encoded, Tokenizer, truncate


def text_windows(
    tok: Tokenizer,
    texts: Sequence[str],
    pairs: Sequence[str] | None,
    limit: int,
    stride: int,
    truncation: str = "head",
) -> tuple[list[Encoded], np.ndarray]:
    """Each text cut into windows of at most `limit` tokens with their special tokens, overlapping by `stride`
    tokens; a text pair's second text goes whole into each window while it takes at most half the room (else it is
    truncated to that half, as `truncation` says). Returns the windows' encodings and (R,) the text each is of; a
    text that fits is one window, encoded as truncation would encode it."""
    budget = limit - tok.num_special(pairs is not None)
    if budget < 1:
        raise UserError(f"max_length {limit} leaves no room for text beside the special tokens")
    a_ids = tok.tokenize_ids(texts)
    b_ids: Sequence[list[int] | None] = tok.tokenize_ids(pairs) if pairs is not None else [None] * len(a_ids)
    encs: list[Encoded] = []
    record: list[int] = []
    for i, (a, b) in enumerate(zip(a_ids, b_ids, strict=True)):
        if b is not None:
            b = truncate(b, min(len(b), budget // 2), truncation)
        capacity = budget - (len(b) if b is not None else 0)
        for start, end in window_ranges(len(a), capacity, min(stride, capacity - 1)):
            encs.append(tok.assemble(a[start:end], b))
            record.append(i)
    return encs, np.array(record, np.int64)


def pool(outputs: np.ndarray, record: np.ndarray, how: str) -> tuple[np.ndarray, np.ndarray]:
    """The records of (R, L) window `outputs` ((D,), ascending) and (D, L) the mean or the max of each record's
    windows' outputs."""
    if how not in WINDOW_POOLS:
        raise ValueError(f"window pool {how!r} is not one of {', '.join(WINDOW_POOLS)}")
    records, inverse = np.unique(record, return_inverse=True)
    if how == "max":
        out = np.full((len(records), *outputs.shape[1:]), -np.inf, np.float32)
        np.maximum.at(out, inverse, outputs)
        return records, out
    sums = np.zeros((len(records), *outputs.shape[1:]), np.float64)
    np.add.at(sums, inverse, outputs)
    counts = np.bincount(inverse, minlength=len(records)).reshape(-1, *([1] * (outputs.ndim - 1)))
    return records, (sums / counts).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Windowed:
    """Table.source of a sequence table whose rows are windows of its records."""

    records: Table  # the table as read, a row per record
    record: np.ndarray  # (R,) the record each row is a window of
    pool: str  # mean or max: how a record's output is made of its windows'


def windowed(table: Table, tok: Tokenizer, cfg: TableConfig, limit: int) -> Table:
    """The table's rows cut into windows (data.stride tokens of overlap), each with its record's target, weight,
    id and group (a record's windows stay in one fold)."""
    encs, record = text_windows(tok, table.texts, table.pairs, limit, cfg.stride, cfg.truncation)
    groups = table.groups or table.row_ids()
    pick = lambda values: None if values is None else [values[r] for r in record]  # noqa: E731
    return Table(
        path=table.path,
        texts=pick(table.texts),
        pairs=pick(table.pairs),
        targets=table.targets[record],
        labels=pick(table.labels),
        weights=table.weights[record],
        ids=pick(table.ids),
        groups=pick(groups),
        encs=encs,
        source=Windowed(table, record, cfg.window_pool),
    )


def records_of(table: Table) -> Table:
    """The table as read: a windowed table's records, else the table itself."""
    return table.source.records if isinstance(table.source, Windowed) else table


def record_of(table: Table) -> np.ndarray:
    """(R,) the record of each row of the table: its window's, or the row itself."""
    return table.source.record if isinstance(table.source, Windowed) else np.arange(len(table))


def outputs_of_records(table: Table, rows: np.ndarray, outputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The records of the table's `rows` ((D,), ascending) and their (D, L) outputs, from the rows' `outputs`:
    pooled over a record's windows, or the rows' own."""
    if not isinstance(table.source, Windowed):
        return rows, outputs
    return pool(outputs, table.source.record[rows], table.source.pool)
