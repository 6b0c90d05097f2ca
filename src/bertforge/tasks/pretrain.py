"""`bertforge pretrain`: masked-LM or replaced-token detection pretraining (objectives.py) from scratch or from a
model, on preprocessed shards, resumable at any point.

The same command run again continues from the newest complete checkpoint, with the same data order, masks and
dropout, as if it had never stopped.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from bertforge import hub, runs
from bertforge.config import to_dict
from bertforge.data.ramp import Ramp, make_loader, ramp_of
from bertforge.data.shards import Shards
from bertforge.errors import UserError
from bertforge.fileio import write_folder_atomic
from bertforge.model.architectures import SEGMENT_FAMILIES, count_params
from bertforge.model.config import ModelConfig, preset
from bertforge.model.load import load_to_continue
from bertforge.model.rtd import RtdConfig, generator_config
from bertforge.runtime.devices import MeshConfig, build_mesh, fetch, param_shardings, process_0s
from bertforge.tasks.export import export_pretrained
from bertforge.tasks.init import fit_to_tokenizer
from bertforge.tokenizer.load import Tokenizer
from bertforge.train import loop, objectives
from bertforge.train.checkpoint import Checkpoints
from bertforge.train.flops import device_peak_flops
from bertforge.train.loss_scale import with_loss_scale
from bertforge.train.metrics_log import LogConfig, MetricsLog
from bertforge.train.optim import OptimConfig, learning_rate, make_optimizer, warmup_fraction
from bertforge.train.step import TrainState, new_train_state


@dataclasses.dataclass(frozen=True)
class DataConfig:
    shards: str = ""  # shard folder made by `bertforge preprocess`
    tokenizer: str = ""  # tokenizer folder (default: the one the shards were made with)
    seed: int = 0  # data order


@dataclasses.dataclass(frozen=True)
class TrainConfig:
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


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 200
    keep_last: int = 2
    keep_best: int = 1


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    model: ModelConfig = dataclasses.field(default_factory=lambda: preset("mini"))
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
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


HUB_STAGING = ".hub"  # RUN/.hub/step-N: exports waiting for their push to the Hub


# ------------------------------------------------------------------------------------------------------ set-up
def total_steps(cfg: TrainConfig, batches_per_epoch: int, seq_len: int) -> int | None:
    options = []
    if cfg.max_steps is not None:
        options.append(cfg.max_steps)
    if cfg.max_epochs is not None:
        options.append(max(1, int(round(cfg.max_epochs * batches_per_epoch))))
    if cfg.max_tokens is not None:
        options.append(max(1, cfg.max_tokens // (cfg.global_batch * seq_len)))
    return min(options) if options else None


def _restore_from(path: Path, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
    """--resume PATH: a step folder (RUN/checkpoints/N) or a run folder (its latest checkpoint)."""
    directory, step = (path.parent, int(path.name)) if path.name.isdigit() else (path / runs.CHECKPOINTS, None)
    if not directory.is_dir():
        raise UserError(f"{path}: no checkpoint to resume from")
    source = Checkpoints(directory)
    try:
        if step is None:
            found = source.restore_newest_good(state)
            if found is None:
                raise UserError(f"{path}: no whole checkpoint to resume from")
            return found[1], found[2]
        if step not in source.all_steps():
            raise UserError(f"{path}: no checkpoint to resume from")
        return source.restore(step, state)
    finally:
        source.close()


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
    with runs.locked(run_dir):
        return _main(cfg, run_dir, resume, vocab_given, model_keys)


def _main(
    cfg: PretrainConfig, run_dir: Path, resume: str, vocab_given: bool, model_keys: Collection[str]
) -> dict[str, Any]:
    train_shards = Shards(cfg.data.shards, "train")
    manifest = train_shards.manifest
    tokenizer_dir = cfg.data.tokenizer
    run_tokenizer = run_dir / runs.TOKENIZER
    if not tokenizer_dir and (run_tokenizer / "tokenizer.json").exists():
        tokenizer_dir = str(run_tokenizer)  # a resumed run uses its own copy
    if cfg.init_from and cfg.objective == "rtd":
        raise UserError(f"--init-from {cfg.init_from}: continuing from a model is for objective mlm, not rtd")
    if cfg.objective == "rtd" and cfg.model.dtype == "float16":
        raise UserError("model.dtype=float16 is for objective mlm: replaced-token detection has no loss scale")
    init = load_to_continue(cfg.init_from, cfg.model, model_keys, cfg.train.seed) if cfg.init_from else None
    if init is not None:
        tokenizer, tokenizer_dir = init.tokenizer, f"{cfg.init_from} (--init-from)"
    elif tokenizer_dir:
        tokenizer = Tokenizer.load(tokenizer_dir)
    else:
        tokenizer, tokenizer_dir = train_shards.tokenizer()
    train_shards.check_tokenizer(tokenizer, tokenizer_dir)
    model_cfg = init.model.config if init is not None else fit_to_tokenizer(cfg.model, tokenizer, vocab_given)
    train_shards.check_model(model_cfg.max_seq_len, model_cfg.vocab_size, "the model (model.max_position_embeddings)")
    if train_shards.packed and model_cfg.family not in SEGMENT_FAMILIES:
        raise UserError(
            f"{cfg.data.shards}: packed shards need an architecture that attends within each packed sequence "
            f"({', '.join(SEGMENT_FAMILIES)}), not {model_cfg.family}; preprocess without --pack"
        )
    valid_shards = Shards(cfg.data.shards, "valid")
    if valid_shards.num_sequences == 0:
        valid_shards = None
    else:
        valid_shards.verify()  # checked now rather than at the first evaluation, steps later
    cfg = dataclasses.replace(cfg, model=model_cfg)

    mesh = build_mesh(cfg.mesh, cfg.train.global_batch, cfg.train.grad_accum, "train.global_batch")
    micro = cfg.train.global_batch // cfg.train.grad_accum
    loader = make_loader(train_shards, cfg.train.global_batch, cfg.train.ramp(), cfg.data.seed, mesh)
    seq_len = train_shards.seq_len
    steps = total_steps(cfg.train, loader.batches_per_epoch, seq_len)
    seconds = cfg.train.time_budget_minutes * 60 if cfg.train.time_budget_minutes else None
    if steps is None and seconds is None:
        raise UserError(
            "no budget: set train.max_steps, train.max_epochs, train.max_tokens or train.time_budget_minutes"
        )
    budget = loop.Budget(max_steps=steps, seconds=seconds)

    # Model, optimizer and state, laid out on the mesh by the logical-axis rules.
    model = init.model if init is not None else objectives.build_model(cfg, model_cfg, cfg.train.seed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    shardings = param_shardings(model, mesh)
    params = jax.device_put(params, shardings)
    tx = with_loss_scale(make_optimizer(cfg.optim, params, model_cfg.num_layers), model_cfg.dtype)
    state = new_train_state(params, tx, mesh)
    state_shardings = jax.tree.map(lambda x: x.sharding, state)

    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoints = Checkpoints(run_dir / runs.CHECKPOINTS, cfg.checkpoint.keep_last, cfg.checkpoint.keep_best)
    key = jax.random.key(cfg.train.seed)
    start_step, elapsed = 0, 0.0
    if resume in ("auto", "never"):
        state, meta = runs.resume(checkpoints, state, run_dir, resume)
    else:
        state, meta = _restore_from(Path(resume), state)
    if meta is not None:
        loader.load_state_dict(meta["loader"])
        start_step, elapsed = int(state.step), float(meta.get("elapsed", 0.0))

    if jax.process_index() == 0:
        shutil.rmtree(run_dir / HUB_STAGING, ignore_errors=True)  # exports a killed run had not pushed yet
        if not (run_tokenizer / "tokenizer.json").exists():
            write_folder_atomic(run_tokenizer, tokenizer.save)
        runs.write_config(run_dir, cfg)
        info = {"model": to_dict(model_cfg), "shards": cfg.data.shards, "objective": cfg.objective}
        runs.write_info(run_dir, "pretrain", info)

    masking = objectives.masking_spec(cfg, tokenizer, manifest["special_ids"], model_cfg.vocab_size)
    ids = (tokenizer.pad_id, tokenizer.cls_id if train_shards.packed else None)  # padding, packed rows' [CLS]
    step_jit, eval_fn = objectives.compile_steps(cfg, graphdef, rest, tx, state_shardings, mesh, seq_len, masking, *ids)

    compiled = {cfg.train.grad_accum: step_jit}  # by micro-batches per step: one program per size a ramp takes

    def step_fn(state: TrainState, batch: Any, lr: float) -> tuple[TrainState, dict[str, Any]]:
        n = batch.shape[0] // micro
        if n not in compiled:
            train = dataclasses.replace(
                cfg.train, global_batch=n * micro, grad_accum=n, batch_ramp=0.0, batch_ramp_start=None
            )
            c = dataclasses.replace(cfg, train=train)
            compiled[n] = objectives.compile_steps(
                c, graphdef, rest, tx, state_shardings, mesh, seq_len, masking, *ids
            )[0]
        return compiled[n](state, batch, jnp.float32(lr), key)

    warmup = warmup_fraction(cfg.optim, steps)
    flops = objectives.flops_per_token(cfg, model_cfg, seq_len)
    peak = device_peak_flops(model_cfg.dtype)[0] * len(mesh.devices.flat)
    log = MetricsLog(run_dir, cfg.log, steps, start_step, to_dict(cfg))
    last: dict[str, Any] = {}

    def write(step: int, metrics: dict[str, float]) -> None:
        metrics = {"epoch": loader.epoch_of(max(step - 1, 0)), "tokens": loader.rows_served * seq_len, **metrics}
        last.update(metrics)
        log.record(step, metrics, ("loss", "lr", "valid_loss"))

    publisher = hub.Publisher(cfg.hub, log.message) if cfg.hub.repo and jax.process_index() == 0 else None
    published: list[int] = []

    def publish(step: int, state: TrainState) -> None:
        """The model at `step` exported and handed to the background push (every process fetches its part)."""
        params = fetch(state.params)
        published.append(step)
        if publisher is None:
            return
        folder = run_dir / HUB_STAGING / f"step-{step}"
        model = objectives.exported(nnx.merge(graphdef, params, rest))
        export_pretrained(model, tokenizer, run_dir, folder, step, cfg.hub.repo, cfg.hub.card())
        publisher.submit(folder, f"step {step}")

    def save(step: int, state: TrainState, evaluation: dict[str, float] | None) -> None:
        meta = {"loader": loader.state_dict(), "elapsed": last.get("elapsed", 0.0), "step": step}
        checkpoints.save(step, state, meta, valid_loss=None if evaluation is None else evaluation["valid_loss"])
        if cfg.hub.repo and (step // cfg.checkpoint.every) % cfg.hub.every == 0:
            publish(step, state)

    def evaluate(step: int, state: TrainState) -> dict[str, float] | None:
        return None if valid_shards is None else objectives.evaluate(eval_fn, state.params, valid_shards, cfg, mesh)

    if cfg.objective == "rtd":
        gen = generator_config(model_cfg, cfg.rtd)
        what = f"replaced-token detection, a {model_cfg.num_layers}x{model_cfg.hidden_size} discriminator and a "
        what += f"{gen.num_layers}x{gen.hidden_size} generator"
    else:
        what = f"masked LM, {model_cfg.num_layers}x{model_cfg.hidden_size}"
    log.message(
        f"pretraining ({what}; {count_params(params) / 1e6:.1f} M parameters) "
        f"on {len(mesh.devices.flat)} device(s) {dict(mesh.shape)}: global batch {cfg.train.global_batch} "
        f"({cfg.train.global_batch // len(mesh.devices.flat)} per device"
        f"{f', {cfg.train.grad_accum} accumulation steps' if cfg.train.grad_accum > 1 else ''}) x {seq_len} tokens, "
        f"{loader.batches_per_epoch} batches per epoch"
        + (f"; resuming from step {start_step}" if start_step else "")
        + (f"; continuing {cfg.init_from}" if init is not None and not start_step else "")
        + ("; with a fresh masked-LM head" if init is not None and init.missing_head and not start_step else "")
    )
    try:
        state, step, elapsed = loop.run(
            state,
            step_fn,
            next_batch=loader.next_at,
            lr_at=lambda p: learning_rate(cfg.optim, p, warmup),
            budget=budget,
            log=write,
            log_every=cfg.log.every,
            start_step=start_step,
            evaluate=loop.Every(cfg.eval.every, evaluate),
            checkpoint=loop.Every(cfg.checkpoint.every, save),
            preemptible=True,
            elapsed_before=elapsed,
            tokens_in=lambda batch: batch.size,
            flops_per_token=flops,
            peak_flops=peak,
            clock=process_0s if seconds is not None and jax.process_count() > 1 else None,
        )
        if checkpoints.latest_step() != step:
            save(step, state, None)
        if cfg.hub.repo and step not in published:
            publish(step, state)
        checkpoints.wait()
        if publisher is not None:
            log.message(f"waiting for the last push to {cfg.hub.repo} to finish")
            publisher.close()
    except loop.NonFiniteLoss as e:
        checkpoints.wait()
        good = checkpoints.latest_step()
        where = (
            f"the last good checkpoint is {run_dir / runs.CHECKPOINTS / str(good)}"
            if good is not None
            else "no checkpoint"
        )
        raise UserError(
            f"{e}; no weights were updated with it and {where}; lower optim.lr or set optim.clip_norm"
        ) from None
    finally:
        if publisher is not None:
            publisher.close(wait=False)  # stopped by a signal or an error: no waiting on the network
        loader.close()
        log.close()
        checkpoints.close()
    last.update(step=step, elapsed=elapsed)
    return last
