"""`bertforge pretrain`: masked-LM or replaced-token detection pretraining (objectives.py) from scratch or from a
model, on preprocessed shards, resumable at any point.

The same command run again continues from the newest complete checkpoint, with the same data order, masks and
dropout, as if it had never stopped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

import jax

from bertforge import hub, runs
from bertforge.config import to_dict
from bertforge.data.ramp import Ramp, make_loader, ramp_of
from bertforge.errors import UserError
from bertforge.model.config import ModelConfig, preset
from bertforge.model.rtd import RtdConfig
from bertforge.runtime.devices import MeshConfig, build_mesh, run_mesh
from bertforge.tasks import pretrain_suites
from bertforge.tasks.phases import PhaseConfig
from bertforge.tasks.pretrain_phases import main_phases
from bertforge.tasks.pretrain_run import Run, banner, suite_runs, train
from bertforge.tasks.pretrain_setup import (
    CONTINUABLE,
    StepCache,
    budget_of,
    compiler,
    resolve,
    resume_state,
    train_state,
    write_run_folder,
)
from bertforge.train.checkpoint import Checkpoints
from bertforge.train.metrics_log import LogConfig, MetricsLog
from bertforge.train.optim import OptimConfig


@dataclasses.dataclass(frozen=True)
class ShardsConfig:
    shards: str = ""  # shard folder made by `bertforge preprocess` (--data PATH=WEIGHT given twice or more: sources)
    # In place of shards, a mixture of shard folders of one tokenizer and one sequence length (data/mixture.py):
    # PATH=WEIGHT each, or PATH each, weighed by temperature.
    sources: tuple[str, ...] = ()
    temperature: float | None = None  # sources' weights proportional to their size^temperature (null: 1, as sizes)
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
    # A moving average of the weights with this decay (0.999, 0.9999), kept beside them (train/ema.py) and exported
    # with `export --weights ema`; 0: none. It holds one more copy of the weights.
    ema: float = 0.0

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.grad_accum < 1:
            raise ValueError("global_batch and grad_accum must be positive")
        if not 0 <= self.ema < 1:
            raise ValueError(f"ema {self.ema}: a decay in [0, 1), such as 0.999 (0: no moving average)")
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
    # Phases (tasks/phases.py), each with its steps or tokens and its own data, masking, schedule piece and rotary
    # positions; one command runs them all. Empty: one phase, the config as it is.
    phases: tuple[PhaseConfig, ...] = ()


# ------------------------------------------------------------------------------------------------------ main
def main(
    cfg: PretrainConfig, out: str, resume: str = "auto", vocab_given: bool = False, model_keys: Collection[str] = ()
) -> dict[str, Any]:
    """Pretrain; returns the last logged metrics. Raises loop.Preempted after saving when SIGTERM arrives.
    `model_keys`: the model section's keys the config gave (with init_from, only runtime ones may be; with
    vocab_size, as `vocab_given`, the model keeps its own vocabulary size rather than the tokenizer's)."""
    vocab_given = vocab_given or "vocab_size" in model_keys
    run_dir = Path(out)
    if not cfg.data.shards and not cfg.data.sources and not any(p.data for p in cfg.phases):
        raise UserError("no shards given (--data SHARDS or data.shards in the config, or data.sources)")
    if cfg.eval.suite:
        pretrain_suites.check(cfg.eval.suite, cfg.eval.suite_data, cfg.eval.suite_every, cfg.checkpoint.every)
    with runs.locked(run_dir):
        if cfg.phases:
            return main_phases(cfg, run_dir, resume, vocab_given, model_keys)
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
    suites = suite_runs(cfg, run_dir, log, start_step)
    run = Run(cfg, run_dir, inputs, model, mesh, loader, step_fn.eval_fn, log, checkpoints, publisher, suites)
    log.message(banner(cfg, inputs, model.num_params, mesh, loader.batches_per_epoch, start_step))
    with run_mesh(mesh):  # the programs are traced at their first use
        step, elapsed = train(run, state, step_fn, budget, start_step, elapsed)
    return {**run.last, "step": step, "elapsed": elapsed}
