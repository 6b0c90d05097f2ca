"""Dynamic loss scaling, for float16 compute: GPUs without bfloat16 (T4, V100, P100) train in float16, whose
smallest normal number is 6e-5, so small gradients would flush to zero on their way back through the layers.

The loss is multiplied by a scale before differentiation and the gradients divided by it after, so the backward's
float16 activations carry gradients `scale` times larger. The scale doubles after PERIOD finite updates in a row;
a non-finite gradient (an overflow) skips that update and halves it. The scale lives in the optimizer's state, so
a checkpoint carries it and a resumed run continues with the same scale, bit for bit. PyTorch's GradScaler starts
at the same 2^16 and doubles after the same 2,000 steps.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

INITIAL = 2.0**16
PERIOD = 2000
FACTOR = 2.0
MINIMUM = 1.0


class LossScaleState(NamedTuple):
    scale: jax.Array  # float32 scalar: what the loss is multiplied by before differentiation
    good_steps: jax.Array  # int32 scalar: finite updates since the scale last changed
    inner: Any  # the wrapped optimizer's state


def dynamic_loss_scale(
    tx: optax.GradientTransformation, initial: float = INITIAL, period: int = PERIOD
) -> optax.GradientTransformationExtraArgs:
    """`tx` with a loss scale in its state. Its update is tx's on gradients already divided by the scale (see
    unscale), and counts the finite update; apply_update calls after_overflow instead when they are not finite."""
    inner_tx = optax.with_extra_args_support(tx)

    def init(params: Any) -> LossScaleState:
        return LossScaleState(jnp.float32(initial), jnp.int32(0), inner_tx.init(params))

    def update(updates: Any, state: LossScaleState, params: Any = None, **extra: Any) -> tuple[Any, LossScaleState]:
        updates, inner = inner_tx.update(updates, state.inner, params, **extra)
        grow = state.good_steps + 1 >= period
        scale = jnp.where(grow, state.scale * FACTOR, state.scale)
        return updates, LossScaleState(scale, jnp.where(grow, 0, state.good_steps + 1), inner)

    return optax.GradientTransformationExtraArgs(init, update)


def with_loss_scale(tx: optax.GradientTransformation, dtype: str) -> optax.GradientTransformation:
    """The optimizer a model of compute `dtype` trains with: tx, with a dynamic loss scale for float16."""
    return dynamic_loss_scale(tx) if dtype == "float16" else tx


def scale_of(opt_state: Any) -> jax.Array | None:
    """The loss scale in an optimizer state (None: the optimizer has none)."""
    return opt_state.scale if isinstance(opt_state, LossScaleState) else None


def after_overflow(opt_state: Any) -> Any:
    """The optimizer state after a skipped update: its loss scale halved (not below MINIMUM), the count reset."""
    if not isinstance(opt_state, LossScaleState):
        return opt_state
    return opt_state._replace(scale=jnp.maximum(opt_state.scale / FACTOR, MINIMUM), good_steps=jnp.int32(0))


def scaled(loss: jax.Array, scale: jax.Array | None) -> jax.Array:
    return loss if scale is None else loss * scale


def unscale(grads: Any, loss: jax.Array, scale: jax.Array | None) -> tuple[Any, jax.Array]:
    """(gradients, loss) of a scaled loss, divided back by the scale (in float32)."""
    if scale is None:
        return grads, loss
    return jax.tree.map(lambda g: g / scale.astype(g.dtype), grads), loss / scale
