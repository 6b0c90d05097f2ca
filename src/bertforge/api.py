"""Notebook-friendly wrappers: a model may be given as a folder, a hub id, or an already loaded Pretrained."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from bertforge.model.hf import Pretrained, load_pretrained
from bertforge.tasks import infer


def _loaded(model: str | os.PathLike | Pretrained, head: str) -> Pretrained:
    if isinstance(model, Pretrained):
        return model
    return load_pretrained(model, head=head, require_head=True)


def fill_mask(
    model: str | os.PathLike | Pretrained, texts: str | Sequence[str], top_k: int = 5
) -> list[list[list[dict[str, Any]]]]:
    """For each text, for each [MASK] in it, the top_k {score, token, token_str, sequence}."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    return infer.fill_mask(_loaded(model, "mlm"), texts, top_k)


def predict(
    model: str | os.PathLike | Pretrained,
    texts: Sequence[str],
    pairs: Sequence[str] | None = None,
    batch_size: int = 32,
    max_length: int | None = None,
    truncation: str = "head",
) -> np.ndarray:
    """(N, num_labels) outputs of a sequence model; the same numbers `bertforge predict` writes."""
    return infer.predict_outputs(_loaded(model, "sequence"), texts, pairs, batch_size, max_length, truncation)
