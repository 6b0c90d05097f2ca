"""`bertforge predict` with a token-classification run (its fold models averaged) or folder: each text's entities
with their character offsets (JSONL), or for CoNLL input the same file with a predicted tag per token."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import fsspec
import numpy as np

from bertforge.data import windows
from bertforge.data.tagged import Document, data_format, read_documents
from bertforge.fileio import write_atomic_fs
from bertforge.finetuning import tokens
from bertforge.model.heads import TokenClassifier
from bertforge.model.hf import Pretrained
from bertforge.tasks.model_outputs import fold_mean_outputs, run_limit


def document_predictions(
    models: Sequence[Pretrained], docs: Sequence[Document], limit: int, stride: int, batch_size: int
) -> tuple[list[np.ndarray], list[windows.Units]]:  # fmt: skip
    """Each document's (U, L) unit outputs, the mean of `models`' (a run's folds share one tokenizer), and its
    units."""
    tok = models[0].tokenizer
    units = tokens.units_of(docs, tok)
    wins = [w for d, u in enumerate(units) for w in windows.document_windows(tok, u, None, d, limit, stride, False)]
    encs = [w.encoded for w in wins]
    mean = fold_mean_outputs(models, TokenClassifier, "token-classification", encs, batch_size, limit)
    by_doc = tokens.document_outputs(wins, units, len(tok.template.prefix), mean)
    return [by_doc[d] for d in range(len(docs))], units


def document_entities(
    models: Sequence[Pretrained], settings: dict[str, Any], docs: Sequence[Document], max_length: int | None,
    batch_size: int, stride: int | None = None,
) -> tuple[list[list[dict[str, Any]]], list[np.ndarray], list[windows.Units]]:  # fmt: skip
    """Each document's entities, (U, L) unit outputs and units; the run's length and stride where none is given."""
    stride = int(stride if stride is not None else settings.get("stride", 32))
    outputs, units = document_predictions(models, docs, run_limit(models, settings, max_length), stride, batch_size)
    names = models[0].label_names()
    found = [tokens.entities(d.text, u, o, names) for d, u, o in zip(docs, units, outputs, strict=True)]
    return found, outputs, units


def predict_tokens(models: Sequence[Pretrained], settings: dict[str, Any], cfg: Any) -> list[list[dict[str, Any]]]:
    """Write cfg.out for cfg.data (infer.PredictConfig); returns each document's entities."""
    docs = read_documents(cfg.data, cfg.format, labelled=False)
    found, outputs, units = document_entities(models, settings, docs, cfg.max_length, cfg.batch_size, cfg.stride)
    if data_format(cfg.data, cfg.format) == "conll":
        text = _conll(docs, units, outputs, models[0].label_names())
    else:
        text = "".join(json_line({"id": d.id, "entities": e}) for d, e in zip(docs, found, strict=True))
    fs, path = fsspec.core.url_to_fs(cfg.out)
    write_atomic_fs(fs, path, text.encode("utf-8"))
    return found


def json_line(record: dict[str, Any]) -> str:
    """A JSON line, with the characters that some readers take as line ends (str.splitlines) escaped."""
    line = json.dumps(record, ensure_ascii=False)
    return line.replace("\x85", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029") + "\n"


def _conll(docs: Sequence[Document], units: Sequence[windows.Units], outputs: Sequence[np.ndarray],
           names: Sequence[str]) -> str:  # fmt: skip
    """Each word and its predicted tag, tab-separated, a blank line after each text."""
    lines = []
    for doc, u, out in zip(docs, units, outputs, strict=True):
        covered = u.first_tokens() >= 0
        for (start, end), best, c in zip(doc.words or (), np.argmax(out, axis=-1), covered, strict=True):
            lines.append(f"{doc.text[start:end]}\t{names[best] if c else 'O'}")
        lines.append("")
    return "\n".join(lines) + "\n"
