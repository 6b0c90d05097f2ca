"""Inference: fill-mask with any masked-LM folder, and predictions of a sequence-classification folder."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence, Sized
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from bertforge.data import tabular
from bertforge.data.batching import bucket_length, pad_batch
from bertforge.data.labelled import LONG_TEXTS, WINDOW_POOLS, LongTextMode, WindowPool
from bertforge.data.long_text import pool, text_windows
from bertforge.errors import UserError
from bertforge.finetuning import task_of
from bertforge.finetuning.tables import prediction_table
from bertforge.model.heads import (
    ChoiceClassifier,
    Embedder,
    MaskedLM,
    SequenceClassifier,
    SpanClassifier,
    TokenClassifier,
)
from bertforge.model.hf import Pretrained
from bertforge.model.load import load_model, load_models
from bertforge.tasks.model_outputs import forward_of, outputs_by_length
from bertforge.tasks.predict_choices import predict_choices
from bertforge.tasks.predict_questions import predict_questions
from bertforge.tasks.predict_tokens import predict_tokens
from bertforge.tokenizer.load import TRUNCATIONS, Tokenizer, Truncation


# ------------------------------------------------------------------------------------------------------ fill-mask
@dataclasses.dataclass(frozen=True)
class FillMaskConfig:
    model: str  # Hugging Face folder or hub id of a masked-LM model
    texts: tuple[str, ...]  # texts with one or more [MASK]
    top_k: int = 5  # candidates shown for each mask


@nnx.jit
def _masked_probs(model: MaskedLM, ids, mask, types, rows, cols):
    hidden = model.encoder(ids, mask, types)  # (B, T, D)
    logits = model.logits_at(hidden[rows, cols])  # (M, V): only the masked positions
    return jax.nn.softmax(logits, axis=-1)


def fill_mask(pre: Pretrained, texts: Sequence[str], top_k: int = 5) -> list[list[list[dict[str, Any]]]]:
    """For each text, for each mask in it, the `top_k` tokens: {score, token, token_str, sequence}."""
    if not isinstance(pre.model, MaskedLM):
        raise UserError(f"{pre.folder}: not a masked-LM model")
    tok: Tokenizer = pre.tokenizer
    cfg = pre.model.config
    texts = [t.replace("[MASK]", tok.mask_token) for t in texts]  # "[MASK]" works for every model
    encs = tok.encode_batch(texts)
    for text, e in zip(texts, encs, strict=True):
        if tok.mask_id not in e.ids:
            raise UserError(f"no {tok.mask_token} in the text {text!r}")
        if len(e.ids) > cfg.max_seq_len:
            raise UserError(f"the text {text[:40]!r}... has {len(e.ids)} tokens; the model holds {cfg.max_seq_len}")
    batch = pad_batch(encs, tok.pad_id, bucket_length(max(len(e.ids) for e in encs), cfg.max_seq_len))
    rows, cols = np.nonzero(batch["input_ids"] == tok.mask_id)
    pre.model.eval()
    arrays = (jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "token_type_ids"))
    probs = np.asarray(_masked_probs(pre.model, *arrays, jnp.asarray(rows), jnp.asarray(cols)))
    k = min(top_k, probs.shape[-1])
    # SentencePiece-style tokenizers write a word's space as part of its piece: decoding the filled ids would put a
    # space before a piece that starts a word even where the text has none (Japanese, Chinese). Their filled
    # sentence is the text as given with the token put in place of the mask.
    in_place = tok.word_marks()["word_start"] == "\u2581"
    results: list[list[list[dict[str, Any]]]] = [[] for _ in texts]
    for m, (r, c) in enumerate(zip(rows, cols, strict=True)):
        top = np.argsort(-probs[m], kind="stable")[:k]
        ids = list(encs[r].ids)
        parts = texts[r].split(tok.mask_token)
        which = len(results[r])  # the how-manyth mask of its text
        options = []
        for tid in top:
            token_str = tok.decode([int(tid)], skip_special_tokens=False)
            if in_place:
                sequence = tok.mask_token.join(parts[: which + 1]) + token_str + tok.mask_token.join(parts[which + 1 :])
            else:
                filled = ids.copy()
                filled[c] = int(tid)
                sequence = tok.decode(filled, skip_special_tokens=True)
            options.append({"score": float(probs[m, tid]), "token": int(tid), "token_str": token_str,
                            "sequence": sequence})  # fmt: skip
        results[r].append(options)
    return results


def fill_mask_main(cfg: FillMaskConfig) -> list[list[list[dict[str, Any]]]]:
    if cfg.top_k < 1:
        raise UserError(f"--top-k must be at least 1, got {cfg.top_k}")
    pre = load_model(cfg.model, head="mlm", require_head=True)
    return fill_mask(pre, cfg.texts, cfg.top_k)


# ------------------------------------------------------------------------------------------------------ predict
@dataclasses.dataclass(frozen=True)
class PredictConfig:
    model: str  # a fine-tuning run (its folds averaged) or a model folder
    # CSV, TSV or JSONL; token classification: CoNLL, JSONL or JSON; QA: SQuAD JSON or question records; multiple
    # choice: a table with choice0..N-1 columns, or records with a 'choices' list.
    data: str
    out: str  # CSV to write; for a token-classification model JSONL (CoNLL for CoNLL input); QA: CSV or JSONL
    text_column: str | None = None  # the text, or a pair's first (default: the fine-tuning run's, else 'text')
    text_pair_column: str | None = None  # a pair's second text (default: the fine-tuning run's)
    id_column: str | None = None  # kept in the output; 'id' is kept when present and this is unset
    batch_size: int = 32  # texts per batch
    max_length: int | None = None  # tokens per text (default: the fine-tuning run's, else the model's)
    # A longer text keeps its start (head), its end (tail) or both (head+tail) (default: the fine-tuning run's, else
    # head).
    truncation: Truncation | None = None
    quoted_tsv: bool = False  # a .tsv table written with CSV quoting; by default a TSV has none and '"' is text
    format: str = ""  # a token-classification model's input: conll, jsonl or json (default: from the file name)
    n_best: int = 1  # a question-answering model's answers per question (a JSONL out lists them)
    # A text longer than max_length: truncate, or cut into windows whose outputs are pooled (default: the
    # fine-tuning run's, else truncate).
    long_text: LongTextMode | None = None
    window_pool: WindowPool | None = None  # windows' outputs pooled by mean or max (default: the run's, else mean)
    stride: int | None = None  # the tokens by which windows overlap (default: the run's, else 32)
    context_column: str | None = None  # a multiple-choice model's: a column read before each question

    def __post_init__(self) -> None:
        if self.truncation is not None and self.truncation not in TRUNCATIONS:
            raise ValueError(f"truncation {self.truncation!r} is not one of {', '.join(TRUNCATIONS)}")
        if self.long_text is not None and self.long_text not in LONG_TEXTS:
            raise ValueError(f"long_text {self.long_text!r} is not one of {', '.join(LONG_TEXTS)}")
        if self.window_pool is not None and self.window_pool not in WINDOW_POOLS:
            raise ValueError(f"window_pool {self.window_pool!r} is not one of {', '.join(WINDOW_POOLS)}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")


@dataclasses.dataclass(frozen=True)
class LongText:
    """What becomes of a text longer than the model's length at prediction (data.long_text and its options)."""

    truncation: str = "head"
    windows: bool = False  # windows overlapping by `stride` tokens instead of truncation, their outputs pooled
    pool: str = "mean"
    stride: int = 32


def predict_outputs(
    models: Pretrained | Sequence[Pretrained],
    texts: Sequence[str],
    pairs: Sequence[str] | None = None,
    batch_size: int = 32,
    max_length: int | None = None,
    truncation: str = "head",
    progress: bool = True,
    long_text: LongText | None = None,
) -> np.ndarray:
    """(N, L) float32 outputs of a sequence model (values for regression, logits otherwise); of several models
    (a fine-tuning run's folds), their mean. `long_text`, when given, replaces `truncation`."""
    models = [models] if isinstance(models, Pretrained) else list(models)
    how = long_text or LongText(truncation)
    outs = []
    # Several fold models each read every text: the bar says so, or 300 texts would count to 900.
    desc = "predict" if len(models) == 1 else f"predict ({len(models)} fold models x {len(texts)} texts)"
    bar = tqdm(total=len(models) * len(texts), desc=desc, unit="text", disable=not progress, file=sys.stderr)
    for pre in models:
        if not isinstance(pre.model, SequenceClassifier) or isinstance(pre.model, ChoiceClassifier):
            raise UserError(f"{pre.folder}: not a sequence-classification model")
        cfg = pre.model.config
        limit = min(max_length or cfg.max_seq_len, cfg.max_seq_len)
        tok = pre.tokenizer
        if how.windows:
            encs, record = text_windows(tok, texts, pairs, limit, how.stride, how.truncation)
        else:
            encs, record = tok.encode_batch(texts, pairs, max_length=limit, truncation=how.truncation), None
        pre.model.eval()
        forward = forward_of(pre.model)
        if record is None:
            outs.append(outputs_by_length(forward, encs, tok.pad_id, batch_size, limit, bar=bar))
        else:  # the bar counts texts, not windows
            outs.append(pool(outputs_by_length(forward, encs, tok.pad_id, batch_size, limit), record, how.pool)[1])
            bar.update(len(texts))
    bar.close()
    return np.mean(outs, axis=0).astype(np.float32)


def long_text_of(settings: dict[str, Any], given: dict[str, Any]) -> LongText:
    """How a run treats long texts: each of `given` (truncation, long_text, window_pool, stride) that is not None,
    else the fine-tuning run's (its run.json `settings`), else the defaults."""
    value = lambda key, default: next((v for v in (given.get(key), settings.get(key)) if v is not None), default)  # noqa: E731
    return LongText(
        truncation=value("truncation", "head"),
        windows=value("long_text", "truncate") == "windows",
        pool=value("window_pool", "mean"),
        stride=int(value("stride", 32)),
    )


def run_outputs(
    models: Sequence[Pretrained],
    settings: dict[str, Any],
    texts: Sequence[str],
    pairs: Sequence[str] | None,
    batch_size: int,
    max_length: int | None,
    truncation: str | None,
    **given: Any,
) -> np.ndarray:
    """predict_outputs of load_models' result: a fine-tuning run's length and its treatment of long texts where
    none is given (`given`: long_text, window_pool, stride)."""
    max_length = max_length or settings.get("max_length")
    how = long_text_of(settings, {"truncation": truncation, **given})
    return predict_outputs(models, texts, pairs, batch_size, max_length, how.truncation, long_text=how)


def predict_main(cfg: PredictConfig) -> Sized:
    """Write cfg.out; returns the predictions (a row of outputs, or a token model's entities, per text)."""
    models, settings = load_models(cfg.model)
    if isinstance(models[0].model, Embedder):
        raise UserError(f"{cfg.model}: an embedding model; `bertforge embed` writes its vectors")
    if isinstance(models[0].model, SpanClassifier):
        return predict_questions(models, settings, cfg)
    if isinstance(models[0].model, ChoiceClassifier):
        return predict_choices(models, settings, cfg)
    if isinstance(models[0].model, TokenClassifier):
        return predict_tokens(models, settings, cfg)
    columns, rows = tabular.read_table(cfg.data, quoted_tsv=cfg.quoted_tsv)
    if not rows:
        raise UserError(f"{cfg.data}: no rows")
    text_column = cfg.text_column or settings.get("text_column") or "text"
    pair_column = cfg.text_pair_column or settings.get("text_pair_column")
    texts = tabular.text_column(cfg.data, columns, rows, text_column)
    pairs = tabular.text_column(cfg.data, columns, rows, pair_column) if pair_column else None
    given = {"long_text": cfg.long_text, "window_pool": cfg.window_pool, "stride": cfg.stride}
    outputs = run_outputs(models, settings, texts, pairs, cfg.batch_size, cfg.max_length, cfg.truncation, **given)
    id_column = cfg.id_column or ("id" if "id" in columns else None)
    if id_column is not None and id_column not in columns:
        raise UserError(f"{cfg.data}: no column '{id_column}' (columns: {', '.join(columns)})")
    first = models[0]
    task = task_of(settings, first.model.num_labels)
    names = task.column_names(first.label_names(), settings)
    keys = [(id_column, [row.get(id_column) for row in rows])] if id_column else []
    tabular.write_csv(cfg.out, *prediction_table(task.prediction_columns, names, outputs, keys))
    return outputs
