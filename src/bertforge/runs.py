"""The run folder: what a bertforge run holds, reading and writing it, and telling a run from a Hugging Face model.

A pretraining run (kind 'pretrain'):

    RUN/run.json          kind, the bertforge version that made it, the model config, the shards
    RUN/config.yaml       the whole config it runs with
    RUN/tokenizer/        its tokenizer, copied in at the start so that a resumed run uses the same one
    RUN/checkpoints/N/    train state and metadata at step N (see train/checkpoint.py)
    RUN/metrics.jsonl     every logged step (see train/logging.py)

A fine-tuning run (kind 'finetune'):

    RUN/run.json          kind, version, task, targets, labels, the text settings predict reuses, the folds
    RUN/config.yaml
    RUN/folds.csv         the fold of every training row (none with a separate validation table)
    RUN/fold-K/           metrics.jsonl, checkpoints/ while it trains, model/ (a Hugging Face folder of the best
                          checkpoint) and result.json, written last: a fold without it is not finished
    RUN/oof.csv, RUN/summary.json   out-of-fold predictions and scores, once the folds are done

While a trainer writes into RUN it holds RUN/.lock.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import fcntl
import json
import os
import re
import socket
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from bertforge import version
from bertforge.config import from_dict, read_yaml, to_dict
from bertforge.data import tabular
from bertforge.errors import UserError
from bertforge.fileio import read_json_object, write_atomic
from bertforge.model.architectures import build, key_table
from bertforge.model.config import ModelConfig
from bertforge.model.hf import Pretrained, load_pretrained
from bertforge.model.rtd import RtdConfig, build_pair, discriminator_alone
from bertforge.tokenizer import BertTokenizer
from bertforge.train.checkpoint import DAMAGED, Checkpoints
from bertforge.train.loss_scale import with_loss_scale
from bertforge.train.optim import OptimConfig, make_optimizer
from bertforge.train.step import TrainState

RUN_FILE = "run.json"
CONFIG = "config.yaml"
TOKENIZER = "tokenizer"
CHECKPOINTS = "checkpoints"
FOLDS = "folds.csv"
RESULT = "result.json"
MODEL = "model"
OOF = "oof.csv"
SUMMARY = "summary.json"


# ------------------------------------------------------------------------------------------------------ run.json
def write_info(run_dir: Path, kind: str, info: dict[str, Any]) -> None:
    """RUN/run.json: the run's kind and the bertforge version that made it, then `info`."""
    data = {"kind": kind, "bertforge_version": version(), **info}
    write_atomic(Path(run_dir) / RUN_FILE, json.dumps(data, indent=2) + "\n")


def read_info(run: str | Path) -> dict[str, Any] | None:
    """RUN/run.json, or None when `run` has none."""
    path = Path(run) / RUN_FILE
    return read_json_object(path) if path.exists() else None


def kind(run: str | Path) -> str | None:
    """'pretrain' or 'finetune', or None when `run` is not a bertforge run."""
    info = read_info(run)
    return None if info is None else info.get("kind")


def write_config(run_dir: Path, cfg: Any) -> None:
    """RUN/config.yaml: the config dataclass `cfg` as YAML, in its fields' order."""
    write_atomic(Path(run_dir) / CONFIG, yaml.safe_dump(to_dict(cfg), sort_keys=False))


def is_run(folder: str | Path) -> bool:
    """Whether `folder` is a pretraining run with checkpoints (rather than a Hugging Face folder)."""
    return (Path(folder) / RUN_FILE).exists() and (Path(folder) / CHECKPOINTS).is_dir()


# ------------------------------------------------------------------------------------------------------ the lock
class RunLock:
    """An exclusive lock on a run folder. The kernel drops it when the holder dies, even by kill -9."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / ".lock"
        self.fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            raise UserError(f"{self.path.parent}: another trainer is using this run ({holder})") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"host {socket.gethostname()}, pid {os.getpid()}\n".encode())
        os.fsync(fd)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextlib.contextmanager
def locked(run_dir: Path) -> Iterator[None]:
    """RUN's lock, taken by process 0 alone: the processes of one run share it, and the refusal a second trainer
    gets names one host and pid."""
    if jax.process_index() != 0:
        yield
        return
    with RunLock(run_dir):
        yield


def resume(checkpoints: Checkpoints, state: Any, run_dir: Path, how: str) -> tuple[Any, dict[str, Any] | None]:
    """The state to start from and its checkpoint's metadata, None when from the start. `how` 'auto': the newest
    whole checkpoint (damaged ones are set aside in RUN/damaged); 'never': none, and a run with checkpoints is
    refused."""
    if checkpoints.latest_step() is None:
        return state, None
    if how == "never":
        raise UserError(f"{run_dir}: already has checkpoints; use another --out, or --resume auto to continue")
    found = checkpoints.restore_newest_good(state, Path(run_dir) / DAMAGED)
    return (state, None) if found is None else (found[1], found[2])


# ------------------------------------------------------------------------------------------------------ folds
def fold_dir(run_dir: Path, fold: int) -> Path:
    return Path(run_dir) / f"fold-{fold}"


def fold_dirs(run: str | Path) -> list[Path]:
    """A fine-tuning run's fold-K folders, by K."""
    found = [(int(m[1]), p) for p in Path(run).glob("fold-*") if (m := re.fullmatch(r"fold-(\d+)", p.name))]
    return [p for _, p in sorted(found) if p.is_dir()]


def write_folds(run_dir: Path, ids: Sequence[str], folds: np.ndarray) -> None:
    body = [[i + 1, ids[i], int(folds[i])] for i in range(len(ids))]
    tabular.write_csv(str(Path(run_dir) / FOLDS), ["row", "id", "fold"], body)


def read_result(run_dir: Path, fold: int) -> dict[str, Any] | None:
    """FOLD/result.json; None while the fold is not finished."""
    path = fold_dir(run_dir, fold) / RESULT
    return read_json_object(path) if path.exists() else None


def write_result(run_dir: Path, fold: int, result: dict[str, Any]) -> None:
    write_atomic(fold_dir(run_dir, fold) / RESULT, json.dumps(result) + "\n")


def write_outcome(run_dir: Path, header: list[str], body: list[list[Any]], summary: dict[str, Any]) -> None:
    """RUN/oof.csv (out-of-fold predictions, a row each) and RUN/summary.json."""
    tabular.write_csv(str(Path(run_dir) / OOF), header, body)
    write_atomic(Path(run_dir) / SUMMARY, json.dumps(summary, indent=2) + "\n")


def read_summary(run: str | Path) -> dict[str, Any] | None:
    path = Path(run) / SUMMARY
    return read_json_object(path) if path.exists() else None


def read_oof(run: str | Path) -> list[dict[str, str]]:
    """RUN/oof.csv's rows by column name; none while the folds are not done."""
    path = Path(run) / OOF
    if not path.exists():
        return []
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def fold_models(name: str | Path) -> tuple[list[Path], dict[str, Any]] | None:
    """A fine-tuning run's finished fold models and its run.json; None when `name` is not such a run."""
    run = Path(name)
    info = read_info(run)
    if info is None or info.get("kind") != "finetune":
        return None
    folders = [d / MODEL for d in fold_dirs(run) if (d / RESULT).exists() and (d / MODEL).is_dir()]
    if not folders:
        raise UserError(f"{run}: no finished fold yet")
    return folders, info


# ------------------------------------------------------------------------------------------------------ models
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


def load_run(run: str | Path, which: str = "latest", part: str = "") -> Pretrained:
    """The model of a pretraining run at a checkpoint ('latest': the newest whole one, 'best', or a step number),
    with the run's tokenizer. Of a replaced-token detection run, `part` 'discriminator' (the default: alone, see
    model/rtd.py) or 'generator'."""
    run = Path(run)
    if not is_run(run):
        raise UserError(f"{run}: not a bertforge run (no {RUN_FILE} and {CHECKPOINTS}/)")
    data = read_yaml(run / CONFIG)
    model_cfg = from_dict(ModelConfig, data.get("model", {}), "model")
    optim = from_dict(OptimConfig, data.get("optim", {}), "optim")
    seed = int((data.get("train") or {}).get("seed", 0))  # the dropout keys the run's model was built with
    rtd = data.get("objective") == "rtd"
    if part and not rtd:
        raise UserError(f"{run}: --part {part}: a masked-LM run has one model; parts are of replaced-token detection")
    if rtd:
        model: Any = build_pair(model_cfg, from_dict(RtdConfig, data.get("rtd") or {}, "rtd"), seed)
    else:
        model = build(model_cfg, "mlm", seed=seed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = with_loss_scale(make_optimizer(optim, params, model_cfg.num_layers), model_cfg.dtype)
    target = TrainState(jnp.int32(0), params, jax.eval_shape(tx.init, params))
    checkpoints = Checkpoints(run / CHECKPOINTS)
    try:
        step = _step(checkpoints, which, run)
        if which == "latest":  # the newest whole one
            found = checkpoints.restore_newest_good(target)
            if found is None:
                raise UserError(f"{run}: every checkpoint is damaged")
            step, state, _ = found
        else:
            state, _ = checkpoints.restore(step, target)
    finally:
        checkpoints.close()
    model = nnx.merge(graphdef, state.params, rest)
    if rtd:
        model = model.generator if part == "generator" else discriminator_alone(model)
    tokenizer = BertTokenizer.load(run / TOKENIZER)
    return Pretrained(model, tokenizer, model.task, {}, None, run, [], step)


def load_model(name: str | os.PathLike, head: str | None = None, **options: Any) -> Pretrained:
    """The model behind `name`: a bertforge pretraining run (its newest whole checkpoint; under a sequence head its
    encoder with a fresh head), or a Hugging Face folder or hub id. `options` are model.hf.load_pretrained's
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
    if require_head:
        raise UserError(f"{pre.folder}: a pretraining run has a masked-LM head, not a sequence head")
    n = num_labels or 1
    model = build(cfg, "sequence", num_labels=n, seed=seed)
    nnx.update(model.encoder, nnx.state(pre.model.encoder, nnx.Param))
    missing = [row.hf for row in key_table(cfg, "sequence") if row.head]
    id2label = {i: f"LABEL_{i}" for i in range(n)}
    return Pretrained(model, pre.tokenizer, "sequence", id2label, None, pre.folder, missing)


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
    """The sequence model(s) behind `name`: a fine-tuning run gives its fold models (predict averages them) and its
    run.json, whose text settings predict reuses; anything else is one model, with no settings."""
    found = fold_models(name)
    if found is not None:
        folders, settings = found
        return [load_pretrained(f, head="sequence", require_head=True) for f in folders], settings
    return [load_model(name, head="sequence", require_head=True)], {}
