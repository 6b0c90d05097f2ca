"""`bertforge mine`: hard negatives for each query of a table of (query, positive) pairs, found by an embedding model
over the table's passages and an optional corpus (data/hard_negatives.py), written as a table that `finetune --task
embedding` reads: the query, its positive, negative_1..K and, with --scores, the model's score of each candidate
(score_<column>, what the distillation losses learn from)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from bertforge.data import tabular
from bertforge.data.hard_negatives import NONE, Margins, mine, unit
from bertforge.data.labelled import TableConfig
from bertforge.errors import UserError
from bertforge.finetuning import pairs
from bertforge.tasks.embed import embed, load_embedder


@dataclasses.dataclass(frozen=True)
class MineConfig:
    model: str  # an embedding model: a sentence-transformers or Hugging Face folder, hub id, or embedding run
    data: str  # a table of (query, positive) pairs: CSV, TSV, JSONL or Parquet
    out: str  # the table with the negatives (.csv)
    negatives: int = 3  # negatives per query; a row whose query has fewer candidates left is dropped
    corpus: str | None = None  # a table of more passages to draw negatives from (its corpus_column)
    corpus_column: str = "text"  # the corpus table's column of passages
    text_column: str = "text"  # the queries' column (without text_pair_column: the first column, unless it is here)
    text_pair_column: str | None = None  # the positives' column (default: the second column, by position)
    margin: float | None = None  # absolute: a negative scores at least this much below the positive
    relative_margin: float | None = None  # a negative scores at most the positive's score x (1 - this) (positive)
    scores: bool = False  # also write score_<column> of the positive and each negative (the model's cosine)
    batch_size: int = 64  # texts per batch when embedding
    max_length: int | None = None  # tokens per text (default: the fine-tuning run's, else the model's)
    block: int = 1024  # queries searched at once
    precision: str = "float16"  # of the corpus's vectors on the devices: float16 (half the memory) or float32

    def __post_init__(self) -> None:
        if self.negatives < 1:
            raise ValueError(f"negatives must be at least 1, got {self.negatives}")
        if (self.margin is not None and self.margin < 0) or (self.relative_margin is not None and not
                                                             0 <= self.relative_margin < 1):  # fmt: skip
            raise ValueError("margin must be at least 0 and relative_margin in [0, 1)")
        if self.precision not in ("float16", "float32"):
            raise ValueError(f"precision {self.precision!r} is not float16 or float32")
        if not self.out.endswith(".csv"):
            raise ValueError(f"out {self.out!r}: mine writes a .csv table")


@dataclasses.dataclass(frozen=True)
class Mined:
    columns: list[str]
    rows: list[list[Any]]
    dropped: int  # rows whose query had fewer than K candidates left


def mined_table(cfg: MineConfig) -> Mined:
    """The rows of cfg.data with their negatives (and scores)."""
    table = pairs.read(cfg.data, TableConfig(text_column=cfg.text_column, text_pair_column=cfg.text_pair_column),
                       scored=False)  # fmt: skip
    anchor, positive = table.source.columns[:2]
    texts = [(row[0], row[1]) for row in table.source.texts]
    corpus = list(dict.fromkeys([p for _, p in texts] + _corpus(cfg)))
    at = {t: i for i, t in enumerate(corpus)}
    queries = list(dict.fromkeys(q for q, _ in texts))
    of_query: dict[str, list[int]] = {q: [] for q in queries}
    for q, p in texts:
        if at[p] not in of_query[q]:
            of_query[q].append(at[p])
    pre, settings = load_embedder(cfg.model)
    length = cfg.max_length or settings.get("max_length")
    q_vec = embed(pre, queries, cfg.batch_size, length, progress=True)
    c_vec = embed(pre, corpus, cfg.batch_size, length, progress=True)
    margins = Margins(cfg.margin, cfg.relative_margin)
    own = [at.get(q, NONE) for q in queries]
    index, _, _ = mine(q_vec, c_vec, [of_query[q] for q in queries], own, cfg.negatives, margins, cfg.block,
                       cfg.precision)  # fmt: skip
    row_of = {q: i for i, q in enumerate(queries)}
    names = [f"negative_{j + 1}" for j in range(cfg.negatives)]
    columns = (["id"] if table.ids is not None else []) + [anchor, positive, *names]
    if cfg.scores:
        columns += [f"score_{positive}", *(f"score_{n}" for n in names)]
    rows, dropped = [], 0
    unit_q, unit_c = unit(q_vec), unit(c_vec)
    for r, (q, p) in enumerate(texts):
        i = row_of[q]
        if index.shape[1] < cfg.negatives or np.any(index[i] == NONE):
            dropped += 1
            continue
        row = ([table.ids[r]] if table.ids is not None else []) + [q, p, *(corpus[j] for j in index[i])]
        if cfg.scores:
            row += [f"{float(unit_q[i] @ unit_c[j]):.7g}" for j in (at[p], *index[i])]
        rows.append(row)
    return Mined(columns, rows, dropped)


def _corpus(cfg: MineConfig) -> list[str]:
    if not cfg.corpus:
        return []
    columns, rows = tabular.read_table(cfg.corpus)
    if not rows:
        raise UserError(f"{cfg.corpus}: no rows")
    return tabular.text_column(cfg.corpus, columns, rows, cfg.corpus_column)


def main(cfg: MineConfig) -> Mined:
    """Write cfg.out; returns what it holds."""
    found = mined_table(cfg)
    if not found.rows:
        raise UserError(f"{cfg.data}: no query has {cfg.negatives} candidates left after the margins; lower "
                        "--negatives, --margin or --relative-margin, or give a larger --corpus")  # fmt: skip
    tabular.write_csv(cfg.out, found.columns, found.rows)
    return found
