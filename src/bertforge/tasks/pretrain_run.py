"""A pretraining run's side of the loop: what it calls back (metrics, evaluation, checkpoints, Hub pushes, suites),
the loop with them, its banner, and its end."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from bertforge import hub, runs
from bertforge.data.mixture import MixedShards
from bertforge.errors import UserError
from bertforge.model.rtd import generator_config
from bertforge.runtime.devices import fetch, process_0s
from bertforge.tasks.export import export_pretrained
from bertforge.tasks.phases import Phase, phase_model
from bertforge.tasks.pretrain_setup import Inputs, ModelParts, StepCache
from bertforge.tasks.pretrain_suites import SuiteRuns
from bertforge.train import loop, objectives
from bertforge.train.checkpoint import Checkpoints
from bertforge.train.flops import device_peak_flops
from bertforge.train.metrics_log import MetricsLog
from bertforge.train.optim import learning_rate, warmup_fraction
from bertforge.train.step import TrainState


# ------------------------------------------------------------------------------------------------------ run
@dataclasses.dataclass(frozen=True)
class Run:
    """What the loop calls back (metric logging, evaluation, checkpoints and the Hub pushes that go with them), the
    end of the run and its clean-up."""

    cfg: Any
    run_dir: Path
    inputs: Inputs
    model: ModelParts
    mesh: Any
    loader: Any
    eval_fn: Any
    log: MetricsLog
    checkpoints: Checkpoints
    publisher: hub.Publisher | None
    suites: SuiteRuns | None = None  # process 0's, when eval.suite is set
    last: dict[str, Any] = dataclasses.field(default_factory=dict)  # the latest value of every metric logged
    published: list[int] = dataclasses.field(default_factory=list)  # the steps exported for the Hub
    phase: Phase | None = None  # of a run in phases: the one running
    tokens_before: int = 0  # of a run in phases: the tokens of the phases before this one

    def write(self, step: int, metrics: dict[str, float]) -> None:
        tokens = self.tokens_before + self.loader.rows_served * self.inputs.train.seq_len
        metrics = {"epoch": self.loader.epoch_of(max(step - 1, 0)), "tokens": tokens, **metrics}
        if self.phase is not None:
            metrics["phase"] = self.phase.name
        by_source = getattr(self.loader, "tokens_by_source", lambda: None)()
        if by_source is not None:
            metrics["tokens_by_source"] = by_source
        self.last.update(metrics)
        self.log.record(step, metrics, ("loss", "lr", "valid_loss"))
        if self.suites is not None:
            self.suites.poll(step)

    def evaluate(self, step: int, state: TrainState) -> dict[str, float] | None:
        valid = self.inputs.valid
        if isinstance(valid, MixedShards):
            return objectives.evaluate_mixture(self.eval_fn, state.params, valid, self.cfg, self.mesh)
        return None if valid is None else objectives.evaluate(self.eval_fn, state.params, valid, self.cfg, self.mesh)

    def save(self, step: int, state: TrainState, evaluation: dict[str, float] | None) -> None:
        meta = {"loader": self.loader.state_dict(), "elapsed": self.last.get("elapsed", 0.0), "step": step}
        if self.phase is not None:  # which phase the loader's position is of, and the model that phase runs
            meta |= {"phase": self.phase.index, "tokens_before": self.tokens_before, "model": phase_model(self.phase)}
        valid_loss = None if evaluation is None else evaluation["valid_loss"]
        self.checkpoints.save(step, state, meta, valid_loss=valid_loss)
        if self.cfg.hub.due(step, self.cfg.checkpoint.every):
            self.publish(step, state)
        if self.cfg.eval.suite and step % self.cfg.eval.suite_every == 0:
            params = fetch(state.params)  # every process gives its part; process 0 exports
            if self.suites is not None:
                self.suites.start(step, functools.partial(self._export, params, step))

    def publish(self, step: int, state: TrainState) -> None:
        """The model at `step` exported and handed to the background push (every process fetches its part)."""
        params = fetch(state.params)
        self.published.append(step)
        if self.publisher is not None:
            export = functools.partial(self._export, params, step)
            hub.stage(self.publisher, self.run_dir, f"step-{step}", export, f"step {step}")

    def _export(self, params: Any, step: int, folder: Path) -> None:
        model = objectives.exported(nnx.merge(self.model.graphdef, params, self.model.rest))
        repo, card = self.cfg.hub.repo, self.cfg.hub.card()
        export_pretrained(model, self.inputs.tokenizer, self.run_dir, folder, step, repo, card)

    def finish(self, step: int, state: TrainState) -> None:
        """After the last step: its checkpoint and push unless made already, and the wait for both."""
        if self.checkpoints.latest_step() != step:
            self.save(step, state, None)
        if self.cfg.hub.repo and step not in self.published:
            self.publish(step, state)
        self.checkpoints.wait()
        hub.finish(self.publisher, self.log.message)
        if self.suites is not None:
            self.suites.finish(step)

    def non_finite(self, e: loop.NonFiniteLoss) -> UserError:
        """The error that stops the run, naming the last good checkpoint."""
        self.checkpoints.wait()
        good = self.checkpoints.latest_step()
        where = (
            f"the last good checkpoint is {self.run_dir / runs.CHECKPOINTS / str(good)}"
            if good is not None
            else "no checkpoint"
        )
        return loop.non_finite_error(e, after=f"; no weights were updated with it and {where}")

    def close(self) -> None:
        hub.abandon(self.publisher)
        self.loader.close()
        self.log.close()
        self.checkpoints.close()


def banner(cfg: Any, inputs: Inputs, num_params: int, mesh: Any, per_epoch: int, start_step: int) -> str:
    model_cfg, init, devices = cfg.model, inputs.init, len(mesh.devices.flat)
    if cfg.objective == "rtd":
        gen = generator_config(model_cfg, cfg.rtd)
        what = f"replaced-token detection, a {model_cfg.num_layers}x{model_cfg.hidden_size} discriminator and a "
        what += f"{gen.num_layers}x{gen.hidden_size} generator"
    else:
        what = f"masked LM, {model_cfg.num_layers}x{model_cfg.hidden_size}"
    return (
        f"pretraining ({what}; {num_params / 1e6:.1f} M parameters) "
        f"on {devices} device(s) {dict(mesh.shape)}: global batch {cfg.train.global_batch} "
        f"({cfg.train.global_batch // devices} per device"
        f"{f', {cfg.train.grad_accum} accumulation steps' if cfg.train.grad_accum > 1 else ''}) x "
        f"{inputs.train.seq_len} tokens, {per_epoch} batches per epoch"
        + (f" of {inputs.train.describe()}" if isinstance(inputs.train, MixedShards) else "")
        + (f"; resuming from step {start_step}" if start_step else "")
        + (f"; continuing {cfg.init_from}" if init is not None and not start_step else "")
        + ("; with a fresh masked-LM head" if init is not None and init.missing_head and not start_step else "")
    )


def train(
    run: Run, state: TrainState, step_fn: StepCache, budget: loop.Budget, start_step: int, elapsed: float
) -> tuple[int, float]:
    """The loop, then the last checkpoint and push; (the last step, the seconds the run has taken)."""
    warmup = warmup_fraction(run.cfg.optim, budget.max_steps)
    try:
        lr_at = functools.partial(learning_rate, run.cfg.optim, warmup=warmup)
        state, step, elapsed = run_loop(run, state, step_fn, budget, start_step, elapsed, lr_at)
        run.finish(step, state)
    except loop.NonFiniteLoss as e:
        raise run.non_finite(e) from None
    finally:
        run.close()
    return step, elapsed


def run_loop(
    run: Run, state: TrainState, step_fn: StepCache, budget: loop.Budget, start_step: int, elapsed: float, lr_at: Any
) -> tuple[TrainState, int, float]:
    """loop.run with the run's callbacks: (the state, the last step, the seconds the run has taken)."""
    cfg = run.cfg
    peak = device_peak_flops(cfg.model.dtype)[0] * len(run.mesh.devices.flat)
    return loop.run(
        state,
        step_fn,
        next_batch=run.loader.next_at,
        lr_at=lr_at,
        budget=budget,
        log=run.write,
        log_every=cfg.log.every,
        start_step=start_step,
        evaluate=loop.Every(cfg.eval.every, run.evaluate),
        checkpoint=loop.Every(cfg.checkpoint.every, run.save),
        preemptible=True,
        elapsed_before=elapsed,
        tokens_in=lambda batch: batch.size,
        flops_per_token=objectives.flops_per_token(cfg, cfg.model, run.inputs.train.seq_len),
        peak_flops=peak,
        clock=process_0s if budget.seconds is not None and jax.process_count() > 1 else None,
    )


def suite_runs(cfg: Any, run_dir: Path, log: MetricsLog, start_step: int) -> SuiteRuns | None:
    """Process 0's suites of eval.suite, those a run before this one left logged or started again."""
    if not cfg.eval.suite or jax.process_index() != 0:
        return None
    suites = SuiteRuns(cfg.eval.suite, cfg.eval.suite_data, run_dir, log.write, log.message)
    suites.resume(start_step)
    return suites
