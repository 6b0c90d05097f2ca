"""A fine-tuning fold's steps and when it evaluates and checkpoints: what finetune_fold's loop runs, and what a
comparison gives another trainer so that both do the same work."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from bertforge.train import loop


def fold_steps(train_rows: int, batch_size: int, epochs: float, evals_per_epoch: int) -> tuple[int, int, int]:
    """(steps per epoch, steps, evaluation interval) of a fold of `train_rows` training rows."""
    per_epoch = math.ceil(train_rows / batch_size)
    return per_epoch, max(1, round(epochs * per_epoch)), max(1, per_epoch // evals_per_epoch)


def evaluation_hook(steps: int, every: int, fn: Callable[..., Any]) -> loop.Every:
    # Counted back from the last step, so that the last evaluation is of the final model, with none just before it
    # (a few steps earlier) to pay for.
    return loop.Every(every, fn, offset=steps % every)


def checkpoint_hook(steps: int, every: int, fn: Callable[..., Any]) -> loop.Every:
    # The final state is written out as the fold's model, not as a checkpoint: a run stopped before that continues
    # from the last checkpoint and repeats the same steps.
    return loop.Every(every, fn, offset=steps % every, last=False)


def work_plan(train_rows: int, batch_size: int, epochs: float, evals_per_epoch: int) -> dict[str, Any]:
    """What an unbroken fold of `train_rows` training rows does: its steps, the steps after which it evaluates, and
    those after which it checkpoints (the train state, the optimizer's included); then it writes one model folder."""
    _, steps, every = fold_steps(train_rows, batch_size, epochs, evals_per_epoch)
    unused = lambda *_: None  # noqa: E731  # only when the hooks are due is asked
    hooks = evaluation_hook(steps, every, unused), checkpoint_hook(steps, every, unused)
    evaluations, checkpoints = loop.fires(*hooks, steps)
    return {"steps": steps, "evaluations": evaluations, "checkpoints": checkpoints}
