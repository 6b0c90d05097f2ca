"""Notebook-friendly wrappers: a model may be given as a folder, a hub id, a run, or an already loaded Pretrained;
a config as the frozen dataclass, a plain dict (as in the YAML files) or a YAML path."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bertforge import runs
from bertforge.data.tagged import Document
from bertforge.model.hf import Pretrained
from bertforge.model.load import load_model, load_models
from bertforge.tasks import infer
from bertforge.tasks.predict_tokens import document_entities


def _loaded(model: str | os.PathLike | Pretrained, head: str) -> Pretrained:
    if isinstance(model, Pretrained):
        return model
    return load_model(model, head=head, require_head=True)


def _config(cls: type, cfg: Any, overrides: Mapping[str, Any]) -> Any:
    from bertforge.config import deep_merge, from_dict, read_yaml, to_dict

    if isinstance(cfg, (str, Path)):
        data = read_yaml(cfg)
    elif isinstance(cfg, cls):
        data = to_dict(cfg)
    else:
        data = dict(cfg or {})
    return from_dict(cls, deep_merge(data, overrides))


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
    truncation: str | None = None,
    long_text: str | None = None,
    window_pool: str | None = None,
    stride: int | None = None,
) -> np.ndarray:
    """(N, num_labels) outputs of a sequence model, or the mean over a fine-tuning run's folds: the numbers
    `bertforge predict` writes. A text longer than max_length is truncated, or with long_text='windows' cut into
    windows overlapping by `stride` tokens whose outputs are pooled by `window_pool` (mean or max); each option
    not given is the fine-tuning run's."""
    if isinstance(model, Pretrained):
        models, settings = [model], {}
    else:
        models, settings = load_models(str(model))
    given = {"long_text": long_text, "window_pool": window_pool, "stride": stride}
    return infer.run_outputs(models, settings, list(texts), pairs, batch_size, max_length, truncation, **given)


def entities(
    model: str | os.PathLike | Pretrained,
    texts: Sequence[str],
    batch_size: int = 32,
    max_length: int | None = None,
) -> list[list[dict[str, Any]]]:
    """Each text's entities by a token-classification run (its folds averaged) or folder: {start, end, type, text,
    score} with character offsets into the text, as `bertforge predict` writes them."""
    if isinstance(model, Pretrained):
        models, settings = [model], {}
    else:
        models, settings = load_models(str(model))
    docs = [Document(str(i), t, None, None, None) for i, t in enumerate(texts)]
    found, _, _ = document_entities(models, settings, docs, max_length, batch_size)
    return found


def embed(
    model: str | os.PathLike | Pretrained,
    texts: Sequence[str],
    batch_size: int = 64,
    max_length: int | None = None,
    dtype: str | None = None,
) -> np.ndarray:
    """(N, D) float32 vectors of `texts` by an embedding model (a sentence-transformers folder, an embedding
    fine-tuning run of one fold) or any encoder (the mean of its tokens), as `bertforge embed` writes them;
    dtype='bfloat16' computes in bfloat16."""
    from bertforge.tasks import embed as task

    if isinstance(model, Pretrained):
        pre, settings = model, {}
    else:
        pre, settings = task.load_embedder(str(model), dtype)
    return task.embed(pre, list(texts), batch_size, max_length or settings.get("max_length"))


def labels(model: str | os.PathLike | Pretrained) -> list[str]:
    """The names of predict's output columns: class names, or target names for regression."""
    if not isinstance(model, Pretrained):
        found = runs.fold_models(str(model))
        if found is not None:
            return list(found[1]["labels"])
        model = load_model(model, head="sequence", require_head=True)
    return model.label_names()


def evaluate(model: str | os.PathLike, data: str | os.PathLike, **options: Any) -> dict[str, Any]:
    """A fine-tuning run's or folder's metrics on labelled data, as `bertforge evaluate` gives them; `options` are
    its flags' fields (text_column="t", target_columns=("label",), max_length=128, out="metrics.json", ...)."""
    from bertforge.tasks import evaluate as task

    return task.main(task.EvaluateConfig(model=str(model), data=str(data), **options))


def finetune(cfg: Any = None, out: str | os.PathLike = "finetune-run", **overrides: Any) -> dict[str, Any]:
    """Fine-tune as `bertforge finetune` does; returns the summary. Keyword arguments override config sections,
    e.g. finetune("configs/finetune/commonlit-minilm.yaml", out="run", model="my-model", train={"epochs": 1})."""
    from bertforge.tasks import finetune as task

    return task.main(_config(task.FinetuneConfig, cfg, overrides), str(out))


def pretrain(cfg: Any = None, out: str | os.PathLike = "pretrain-run", **overrides: Any) -> dict[str, Any]:
    """Pretrain as `bertforge pretrain` does; returns the last logged metrics. Keyword arguments override config
    sections, e.g. pretrain("configs/pretrain/mini.yaml", out="run", data={"shards": "shards/"})."""
    from bertforge.tasks import pretrain as task

    return task.main(_config(task.PretrainConfig, cfg, overrides), str(out))
