"""What the two embedding tasks share: a table whose rows are N texts (an anchor, its positive and its hard
negatives; or two texts and their score), each text encoded alone, a row batched as (N, T) and embedded by the
model as (N, D). The validation outputs of a row are its N embeddings, flat (N * D)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from bertforge.data import tabular
from bertforge.data.batching import EncodedChoices
from bertforge.data.labelled import Table, TableConfig
from bertforge.errors import UserError
from bertforge.finetuning import tables
from bertforge.finetuning.columns import numbers
from bertforge.tokenizer.load import Encoded, Tokenizer


@dataclasses.dataclass(frozen=True)
class PairTexts:
    """A pair table's texts (Table.source): its columns, and each row's texts in their order."""

    columns: tuple[str, ...]
    texts: list[tuple[str, ...]]


def read(path: str, cfg: TableConfig, scored: bool) -> Table:
    """The rows of `path`: its text columns (text_columns) and with `scored` its score column. Targets (R, 4): the
    score (1 without one), 1 (a real row, not a batch's filler), the row's index, by which the metrics find its texts,
    and its positive's id (the first row with that text), by which the loss knows one passage found by several
    anchors."""
    columns, rows = tabular.read_table(path, quoted_tsv=cfg.quoted_tsv)
    if not rows:
        raise UserError(f"{path}: no rows")
    names, target = text_columns(path, columns, cfg, scored)
    texts = [tabular.text_column(path, columns, rows, c) for c in names]
    n = len(rows)
    score = tabular.numeric_column(path, columns, rows, target) if target else np.ones(n)
    first: dict[str, int] = {}
    positive = [first.setdefault(t, i) for i, t in enumerate(texts[1])]  # a passage's id: its first row
    targets = np.stack([score, np.ones(n), np.arange(n), positive], axis=1).astype(np.float32)
    teacher = teacher_scores(path, columns, rows, names)
    if teacher is not None:
        targets = np.concatenate([targets, teacher], axis=1)
    id_column = cfg.id_column or ("id" if "id" in columns else None)
    ids = tabular.plain_column(path, columns, rows, id_column) if id_column else None
    groups = tabular.plain_column(path, columns, rows, cfg.group_column) if cfg.group_column else None
    return Table(path, texts[0], texts[1], targets, None, np.ones(n, np.float32), ids, groups,
                 source=PairTexts(names, list(zip(*texts, strict=True))))  # fmt: skip


def teacher_scores(path: str, columns: Sequence[str], rows: list, names: Sequence[str]) -> np.ndarray | None:
    """(R, N - 1) a teacher's score of each row's candidates, from `score_<column>` beside each candidate column, or
    None when the table has none of them."""
    wanted = [f"score_{name}" for name in names[1:]]
    present = [c for c in wanted if c in columns]
    if not present:
        return None
    if len(present) < len(wanted):
        missing = ", ".join(c for c in wanted if c not in columns)
        raise UserError(f"{path}: teacher scores are given for some candidates only: no column {missing}")
    return np.stack([tabular.numeric_column(path, columns, rows, c) for c in wanted], axis=1)


def check_teacher(table: Table, loss: str) -> None:
    """A distillation loss (train/contrastive.py) learns from the teacher's score of every candidate of a row."""
    columns: tuple[str, ...] = table.source.columns
    if len(columns) < 3:
        raise UserError(f"{table.path}: head.loss={loss} compares each row's positive with its hard negatives: the "
                        "table has none")  # fmt: skip
    if table.targets.shape[1] < 3 + len(columns):
        wanted = ", ".join(f"score_{c}" for c in columns[1:])
        raise UserError(f"{table.path}: head.loss={loss} learns from a teacher's scores of each row's candidates: "
                        f"no columns {wanted}")  # fmt: skip


def text_columns(
    path: str, columns: Sequence[str], cfg: TableConfig, scored: bool
) -> tuple[tuple[str, ...], str | None]:
    """(a row's text columns in order, its score column or None): data.text_column, data.text_pair_column and
    data.negative_columns when a second text is named; else sentence-transformers' convention, by position: every
    column but the score's (data.target_columns[0], `label` or `score`), the id, the group and teachers' `score_*`,
    the first (or data.text_column where the table has it) the anchor, the next its positive, the rest negatives."""
    if cfg.text_pair_column or cfg.negative_columns:
        if not cfg.text_pair_column:
            raise UserError(f"{path}: negative columns name no positive: give --text-pair-column too")
        names = (cfg.text_column, cfg.text_pair_column, *cfg.negative_columns)
        if len(set(names)) < len(names):
            raise UserError(f"{path}: a column is named twice among the text columns ({', '.join(names)})")
        return names, cfg.target_columns[0] if scored else None
    target = next((c for c in (cfg.target_columns[0], "label", "score") if c in columns), None)
    id_column = cfg.id_column or ("id" if "id" in columns else None)
    skip = {target, id_column, cfg.group_column}
    texts = [c for c in columns if c not in skip and not c.startswith("score_")]
    if cfg.text_column in texts:
        texts.insert(0, texts.pop(texts.index(cfg.text_column)))
    if len(texts) < 2:
        first = "the first text" if scored else "the anchor (a query)"
        second = "the second" if scored else "its positive (the passage it should find)"
        raise UserError(f"{path}: no second text column (columns: {', '.join(columns)}): --text-column names {first}, "
                        f"--text-pair-column {second}, or give them as the table's first two columns")  # fmt: skip
    if scored and target is None:
        raise UserError(f"{path}: no score column: name it with --target-column (or call it label or score)")
    if scored and len(texts) > 2:
        raise UserError(f"{path}: a scored row is two texts; read by position, the table has {len(texts)} text columns"
                        f" ({', '.join(texts)}): name the two with --text-column and --text-pair-column")  # fmt: skip
    return tuple(texts), target if scored else None


def output_names(table: Table, cfg: TableConfig) -> list[str]:
    """A row's texts, by their columns."""
    return list(table.source.columns)


def rows(table: Table, tokenizer: Tokenizer, cfg: TableConfig, limit: int) -> Table:
    """Every text of every row encoded alone in at most `limit` tokens (cut as data.truncation says)."""
    texts: list[tuple[str, ...]] = table.source.texts
    n = len(table.source.columns)
    flat = tokenizer.encode_batch([t for row in texts for t in row], None, max_length=limit, truncation=cfg.truncation)
    table.encs = [EncodedChoices(tuple(flat[i * n : (i + 1) * n])) for i in range(len(texts))]
    return table


def embeddings(outputs: np.ndarray, names: Sequence[str]) -> np.ndarray:
    """(R, N * D) validation outputs -> (R, N, D)."""
    return np.asarray(outputs, np.float32).reshape(len(outputs), len(names), -1)


def cosines(emb: np.ndarray) -> np.ndarray:
    """(R, N, D) -> (R,) cosine similarity of each row's first two texts."""
    a, b = emb[:, 0].astype(np.float64), emb[:, 1].astype(np.float64)
    norms = np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
    return np.sum(a * b, axis=1) / norms


def run_info(table: Table, cfg: TableConfig) -> dict[str, Any]:
    return {"columns": list(table.source.columns)}


def strata(table: Table, bins: int) -> np.ndarray | None:
    return None


def column_names(labels: list[str], run: dict[str, Any]) -> list[str]:
    return list(run.get("columns", labels))


def prediction_columns(
    names: Sequence[str], outputs: np.ndarray, beside_truth: bool
) -> tuple[list[str], list[list[Any]]]:
    """The cosine similarity of each row's first two texts."""
    return ["cosine"], numbers(cosines(embeddings(outputs, names))[:, None])


def out_of_fold(table: Table, cfg: TableConfig, names: Sequence[str], rows: np.ndarray, outputs: np.ndarray,
                keys: Sequence[tuple[str, Sequence[Any]]]) -> tuple[list[str], list[list[Any]]]:  # fmt: skip
    """oof.csv: the keys, the score (1 for pairs without one) and the cosine of each row's first two texts."""
    truth = (["score"], numbers(table.targets[rows, :1]))
    return tables.prediction_table(prediction_columns, names, outputs, keys, truth)


def distinct_texts(rows: Sequence[EncodedChoices]) -> tuple[list[Encoded], np.ndarray]:
    """The distinct texts of rows of N encoded texts, each once (a passage that several anchors share is embedded
    once), and (R, N) the place of each row's texts among them."""
    place: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    texts: list[Encoded] = []
    index = np.zeros((len(rows), len(rows[0].options) if rows else 0), np.int64)
    for r, row in enumerate(rows):
        for n, e in enumerate(row.options):
            key = (tuple(e.ids), tuple(e.type_ids))
            if key not in place:
                place[key] = len(texts)
                texts.append(e)
            index[r, n] = place[key]
    return texts, index
