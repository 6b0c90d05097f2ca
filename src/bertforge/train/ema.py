"""An exponential moving average of the weights (`train.ema`), kept in the optimizer's state so that checkpoints
carry it and a resumed run continues it bit for bit, laid out on the mesh like the weights it follows.

The average is debiased as Adam debiases its moments: it starts at zero, and after t updates the weights it gives
are (sum over updates i of (1 - d) d^(t-i) w_i) / (1 - d^t), a weighted mean of the trained weights alone. A plain
average started at the initial weights would keep d^t of those random weights in it (a third after 1,000 steps at
0.999). An update skipped for a non-finite gradient leaves the average as it was.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from bertforge.train.loss_scale import LossScaleState


class EmaState(NamedTuple):
    ema: Any  # the weights' tree: the undebiased average
    count: jax.Array  # int32 scalar: the updates averaged
    inner: Any  # the wrapped optimizer's state


def with_ema(tx: optax.GradientTransformation, decay: float) -> optax.GradientTransformation:
    """`tx`, with the moving average (decay `decay`) of the weights its updates give; 0 leaves tx as it is."""
    if not decay:
        return tx
    inner_tx = optax.with_extra_args_support(tx)

    def init(params: Any) -> EmaState:
        return EmaState(jax.tree.map(jnp.zeros_like, params), jnp.int32(0), inner_tx.init(params))

    def update(updates: Any, state: EmaState, params: Any = None, **extra: Any) -> tuple[Any, EmaState]:
        if params is None:
            raise ValueError("the weights' moving average needs the parameters")
        updates, inner = inner_tx.update(updates, state.inner, params, **extra)
        new = optax.apply_updates(params, updates)
        ema = jax.tree.map(lambda e, w: decay * e + (1 - decay) * w.astype(e.dtype), state.ema, new)
        return updates, EmaState(ema, state.count + 1, inner)

    return optax.GradientTransformationExtraArgs(init, update)


def ema_state(opt_state: Any) -> EmaState | None:
    """The moving average in an optimizer's state (under a loss scale too), or None when it keeps none."""
    if isinstance(opt_state, LossScaleState):
        opt_state = opt_state.inner
    return opt_state if isinstance(opt_state, EmaState) else None


def ema_weights(opt_state: Any, decay: float) -> Any:
    """The debiased average of the weights after the updates it has seen; None before the first update."""
    found = ema_state(opt_state)
    if found is None:
        raise ValueError("the optimizer's state keeps no moving average of the weights")
    count = int(found.count)
    if count == 0:
        return None
    correction = 1.0 - decay**count
    return jax.tree.map(lambda e: (e / correction).astype(e.dtype), found.ema)
