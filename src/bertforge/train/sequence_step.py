"""The pure, jitted train and predict steps of fine-tuning a sequence head, and the losses by name.

A batch is a dict of (B, T) input_ids / attention_mask / token_type_ids, targets ((B, L) float for regression and
multi-label, (B,) int for classification) and weight (B,): 0 for filler rows, otherwise 1 or an importance weight.
The loss is the weighted sum over the rows divided by the number of real rows of the whole batch, so gradient
accumulation gives the update of the full batch.
"""

from __future__ import annotations

import dataclasses
import functools
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


def gradients(
    graphdef: Any,
    rest: Any,
    params: Any,
    step: jax.Array,
    batch: dict[str, jax.Array],
    key: jax.Array,
    cfg: SequenceStepConfig,
) -> tuple[Any, jax.Array]:
    """The gradients of the batch's loss at `params` (the update numbered `step`), and the loss."""
    loss_of = LOSSES[cfg.loss]
    real = jnp.maximum(jnp.sum(batch["weight"] > 0), 1).astype(jnp.float32)
    keys = jax.random.split(jax.random.fold_in(key, step), cfg.grad_accum)
    micro = {k: _micro(v, cfg.grad_accum) for k, v in batch.items()}

    def loss_fn(params: Any, xs: tuple) -> jax.Array:
        b, k = xs
        model = nnx.merge(graphdef, params, with_dropout_key(rest, k))
        outputs = model(b["input_ids"], b["attention_mask"], b["token_type_ids"])  # (b, L)
        return jnp.sum(loss_of(outputs, b["targets"]) * b["weight"]) / real

    def grad_fn(params: Any, xs: tuple) -> tuple[jax.Array, Any]:
        return jax.value_and_grad(loss_fn)(params, xs)

    return accumulate(grad_fn, params, (micro, keys))


def update(
    state: TrainState, grads: Any, loss: jax.Array, lr: jax.Array, tx: Any
) -> tuple[TrainState, dict[str, jax.Array]]:
    """The optimizer update of `grads`; a non-finite loss leaves the state as it was."""
    new_state, grad_norm, finite = apply_update(state, grads, loss, lr, tx)
    return new_state, {"loss": loss, "grad_norm": grad_norm, "finite": finite}


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
    grads, loss = gradients(graphdef, rest, state.params, state.step, batch, key, cfg)
    return update(state, grads, loss, lr, tx)


def compile_train_step(graphdef: Any, rest: Any, tx: Any, cfg: SequenceStepConfig, state_shardings: Any) -> Any:
    """train_step as two programs: the gradients, compiled once per batch shape, then the update, compiled once.

    Fine-tuning pads its batches to a few lengths: with the update in every length's program, each would compile
    and trace it again (on a 2-core CPU, MiniLM's update is 2.1 of a 4.2 s compilation). The state is
    donated, so the update reuses its buffers (the gradients have no output of their shape to go to).
    """
    grads_jit = jax.jit(
        functools.partial(gradients, graphdef, rest, cfg=cfg), out_shardings=(state_shardings.params, None)
    )
    update_jit = jax.jit(functools.partial(update, tx=tx), donate_argnums=0, out_shardings=(state_shardings, None))

    def step(state: TrainState, batch: dict[str, jax.Array], lr: jax.Array, key: jax.Array) -> tuple[TrainState, dict]:
        grads, loss = grads_jit(state.params, state.step, batch, key)
        return update_jit(state, grads, loss, lr)

    return step


def predict_step(graphdef: Any, rest: Any, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """(B, L) float32 outputs, no dropout."""
    model = nnx.merge(graphdef, params, rest)
    model.eval()
    return model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
