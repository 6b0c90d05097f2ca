"""The same work on both sides of a fine-tuning comparison, by construction.

bertforge's fold evaluates and checkpoints at steps its own rule picks (bertforge.tasks.fold_steps). `plan` computes
them for a recipe, and `trainer_callback` makes a transformers (or sentence-transformers) Trainer evaluate and save
after exactly those steps, and at no other: its own strategies are off (eval_strategy and save_strategy "no"), so it
neither evaluates at the last step on its own nor saves a checkpoint bertforge does not. `finish` then does what
bertforge does after its last step: picks the best evaluation (a tie goes to the later step), loads that checkpoint
when it is not the final state, and writes one model folder; the score is the one that evaluation logged, never an
extra `evaluate()`.

`environment` is the process environment both sides run in: the allocator tunables bertforge's command gives itself
on a CPU (bertforge.runtime.allocator) are given to the reference's process too. `order` alternates the systems'
order from seed to seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from bertforge.runtime.allocator import tuned_environment
from bertforge.tasks.fold_steps import work_plan

TRAINER = "transformers Trainer (PyTorch)"
REFERENCES = {"shipped": TRAINER, "tuned": f"{TRAINER}, group_by_length"}  # a reference's rows, by variant


def index_name(system: str) -> str:
    """A comparison's system as the results index names it: the Trainer whatever its variant, else as it is."""
    return TRAINER if system.startswith(TRAINER) else system


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A benchmark's training recipe: what decides its steps, evaluations and saves."""

    benchmark: str  # the script
    name: str
    train_rows: int  # the rows (or windows) one epoch trains on, as the script's split of its public set gives them
    batch_size: int
    epochs: float
    evals_per_epoch: int


def plan(train_rows: int, batch_size: int, epochs: float, evals_per_epoch: int) -> dict[str, Any]:
    """{"steps", "evaluations": [step, ...], "checkpoints": [step, ...]}: what bertforge's fold does (its model
    folder written once at the end besides)."""
    return work_plan(train_rows, batch_size, epochs, evals_per_epoch)


def recipe_plan(recipe: Recipe) -> dict[str, Any]:
    return plan(recipe.train_rows, recipe.batch_size, recipe.epochs, recipe.evals_per_epoch)


def trainer_arguments(work: dict[str, Any]) -> dict[str, Any]:
    """The TrainingArguments that leave evaluations and saves to `trainer_callback` and run `work`'s steps."""
    return {"max_steps": work["steps"], "eval_strategy": "no", "save_strategy": "no", "save_total_limit": None,
            "load_best_model_at_end": False}  # fmt: skip


def trainer_callback(work: dict[str, Any]) -> Any:
    """A TrainerCallback that asks for an evaluation after each of `work`'s evaluation steps and a checkpoint after
    each of its checkpoint steps, and for neither after any other step; it counts what the Trainer did."""
    from transformers import TrainerCallback

    evaluations, checkpoints = set(work["evaluations"]), set(work["checkpoints"])

    class SameWork(TrainerCallback):
        def __init__(self) -> None:
            self.evaluated: list[int] = []
            self.saved: list[int] = []

        def on_step_end(self, _args, state, control, **kw):
            control.should_evaluate = state.global_step in evaluations
            control.should_save = state.global_step in checkpoints
            return control

        def on_evaluate(self, _args, state, _control, **kw):
            self.evaluated.append(state.global_step)

        def on_save(self, _args, state, _control, **kw):
            self.saved.append(state.global_step)

    return SameWork()


def best_evaluation(log_history: list[dict], metric: str, higher_is_better: bool) -> dict:
    """The logged evaluation that ranks best by `metric` (eval_<metric>), a tie going to the later step, as
    bertforge picks among its evaluations."""
    key = metric if metric.startswith("eval_") else f"eval_{metric}"
    found = [h for h in log_history if key in h]
    if not found:
        raise ValueError(f"no evaluation logged {key}")
    sign = 1.0 if higher_is_better else -1.0
    rank = lambda h: -math.inf if math.isnan(h[key]) else sign * h[key]  # noqa: E731  # undefined ranks last
    best = found[0]
    for h in found[1:]:
        if rank(h) >= rank(best):
            best = h
    return best


def finish(trainer: Any, metric: str, higher_is_better: bool, model_dir: Path) -> dict[str, Any]:
    """After `trainer.train()`: the best evaluation's model (its checkpoint loaded unless it is the final state)
    written to `model_dir` once; -> {"score", "best_step", "evaluation": the whole logged evaluation}."""
    best = best_evaluation(trainer.state.log_history, metric, higher_is_better)
    step = best["step"]
    if step != trainer.state.global_step:
        # What load_best_model_at_end does, for the checkpoint this callback had saved after that evaluation.
        trainer._load_from_checkpoint(os.path.join(trainer.args.output_dir, f"checkpoint-{step}"))
    trainer.save_model(str(model_dir))
    key = metric if metric.startswith("eval_") else f"eval_{metric}"
    return {"score": best[key], "best_step": step, "evaluation": best}


def environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment both systems' processes get: `base` (os.environ) with the allocator tunables that
    `bertforge finetune` would run itself again with on this machine, so that neither process has an allocator the
    other lacks."""
    base = dict(os.environ if base is None else base)
    return tuned_environment(base, command="finetune") or base


def order(systems: list[Any], seed_index: int) -> list[Any]:
    """`systems` rotated by the seed's index: each system runs first on every len(systems)-th seed."""
    k = seed_index % len(systems)
    return systems[k:] + systems[:k]


def reference_options(p: argparse.ArgumentParser) -> None:
    """A comparison's --references (its runs, one per variant) and the worker's --reference."""
    p.add_argument("--references", nargs="+", choices=["shipped", "tuned"], default=["shipped", "tuned"],
                   help="the Trainer as shipped (random batches) and tuned (group_by_length)")  # fmt: skip
    p.add_argument("--reference", choices=["shipped", "tuned"], default="tuned", help=argparse.SUPPRESS)
