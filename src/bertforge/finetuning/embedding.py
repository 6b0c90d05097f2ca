"""Embedding models for search: pairs of an anchor (a query) and its positive (the passage it should find), with
optional hard negatives, trained with multiple-negatives ranking over the batch (every other row's positive and
negatives are the anchor's negatives) and chosen by nDCG@10 of retrieving each validation anchor's positive among
all the validation rows' positives and negatives. The model is a sentence-transformers folder."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bertforge.data.labelled import Table, TableConfig
from bertforge.finetuning import pairs
from bertforge.finetuning.pairs import (  # noqa: F401 (what both embedding tasks do alike)
    column_names,
    out_of_fold,
    output_names,
    prediction_columns,
    rows,
    run_info,
    strata,
)
from bertforge.train.retrieval import retrieval_scores

NAME = "embedding"
HEAD = "embedding"
PIPELINE_TAG = "sentence-similarity"
AUTO_CLASS = "AutoModel"
DESCRIPTION = "sentence-embedding model"
DEFAULT_LOSS = "mnrl"
LOSSES = ("mnrl", "margin_mse", "kl")  # the last two distil a teacher's scores (score_* columns)
DEFAULT_METRIC = "ndcg@10"


def read(path: str, cfg: TableConfig, known: Sequence[str] | None) -> Table:
    return pairs.read(path, cfg, scored=False)


def scores(outputs: np.ndarray, targets: np.ndarray, names: Sequence[str], source: Any = None) -> dict[str, float]:
    """Retrieval of each row's positive by its anchor, from the distinct texts of the rows' positives and
    negatives (a passage that several anchors share is one document, relevant to each of them)."""
    emb = pairs.embeddings(outputs, names)
    texts: list[tuple[str, ...]] = [source.texts[int(i)] for i in targets[:, 2]]
    doc_of: dict[str, int] = {}
    for row in texts:
        for t in row[1:]:
            doc_of.setdefault(t, len(doc_of))
    docs = np.zeros((len(doc_of), emb.shape[2]), np.float32)
    for r, row in enumerate(texts):
        for j, t in enumerate(row[1:], start=1):
            docs[doc_of[t]] = emb[r, j]
    relevant = [{doc_of[row[1]]: 1.0} for row in texts]
    return retrieval_scores(emb[:, 0], docs, relevant, [str(i) for i in range(len(docs))])
