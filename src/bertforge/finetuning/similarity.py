"""Embedding models for semantic similarity: pairs of texts with a score (STS), trained with CoSENT (the pairs of
the batch ranked by their cosine as their scores rank them) and chosen by the Spearman correlation of the cosine
with the score. The model is a sentence-transformers folder."""

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
from bertforge.train import metrics

NAME = "similarity"
HEAD = "embedding"
PIPELINE_TAG = "sentence-similarity"
AUTO_CLASS = "AutoModel"
DESCRIPTION = "sentence-embedding model"
DEFAULT_LOSS = "cosent"
LOSSES = ("cosent",)
DEFAULT_METRIC = "spearman"


def read(path: str, cfg: TableConfig, known: Sequence[str] | None) -> Table:
    return pairs.read(path, cfg, scored=True)


def scores(outputs: np.ndarray, targets: np.ndarray, names: Sequence[str], source: Any = None) -> dict[str, float]:
    """Spearman's and Pearson's correlation of each pair's cosine with its score."""
    found = metrics.regression(pairs.cosines(pairs.embeddings(outputs, names)), targets[:, 0])
    return {"spearman": found["spearman"], "pearson": found["pearson"]}
