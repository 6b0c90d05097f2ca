"""The run folder: what a bertforge run holds, reading and writing it, and telling a run from a Hugging Face model.

A pretraining run (kind 'pretrain'):

    RUN/run.json          kind, the bertforge version that made it, the model config, the shards
    RUN/config.yaml       the whole config it runs with
    RUN/tokenizer/        its tokenizer, copied in at the start so that a resumed run uses the same one
    RUN/checkpoints/N/    train state and metadata at step N (see train/checkpoint.py)
    RUN/metrics.jsonl     every logged step (see train/metrics_log.py)

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
import fcntl
import json
import os
import re
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml

from bertforge import version
from bertforge.config import read_yaml, to_dict
from bertforge.data import tabular
from bertforge.errors import UserError
from bertforge.fileio import finite_json, nan_for_null, read_json_object, write_atomic
from bertforge.train.checkpoint import DAMAGED, Checkpoints

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


# What a run may change when it continues: where it logs and publishes, how its devices are laid out, how often it
# saves, and which folds this process trains.
FREE_SETTINGS = ("log", "hub", "mesh", "checkpoint", "folds.run")


def check_settings(run_dir: Path, cfg: Any, free: Sequence[str] = ()) -> None:
    """Refuse to continue the run in `run_dir` with other settings than RUN/config.yaml's: its checkpoints and
    finished folds were made with those. FREE_SETTINGS and `free` (keys or sections) may change; a key that one
    side lacks (another version's) is left alone."""
    path = Path(run_dir) / CONFIG
    if not path.is_file():
        return
    old = _flat(read_yaml(path))
    new = _flat(yaml.safe_load(yaml.safe_dump(to_dict(cfg), sort_keys=False)))
    loose = tuple(f"{f}." for f in (*FREE_SETTINGS, *free))
    changed = [k for k in new if k in old and old[k] != new[k] and not f"{k}.".startswith(loose)]
    if changed:
        k, more = changed[0], changed[1:]
        also = f" (also {', '.join(more[:3])}{', ...' if len(more) > 3 else ''})" if more else ""
        raise UserError(
            f"{run_dir}: this run has {k}: {old[k]!r}, this command gives {new[k]!r}{also}; to continue it, give "
            "its own settings (its config.yaml), or use another --out"
        )


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{'a.b': value} of a nested mapping; lists and empty mappings are values."""
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, sub in tree.items():
        flat.update(_flat(sub, f"{prefix}.{key}" if prefix else str(key)))
    return flat


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
    if not path.exists():
        return None
    result = read_json_object(path)
    return {**result, **{k: nan_for_null(result[k]) for k in ("score", "metrics", "outputs") if k in result}}


def write_result(run_dir: Path, fold: int, result: dict[str, Any]) -> None:
    """FOLD/result.json, an undefined score (a correlation of outputs that do not vary) as null."""
    write_atomic(fold_dir(run_dir, fold) / RESULT, finite_json(result) + "\n")


def write_outcome(run_dir: Path, header: list[str], body: list[list[Any]], summary: dict[str, Any]) -> None:
    """RUN/oof.csv (out-of-fold predictions, a row each) and RUN/summary.json."""
    tabular.write_csv(str(Path(run_dir) / OOF), header, body)
    write_atomic(Path(run_dir) / SUMMARY, finite_json(summary, indent=2) + "\n")


def read_summary(run: str | Path) -> dict[str, Any] | None:
    """RUN/summary.json, its scores' nulls as NaN; None before the folds are done."""
    path = Path(run) / SUMMARY
    if not path.exists():
        return None
    summary = read_json_object(path)
    folds = [{**f, "score": nan_for_null(f.get("score"))} for f in summary.get("folds", [])]
    numbers = {k: nan_for_null(summary[k]) for k in ("mean", "std", "out_of_fold") if k in summary}
    return {**summary, **numbers, "folds": folds}


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
