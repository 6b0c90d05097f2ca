"""The evaluations of a fine-tuning fold (tasks/finetune_fold.py): the model's outputs on the fold's validation
records, padded to the length ladder or packed, and the task's metrics and loss of them."""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bertforge.data.long_text import outputs_of_records
from bertforge.data.text_packing import PACKED_INPUTS
from bertforge.runtime.devices import global_array
from bertforge.tasks.model_outputs import INPUTS, outputs_by_length
from bertforge.tasks.packed_batches import packed_outputs
from bertforge.train.metrics import HIGHER_IS_BETTER
from bertforge.train.sequence_step import LOSSES, loss_count
from bertforge.train.step import TrainState

# `job` is a finetune_fold.Job and `fold` a finetune_fold.Fold; that module calls this one, so the types are not
# imported here.
Job = Fold = Any


def eval_batch(job: Job) -> tuple[int, int]:
    """(rows, choices) of a padded evaluation batch: train.eval_batch_size rows; for an embedding model, which
    embeds each text alone, their texts."""
    if job.task.HEAD == "embedding":
        return job.train.eval_batch_size * job.choices, 0
    return job.train.eval_batch_size, job.choices


def scores(job: Job, outputs: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """The task's metrics and the loss of `outputs` against `targets` (of the validation table's rows)."""
    found = job.task.scores(outputs, targets, job.names, (job.valid_table or job.table).source)
    if job.loss in LOSSES:  # a contrastive loss is of a batch, not of the whole validation set
        found["loss"] = float(_mean_loss(outputs, targets, job.loss))
    return found


def rank(job: Job, evaluation: dict[str, float]) -> float:
    """An evaluation's rank among a fold's checkpoints, lower being better: its metric, negated where higher is
    better."""
    return (-1.0 if HIGHER_IS_BETTER[job.metric] else 1.0) * evaluation[f"valid_{job.metric}"]


@functools.partial(jax.jit, static_argnums=2)
def _mean_loss(outputs: jax.Array, targets: jax.Array, loss: str) -> jax.Array:
    # One program: run op by op, the loss would compile a dozen (0.3-0.5 s on a first run, with their tracing).
    weight = jnp.ones(outputs.shape[0], jnp.float32)
    return jnp.sum(LOSSES[loss](outputs, targets)) / loss_count(loss, targets, weight)


def _valid_outputs(job: Job, fold: Fold, params: Any) -> np.ndarray:
    """The model's outputs on the fold's validation records (a text's windows pooled)."""

    def forward(batch: dict[str, np.ndarray]) -> np.ndarray:
        keys = PACKED_INPUTS if job.pack else INPUTS
        return np.asarray(job.forward_jit(params, {k: global_array(batch[k], job.mesh) for k in keys}))

    pad_id, (size, _) = job.pre.tokenizer.pad_id, eval_batch(job)
    if job.pack is not None:
        outputs = packed_outputs(forward, fold.eval_encs, job.pack, pad_id, limit=job.limit)
    else:
        outputs = outputs_by_length(forward, fold.eval_encs, pad_id, size, job.limit, job.bucket, rungs=job.rungs)
    if fold.eval_index is not None:  # each validation row's N vectors, flat
        outputs = outputs[fold.eval_index].reshape(len(fold.eval_index), -1)
    return outputs_of_records(job.valid_table or job.table, fold.valid_rows, outputs)[1]


class Evaluations:
    """The loop's evaluation, which keeps the validation outputs of each step whose checkpoint is kept: the best
    step's are the fold's outputs."""

    def __init__(self, job: Job, fold: Fold) -> None:
        self.job, self.fold = job, fold
        self.outputs: dict[int, np.ndarray] = {}  # step -> validation outputs
        self.ranks: dict[int, float] = {}  # step -> its rank (lower is better) of this process's evaluations

    def evaluate(self, step: int, state: TrainState) -> dict[str, float]:
        began = time.perf_counter()
        self.outputs[step] = _valid_outputs(self.job, self.fold, state.params)
        found = {f"valid_{k}": v for k, v in scores(self.job, self.outputs[step], self.fold.valid_targets).items()}
        self.ranks[step] = rank(self.job, found)
        return {**found, "eval_seconds": time.perf_counter() - began}

    def keep(self, steps: set[int]) -> None:
        """Forget the outputs of the steps whose checkpoints are gone: they can no longer be the best."""
        for gone in [s for s in self.outputs if s not in steps]:
            del self.outputs[gone]

    def of_step(self, step: int, state: TrainState) -> np.ndarray:
        """The outputs of `step`, whose state is `state`: evaluated again when that was before a resume."""
        return self.outputs[step] if step in self.outputs else _valid_outputs(self.job, self.fold, state.params)
