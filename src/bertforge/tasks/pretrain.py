"""`bertforge pretrain`: masked-LM or replaced-token detection pretraining (objectives.py) from scratch or from a
model, on preprocessed shards, resumable at any point.

The same command run again continues from the newest complete checkpoint, with the same data order, masks and
dropout, as if it had never stopped.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

import jax
from flax import nnx

from bertforge import hub, runs
from bertforge.config import to_dict
from bertforge.data.ramp import Ramp, make_loader, ramp_of
from bertforge.errors import UserError
from bertforge.model.config import ModelConfig, preset
from bertforge.model.rtd import RtdConfig, generator_config
from bertforge.runtime.devices import MeshConfig, build_mesh, fetch, process_0s, run_mesh
from bertforge.tasks import pretrain_suites
from bertforge.tasks.export import export_pretrained
from bertforge.tasks.pretrain_setup import (
    Inputs,
    ModelParts,
    StepCache,
    budget_of,
    compiler,
    resolve,
    resume_state,
    train_state,
    write_run_folder,
)
from bertforge.tasks.pretrain_suites import SuiteRuns
from bertforge.train import loop, objectives
from bertforge.train.checkpoint import Checkpoints
from bertforge.train.flops import device_peak_flops
from bertforge.train.metrics_log import LogConfig, MetricsLog
from bertforge.train.optim import OptimConfig, learning_rate, warmup_fraction
from bertforge.train.step import TrainState


@dataclasses.dataclass(frozen=True)
class ShardsConfig:
    shards: str = ""  # shard folder made by `bertforge preprocess`
    tokenizer: str = ""  # tokenizer folder (default: the one the shards were made with)
    seed: int = 0  # data order


@dataclasses.dataclass(frozen=True)
class PretrainTrainConfig:
    global_batch: int = 32
    grad_accum: int = 1
    max_steps: int | None = None
    max_epochs: float | None = None
    max_tokens: int | None = None
    time_budget_minutes: float | None = None
    seed: int = 0  # parameters, masks, dropout
    sparse_head: bool = True  # vocabulary projection only at masked positions
    batch_ramp: float = 0.0  # share of the run over which the batch grows to global_batch (0: none)
    batch_ramp_start: int | None = None  # rows per step at the start of the ramp (None: one micro-batch)

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.grad_accum < 1:
            raise ValueError("global_batch and grad_accum must be positive")
        if self.global_batch % self.grad_accum:
            raise ValueError(f"global_batch {self.global_batch} is not divisible by grad_accum {self.grad_accum}")
        self.ramp()  # checks the ramp's keys

    def ramp(self) -> Ramp | None:
        return ramp_of(self.global_batch, self.grad_accum, self.batch_ramp, self.batch_ramp_start)


@dataclasses.dataclass(frozen=True)
class MlmConfig:
    rate: float = 0.15
    mask_fraction: float = 0.8
    random_fraction: float = 0.1
    whole_word: bool = False


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    every: int = 200
    max_batches: int | None = None  # None: the whole validation split
    # Downstream scores while training: a suite (glue, jglue or a YAML file; a small one) that fine-tunes the model
    # every suite_every steps (a multiple of checkpoint.every) in a process of its own, on suite_data's files.
    suite: str = ""
    suite_data: str = ""
    suite_every: int = 0


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 200
    keep_last: int = 2
    keep_best: int = 1


# Settings a pretraining run may change when it continues, besides runs.FREE_SETTINGS: how long it trains (a finished
# run given a larger budget goes on) and how it is evaluated.
CONTINUABLE = ("train.max_steps", "train.max_epochs", "train.max_tokens", "train.time_budget_minutes", "eval")


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    model: ModelConfig = dataclasses.field(default_factory=lambda: preset("mini"))
    data: ShardsConfig = dataclasses.field(default_factory=ShardsConfig)
    train: PretrainTrainConfig = dataclasses.field(default_factory=PretrainTrainConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    mlm: MlmConfig = dataclasses.field(default_factory=MlmConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    hub: hub.HubConfig = dataclasses.field(default_factory=hub.HubConfig)
    # mlm: masked LM; rtd: replaced-token detection (ELECTRA, DeBERTa-v3), a generator and a discriminator (rtd).
    objective: Literal["mlm", "rtd"] = "mlm"
    rtd: RtdConfig = dataclasses.field(default_factory=RtdConfig)
    # Continue pretraining a Hugging Face folder, hub id or bertforge run: its weights (its MLM head, or a fresh one),
    # its architecture and its tokenizer, which must be the one the shards were made with.
    init_from: str = ""


# ------------------------------------------------------------------------------------------------------ run
@dataclasses.dataclass(frozen=True)
class _Run:
    """What the loop calls back (metric logging, evaluation, checkpoints and the Hub pushes that go with them), the
    end of the run and its clean-up."""

    cfg: PretrainConfig
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

    def write(self, step: int, metrics: dict[str, float]) -> None:
        tokens = self.loader.rows_served * self.inputs.train.seq_len
        metrics = {"epoch": self.loader.epoch_of(max(step - 1, 0)), "tokens": tokens, **metrics}
        self.last.update(metrics)
        self.log.record(step, metrics, ("loss", "lr", "valid_loss"))
        if self.suites is not None:
            self.suites.poll(step)

    def evaluate(self, step: int, state: TrainState) -> dict[str, float] | None:
        valid = self.inputs.valid
        return None if valid is None else objectives.evaluate(self.eval_fn, state.params, valid, self.cfg, self.mesh)

    def save(self, step: int, state: TrainState, evaluation: dict[str, float] | None) -> None:
        meta = {"loader": self.loader.state_dict(), "elapsed": self.last.get("elapsed", 0.0), "step": step}
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


def _banner(cfg: PretrainConfig, inputs: Inputs, num_params: int, mesh: Any, per_epoch: int, start_step: int) -> str:
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
        + (f"; resuming from step {start_step}" if start_step else "")
        + (f"; continuing {cfg.init_from}" if init is not None and not start_step else "")
        + ("; with a fresh masked-LM head" if init is not None and init.missing_head and not start_step else "")
    )


def _train(
    run: _Run, state: TrainState, step_fn: StepCache, budget: loop.Budget, start_step: int, elapsed: float
) -> tuple[int, float]:
    """The loop, then the last checkpoint and push; (the last step, the seconds the run has taken)."""
    cfg = run.cfg
    warmup = warmup_fraction(cfg.optim, budget.max_steps)
    peak = device_peak_flops(cfg.model.dtype)[0] * len(run.mesh.devices.flat)
    try:
        state, step, elapsed = loop.run(
            state,
            step_fn,
            next_batch=run.loader.next_at,
            lr_at=lambda p: learning_rate(cfg.optim, p, warmup),
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
        run.finish(step, state)
    except loop.NonFiniteLoss as e:
        raise run.non_finite(e) from None
    finally:
        run.close()
    return step, elapsed


def _suites(cfg: PretrainConfig, run_dir: Path, log: MetricsLog, start_step: int) -> SuiteRuns | None:
    """Process 0's suites of eval.suite, those a run before this one left logged or started again."""
    if not cfg.eval.suite or jax.process_index() != 0:
        return None
    suites = SuiteRuns(cfg.eval.suite, cfg.eval.suite_data, run_dir, log.write, log.message)
    suites.resume(start_step)
    return suites


# ------------------------------------------------------------------------------------------------------ main
def main(
    cfg: PretrainConfig, out: str, resume: str = "auto", vocab_given: bool = False, model_keys: Collection[str] = ()
) -> dict[str, Any]:
    """Pretrain; returns the last logged metrics. Raises loop.Preempted after saving when SIGTERM arrives.
    `model_keys`: the model section's keys the config gave (with init_from, only runtime ones may be; with
    vocab_size, as `vocab_given`, the model keeps its own vocabulary size rather than the tokenizer's)."""
    vocab_given = vocab_given or "vocab_size" in model_keys
    run_dir = Path(out)
    if not cfg.data.shards:
        raise UserError("no shards given (--data SHARDS or data.shards in the config)")
    if cfg.eval.suite:
        pretrain_suites.check(cfg.eval.suite, cfg.eval.suite_data, cfg.eval.suite_every, cfg.checkpoint.every)
    with runs.locked(run_dir):
        return _main(cfg, run_dir, resume, vocab_given, model_keys)


def _main(
    cfg: PretrainConfig, run_dir: Path, resume: str, vocab_given: bool, model_keys: Collection[str]
) -> dict[str, Any]:
    inputs = resolve(cfg, run_dir, vocab_given, model_keys)
    cfg = inputs.cfg
    mesh = build_mesh(cfg.mesh, cfg.train.global_batch, cfg.train.grad_accum, "train.global_batch")
    loader = make_loader(inputs.train, cfg.train.global_batch, cfg.train.ramp(), cfg.data.seed, mesh)
    budget = budget_of(cfg.train, loader.batches_per_epoch, inputs.train.seq_len)
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoints = Checkpoints(run_dir / runs.CHECKPOINTS, cfg.checkpoint.keep_last, cfg.checkpoint.keep_best)
    if resume == "auto" and checkpoints.latest_step() is not None:
        runs.check_settings(run_dir, cfg, CONTINUABLE)
    model, state = train_state(cfg, inputs.init, mesh)
    state, start_step, elapsed = resume_state(resume, run_dir, checkpoints, state, loader)
    if jax.process_index() == 0:
        write_run_folder(run_dir, cfg, inputs.tokenizer)
    step_fn = StepCache(cfg, compiler(cfg, inputs, model, mesh))
    log = MetricsLog(run_dir, cfg.log, budget.max_steps, start_step, to_dict(cfg))
    publisher = hub.open_publisher(cfg.hub, log.message)
    suites = _suites(cfg, run_dir, log, start_step)
    run = _Run(cfg, run_dir, inputs, model, mesh, loader, step_fn.eval_fn, log, checkpoints, publisher, suites)
    log.message(_banner(cfg, inputs, model.num_params, mesh, loader.batches_per_epoch, start_step))
    with run_mesh(mesh):  # the programs are traced at their first use
        step, elapsed = _train(run, state, step_fn, budget, start_step, elapsed)
    return {**run.last, "step": step, "elapsed": elapsed}
