"""The pure, jitted train and predict steps of fine-tuning a sequence head, and the losses by name.

A batch is a dict of (B, T) input_ids / attention_mask / token_type_ids, targets ((B, L) float for regression and
multi-label, (B,) int for classification) and weight (B,): 0 for filler rows, otherwise 1 or an importance weight.
The loss is the weighted sum over the rows divided by the number of real rows of the whole batch, so gradient
accumulation gives the update of the full batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from bertforge.train.step import TrainState, accumulate, apply_update, with_dropout_key

LossFn = Callable[[jax.Array, jax.Array], jax.Array]  # (outputs (B, L), targets) -> per-row loss (B,)
LOSSES: dict[str, LossFn] = {}


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Make a per-row loss available as `head.loss: NAME` in fine-tuning configs."""

    def add(fn: LossFn) -> LossFn:
        LOSSES[name] = fn
        return fn

    return add


@register_loss("mse")
def mse(outputs: jax.Array, targets: jax.Array) -> jax.Array:
    return jnp.mean((outputs - targets) ** 2, axis=-1)


@register_loss("mae")
def mae(outputs: jax.Array, targets: jax.Array) -> jax.Array:
    return jnp.mean(jnp.abs(outputs - targets), axis=-1)


@register_loss("cross_entropy")
def cross_entropy(outputs: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(outputs, targets)


@register_loss("bce")
def bce(outputs: jax.Array, targets: jax.Array) -> jax.Array:
    return jnp.mean(optax.sigmoid_binary_cross_entropy(outputs, targets), axis=-1)


DEFAULT_LOSS = {"regression": "mse", "classification": "cross_entropy", "multilabel": "bce"}


@dataclasses.dataclass(frozen=True)
class SequenceStepConfig:
    loss: str
    grad_accum: int = 1


def _micro(x: jax.Array, a: int) -> jax.Array:
    # Row i*A + k goes to micro-batch k: each device keeps its own rows in every micro-batch.
    return x.reshape(x.shape[0] // a, a, *x.shape[1:]).swapaxes(0, 1)


def train_step(
    graphdef: Any,
    rest: Any,
    state: TrainState,
    batch: dict[str, jax.Array],
    lr: jax.Array,
    key: jax.Array,
    tx: Any,
    cfg: SequenceStepConfig,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update from a batch; a non-finite loss leaves the state as it was."""
    loss_of = LOSSES[cfg.loss]
    real = jnp.maximum(jnp.sum(batch["weight"] > 0), 1).astype(jnp.float32)
    keys = jax.random.split(jax.random.fold_in(key, state.step), cfg.grad_accum)
    micro = {k: _micro(v, cfg.grad_accum) for k, v in batch.items()}

    def loss_fn(params: Any, xs: tuple) -> jax.Array:
        b, k = xs
        model = nnx.merge(graphdef, params, with_dropout_key(rest, k))
        outputs = model(b["input_ids"], b["attention_mask"], b["token_type_ids"])  # (b, L)
        return jnp.sum(loss_of(outputs, b["targets"]) * b["weight"]) / real

    def grad_fn(params: Any, xs: tuple) -> tuple[jax.Array, Any]:
        return jax.value_and_grad(loss_fn)(params, xs)

    grads, loss = accumulate(grad_fn, state.params, (micro, keys))
    new_state, grad_norm, finite = apply_update(state, grads, loss, lr, tx)
    return new_state, {"loss": loss, "grad_norm": grad_norm, "finite": finite}


def predict_step(graphdef: Any, rest: Any, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """(B, L) float32 outputs, no dropout."""
    model = nnx.merge(graphdef, params, rest)
    model.eval()
    return model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
