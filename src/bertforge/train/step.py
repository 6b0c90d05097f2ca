"""The pure, jitted train and eval steps of masked-LM pretraining.

State in, state out: no hidden randomness (the masks and dropout of step s come from fold_in(key, s)), no side
effects, buffers donated. Gradient accumulation splits the global batch into micro-batches inside the step and
normalises by the masked-token count of the whole batch, so A micro-batches of B/A give the update of one batch
of B. With `sparse_head`, the vocabulary projection runs only on the masked positions (Cramming, MosaicBERT):
the loss is the same, the work a fraction.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from bertforge.data.masking import IGNORE, MaskingSpec, mask_tokens
from bertforge.data.packing import segment_ids
from bertforge.train.loss_scale import MINIMUM, after_overflow, scale_of, scaled, unscale
from bertforge.train.optim import set_learning_rate


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: updates done
    params: Any  # nnx.State of nnx.Param
    opt_state: Any


def _compiled_init(tx: Any, params: Any, mesh: jax.sharding.Mesh) -> tuple[Any, Any]:
    """tx.init compiled for `params` (arrays or ShapeDtypeStructs with shardings), and the optimizer state's
    layout: moments laid out like their parameters, as the compiler places them, and its scalars replicated."""
    init = jax.jit(tx.init).lower(params).compile()
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shardings = jax.tree.map(lambda s: s if getattr(s, "mesh", None) == mesh else replicated, init.output_shardings)
    return init, shardings


def new_train_state(params: Any, tx: Any, mesh: jax.sharding.Mesh) -> TrainState:
    """Step 0 with the optimizer's moments laid out like their parameters and its scalars replicated."""
    init, shardings = _compiled_init(tx, params, mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return TrainState(jax.device_put(jnp.int32(0), replicated), params, jax.device_put(init(params), shardings))


def abstract_train_state(params: Any, tx: Any, mesh: jax.sharding.Mesh) -> TrainState:
    """new_train_state's shapes, dtypes and shardings, for ShapeDtypeStruct parameters: nothing allocated."""
    _, shardings = _compiled_init(tx, params, mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    opt_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), jax.eval_shape(tx.init, params), shardings
    )
    return TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated), params, opt_state)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    masking: MaskingSpec
    pad_id: int
    grad_accum: int = 1
    sparse_head: bool = True
    groups: int = 1  # row groups of a micro-batch, one per batch shard, each picking its own masked positions
    capacity: int = 0  # max masked positions per group (see prediction_capacity)
    packed_cls: int | None = None  # packed shards: the [CLS] id each of a row's sequences starts with


def prediction_capacity(tokens: int, rate: float) -> int:
    """Room for the masked positions of `tokens` tokens: the mean plus 6 standard deviations, a multiple of 8.

    Selections beyond it (a chance below 1e-9) are dropped from the loss in both the sparse and the dense head, so
    the two stay identical.
    """
    mean = tokens * rate
    return min(tokens, int(math.ceil((mean + 6 * math.sqrt(mean * (1 - rate)) + 8) / 8) * 8))


def cap_labels(labels: jax.Array, groups: int, capacity: int) -> jax.Array:
    """labels (b, T) with the masked positions beyond `capacity` per row group set to IGNORE."""
    grouped = labels.reshape(groups, -1)
    valid = grouped != IGNORE
    keep = jnp.cumsum(valid, axis=1) <= capacity
    return jnp.where(valid & keep, grouped, IGNORE).reshape(labels.shape)


def _pick(hidden: jax.Array, labels: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One group's masked positions: hidden (n, D), labels (n,) -> (C, D), (C,), weights (C,)."""
    valid = labels != IGNORE
    (index,) = jnp.nonzero(valid, size=capacity, fill_value=0)
    return hidden[index], labels[index], jnp.arange(capacity) < valid.sum()


def encode(encoder: Any, inputs: jax.Array, cfg: StepConfig) -> jax.Array:
    """(b, T) ids -> (b, T, D), attending to the tokens that are not padding, or in packed rows within each
    sequence (masking never replaces [CLS], so masked inputs still mark where each sequence starts)."""
    if cfg.packed_cls is None:
        return encoder(inputs, (inputs != cfg.pad_id).astype(jnp.int32))
    return encoder(inputs, segment_ids=segment_ids(inputs, cfg.packed_cls, cfg.pad_id))


def mlm_sums(
    model: Any, inputs: jax.Array, labels: jax.Array, cfg: StepConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(loss sum, correct predictions, predictions) over the masked positions of inputs/labels (b, T)."""
    hidden = encode(model.encoder, inputs, cfg)  # (b, T, D)
    if cfg.sparse_head:
        g = cfg.groups
        picked, target, weight = jax.vmap(_pick, in_axes=(0, 0, None))(
            hidden.reshape(g, -1, hidden.shape[-1]), labels.reshape(g, -1), cfg.capacity
        )  # (G, C, D), (G, C), (G, C)
        logits = model.logits_at(picked)  # (G, C, V)
    else:
        logits = model.logits_at(hidden)  # (b, T, V)
        target, weight = labels, labels != IGNORE
    target = jnp.where(weight, target, 0)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, target)
    w = weight.astype(jnp.float32)
    correct = (jnp.argmax(logits, axis=-1) == target).astype(jnp.float32)
    return jnp.sum(loss * w), jnp.sum(correct * w), jnp.sum(w)


def _is_key(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def stream_keys(rest: Any, key: jax.Array) -> tuple[jax.Array, ...]:
    """The key of each of the model's random streams, in the order of the state's leaves: fold_in(key, i) for
    the stream at leaf i."""
    return tuple(jax.random.fold_in(key, i) for i, x in enumerate(jax.tree.leaves(rest)) if _is_key(x))


def with_stream_keys(rest: Any, keys: tuple[jax.Array, ...]) -> Any:
    """The model's random-stream state with its streams keyed by `keys` (stream_keys' order)."""
    leaves, treedef = jax.tree.flatten(rest)
    given = iter(keys)
    return jax.tree.unflatten(treedef, [next(given) if _is_key(x) else x for x in leaves])


def with_dropout_key(rest: Any, key: jax.Array) -> Any:
    """The model's random-stream state with stream i keyed fold_in(key, i): dropout as a function of `key`."""
    return with_stream_keys(rest, stream_keys(rest, key))


def micro_batches(x: jax.Array, a: int) -> jax.Array:
    """(B, ...) -> (A, B/A, ...): row i*A + k goes to micro-batch k, so each device keeps its own rows in every
    micro-batch."""
    return x.reshape(x.shape[0] // a, a, *x.shape[1:]).swapaxes(0, 1)


def _masked_batch(key: jax.Array, ids: jax.Array, cfg: StepConfig) -> tuple[jax.Array, jax.Array]:
    """Mask the global batch, then lay it out as (A, B/A, T) micro-batches with their capped labels."""
    inputs, labels = mask_tokens(key, ids, cfg.masking)
    inputs, labels = micro_batches(inputs, cfg.grad_accum), micro_batches(labels, cfg.grad_accum)
    labels = jax.vmap(cap_labels, in_axes=(0, None, None))(labels, cfg.groups, cfg.capacity)
    return inputs, labels


def accumulate(grad_fn: Any, params: Any, xs: Any) -> tuple[Any, Any]:
    """Sum grad_fn(params, x) -> (aux, grads) over the leading axis of xs (the micro-batches): (grads, aux sums)."""
    first = jax.tree.map(lambda a: a[0], xs)
    if jax.tree.leaves(xs)[0].shape[0] == 1:  # no loop: tracing the model once, not twice (eval_shape and scan)
        aux, grads = grad_fn(params, first)
        return grads, aux

    def micro(carry: tuple, x: Any) -> tuple[tuple, None]:
        aux, grads = grad_fn(params, x)
        return jax.tree.map(jnp.add, carry, (grads, aux)), None

    shapes = jax.eval_shape(grad_fn, params, first)
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), (shapes[1], shapes[0]))
    (grads, aux), _ = jax.lax.scan(micro, zeros, xs)
    return grads, aux


def apply_update(
    state: TrainState, grads: Any, loss: jax.Array, lr: jax.Array, tx: Any
) -> tuple[TrainState, jax.Array, jax.Array]:
    """One optimizer update; a non-finite loss or gradient leaves the parameters and moments as they were (and
    halves a float16 run's loss scale). -> (state, norm, ok): ok is False when the run cannot go on, a non-finite
    loss, or gradients that overflow with no loss scale left to lower."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def update() -> TrainState:
        opt_state = set_learning_rate(state.opt_state, lr)
        # The norm goes to the clipping, which would otherwise read every gradient again inside this branch.
        updates, new_opt_state = optax.with_extra_args_support(tx).update(
            grads, opt_state, state.params, grad_norm=grad_norm
        )
        return TrainState(state.step + 1, optax.apply_updates(state.params, updates), new_opt_state)

    def skip() -> TrainState:
        return TrainState(state.step + 1, state.params, after_overflow(state.opt_state))

    # A branch, not an element-wise select of old and new, so that no second copy of every buffer is made.
    new_state = jax.lax.cond(finite, update, skip)
    scale = scale_of(state.opt_state)
    if scale is None:
        return new_state, grad_norm, finite
    # float16: an overflow of the gradients is the loss scale's to absorb (it has just been halved).
    return new_state, grad_norm, jnp.isfinite(loss) & (finite | (scale > MINIMUM))


def train_step(
    graphdef: Any, rest: Any, state: TrainState, ids: jax.Array, lr: jax.Array, key: jax.Array, tx: Any, cfg: StepConfig
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update from a global batch of token ids (B, T). A non-finite loss leaves the state as it was."""
    step_key = jax.random.fold_in(key, state.step)
    mask_key, dropout_key = jax.random.split(step_key)
    inputs, labels = _masked_batch(mask_key, ids, cfg)
    total = jnp.maximum(jnp.sum(labels != IGNORE), 1).astype(jnp.float32)
    scale = scale_of(state.opt_state)  # float16 compute: the loss scale (loss_scale.py)

    def loss_fn(params: Any, xs: tuple) -> tuple[jax.Array, jax.Array]:
        x, y, k = xs
        model = nnx.merge(graphdef, params, with_dropout_key(rest, k))
        loss_sum, correct, _ = mlm_sums(model, x, y, cfg)
        return scaled(loss_sum / total, scale), correct

    def grad_fn(params: Any, xs: tuple) -> tuple[tuple, Any]:
        (loss, correct), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, xs)
        return (loss, correct), grads

    keys = jax.random.split(dropout_key, cfg.grad_accum)
    grads, (loss, correct) = accumulate(grad_fn, state.params, (inputs, labels, keys))
    grads, loss = unscale(grads, loss, scale)
    new_state, grad_norm, finite = apply_update(state, grads, loss, lr, tx)
    metrics = {"loss": loss, "accuracy": correct / total, "grad_norm": grad_norm, "predictions": total}
    metrics["finite"] = finite
    if scale is not None:
        metrics["loss_scale"] = scale
    return new_state, metrics


def eval_sums(graphdef: Any, rest: Any, params: Any, ids: jax.Array, key: jax.Array, cfg: StepConfig) -> jax.Array:
    """[loss sum, correct, predictions] of one validation batch (B, T), masks from `key`, no dropout."""
    # One pass over the whole batch: A micro-batches' groups side by side.
    eval_cfg = dataclasses.replace(cfg, groups=cfg.groups * cfg.grad_accum, grad_accum=1)
    inputs, labels = mask_tokens(key, ids, cfg.masking)
    labels = cap_labels(labels, eval_cfg.groups, eval_cfg.capacity)
    model = nnx.merge(graphdef, params, rest)
    model.eval()
    return jnp.stack(mlm_sums(model, inputs, labels, eval_cfg))
