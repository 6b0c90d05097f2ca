"""The pure, jitted train and eval steps of replaced-token detection (ELECTRA; DeBERTa-v3).

One step: mask the batch as masked LM does; the generator predicts the masked tokens (its vocabulary projection
only at the masked positions); each masked position is filled with a token drawn from the generator's softmax; the
discriminator labels every real token of the result as original or replaced. The loss is the generator's mean
cross-entropy over the masked tokens plus `disc_weight` times the discriminator's mean binary cross-entropy over
the real tokens. No gradient flows through the draw. A sampled token equal to the original counts as original.

The draw at a position is a function of the generator's logits there and one uniform number of the (B, T) batch,
drawn from the step's key: it does not depend on how the batch is split over devices or micro-batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from bertforge.data.masking import IGNORE, mask_tokens
from bertforge.data.packing import segment_ids
from bertforge.train.step import (
    StepConfig,
    TrainState,
    accumulate,
    apply_update,
    cap_labels,
    encode,
    micro_batches,
    with_dropout_key,
)

SUMS = ("gen_loss", "gen_correct", "predictions", "disc_loss", "disc_correct", "tokens", "replaced")


@dataclasses.dataclass(frozen=True)
class RtdStepConfig:
    mlm: StepConfig  # masking, padding, accumulation, groups and capacity of the generator's predictions
    disc_weight: float = 50.0
    temperature: float = 1.0


def sample_tokens(
    logits: jax.Array, u: jax.Array, temperature: float = 1.0, disallowed: Sequence[int] = (), block: int = 256
) -> jax.Array:
    """logits (..., V), u (...) uniform in [0, 1) -> (...) int32: the first id whose cumulative softmax probability
    exceeds u (inverse-transform sampling), never a `disallowed` id. The cumulative sum runs over blocks of `block`
    ids and then within the chosen block: one over all V ids is several times slower on a CPU."""
    v = logits.shape[-1]
    z = logits.astype(jnp.float32) / temperature
    if disallowed:
        z = z.at[..., jnp.asarray(disallowed, jnp.int32)].set(-jnp.inf)
    p = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))
    n = -(-v // block)
    p = jnp.pad(p, [(0, 0)] * (p.ndim - 1) + [(0, n * block - v)]).reshape(*p.shape[:-1], n, block)  # (..., n, k)
    cum = jnp.cumsum(jnp.sum(p, axis=-1), axis=-1)  # (..., n)
    t = u * cum[..., -1]
    j = jnp.minimum(jnp.sum(cum <= t[..., None], axis=-1), n - 1)  # the block
    before = jnp.where(j > 0, jnp.take_along_axis(cum, jnp.maximum(j - 1, 0)[..., None], axis=-1)[..., 0], 0.0)
    inner = jnp.take_along_axis(p, j[..., None, None], axis=-2)[..., 0, :]  # (..., k)
    k = jnp.minimum(jnp.sum(jnp.cumsum(inner, axis=-1) <= (t - before)[..., None], axis=-1), block - 1)
    return jnp.minimum(j * block + k, v - 1).astype(jnp.int32)


def _real(ids: jax.Array, cfg: StepConfig) -> jax.Array:
    """(b, T) ids -> (b, T) True on the tokens that are not padding."""
    if cfg.packed_cls is None:
        return ids != cfg.pad_id
    return segment_ids(ids, cfg.packed_cls, cfg.pad_id) != 0


def _positions(labels: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """One group's masked positions: labels (n,) -> index (C,) and whether each slot holds one (C,)."""
    valid = labels != IGNORE
    (index,) = jnp.nonzero(valid, size=capacity, fill_value=0)
    return index, jnp.arange(capacity) < valid.sum()


def corrupt(
    model: Any, inputs: jax.Array, labels: jax.Array, original: jax.Array, u: jax.Array, cfg: RtdStepConfig
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The generator's part: inputs, labels, original ids, uniforms (b, T) -> (cross-entropy sum, correct,
    predictions, the discriminator's inputs (b, T) with every masked position replaced by a draw)."""
    mlm = cfg.mlm
    g = mlm.groups
    hidden = encode(model.generator.encoder, inputs, mlm)  # (b, T, D)
    grouped = labels.reshape(g, -1)
    n = grouped.shape[1]
    index, weight = jax.vmap(_positions, in_axes=(0, None))(grouped, mlm.capacity)  # (G, C)
    picked = jnp.take_along_axis(hidden.reshape(g, n, -1), index[..., None], axis=1)  # (G, C, D)
    logits = model.generator.logits_at(picked)  # (G, C, V)
    target = jnp.where(weight, jnp.take_along_axis(grouped, index, axis=1), 0)
    w = weight.astype(jnp.float32)
    loss = jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, target) * w)
    correct = jnp.sum((jnp.argmax(logits, axis=-1) == target) * w)
    draws = jnp.take_along_axis(u.reshape(g, n), index, axis=1)
    sampled = sample_tokens(jax.lax.stop_gradient(logits), draws, cfg.temperature, mlm.masking.special_ids)
    rows = jnp.arange(g)[:, None]
    disc_inputs = original.reshape(g, n).at[rows, jnp.where(weight, index, n)].set(sampled, mode="drop")
    return loss, correct, jnp.sum(w), disc_inputs.reshape(original.shape)


def detect(
    model: Any, disc_inputs: jax.Array, original: jax.Array, cfg: RtdStepConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The discriminator's part: (b, T) -> logits, replaced (bool) and real (bool, not padding), each (b, T)."""
    hidden = encode(model.discriminator.encoder, disc_inputs, cfg.mlm)
    logits = model.discriminator.head(hidden)  # (b, T)
    return logits, disc_inputs != original, _real(original, cfg.mlm)


def rtd_sums(
    model: Any, inputs: jax.Array, labels: jax.Array, original: jax.Array, u: jax.Array, cfg: RtdStepConfig
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    """The SUMS of one micro-batch (7,), and the discriminator's logits, replaced and real tokens (b, T)."""
    gen_loss, gen_correct, predictions, disc_inputs = corrupt(model, inputs, labels, original, u, cfg)
    logits, replaced, real = detect(model, disc_inputs, original, cfg)
    r, y = real.astype(jnp.float32), replaced.astype(jnp.float32)
    disc_loss = jnp.sum(optax.sigmoid_binary_cross_entropy(logits, y) * r)
    disc_correct = jnp.sum(((logits > 0) == replaced) * r)
    sums = jnp.stack([gen_loss, gen_correct, predictions, disc_loss, disc_correct, jnp.sum(r), jnp.sum(y * r)])
    return sums, (logits, replaced, real)


def _corrupted_batch(key: jax.Array, ids: jax.Array, cfg: RtdStepConfig) -> tuple[jax.Array, ...]:
    """The masked inputs, capped labels, original ids and uniforms of the global batch, each (A, B/A, T)."""
    mask_key, sample_key = jax.random.split(key)
    mlm = cfg.mlm
    inputs, labels = mask_tokens(mask_key, ids, mlm.masking)
    u = jax.random.uniform(sample_key, ids.shape)
    a = mlm.grad_accum
    labels = jax.vmap(cap_labels, in_axes=(0, None, None))(micro_batches(labels, a), mlm.groups, mlm.capacity)
    return micro_batches(inputs, a), labels, micro_batches(ids.astype(jnp.int32), a), micro_batches(u, a)


def gradients(
    graphdef: Any, rest: Any, params: Any, step: jax.Array, ids: jax.Array, key: jax.Array, cfg: RtdStepConfig
) -> tuple[Any, jax.Array, jax.Array]:
    """The gradients of step `step` from a global batch of token ids (B, T), its loss, and its SUMS."""
    step_key = jax.random.fold_in(key, step)
    batch_key, dropout_key = jax.random.split(step_key)
    inputs, labels, original, u = _corrupted_batch(batch_key, ids, cfg)
    # Means over the whole batch, whatever the micro-batches: A micro-batches give the update of one batch.
    masked = jnp.maximum(jnp.sum(labels != IGNORE), 1).astype(jnp.float32)
    tokens = jnp.maximum(jnp.sum(_real(ids, cfg.mlm)), 1).astype(jnp.float32)

    def grad_fn(params: Any, xs: tuple) -> tuple[tuple, Any]:
        def loss_fn(params: Any) -> tuple[jax.Array, jax.Array]:
            x, y, o, v, k = xs
            model = nnx.merge(graphdef, params, with_dropout_key(rest, k))
            sums, _ = rtd_sums(model, x, y, o, v, cfg)
            return sums[0] / masked + cfg.disc_weight * sums[3] / tokens, sums

        (loss, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return (loss, sums), grads

    keys = jax.random.split(dropout_key, cfg.mlm.grad_accum)
    grads, (loss, sums) = accumulate(grad_fn, params, (inputs, labels, original, u, keys))
    return grads, loss, sums


def train_step(
    graphdef: Any,
    rest: Any,
    state: TrainState,
    ids: jax.Array,
    lr: jax.Array,
    key: jax.Array,
    tx: Any,
    cfg: RtdStepConfig,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update of generator and discriminator from a global batch of token ids (B, T)."""
    grads, loss, sums = gradients(graphdef, rest, state.params, state.step, ids, key, cfg)
    new_state, grad_norm, finite = apply_update(state, grads, loss, lr, tx)
    return new_state, {"loss": loss, **summary(sums), "grad_norm": grad_norm, "finite": finite}


def summary(sums: jax.Array, disc_weight: float | None = None) -> dict[str, Any]:
    """Means from the SUMS: the generator's loss and accuracy, the discriminator's loss and accuracy, the share of
    real tokens replaced, the accuracy of calling every token original; with `disc_weight`, the combined loss."""
    s = dict(zip(SUMS, sums, strict=True))
    masked, tokens = jnp.maximum(s["predictions"], 1), jnp.maximum(s["tokens"], 1)
    out = {
        "gen_loss": s["gen_loss"] / masked,
        "gen_accuracy": s["gen_correct"] / masked,
        "disc_loss": s["disc_loss"] / tokens,
        "disc_accuracy": s["disc_correct"] / tokens,
        "replaced": s["replaced"] / tokens,
    }
    if disc_weight is not None:
        out["loss"] = out["gen_loss"] + disc_weight * out["disc_loss"]
    return out


def eval_outputs(
    graphdef: Any, rest: Any, params: Any, ids: jax.Array, key: jax.Array, cfg: RtdStepConfig
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One validation batch (B, T), masks and draws from `key`, no dropout: the SUMS (7,), and the discriminator's
    logits, replaced and real tokens (B, T), from which the evaluation's AUC is computed."""
    mlm = cfg.mlm
    one = dataclasses.replace(mlm, groups=mlm.groups * mlm.grad_accum, grad_accum=1)  # the batch in one pass
    one_cfg = dataclasses.replace(cfg, mlm=one)
    inputs, labels, original, u = (x[0] for x in _corrupted_batch(key, ids, one_cfg))
    model = nnx.merge(graphdef, params, rest)
    model.eval()
    sums, (logits, replaced, real) = rtd_sums(model, inputs, labels, original, u, one_cfg)
    return sums, logits, replaced, real
