"""Running a pretraining in phases (tasks/phases.py has what a phase is): each phase's shards, model and step
program, its piece of the schedule, and the loop over the phases, resumable in any of them."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from pathlib import Path
from typing import Any

import jax

from bertforge import hub, runs
from bertforge.config import to_dict
from bertforge.data.ramp import make_loader
from bertforge.errors import UserError
from bertforge.runtime.devices import build_mesh, run_mesh
from bertforge.tasks.phases import ROTARY, Phase, local_progress, phase_configs, steps_of
from bertforge.tasks.pretrain_run import Run, banner, run_loop, suite_runs
from bertforge.tasks.pretrain_setup import (
    CONTINUABLE,
    Inputs,
    ModelParts,
    StepCache,
    compiler,
    phase_inputs,
    phase_parts,
    resolve,
    restored,
    train_state,
    write_run_folder,
)
from bertforge.train import loop
from bertforge.train.checkpoint import Checkpoints
from bertforge.train.metrics_log import MetricsLog
from bertforge.train.optim import learning_rate, warmup_fraction
from bertforge.train.step import TrainState


# ------------------------------------------------------------------------------------------------------ phases
def _planned(cfg: Any, inputs: Inputs) -> list[tuple[Phase, Inputs]]:
    """Each phase with its step range and what it reads, checked before the first step of the first."""
    if cfg.train.batch_ramp:
        raise UserError("train.batch_ramp: a run in phases keeps one batch size")
    planned, start = [], 0
    for i, (name, phase_cfg, phase) in enumerate(phase_configs(cfg)):
        if phase.model and phase_cfg.model.family not in ROTARY:  # the model continued, when there is one
            raise UserError(f"phases[{i}].model: only a rotary model ({', '.join(ROTARY)}) changes its positions")
        phase_in = phase_inputs(inputs, phase_cfg)
        steps = steps_of(phase, cfg.train.global_batch, phase_in.train.seq_len, f"phases[{i}]")
        planned.append((Phase(i, name, phase_cfg, start, steps), phase_in))
        start += steps
    return planned


def main_phases(cfg: Any, run_dir: Path, resume: str, vocab_given: bool, model_keys: Collection[str]) -> dict[str, Any]:
    """pretrain.main for a config with phases: each phase in turn from the step the run's newest checkpoint holds (its
    phase's data position restored when the checkpoint fell inside it), then the last checkpoint and push."""
    # The shards are checked against the model as each phase runs it, in _planned.
    inputs = resolve(phase_configs(cfg)[0][1], run_dir, vocab_given, model_keys, check_data=False)
    cfg = dataclasses.replace(cfg, model=inputs.cfg.model)  # fitted to the tokenizer (the first phase's changes in)
    plan = _planned(cfg, inputs)
    mesh = build_mesh(cfg.mesh, cfg.train.global_batch, cfg.train.grad_accum, "train.global_batch")
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoints = Checkpoints(run_dir / runs.CHECKPOINTS, cfg.checkpoint.keep_last, cfg.checkpoint.keep_best)
    if resume == "auto" and checkpoints.latest_step() is not None:
        runs.check_settings(run_dir, cfg, CONTINUABLE)
    first, state = train_state(plan[0][0].cfg, inputs.init, mesh)
    state, meta = restored(resume, run_dir, checkpoints, state)
    step, elapsed = (0, 0.0) if meta is None else (int(state.step), float(meta.get("elapsed", 0.0)))
    if jax.process_index() == 0:
        write_run_folder(run_dir, cfg, inputs.tokenizer)
    log = MetricsLog(run_dir, cfg.log, plan[-1][0].end, step, to_dict(cfg))
    shared = {"log": log, "checkpoints": checkpoints, "publisher": hub.open_publisher(cfg.hub, log.message),
              "suites": suite_runs(cfg, run_dir, log, step), "last": {}, "published": []}  # fmt: skip
    run, started = None, step
    try:
        for (phase, phase_in), tokens_before in zip(plan, _tokens_before(plan, cfg.train.global_batch), strict=True):
            if step >= phase.end and phase is not plan[-1][0]:
                continue
            if run is not None:
                run.loader.close()
            run, step_fn = _phase_run(phase, phase_in, first, state, mesh, run_dir, shared, tokens_before)
            if meta is not None and meta.get("phase") == phase.index and step > phase.start:
                run.loader.load_state_dict(meta["loader"])  # a phase stopped part-way; at its start: from the start
            resumed = step if step == started else 0  # a later phase is no resumption
            log.message(banner(phase.cfg, phase_in, first.num_params, mesh, run.loader.batches_per_epoch, resumed)
                        + f"; {phase.name}: steps {phase.start + 1}-{phase.end}")  # fmt: skip
            lr_at = _phase_lr(phase)
            with run_mesh(mesh):
                state, step, elapsed = run_loop(run, state, step_fn, loop.Budget(phase.end), step, elapsed, lr_at)
        assert run is not None
        run.finish(step, state)
    except loop.NonFiniteLoss as e:
        raise run.non_finite(e) from None  # type: ignore[union-attr]
    finally:
        if run is not None:
            run.close()
    return {**shared["last"], "step": step, "elapsed": elapsed}


def _phase_run(
    phase: Phase, phase_in: Inputs, first: ModelParts, state: TrainState, mesh: Any, run_dir: Path, shared: dict,
    tokens_before: int,
) -> tuple[Run, StepCache]:  # fmt: skip
    model = phase_parts(phase.cfg, first, state.params)  # the phase's positions, also over an --init-from model
    step_fn = StepCache(phase.cfg, compiler(phase.cfg, phase_in, model, mesh))
    loader = make_loader(phase_in.train, phase.cfg.train.global_batch, None, phase.cfg.data.seed, mesh)
    run = Run(phase.cfg, run_dir, phase_in, model, mesh, loader, step_fn.eval_fn, **shared, phase=phase,
               tokens_before=tokens_before)  # fmt: skip
    return run, step_fn


def _phase_lr(phase: Phase) -> Any:
    """The learning rate at the loop's progress: the phase's schedule over its own steps."""
    warmup = warmup_fraction(phase.cfg.optim, phase.steps)
    return lambda progress: learning_rate(phase.cfg.optim, local_progress(progress, phase), warmup)


def _tokens_before(plan: list[tuple[Phase, Inputs]], global_batch: int) -> list[int]:
    sizes = [p.steps * global_batch * phase_in.train.seq_len for p, phase_in in plan]
    return [sum(sizes[:i]) for i in range(len(sizes))]
