"""A batch-size ramp (Cramming): global batches that grow, one micro-batch at a time, from a small batch to the
configured one over the first part of a run, so that early updates, which need little averaging, come cheaply.

The ramp moves in micro-batches of global_batch / grad_accum rows: step s takes n(s) of them, read in the data
order of a loader of micro-batches, so the rows a run sees are the same sequence whatever the ramp, and the loader's
state (micro-batches served) resumes it exactly. The train step accumulates the n micro-batches as it accumulates
grad_accum of them without a ramp: one compiled program per n.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from bertforge.data.mixture import MixedShards, MixtureLoader, loader_for
from bertforge.data.shards import BatchLoader, Shards
from bertforge.errors import UserError
from bertforge.runtime.devices import batch_sharding


@dataclasses.dataclass(frozen=True)
class Ramp:
    start: int  # micro-batches per step at the start of the run
    end: int  # micro-batches per step once the ramp is over (train.grad_accum)
    fraction: float  # share of the run (of its steps, or of its time budget) the ramp takes

    def micro_batches(self, progress: float) -> int:
        """Micro-batches of the step at `progress` (0..1 of the run): start, rising linearly to end."""
        if progress >= self.fraction:
            return self.end
        return min(self.end, self.start + math.floor((self.end - self.start + 1) * progress / self.fraction))


def ramp_of(global_batch: int, grad_accum: int, fraction: float, start_rows: int | None) -> Ramp | None:
    """train.batch_ramp and train.batch_ramp_start as a Ramp in micro-batches (None without a ramp); ValueError
    for keys that cannot make one."""
    micro = global_batch // grad_accum
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"batch_ramp must be in [0, 1), got {fraction}")
    if fraction and grad_accum == 1:
        raise ValueError(
            "batch_ramp grows the batch by micro-batches of global_batch / grad_accum rows: set grad_accum > 1"
        )
    if start_rows is not None and (start_rows < micro or start_rows % micro or start_rows > global_batch):
        raise ValueError(
            f"batch_ramp_start {start_rows} must be a multiple of the micro-batch ({micro}) up to global_batch"
        )
    return Ramp((start_rows or micro) // micro, grad_accum, fraction) if fraction else None


def make_loader(
    shards: Shards | MixedShards, global_batch: int, ramp: Ramp | None, seed: int, mesh: jax.sharding.Mesh
) -> BatchLoader | RampedLoader:
    """The training loader: BatchLoader's global batches, or with a ramp, RampedLoader's growing ones (micro-batches
    of global_batch / ramp.end rows)."""
    if ramp is None:
        return loader_for(shards, global_batch, seed, batch_sharding(mesh))
    return RampedLoader(shards, global_batch // ramp.end, ramp, seed, batch_sharding(mesh))


class RampedLoader:
    """BatchLoader's interface for a ramped run: `next_at(progress)` is a global batch of n micro-batches, laid out
    so that row i*n + k is row i of micro-batch k (the train step's accumulation layout: each device keeps its rows
    of every micro-batch)."""

    def __init__(
        self, shards: Shards | MixedShards, micro: int, ramp: Ramp, seed: int, sharding: jax.sharding.Sharding
    ):
        self.micro = loader_for(shards, micro, seed)  # host rows, prefetched; placed on devices here
        self.ramp, self.sharding, self.seq_len = ramp, sharding, shards.seq_len
        self.batches_per_epoch = self.micro.batches_per_epoch // ramp.end  # of full batches, for messages

    def next_at(self, progress: float) -> jax.Array:
        n = self.ramp.micro_batches(progress)
        parts = [next(self.micro) for _ in range(n)]  # n x (micro / processes, T)
        local = np.stack(parts, axis=1).reshape(-1, self.seq_len)  # (n * micro / processes, T)
        shape = (n * self.micro.global_batch, self.seq_len)
        return jax.make_array_from_process_local_data(self.sharding, local, shape)

    @property
    def rows_served(self) -> int:
        return self.micro.step * self.micro.global_batch

    def epoch_of(self, _step: int) -> int:
        """The epoch of the last micro-batch served (a step's rows depend on the ramp, not on its index alone)."""
        return self.micro.epoch_of(max(self.micro.step - 1, 0))

    def tokens_by_source(self) -> dict[str, int] | None:
        return self.micro.tokens_by_source() if isinstance(self.micro, MixtureLoader) else None

    def state_dict(self) -> dict[str, Any]:
        return {"micro_batches": self.micro.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "micro_batches" not in state:
            raise UserError("the checkpoint was taken without train.batch_ramp; resume it without one")
        self.micro.load_state_dict(state["micro_batches"])

    def close(self) -> None:
        self.micro.close()
