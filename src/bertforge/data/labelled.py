"""A labelled table for fine-tuning: texts (or text pairs) with targets, read from CSV, TSV, JSONL or Parquet and
checked value by value, so that a bad row is named before anything trains."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

import numpy as np

from bertforge.data import tabular
from bertforge.data.batching import POOL, Row
from bertforge.errors import UserError
from bertforge.tokenizer.load import TRUNCATIONS, Truncation

LongTextMode = Literal["truncate", "windows"]  # data.long_text: what becomes of a text longer than max_length
WindowPool = Literal["mean", "max"]  # data.window_pool: how a text's output is made of its windows'
LONG_TEXTS: tuple[str, ...] = get_args(LongTextMode)
WINDOW_POOLS: tuple[str, ...] = get_args(WindowPool)


@dataclasses.dataclass(frozen=True)
class TableConfig:
    train: str = ""  # training table: CSV, TSV, JSONL or Parquet, local or fsspec URL
    valid: str = ""  # a separate validation table instead of folds
    text_column: str = "text"  # the text, or a pair's first
    text_pair_column: str | None = None  # a pair's second text, encoded with the first
    target_columns: tuple[str, ...] = ("target",)  # one per output; several 0/1 columns for multilabel
    id_column: str | None = None  # each row's id, kept in the predictions (default: 'id' when the table has it)
    group_column: str | None = None  # rows sharing a value stay in one fold
    error_column: str | None = None  # standard error of the target: rows weighted by 1 / error^2
    max_length: int = 256  # tokens per text
    truncation: Truncation = "head"  # a longer text keeps its start (head), its end (tail) or both (head+tail)
    bucket: int = 8  # padded lengths are multiples of this; 0 pads every batch to max_length
    shapes: int = 6  # at most this many padded lengths, chosen from the training texts; 0: every multiple of bucket
    # Training batches per pool of shuffled rows sorted by length (batching.epoch_batches): a batch holds texts of
    # similar length. 1: plain random batches, each still padded to the shortest length that holds it. Packed, the
    # pool's batches are balanced to about equal tokens instead (batching.balanced_batches).
    pool: int = POOL
    # On every family but DeBERTa: several texts packed into each row, attending within each (packed_batches.py):
    # one compiled shape for training and one for evaluation. None (auto): where it is exact, and on a CPU only where
    # it computes at most 5% more than the ladder's padded batches; true: wherever it is exact (else an error);
    # false: never.
    pack: bool | None = None
    quoted_tsv: bool = False  # .tsv tables written with CSV quoting; by default a TSV has none and '"' is text
    format: str = ""  # token classification: the files' format, conll, jsonl or json (default: from the file name)
    # Token classification: the tag scheme trained, io, bio or bioes (default: the data's own; bio for spans).
    tag_scheme: str = ""
    label_all_tokens: bool = False  # token classification: every sub-token of a word takes its label in the loss
    stride: int = 32  # the tokens by which a long text's windows overlap (entities, questions, long_text=windows)
    # Regression and classification: a text longer than max_length is truncated (as `truncation` says), or cut
    # into windows overlapping by `stride` tokens whose outputs are pooled (window_pool).
    long_text: LongTextMode = "truncate"
    window_pool: WindowPool = "mean"  # long_text=windows: the windows' outputs pooled by mean or max
    max_question_length: int = 64  # question answering: the question's tokens kept in each window (the rest cut)
    max_answer_length: int = 30  # question answering: the longest answer, in tokens
    # Question answering with questions that have no answer (SQuAD v2.0): by how much the null answer must beat
    # the best span.
    null_threshold: float = 0.0
    # Multiple choice: a column read before each question as its context (run_swag's first sentence).
    context_column: str | None = None
    # Embedding: the columns of each anchor's hard negatives (text_column is the anchor, text_pair_column its
    # positive; for similarity the two texts, target_columns[0] their score).
    negative_columns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.truncation not in TRUNCATIONS:
            raise ValueError(f"truncation {self.truncation!r} is not one of {', '.join(TRUNCATIONS)}")
        if not self.target_columns:
            raise ValueError("target_columns is empty")
        if self.tag_scheme not in ("", "io", "bio", "bioes"):
            raise ValueError(f"tag_scheme {self.tag_scheme!r} is not one of io, bio, bioes")
        if self.long_text not in LONG_TEXTS:
            raise ValueError(f"long_text {self.long_text!r} is not one of {', '.join(LONG_TEXTS)}")
        if self.window_pool not in WINDOW_POOLS:
            raise ValueError(f"window_pool {self.window_pool!r} is not one of {', '.join(WINDOW_POOLS)}")
        if self.stride < 0:
            raise ValueError(f"stride must be at least 0, got {self.stride}")
        if self.max_question_length < 1 or self.max_answer_length < 1:
            raise ValueError("max_question_length and max_answer_length must be at least 1")
        if self.max_length < 2 or self.bucket < 0 or self.shapes < 0 or self.pool < 1:
            raise ValueError("max_length must be at least 2, bucket and shapes at least 0, pool at least 1")


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
    encs: list[Row] | None = None  # each row's tokens, once a task's rows() has encoded them
    source: Any = None  # what a task's rows came from, when a row is not a record of the file (a document's window)

    def __len__(self) -> int:
        return len(self.texts)

    def row_ids(self) -> list[str]:
        """The id column's values, or row numbers from 0 when the table has none."""
        return self.ids or [str(i) for i in range(len(self))]


# A task's reader of its targets (finetuning.FinetuneTask.read_targets): (path, columns, rows, cfg, classes) ->
# (targets, each row's label as written or None).
TargetReader = Callable[
    [str, list[str], list[dict[str, Any]], TableConfig, Sequence[str] | None], tuple[np.ndarray, list[str] | None]
]


def read_table(path: str, cfg: TableConfig, read_targets: TargetReader, classes: Sequence[str] | None = None) -> Table:
    """A training or validation table with every value checked; errors name the file, row and column. A task's
    `read_targets` reads its targets; a validation table takes the training table's `classes` (output names)."""
    columns, rows = tabular.read_table(path, quoted_tsv=cfg.quoted_tsv)
    if not rows:
        raise UserError(f"{path}: no rows")
    texts = tabular.text_column(path, columns, rows, cfg.text_column)
    pairs = tabular.text_column(path, columns, rows, cfg.text_pair_column) if cfg.text_pair_column else None
    targets, labels = read_targets(path, columns, rows, cfg, classes)
    weights = np.ones(len(rows), np.float32)
    if cfg.error_column:
        errors = tabular.numeric_column(path, columns, rows, cfg.error_column)
        if np.any(errors < 0):
            raise UserError(f"{path}: row {int(np.argmax(errors < 0)) + 1}: column '{cfg.error_column}' is negative")
        floor = errors[errors > 0].min() if np.any(errors > 0) else 1.0
        inverse = 1.0 / np.maximum(errors, floor) ** 2  # an error of 0 (an anchor row) counts like the smallest
        weights = (inverse / inverse.mean()).astype(np.float32)
    id_column = cfg.id_column or ("id" if "id" in columns else None)
    ids = tabular.plain_column(path, columns, rows, id_column) if id_column else None
    groups = tabular.plain_column(path, columns, rows, cfg.group_column) if cfg.group_column else None
    return Table(path, texts, pairs, targets, labels, weights, ids, groups)


def sorted_classes(labels: Sequence[str]) -> list[str]:
    """The classes in `labels`, in numeric order when they are all numbers."""
    unique = sorted(set(labels))
    try:
        return sorted(unique, key=float)
    except ValueError:
        return unique
