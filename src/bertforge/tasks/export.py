"""`bertforge export RUN`: a pretraining run's weights as a Hugging Face folder (config, safetensors, tokenizer, a
model card), and with `--push-to-hub ORG/NAME` that folder published on the Hugging Face Hub. A replaced-token
detection run exports its discriminator, or with `--part generator` its generator (a masked-LM model).

A fine-tuning run's folds each keep their best model as a Hugging Face folder already (fold-K/model); exporting
such a run copies them out and/or pushes them as `finetune --hub.repo` lays them out: one finished fold's folder as
the repository itself, several each into fold-K/. Only finished folds go (those with their result.json)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bertforge import hub, runs
from bertforge.card import card_files
from bertforge.config import read_yaml
from bertforge.errors import UserError
from bertforge.fileio import copy_folder_into, fill_folder_into, read_json_object, write_atomic
from bertforge.model.heads import Model
from bertforge.model.hf import WEIGHT_DTYPES, read_weights, save_pretrained, weight_files, weights_blob
from bertforge.model.load import WEIGHTS, load_run
from bertforge.tokenizer.load import Tokenizer
from bertforge.train.metrics_log import read_metrics


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    run: str  # run folder
    out: str = ""  # Hugging Face folder to write (with --push-to-hub and no --out: a temporary one)
    step: str = "latest"  # latest, best, or a step number
    part: str = ""  # of a replaced-token detection run: discriminator (the default) or generator
    push_to_hub: str = ""  # ORG/NAME: publish the folder in this Hub model repository (made when missing)
    private: bool = False  # make the Hub repository private when it is created
    revision: str = ""  # Hub branch to push to (made when missing); default: main
    message: str = ""  # commit message of the push
    language: tuple[str, ...] = ()  # the model card's languages (ISO 639-1 codes such as en, ja)
    datasets: tuple[str, ...] = ()  # the model card's datasets (Hub dataset ids)
    license: str = ""  # the model card's license (a Hub license id such as apache-2.0)
    dtype: str = "float32"  # the weights' dtype in model.safetensors: float32, or float16 or bfloat16 (half the size)
    weights: str = "params"  # of a pretraining run: its weights (params), or the moving average it kept (ema)
    average: str = ""  # the mean of checkpoints' weights in place of --step's one: last:N (the newest N) or step:A,B,C

    def __post_init__(self) -> None:
        problem = hub.repo_problem(self.push_to_hub) if self.push_to_hub else None
        if self.weights not in WEIGHTS:
            raise ValueError(f"--weights {self.weights!r}: one of {', '.join(WEIGHTS)}")
        if self.average and self.step != "latest":
            raise ValueError(f"--average {self.average} and --step {self.step}: give one of them")
        if self.dtype not in WEIGHT_DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: one of {', '.join(WEIGHT_DTYPES)}")
        if self.part not in ("", "discriminator", "generator"):
            raise ValueError(f"--part {self.part!r}: discriminator or generator")
        if problem is not None:
            raise ValueError(f"--push-to-hub {self.push_to_hub!r}: not a repository name the Hub accepts ({problem})")


def export_pretrained(
    model: Model,
    tokenizer: Tokenizer,
    run: str | Path,
    out: str | Path,
    step: int,
    name: str = "",
    card: dict[str, Any] | None = None,
    dtype: str = "float32",
    how: dict[str, Any] | None = None,
) -> Path:
    """Write pretraining run `run`'s `model` (its state at `step`) into `out`, with a model card and the run's
    run.json (and where it lies) as bertforge.json, its weights in `dtype`. `card` holds the card's language,
    datasets and license; `how`, which weights of the checkpoint(s) these are (export's --weights, --average)."""
    run = Path(run)
    info = runs.read_info(run) or {}
    provenance = json.dumps({"run": str(run.absolute()), "step": step, **(how or {}), **info}, indent=2) + "\n"
    config = read_yaml(run / runs.CONFIG) if (run / runs.CONFIG).exists() else {}
    config.pop("hub", None)  # where it was pushed is no part of how it was trained
    records = [r for r in read_metrics(run) if r.get("step", 0) <= step]
    files = card_files(
        name=name or run.name,  # not the folder written: the same run gives the same card wherever it goes
        kind="pretrain",
        records=records,
        model=model.config,
        head=model.task,
        config=config,
        step=step,
        metrics=("perplexity", "accuracy") if model.task == "mlm" else ("accuracy", "roc_auc"),
        **(card or {}),
    )
    return save_pretrained(model, out, tokenizer, extra_files={**files, "bertforge.json": provenance}, dtype=dtype)


def main(cfg: ExportConfig) -> tuple[Path | None, str | None, str]:
    """Export RUN's model into `out` and/or push it; returns the folder (None when it was a temporary one), the Hub
    commit's URL (None without a push), and what was exported: a pretraining run's checkpoint `step` ('latest',
    'best' or a step), or a fine-tuning run's finished folds' models (export_folds)."""
    if not cfg.out and not cfg.push_to_hub:
        raise UserError("nowhere to export to: give --out FOLDER, --push-to-hub ORG/NAME, or both")
    folds = runs.fold_models(cfg.run)
    given = [f"--{k} {v}" for k, v in _pretraining_options(cfg) if v]
    if folds is not None and given:
        raise UserError(f"{cfg.run}: {given[0]} is for pretraining runs; a fine-tuning run exports its folds' models")
    # A temporary folder only for a push without --out: one made anyway outlives an export killed mid-way.
    scratch = contextlib.nullcontext("") if cfg.out else tempfile.TemporaryDirectory(prefix="bertforge-export-")
    with scratch as tmp:
        out = Path(cfg.out) if cfg.out else Path(tmp) / (cfg.push_to_hub.split("/")[-1] or "model")
        what = _export_checkpoint(cfg, out) if folds is None else export_folds(folds[0], out, cfg.dtype)
        url = _push(cfg, out, what) if cfg.push_to_hub else None
    return (Path(cfg.out) if cfg.out else None), url, what


def _pretraining_options(cfg: ExportConfig) -> list[tuple[str, str]]:
    """The options of `cfg` that only a pretraining run takes, each with its value ('' where not given)."""
    step = cfg.step if cfg.step not in ("latest", "best") else ""
    return [("part", cfg.part), ("average", cfg.average), ("weights", cfg.weights * (cfg.weights != "params")),
            ("step", step)]  # fmt: skip


def _export_checkpoint(cfg: ExportConfig, out: Path) -> str:
    pre = load_run(cfg.run, cfg.step, cfg.part, cfg.weights, cfg.average)
    assert pre.tokenizer is not None and pre.step is not None
    card = {"language": cfg.language, "datasets": cfg.datasets, "license": cfg.license}
    how = {"weights": cfg.weights, **({"average": cfg.average} if cfg.average else {})}
    export_pretrained(pre.model, pre.tokenizer, cfg.run, out, pre.step, cfg.push_to_hub, card, cfg.dtype, how)
    what = f"the mean of checkpoints {cfg.average} (newest: step {pre.step})" if cfg.average else f"step {pre.step}"
    return f"{what}, its moving average" if cfg.weights == "ema" else what


def export_folds(models: list[Path], out: Path, dtype: str = "float32") -> str:
    """Copy a fine-tuning run's fold models (FOLD/model folders) into `out`: one as `out` itself, several each into
    out/fold-K/, as `finetune --hub.repo` pushes them, their weights in `dtype`; returns which folds went."""
    names = [m.parent.name for m in models]
    for model, name in zip(models, names, strict=True):
        dest = out if len(models) == 1 else out / name
        if dtype == "float32":  # as fine-tuning wrote them
            copy_folder_into(model, dest)
        else:  # copied into the temporary folder that moves into place, and recast there
            fill_folder_into(dest, functools.partial(_recast_copy, model, dtype=dtype))
    return f"the best model of {', '.join(names)}"


def _recast_copy(source: Path, tmp: Path, dtype: str) -> None:
    shutil.copytree(source, tmp, dirs_exist_ok=True)
    recast(tmp, dtype)


def recast(folder: Path, dtype: str) -> None:
    """Rewrite a Hugging Face folder's weights (model.safetensors) in `dtype`, and config.json's dtype to say so."""
    tensors = read_weights(weight_files(folder))
    config = read_json_object(folder / "config.json")
    write_atomic(folder / "model.safetensors", weights_blob(tensors, dtype))
    write_atomic(folder / "config.json", json.dumps({**config, "dtype": dtype}, indent=2) + "\n")


def _push(cfg: ExportConfig, out: Path, what: str) -> str:
    message = cfg.message or f"bertforge export of {Path(cfg.run).name}: {what}"
    try:
        return hub.push_folder(out, cfg.push_to_hub, private=cfg.private, revision=cfg.revision, message=message)
    except Exception as e:  # the network, the token, the Hub's refusal: the user's to fix
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        kept = f"; the export is in {out}" if cfg.out else ""
        raise UserError(f"pushing to {cfg.push_to_hub} failed ({reason}){kept}") from None
