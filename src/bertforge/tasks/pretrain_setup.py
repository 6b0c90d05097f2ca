"""The set-up of `bertforge pretrain`: the tokenizer, model and shards a run trains with, checked before anything is
written; the train state, new or resumed; the run folder; and the compiled train steps.

`cfg` is tasks/pretrain.py's PretrainConfig (its `train` section a PretrainTrainConfig), typed Any as in
train/objectives.py: that module imports this one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from bertforge import hub, runs
from bertforge.config import to_dict
from bertforge.data.mixture import MixedShards, training_shards
from bertforge.data.shards import Shards
from bertforge.errors import UserError
from bertforge.fileio import write_folder_atomic
from bertforge.model.architectures import SEGMENT_FAMILIES, count_params
from bertforge.model.attention import unavailable
from bertforge.model.hf import Pretrained
from bertforge.model.load import load_to_continue
from bertforge.runtime.devices import param_shardings
from bertforge.tasks.init import fit_to_tokenizer
from bertforge.tokenizer.load import Tokenizer
from bertforge.train import loop, objectives
from bertforge.train.checkpoint import Checkpoints
from bertforge.train.optim import pretraining_optimizer
from bertforge.train.step import TrainState, new_train_state

# Settings a pretraining run may change when it continues, besides runs.FREE_SETTINGS: how long it trains (a finished
# run given a larger budget goes on) and how it is evaluated.
CONTINUABLE = ("train.max_steps", "train.max_epochs", "train.max_tokens", "train.time_budget_minutes", "eval")


# ------------------------------------------------------------------------------------------------------ set-up
def total_steps(cfg: Any, batches_per_epoch: int, seq_len: int) -> int | None:
    options = []
    if cfg.max_steps is not None:
        options.append(cfg.max_steps)
    if cfg.max_epochs is not None:
        options.append(max(1, int(round(cfg.max_epochs * batches_per_epoch))))
    if cfg.max_tokens is not None:
        options.append(max(1, cfg.max_tokens // (cfg.global_batch * seq_len)))
    return min(options) if options else None


def restore_from(path: Path, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
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


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What the command reads and checks before anything is written."""

    cfg: Any  # with the model section of the model trained: fitted to the tokenizer, or the one continued
    tokenizer: Tokenizer
    init: Pretrained | None  # the model --init-from continues
    train: Shards | MixedShards
    valid: Shards | MixedShards | None  # None: the shards have no validation split


def resolve(cfg: Any, run_dir: Path, vocab_given: bool, model_keys: Collection[str], check_data: bool = True) -> Inputs:
    """The tokenizer, the model to continue and the shards of `cfg`, checked; without `check_data` (a run in phases,
    whose phases check their own) the shards are not checked against the model and no validation split is read."""
    train_shards = training_shards(cfg.data.shards, cfg.data.sources, cfg.data.temperature, "train")
    if cfg.init_from and cfg.objective == "rtd":
        raise UserError(f"--init-from {cfg.init_from}: continuing from a model is for objective mlm, not rtd")
    if cfg.objective == "rtd" and cfg.model.dtype == "float16":
        raise UserError("model.dtype=float16 is for objective mlm: replaced-token detection has no loss scale")
    if why := unavailable(cfg.model.attention, jax.default_backend()):
        raise UserError(f"model.attention={cfg.model.attention}: {why}")
    init = load_to_continue(cfg.init_from, cfg.model, model_keys, cfg.train.seed) if cfg.init_from else None
    tokenizer = _tokenizer(cfg, run_dir, train_shards, init)
    model_cfg = init.model.config if init is not None else fit_to_tokenizer(cfg.model, tokenizer, vocab_given)
    cfg = dataclasses.replace(cfg, model=model_cfg)
    return Inputs(cfg, tokenizer, init, train_shards, validation_of(cfg, train_shards) if check_data else None)


def validation_of(cfg: Any, train: Shards | MixedShards) -> Shards | MixedShards | None:
    """The validation split beside the training shards of `cfg.data` (None: they have none), once the shards are
    checked against `cfg.model`."""
    model_cfg = cfg.model
    train.check_model(model_cfg.max_seq_len, model_cfg.vocab_size, "the model (model.max_position_embeddings)")
    if train.packed and model_cfg.family not in SEGMENT_FAMILIES:
        raise UserError(
            f"{train.root}: packed shards need an architecture that attends within each packed sequence "
            f"({', '.join(SEGMENT_FAMILIES)}), not {model_cfg.family}; preprocess without --pack"
        )
    valid: Any = training_shards(cfg.data.shards, cfg.data.sources, cfg.data.temperature, "valid")
    if valid.num_sequences == 0:
        return None
    valid.verify()  # checked now rather than at the first evaluation, steps later
    return valid


def phase_inputs(inputs: Inputs, cfg: Any) -> Inputs:
    """What a phase of the run reads (tasks/phases.py): its shards, checked against the run's tokenizer and the model
    as the phase changes it."""
    train: Any = training_shards(cfg.data.shards, cfg.data.sources, cfg.data.temperature, "train")
    train.check_tokenizer(inputs.tokenizer, "the run's tokenizer")
    return dataclasses.replace(inputs, cfg=cfg, train=train, valid=validation_of(cfg, train))


def _tokenizer(cfg: Any, run_dir: Path, shards: Shards | MixedShards, init: Pretrained | None) -> Tokenizer:
    """The model's to continue, data.tokenizer, the run's own copy when it resumes, or the shards'; checked against
    the shards."""
    run_tokenizer = run_dir / runs.TOKENIZER
    if init is not None:
        tokenizer, where = init.tokenizer, f"{cfg.init_from} (--init-from)"
    elif cfg.data.tokenizer or (run_tokenizer / "tokenizer.json").exists():
        where = cfg.data.tokenizer or str(run_tokenizer)  # a resumed run uses its own copy
        tokenizer = Tokenizer.load(where)
    else:
        tokenizer, where = shards.tokenizer()
    shards.check_tokenizer(tokenizer, where)
    return tokenizer


def budget_of(cfg: Any, batches_per_epoch: int, seq_len: int) -> loop.Budget:
    steps = total_steps(cfg, batches_per_epoch, seq_len)
    seconds = cfg.time_budget_minutes * 60 if cfg.time_budget_minutes else None
    if steps is None and seconds is None:
        raise UserError(
            "no budget: set train.max_steps, train.max_epochs, train.max_tokens or train.time_budget_minutes"
        )
    return loop.Budget(max_steps=steps, seconds=seconds)


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """The model split for the compiled steps, its optimizer, and the train state's layout on the mesh."""

    graphdef: Any
    rest: Any
    tx: Any
    state_shardings: Any
    num_params: int


def phase_parts(cfg: Any, first: ModelParts, params: Any) -> ModelParts:
    """ModelParts of a later phase: its model as the phase configures it (rotary positions), over the same weights
    and optimizer state as the first phase's."""
    graphdef, _, rest = nnx.split(objectives.build_model(cfg, cfg.model, cfg.train.seed), nnx.Param, ...)
    tx = pretraining_optimizer(cfg.optim, params, cfg.model, cfg.train.ema)
    return dataclasses.replace(first, graphdef=graphdef, rest=rest, tx=tx)


def train_state(cfg: Any, init: Pretrained | None, mesh: Any) -> tuple[ModelParts, TrainState]:
    """Model, optimizer and state, laid out on the mesh by the logical-axis rules."""
    model = init.model if init is not None else objectives.build_model(cfg, cfg.model, cfg.train.seed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.device_put(params, param_shardings(model, mesh))
    tx = pretraining_optimizer(cfg.optim, params, cfg.model, cfg.train.ema)
    state = new_train_state(params, tx, mesh)
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    return ModelParts(graphdef, rest, tx, state_shardings, count_params(params)), state


def restored(resume: str, run_dir: Path, checkpoints: Checkpoints, state: TrainState) -> tuple[TrainState, dict | None]:
    """The state to start from and its checkpoint's metadata (None: from the start)."""
    if resume in ("auto", "never"):
        return runs.resume(checkpoints, state, run_dir, resume)
    return restore_from(Path(resume), state)


def resume_state(
    resume: str, run_dir: Path, checkpoints: Checkpoints, state: TrainState, loader: Any
) -> tuple[TrainState, int, float]:
    """The state to start from, its step and the seconds spent before it; the loader moved to where it was."""
    state, meta = restored(resume, run_dir, checkpoints, state)
    if meta is None:
        return state, 0, 0.0
    loader.load_state_dict(meta["loader"])
    return state, int(state.step), float(meta.get("elapsed", 0.0))


def write_run_folder(run_dir: Path, cfg: Any, tokenizer: Tokenizer) -> None:
    """Process 0's part: the tokenizer (kept when resuming), the config and the run's info."""
    hub.clear_staging(run_dir)
    run_tokenizer = run_dir / runs.TOKENIZER
    if not (run_tokenizer / "tokenizer.json").exists():
        write_folder_atomic(run_tokenizer, tokenizer.save)
    runs.write_config(run_dir, cfg)
    shards = cfg.data.shards or list(cfg.data.sources)
    info = {"model": to_dict(cfg.model), "shards": shards, "objective": cfg.objective}
    runs.write_info(run_dir, "pretrain", info)


# ------------------------------------------------------------------------------------------------------ steps
def compiler(cfg: Any, inputs: Inputs, model: ModelParts, mesh: Any) -> Callable[[Any], Any]:
    """objectives.compile_steps of a config like `cfg` (another batch size): (train step, evaluation)."""
    tokenizer, shards = inputs.tokenizer, inputs.train
    masking = objectives.masking_spec(cfg, tokenizer, shards.manifest["special_ids"], cfg.model.vocab_size)
    ids = (tokenizer.pad_id, tokenizer.cls_id if shards.packed else None)  # padding, packed rows' [CLS]
    parts = (model.graphdef, model.rest, model.tx, model.state_shardings, mesh, shards.seq_len, masking, *ids)
    return lambda c: objectives.compile_steps(c, *parts)


class StepCache:
    """The train step, called as step_fn(state, batch, lr): one program for each number of micro-batches per step a
    batch ramp takes, compiled when a batch of that size first comes."""

    def __init__(self, cfg: Any, compile_steps: Callable[[Any], Any]) -> None:
        self.cfg, self.compile_steps = cfg, compile_steps
        self.micro = cfg.train.global_batch // cfg.train.grad_accum
        step_jit, self.eval_fn = compile_steps(cfg)
        self.compiled = {cfg.train.grad_accum: step_jit}
        self.key = jax.random.key(cfg.train.seed)

    def __call__(self, state: TrainState, batch: Any, lr: float) -> tuple[TrainState, dict[str, Any]]:
        n = batch.shape[0] // self.micro
        if n not in self.compiled:
            train = dataclasses.replace(
                self.cfg.train, global_batch=n * self.micro, grad_accum=n, batch_ramp=0.0, batch_ramp_start=None
            )
            self.compiled[n] = self.compile_steps(dataclasses.replace(self.cfg, train=train))[0]
        return self.compiled[n](state, batch, jnp.float32(lr), self.key)
