"""Inference: fill-mask with any masked-LM folder, and predictions of a sequence-classification folder."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from bertforge.data import tabular
from bertforge.errors import UserError
from bertforge.model.bert import MaskedLM, SequenceClassifier
from bertforge.model.hf import Pretrained, load_pretrained
from bertforge.tokenizer import TRUNCATIONS, BertTokenizer, Encoded

BUCKET = 32  # pad batches to a multiple of this, so only a few shapes are ever compiled


def pad_batch(encs: Sequence[Encoded], pad_id: int, length: int) -> dict[str, np.ndarray]:
    """Right-pad encodings to `length`: input_ids, attention_mask, token_type_ids, each (B, T) int32."""
    b = len(encs)
    ids = np.full((b, length), pad_id, np.int32)
    mask = np.zeros((b, length), np.int32)
    types = np.zeros((b, length), np.int32)
    for i, e in enumerate(encs):
        n = len(e.ids)
        ids[i, :n], mask[i, :n], types[i, :n] = e.ids, 1, e.type_ids
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def bucket_length(n: int, limit: int, bucket: int = BUCKET) -> int:
    return min(limit, -(-n // bucket) * bucket)


# ------------------------------------------------------------------------------------------------------ fill-mask
@dataclasses.dataclass(frozen=True)
class FillMaskConfig:
    model: str
    texts: tuple[str, ...]
    top_k: int = 5


@nnx.jit
def _masked_probs(model: MaskedLM, ids, mask, types, rows, cols):
    hidden = model.encoder(ids, mask, types)  # (B, T, D)
    logits = model.logits_at(hidden[rows, cols])  # (M, V): only the masked positions
    return jax.nn.softmax(logits, axis=-1)


def fill_mask(pre: Pretrained, texts: Sequence[str], top_k: int = 5) -> list[list[list[dict[str, Any]]]]:
    """For each text, for each mask in it, the `top_k` tokens: {score, token, token_str, sequence}."""
    if not isinstance(pre.model, MaskedLM):
        raise UserError(f"{pre.folder}: not a masked-LM model")
    tok: BertTokenizer = pre.tokenizer
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
    results: list[list[list[dict[str, Any]]]] = [[] for _ in texts]
    for m, (r, c) in enumerate(zip(rows, cols, strict=True)):
        top = np.argsort(-probs[m], kind="stable")[:k]
        ids = list(encs[r].ids)
        options = []
        for tid in top:
            filled = ids.copy()
            filled[c] = int(tid)
            options.append(
                {
                    "score": float(probs[m, tid]),
                    "token": int(tid),
                    "token_str": tok.decode([int(tid)], skip_special_tokens=False),
                    "sequence": tok.decode(filled, skip_special_tokens=True),
                }
            )
        results[r].append(options)
    return results


def fill_mask_main(cfg: FillMaskConfig) -> list[list[list[dict[str, Any]]]]:
    if cfg.top_k < 1:
        raise UserError(f"--top-k must be at least 1, got {cfg.top_k}")
    pre = load_pretrained(cfg.model, head="mlm", require_head=True)
    return fill_mask(pre, cfg.texts, cfg.top_k)


# ------------------------------------------------------------------------------------------------------ predict
@dataclasses.dataclass(frozen=True)
class PredictConfig:
    model: str
    data: str
    out: str
    text_column: str = "text"
    text_pair_column: str | None = None
    id_column: str | None = None  # kept in the output; 'id' is kept when present and this is unset
    batch_size: int = 32
    max_length: int | None = None
    truncation: str = "head"

    def __post_init__(self) -> None:
        if self.truncation not in TRUNCATIONS:
            raise ValueError(f"truncation {self.truncation!r} is not one of {', '.join(TRUNCATIONS)}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")


@nnx.jit
def _sequence_outputs(model: SequenceClassifier, ids, mask, types):
    return model(ids, mask, types)


def predict_outputs(
    pre: Pretrained,
    texts: Sequence[str],
    pairs: Sequence[str] | None = None,
    batch_size: int = 32,
    max_length: int | None = None,
    truncation: str = "head",
    progress: bool = True,
) -> np.ndarray:
    """(N, L) float32 outputs of a sequence model: values for regression (L == 1), logits otherwise.

    Texts are sorted by length and batched with little padding; outputs come back in input order.
    """
    if not isinstance(pre.model, SequenceClassifier):
        raise UserError(f"{pre.folder}: not a sequence-classification model")
    cfg = pre.model.config
    limit = min(max_length or cfg.max_seq_len, cfg.max_seq_len)
    encs = pre.tokenizer.encode_batch(texts, pairs, max_length=limit, truncation=truncation)
    order = np.argsort([-len(e.ids) for e in encs], kind="stable")  # longest first: a memory error shows at once
    pre.model.eval()
    out = np.zeros((len(encs), pre.model.num_labels), np.float32)
    bar = tqdm(total=len(encs), desc="predict", unit="text", disable=not progress, file=sys.stderr)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        chunk = [encs[i] for i in idx]
        batch = pad_batch(chunk, pre.tokenizer.pad_id, bucket_length(max(len(e.ids) for e in chunk), limit))
        out[idx] = np.asarray(_sequence_outputs(pre.model, *(jnp.asarray(v) for v in batch.values())))
        bar.update(len(idx))
    bar.close()
    return out


def predict_main(cfg: PredictConfig) -> np.ndarray:
    pre = load_pretrained(cfg.model, head="sequence", require_head=True)
    columns, rows = tabular.read_table(cfg.data)
    if not rows:
        raise UserError(f"{cfg.data}: no rows")
    texts = tabular.text_column(cfg.data, columns, rows, cfg.text_column)
    pairs = tabular.text_column(cfg.data, columns, rows, cfg.text_pair_column) if cfg.text_pair_column else None
    outputs = predict_outputs(pre, texts, pairs, cfg.batch_size, cfg.max_length, cfg.truncation)
    id_column = cfg.id_column or ("id" if "id" in columns else None)
    if id_column is not None and id_column not in columns:
        raise UserError(f"{cfg.data}: no column '{id_column}' (columns: {', '.join(columns)})")
    ids = [[row.get(id_column)] for row in rows] if id_column else [[] for _ in rows]
    if pre.model.num_labels == 1:
        header = [*([id_column] if id_column else []), "prediction"]
        body = [[*i, f"{o[0]:.7g}"] for i, o in zip(ids, outputs, strict=True)]
    else:
        labels = [pre.id2label.get(j, str(j)) for j in range(pre.model.num_labels)]
        header = [*([id_column] if id_column else []), "label", *(f"logit_{name}" for name in labels)]
        body = [[*i, labels[int(np.argmax(o))], *(f"{x:.7g}" for x in o)] for i, o in zip(ids, outputs, strict=True)]
    tabular.write_csv(cfg.out, header, body)
    return outputs
