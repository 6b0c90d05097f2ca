"""The gradients of an embedding model's contrastive loss (train/contrastive.py) over a whole batch: directly, or
in the cached form (GradCache, Gao et al. 2021) when the batch is taken in several mini-batches.

A loss over the batch's similarity matrix cannot be accumulated over micro-batches (each would see only its own
negatives), so with train.grad_accum A > 1 the batch is embedded in A mini-batches without gradients, the loss and
its gradient with respect to the (B, N, D) embeddings are computed over the whole batch, and each mini-batch is
embedded again with the same dropout and back-propagated from its share of that gradient. The parameters' gradient
is the whole batch's, while the memory held is one mini-batch's activations and the batch's embeddings. Under data
parallelism the batch is the global one: every device's embeddings are candidates for every anchor. Packed rows
(data/text_packing.py) come as one packed batch per mini-batch, interleaved as micro_batches cuts them apart.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from bertforge.data.text_packing import PACKED_INPUTS
from bertforge.train.contrastive import ContrastiveConfig, batch_loss
from bertforge.train.loss_scale import scaled, unscale
from bertforge.train.step import micro_batches, with_stream_keys

INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def _embed(graphdef: Any, rest: Any, params: Any, batch: dict[str, jax.Array], keys: Any, b: int) -> jax.Array:
    """(b, N, T) inputs -> (b, N, D) embeddings, dropout keyed by `keys` (None: the model draws none). Rows that
    pack b rows' texts (data/text_packing.py) hold text n of row r in slot r * N + n."""
    model = nnx.merge(graphdef, params, rest if keys is None else with_stream_keys(rest, keys))
    if "starts" in batch:
        return model.packed(*(batch[k] for k in PACKED_INPUTS)).reshape(b, batch["starts"].shape[0] // b, -1)
    return model(*(batch[k] for k in INPUTS))


def contrastive_gradients(
    graphdef: Any,
    rest: Any,
    params: Any,
    keys: tuple[jax.Array, ...] | None,
    batch: dict[str, jax.Array],
    cfg: ContrastiveConfig,
    grad_accum: int,
    scale: jax.Array | None = None,
) -> tuple[Any, jax.Array]:
    """(gradients, loss) of the batch's contrastive loss; `keys`: each random stream's (A,) keys, one per
    mini-batch (sequence_step.dropout_keys), or None; `scale`: float16's loss scale, divided out again."""
    targets = batch["targets"]
    if grad_accum == 1:  # the whole batch at once: padded (B, N, T), or packed rows
        first = None if keys is None else tuple(k[0] for k in keys)
        embed = lambda p: _embed(graphdef, rest, p, batch, first, targets.shape[0])  # noqa: E731
        loss, grads = jax.value_and_grad(lambda p: scaled(batch_loss(cfg, embed(p), targets), scale))(params)
        return unscale(grads, loss, scale)
    # (A, B/A, N, T), or each mini-batch's packed rows (packed_batches.whole_batch lays them out for this cut)
    inputs = {k: micro_batches(batch[k], grad_accum) for k in (PACKED_INPUTS if "starts" in batch else INPUTS)}
    b = targets.shape[0] // grad_accum

    def forward(_: None, xs: tuple) -> tuple[None, jax.Array]:
        part, k = xs
        return None, _embed(graphdef, rest, params, part, k, b)

    _, parts = jax.lax.scan(forward, None, (inputs, keys))  # (A, B/A, N, D)
    emb = jnp.swapaxes(parts, 0, 1).reshape(-1, *parts.shape[2:])  # (B, N, D): micro_batches undone
    loss, d_emb = jax.value_and_grad(lambda e: scaled(batch_loss(cfg, e, targets), scale))(emb)

    def backward(grads: Any, xs: tuple) -> tuple[Any, None]:
        part, k, d = xs
        _, pull = jax.vjp(lambda p: _embed(graphdef, rest, p, part, k, b), params)
        return jax.tree.map(jnp.add, grads, pull(d)[0]), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, _ = jax.lax.scan(backward, zeros, (inputs, keys, micro_batches(d_emb, grad_accum)))
    return unscale(grads, loss, scale)
