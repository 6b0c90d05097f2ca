"""A model by name: a bertforge pretraining run (at a checkpoint), a fine-tuning run's fold models, or a Hugging Face
folder or hub id, with its tokenizer."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from bertforge.config import from_dict, read_yaml
from bertforge.errors import UserError
from bertforge.model.architectures import build, key_table
from bertforge.model.config import ModelConfig
from bertforge.model.hf import Pretrained, fine_tuned_head, load_pretrained
from bertforge.model.rtd import RtdConfig, build_pair, discriminator_alone
from bertforge.runs import CHECKPOINTS, CONFIG, RUN_FILE, TOKENIZER, fold_models, is_run
from bertforge.tokenizer.load import Tokenizer
from bertforge.train.checkpoint import Checkpoints
from bertforge.train.ema import ema_weights
from bertforge.train.optim import OptimConfig, pretraining_optimizer
from bertforge.train.step import TrainState


def _step(checkpoints: Checkpoints, which: str, run: Path) -> int:
    steps = checkpoints.all_steps()
    if not steps:
        raise UserError(f"{run}: no checkpoint yet")
    if which == "latest":
        return max(steps)
    if which == "best":
        best = checkpoints.best_step()
        if best is None:
            raise UserError(f"{run}: no checkpoint has a validation loss (was there a validation split?)")
        return best
    if not which.isdigit() or int(which) not in steps:
        raise UserError(f"{run}: no checkpoint at step {which} (there are {', '.join(map(str, sorted(steps)))})")
    return int(which)


WEIGHTS = ("params", "ema")  # what a run's checkpoint gives: the trained weights, or their moving average


def average_steps(spec: str, steps: Collection[int], run: Path, keep_last: int | None = None) -> list[int]:
    """The checkpoints `--average SPEC` names among a run's `steps`: 'last:N' (the newest N) or 'step:A,B,C'."""
    kind, _, values = spec.partition(":")
    kept = ", ".join(map(str, sorted(steps))) or "none"
    if kind == "last" and values.isdigit() and int(values) >= 1:
        n = int(values)
        if n > len(steps):
            keep = f"checkpoint.keep_last is {keep_last}; " if keep_last is not None else ""
            raise UserError(
                f"{run}: --average {spec}: the run kept {len(steps)} checkpoint(s) (steps {kept}); {keep}set "
                f"checkpoint.keep_last to {n} or more before training to keep the checkpoints to average"
            )
        return sorted(steps)[-n:]
    chosen = [int(v) for v in values.split(",") if v.strip().isdigit()] if kind == "step" else []
    if not chosen or len(chosen) != len(values.split(",")):
        raise UserError(f"--average {spec!r}: last:N (the newest N checkpoints) or step:A,B,C (those steps)")
    missing = sorted(set(chosen) - set(steps))
    if missing:
        raise UserError(f"{run}: --average {spec}: no checkpoint at step {missing[0]} (there are {kept})")
    return sorted(set(chosen))


def mean_of(trees: list[Any]) -> Any:
    """The element-wise mean of weight trees of one structure, summed in float32 (model merging's uniform soup)."""
    total = jax.tree.map(lambda *xs: sum(jnp.asarray(x, jnp.float32) for x in xs), *trees)
    return jax.tree.map(lambda t, x: (t / len(trees)).astype(x.dtype), total, trees[0])


def _run_model(data: dict[str, Any], changes: dict[str, Any] | None = None) -> tuple[Any, Any, Any, ModelConfig]:
    """(graphdef, params, rest, model config) of a pretraining run's config `data`, its model section with
    `changes` (what the phase of a checkpoint ran: tasks/phases.py)."""
    model_cfg = from_dict(ModelConfig, {**data.get("model", {}), **(changes or {})}, "model")
    seed = int((data.get("train") or {}).get("seed", 0))  # the dropout keys the run's model was built with
    if data.get("objective") == "rtd":
        model: Any = build_pair(model_cfg, from_dict(RtdConfig, data.get("rtd") or {}, "rtd"), seed)
    else:
        model = build(model_cfg, "mlm", seed=seed)
    return (*nnx.split(model, nnx.Param, ...), model_cfg)


def _target(data: dict[str, Any], params: Any, model_cfg: ModelConfig) -> TrainState:
    """The train state a checkpoint of the run restores into."""
    optim = from_dict(OptimConfig, data.get("optim", {}), "optim")
    tx = pretraining_optimizer(optim, params, model_cfg, float((data.get("train") or {}).get("ema") or 0.0))
    return TrainState(jnp.int32(0), params, jax.eval_shape(tx.init, params))


def _restore(checkpoints: Checkpoints, which: str, average: str, target: Any, run: Path, keep: Any) -> dict:
    """{step: (state, metadata)} of the checkpoint `which` names, or of each checkpoint `average` names."""
    if average:
        return {s: checkpoints.restore(s, target) for s in average_steps(average, checkpoints.all_steps(), run, keep)}
    step = _step(checkpoints, which, run)
    if which != "latest":
        return {step: checkpoints.restore(step, target)}
    found = checkpoints.restore_newest_good(target)  # the newest whole one
    if found is None:
        raise UserError(f"{run}: every checkpoint is damaged")
    return {found[0]: found[1:]}


def _weights(state: TrainState, weights: str, data: dict[str, Any], run: Path, step: int) -> Any:
    if weights == "params":
        return state.params
    decay = float((data.get("train") or {}).get("ema") or 0.0)
    if not decay:
        raise UserError(f"{run}: --weights ema: the run kept no moving average of its weights (train.ema was not set)")
    averaged = ema_weights(state.opt_state, decay)
    if averaged is None:
        raise UserError(f"{run}: --weights ema: checkpoint {step} was saved before the first update")
    return averaged


def load_run(
    run: str | Path, which: str = "latest", part: str = "", weights: str = "params", average: str = ""
) -> Pretrained:
    """The model of a pretraining run at a checkpoint ('latest': the newest whole one, 'best', or a step number),
    with the run's tokenizer. Of a replaced-token detection run, `part` 'discriminator' (the default: alone, see
    model/rtd.py) or 'generator'. `weights` 'ema': the moving average of the weights the run kept (train.ema);
    `average` 'last:N' or 'step:A,B,C': the mean of those checkpoints' weights (Pretrained.step: the newest)."""
    run = Path(run)
    if not is_run(run):
        raise UserError(f"{run}: not a bertforge run (no {RUN_FILE} and {CHECKPOINTS}/)")
    if weights not in WEIGHTS:
        raise UserError(f"--weights {weights!r}: one of {', '.join(WEIGHTS)}")
    data = read_yaml(run / CONFIG)
    graphdef, params, rest, model_cfg = _run_model(data)
    rtd = data.get("objective") == "rtd"
    if part and not rtd:
        raise UserError(f"{run}: --part {part}: a masked-LM run has one model; parts are of replaced-token detection")
    checkpoints = Checkpoints(run / CHECKPOINTS)
    try:
        keep = (data.get("checkpoint") or {}).get("keep_last")
        states = _restore(checkpoints, which, average, _target(data, params, model_cfg), run, keep)
    finally:
        checkpoints.close()
    step = max(states)
    if states[step][1].get("model"):  # a phase changed the model's positions: as it ran them
        graphdef, _, rest, _ = _run_model(data, states[step][1]["model"])
    weights_of = [_weights(state, weights, data, run, n) for n, (state, _) in states.items()]
    model = nnx.merge(graphdef, mean_of(weights_of), rest)
    if rtd:
        model = model.generator if part == "generator" else discriminator_alone(model)
    tokenizer = Tokenizer.load(run / TOKENIZER)
    return Pretrained(model, tokenizer, model.task, {}, None, run, [], step)


def load_model(name: str | os.PathLike, head: str | None = None, **options: Any) -> Pretrained:
    """The model behind `name`: a bertforge pretraining run (its newest whole checkpoint; under a sequence or token
    head its encoder with a fresh head), or a Hugging Face folder or hub id. `options` are model.hf.load_pretrained's
    keyword arguments (require_head, num_labels, need_tokenizer, dtype, seed, overrides)."""
    if not is_run(Path(name)):
        return load_pretrained(name, head=head, **options)
    return _from_run(Path(name), head, **options)


def _from_run(
    name: Path, head, *, require_head=False, num_labels=None, need_tokenizer=True, dtype=None, seed=0, overrides=None
) -> Pretrained:
    del need_tokenizer  # a run always has its tokenizer
    overrides = dict(overrides or {})
    if dtype is not None:
        overrides["dtype"] = dtype
    if head == "embedding":  # what sentence-transformers gives a plain encoder
        overrides = {"pooling": "mean", "normalize": False, **overrides}
    pre = load_run(name, part="generator" if head in (None, "mlm") and _is_rtd(name) else "")
    try:
        cfg = dataclasses.replace(pre.model.config, **overrides)
    except (TypeError, ValueError) as e:
        raise UserError(f"{pre.folder}: {e}") from None
    if head in (None, "mlm"):
        if overrides:
            model = build(cfg, "mlm", seed=seed)
            nnx.update(model, nnx.state(pre.model, nnx.Param))
            pre = dataclasses.replace(pre, model=model)
        return pre
    task = head
    if require_head and task != "embedding":  # an embedding model is the encoder alone
        raise UserError(f"{pre.folder}: a pretraining run has a masked-LM head, not a {task} head")
    n = num_labels or 1
    model = build(cfg, task, num_labels=n, seed=seed)
    nnx.update(model.encoder, nnx.state(pre.model.encoder, nnx.Param))
    missing = [row.hf for row in key_table(cfg, task) if row.head]
    id2label = {i: f"LABEL_{i}" for i in range(n)}
    return Pretrained(model, pre.tokenizer, task, id2label, None, pre.folder, missing)


def _is_rtd(run: Path) -> bool:
    return (read_yaml(run / CONFIG) or {}).get("objective") == "rtd"


# What `pretrain --init-from` takes from the model section: how the model runs, not what it is.
RUNTIME_FIELDS = ("hidden_dropout", "attention_dropout", "classifier_dropout", "dtype", "remat", "attention")


def load_to_continue(name: str, model: ModelConfig, given: Collection[str], seed: int) -> Pretrained:
    """The masked-LM model and tokenizer that `pretrain --init-from NAME` continues (a Hugging Face folder, hub id or
    run; a fresh MLM head when it has none), with the fields of RUNTIME_FIELDS that the model section `given` set."""
    other = sorted(set(given) - set(RUNTIME_FIELDS))
    if other:
        raise UserError(
            f"model.{other[0]}: --init-from {name} takes the model from there; of the model section only "
            f"{', '.join(RUNTIME_FIELDS)} apply"
        )
    pre = load_model(name, head="mlm", seed=seed, overrides={k: getattr(model, k) for k in given})
    if pre.tokenizer is None:
        raise UserError(f"{name}: has no tokenizer")
    return pre


def load_models(name: str | os.PathLike) -> tuple[list[Pretrained], dict[str, Any]]:
    """The fine-tuned model(s) behind `name` (a sequence or token head): a fine-tuning run gives its fold models
    (predict averages them) and its run.json, whose text settings predict reuses; anything else is one model, with
    no settings."""
    found = fold_models(name)
    if found is not None:
        folders, settings = found
        return [load_pretrained(f, head=fine_tuned_head(f), require_head=True) for f in folders], settings
    head = "sequence" if is_run(Path(name)) else fine_tuned_head(name)
    return [load_model(name, head=head, require_head=True)], {}
