"""The training step of packed fine-tuning (data/text_packing.py): a step's texts come as micro-batches of one
shape, as many as they need; each micro-batch's gradients are added into the step's by one program, and one update
follows. Every step of a run runs the same programs, whatever its texts' lengths.

Each micro-batch's loss is its texts' summed loss over the number of real texts of the whole step, so the added
gradients are those of the whole batch, as the padded step computes them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from bertforge.train.ahead import Ahead
from bertforge.train.loss_scale import scale_of
from bertforge.train.sequence_step import SequenceStepConfig, dropout_keys, summed_gradients, update
from bertforge.train.step import TrainState


class PackedBatch(NamedTuple):
    """A training step's micro-batches (each a packed batch with its texts' targets and weights, on the devices)
    and the number of real texts (weight > 0) of the whole step."""

    micro: list[dict[str, jax.Array]]
    count: float


def add_gradients(
    graphdef: Any,
    rest: Any,
    params: Any,
    keys: tuple[jax.Array, ...] | None,
    batch: dict[str, jax.Array],
    count: jax.Array,
    total: tuple[Any, jax.Array],
    cfg: SequenceStepConfig,
    scale: jax.Array | None = None,
) -> tuple[Any, jax.Array]:
    """total (gradients, loss) plus a micro-batch's: its texts' loss over `count`, the step's real texts (float16's
    loss scale divided out)."""
    grads, loss = summed_gradients(graphdef, rest, params, keys, batch, cfg, scale, count=count)
    return jax.tree.map(jnp.add, total[0], grads), total[1] + loss


def micro_keys(rest: Any, step: jax.Array, key: jax.Array, k: jax.Array) -> tuple[jax.Array, ...]:
    """The dropout keys of micro-batch k of the update numbered `step`."""
    return dropout_keys(rest, step, jax.random.fold_in(key, k), 1)


class PackedTrainStep:
    """A packed step as three programs: the dropout keys, a micro-batch's gradients added into a sum, and the
    update; call it as sequence_step.TrainStep. Every step's sum starts from the same zeros, made once, so that one
    gradient program serves the first micro-batch and the others: a first run compiles it once (a second program
    for the first micro-batch would save each step the addition, and cost a first run more than that)."""

    def __init__(self, keys_jit: Any, zeros_jit: Any, add: Ahead, update: Ahead, cfg: SequenceStepConfig):
        self.keys_jit, self.zeros_jit, self.add, self.update, self.cfg = keys_jit, zeros_jit, add, update, cfg
        self.zeros: tuple[Any, jax.Array] | None = None

    def _keys(self, state: TrainState, key: jax.Array, k: int) -> tuple[jax.Array, ...] | None:
        return self.keys_jit(state.step, key, np.int32(k)) if self.cfg.dropout else None

    def __call__(self, state: TrainState, batch: PackedBatch, lr: jax.Array, key: jax.Array) -> tuple[TrainState, dict]:
        scale, count = scale_of(state.opt_state), np.float32(max(batch.count, 1))
        if self.zeros is None:
            self.zeros = self.zeros_jit(state.params)
        total = self.zeros
        for k, micro in enumerate(batch.micro):
            total = self.add(state.params, self._keys(state, key, k), micro, count, total, scale=scale)
        grads, loss = total
        return self.update(state, grads, None, loss, lr)

    def ahead(self, state: TrainState, batch: PackedBatch, key: jax.Array) -> None:
        """Start compiling the micro-batches' program (Ahead.ahead); the update's follows at the first step."""
        like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
        total = (jax.tree.map(like, state.params), jax.ShapeDtypeStruct((), jnp.float32, sharding=state.step.sharding))
        self.add.ahead(state.params, self._keys(state, key, 0), batch.micro[0], np.float32(1), total,
                       scale=scale_of(state.opt_state))  # fmt: skip


def zeros_like(params: Any) -> tuple[Any, jax.Array]:
    return jax.tree.map(jnp.zeros_like, params), jnp.float32(0.0)


def compile_packed_step(
    graphdef: Any, rest: Any, tx: Any, cfg: SequenceStepConfig, state_shardings: Any
) -> PackedTrainStep:
    """The packed step's programs, each compiled once for the run's one micro-batch shape."""
    cfg = dataclasses.replace(cfg, grad_accum=1)
    totals = (state_shardings.params, state_shardings.step)  # the loss replicated, as the step count
    keys_jit = jax.jit(functools.partial(micro_keys, rest), out_shardings=state_shardings.step)
    zeros_jit = jax.jit(zeros_like, out_shardings=totals)
    add = jax.jit(functools.partial(add_gradients, graphdef, rest, cfg=cfg), out_shardings=totals)
    update_jit = jax.jit(functools.partial(update, tx=tx), donate_argnums=0, out_shardings=(state_shardings, None))
    return PackedTrainStep(keys_jit, zeros_jit, Ahead(add), Ahead(update_jit), cfg)
