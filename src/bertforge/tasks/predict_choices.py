"""`bertforge predict` with a multiple-choice model: for each question, the chosen choice's index and each choice's
probability (the softmax of the mean of a run's fold models' scores)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bertforge.data.choices import read_choices
from bertforge.data.tabular import write_csv
from bertforge.finetuning import multiple_choice
from bertforge.finetuning.tables import prediction_table
from bertforge.model.heads import ChoiceClassifier
from bertforge.model.hf import Pretrained
from bertforge.tasks.model_outputs import fold_mean_outputs, run_limit


def predict_choices(models: Sequence[Pretrained], settings: dict[str, Any], cfg: Any) -> np.ndarray:
    """Write cfg.out (infer.PredictConfig) for the questions in cfg.data; returns their (N, C) scores. The run's
    context column, length and truncation where none is given."""
    context = cfg.context_column or settings.get("context_column")
    records = read_choices(cfg.data, labelled=False, context=context)
    limit = run_limit(models, settings, cfg.max_length)
    truncation = cfg.truncation or settings.get("truncation") or "head"
    encs = multiple_choice.encode(records, models[0].tokenizer, limit, truncation)
    scores = fold_mean_outputs(models, ChoiceClassifier, "multiple-choice", encs, cfg.batch_size, limit)
    names = multiple_choice.names_of(scores.shape[1])
    keys = [("id", [r.id for r in records])]
    write_csv(cfg.out, *prediction_table(multiple_choice.prediction_columns, names, scores, keys))
    return scores
