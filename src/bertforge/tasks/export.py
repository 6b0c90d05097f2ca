"""`bertforge export RUN`: a pretraining run's weights as a Hugging Face folder (config, safetensors, tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from bertforge.config import from_dict, read_yaml
from bertforge.errors import UserError
from bertforge.model.bert import MaskedLM, build
from bertforge.model.hf import Pretrained, save_pretrained
from bertforge.tokenizer import BertTokenizer
from bertforge.train.checkpoint import Checkpoints
from bertforge.train.optim import make_optimizer
from bertforge.train.step import TrainState

RUN_FILE = "run.json"


def is_run(folder: Path) -> bool:
    return (Path(folder) / RUN_FILE).exists() and (Path(folder) / "checkpoints").is_dir()


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


def load_run(run: str | Path, which: str = "latest") -> Pretrained:
    """The model of a pretraining run at a checkpoint, with the run's tokenizer."""
    from bertforge.tasks.pretrain import PretrainConfig

    run = Path(run)
    if not is_run(run):
        raise UserError(f"{run}: not a bertforge run (no {RUN_FILE} and checkpoints/)")
    cfg = from_dict(PretrainConfig, read_yaml(run / "config.yaml"))
    model = build(cfg.model, "mlm", seed=cfg.train.seed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = make_optimizer(cfg.optim, params, cfg.model.num_layers)
    target = TrainState(jnp.int32(0), params, jax.eval_shape(tx.init, params))
    checkpoints = Checkpoints(run / "checkpoints")
    try:
        step = _step(checkpoints, which, run)
        if which == "latest":  # the newest whole one
            found = checkpoints.restore_newest_good(target)
            if found is None:
                raise UserError(f"{run}: every checkpoint is damaged")
            _, state, _ = found
        else:
            state, _ = checkpoints.restore(step, target)
    finally:
        checkpoints.close()
    model = nnx.merge(graphdef, state.params, rest)
    assert isinstance(model, MaskedLM)
    tokenizer = BertTokenizer.load(run / "tokenizer")
    return Pretrained(model, tokenizer, "mlm", {}, None, run, [])


def main(run: str, out: str, which: str = "latest") -> Path:
    pre = load_run(run, which)
    info = json.loads((Path(run) / RUN_FILE).read_text())
    provenance = json.dumps({"run": str(Path(run).absolute()), **info}, indent=2) + "\n"
    return save_pretrained(pre.model, out, pre.tokenizer, extra_files={"bertforge.json": provenance})
