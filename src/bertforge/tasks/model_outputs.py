"""A model's outputs over many encoded texts, batched by length so that each padded length compiles once: what
evaluation during fine-tuning and every prediction share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bertforge.data.batching import BUCKET, Row, by_length, pad_batch, padded_length, tokens_of
from bertforge.data.text_packing import PACKED_INPUTS
from bertforge.errors import UserError
from bertforge.model.hf import Pretrained

INPUTS = ("input_ids", "attention_mask", "token_type_ids")  # a batch's keys that a model's forward takes


@nnx.jit
def _head_outputs(model: nnx.Module, ids, mask, types):
    return model(ids, mask, types)


def forward_of(model: nnx.Module) -> Callable[[dict[str, Any]], Any]:
    """batch -> the outputs of a sequence or token model (put in eval mode by the caller), jitted."""
    return lambda batch: _head_outputs(model, *(jnp.asarray(batch[k]) for k in INPUTS))


@nnx.jit
def _packed_outputs(model: nnx.Module, *inputs: jax.Array) -> jax.Array:
    return model.packed(*inputs)


def packed_forward_of(model: nnx.Module) -> Callable[[dict[str, Any]], Any]:
    """A packed batch (data/text_packing.py) -> each text's outputs, of a model with a packed form (eval mode set
    by the caller), jitted."""
    return lambda batch: _packed_outputs(model, *(jnp.asarray(batch[k]) for k in PACKED_INPUTS))


def outputs_by_length(
    forward: Callable[[dict[str, Any]], Any],
    encs: Sequence[Row],
    pad_id: int,
    batch_size: int,
    limit: int,
    bucket: int = BUCKET,
    bar: Any = None,
    rungs: tuple[int, ...] = (),
) -> np.ndarray:
    """forward(batch) -> (B, L) over all encodings, in input order; a token model's (B, T, L) as (N, limit, L); a
    multiple-choice model's (B, N) over its rows (batching.EncodedChoices).

    Texts are sorted by length, longest first, and batched with little padding; every batch has `batch_size` rows
    (the last is filled with padding rows), so a model compiles once per padded length: the shortest of `rungs`
    that holds the batch, else a multiple of `bucket`. `bar`, a tqdm progress bar, advances by the texts done.
    """
    out: np.ndarray | None = None
    for idx in by_length(np.array([tokens_of(e) for e in encs]), batch_size):
        chunk = [encs[i] for i in idx]
        length = padded_length(max(tokens_of(e) for e in chunk), limit, bucket, rungs)
        batch = pad_batch(chunk, pad_id, length, batch_size)
        values = np.asarray(forward(batch))[: len(idx)]
        if out is None:  # token outputs (B, T, L) are kept at `limit` tokens, the rest zeros
            out = np.zeros((len(encs), *((limit,) if values.ndim == 3 else ()), values.shape[-1]), np.float32)
        out[idx, ...] = values if values.ndim == 2 else np.pad(values, ((0, 0), (0, limit - length), (0, 0)))
        if bar is not None:
            bar.update(len(idx))
    assert out is not None
    return out


def run_limit(models: Sequence[Pretrained], settings: dict[str, Any], max_length: int | None) -> int:
    """The tokens per row of a prediction: `max_length`, else the fine-tuning run's (run.json `settings`), else the
    model's, never more than the model holds."""
    max_seq_len = models[0].model.config.max_seq_len
    return min(max_length or settings.get("max_length") or max_seq_len, max_seq_len)


def fold_mean_outputs(
    models: Sequence[Pretrained], kind: type, what: str, encs: Sequence[Row], batch_size: int, limit: int
) -> np.ndarray:
    """The mean of `models`' outputs over `encs` (a run's fold models, which share one tokenizer), each model
    checked to be a `kind` model; a model of another kind is an error naming it as not a `what` model."""
    total: np.ndarray | None = None
    pad_id = models[0].tokenizer.pad_id
    for pre in models:
        if not isinstance(pre.model, kind):
            raise UserError(f"{pre.folder}: not a {what} model")
        pre.model.eval()
        out = outputs_by_length(forward_of(pre.model), encs, pad_id, batch_size, limit)
        total = out if total is None else total + out
    assert total is not None
    return total / len(models)
