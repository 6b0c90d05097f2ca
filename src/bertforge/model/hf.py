"""Hugging Face folders in and out: config.json, safetensors weights, tokenizer files.

Each architecture's key table (architectures.key_table) maps every Hugging Face parameter name to a path in the NNX
parameter tree, with a shape check on every tensor. Weights are read from safetensors only: pickled PyTorch files
are refused, never opened.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict
from safetensors import safe_open
from safetensors.numpy import save as safetensors_bytes

from bertforge.errors import UserError
from bertforge.fileio import fill_folder_into, read_json_object, write_atomic
from bertforge.model import sentence_folder
from bertforge.model.architectures import (
    HEADS,
    LABELLED,
    build,
    config_from_hf,
    config_to_hf,
    key_table,
    normalise_keys,
)
from bertforge.model.config import ModelConfig
from bertforge.model.heads import Model
from bertforge.tokenizer.load import Tokenizer

PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
HEAD_KINDS = {"mlm": "masked-LM", "sequence": "sequence-classification", "token": "token-classification",
              "span": "question-answering", "choice": "multiple-choice", "rtd": "replaced-token detection",
              "embedding": "embedding"}  # fmt: skip


# ------------------------------------------------------------------------------------------------------ weights
SAFE_WEIGHT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*\.safetensors")


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder; a folder with only pickled weights is refused with the fix."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(map(str, json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise UserError(f"{index}: not a valid safetensors index (no weight_map)") from None
        for name in names:  # names come from a file: never let one point outside the folder
            if not SAFE_WEIGHT_NAME.fullmatch(name):
                raise UserError(f"{index}: weight file {name!r} is not a plain .safetensors file name")
        return [folder / name for name in names]
    if (folder / "model.safetensors").exists():
        return [folder / "model.safetensors"]
    pickles = sorted(p.name for pattern in PICKLE_PATTERNS for p in folder.glob(pattern))
    if pickles:
        raise UserError(
            f"{folder}: holds only pickled weights ({', '.join(pickles)}), which bertforge never loads because "
            'unpickling can run arbitrary code; convert them once with: python -c "from transformers import '
            f"AutoModel; m = AutoModel.from_pretrained('{folder}'); m.save_pretrained('{folder}')\""
        )
    raise UserError(f"{folder}: no model.safetensors here")


def read_weights(files: list[Path]) -> dict[str, np.ndarray]:
    """All tensors of safetensors file(s) (see weight_files) as float32 numpy arrays, keyed by HF name."""
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="flax") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    tensors[key] = np.asarray(f.get_tensor(key), dtype=np.float32)
        except FileNotFoundError:
            raise UserError(f"{path}: listed in the index but missing") from None
        except Exception as e:  # safetensors raises its own error type for a corrupt header
            raise UserError(f"{path}: not a readable safetensors file ({e})") from None
    return tensors


def build_with_weights(
    cfg: ModelConfig, tensors: dict[str, np.ndarray], head: str, num_labels: int, seed: int, source: str
) -> tuple[Model, list[str]]:
    """build(cfg, head, num_labels, seed) with Hugging Face tensors in place of the initial values of their
    parameters, and the head parameters that were absent (those keep their initial values).

    The shapes are checked before a model of that size exists, and only the parameters the tensors do not give are
    drawn: one small compiled program instead of drawing every weight to throw it away, which was most of a load's
    time on a CPU."""
    try:
        key_table(cfg, head)  # a config the architecture cannot hold (BERT without a token-type table) names its file
    except UserError as e:
        raise UserError(f"{source}: {e}") from None
    # Presence first: tracing even an abstract model takes time that grows faster than its depth, so a config
    # naming more layers than the weights hold is refused from the key table alone.
    _absent_head_weights(cfg, normalise_keys(tensors, cfg), head, source)
    fresh_model = functools.partial(build, cfg, head, num_labels=num_labels, seed=seed)
    graphdef, params, _ = nnx.split(nnx.eval_shape(fresh_model), nnx.Param, ...)
    flat = flatten_dict(nnx.to_pure_dict(params))
    missing_head = _match_weights(cfg, flat, tensors, head, source)
    fresh = [path for path, value in flat.items() if isinstance(value, jax.ShapeDtypeStruct)]

    def initial(key_seed: jax.Array | int) -> tuple[list[jax.Array], Any]:
        # The same draws as build's (XLA drops the ones not returned), and the model's random-stream state.
        _, drawn, rest = nnx.split(fresh_model(seed=key_seed), nnx.Param, ...)
        values = flatten_dict(nnx.to_pure_dict(drawn))
        return [values[path] for path in fresh], rest

    # The seed as an argument, not a constant: one program (one cache entry) for every seed, drawing what the int
    # draws in this range (build adds 1 for the dropout stream).
    if 0 <= seed < 2**32 - 1:
        values, rest = jax.jit(initial)(np.uint32(seed))
    else:
        values, rest = jax.jit(functools.partial(initial, seed))()
    flat.update(zip(fresh, values, strict=True))
    nnx.replace_by_pure_dict(params, unflatten_dict(flat))
    return nnx.merge(graphdef, params, rest), missing_head


def _absent_head_weights(cfg: ModelConfig, tensors: dict[str, np.ndarray], head: str, source: str) -> list[str]:
    """The head parameters missing from `tensors` (normalised keys); a missing encoder parameter is an error."""
    absent = [row for row in key_table(cfg, head) if row.hf not in tensors]
    encoder = [row.hf for row in absent if not row.head]
    if encoder:
        more = f" and {len(encoder) - 1} more" if len(encoder) > 1 else ""
        raise UserError(f"{source}: missing weight {encoder[0]}{more} (does config.json match the weights?)")
    return [row.hf for row in absent if row.head]


def without_other_head(
    cfg: ModelConfig, tensors: dict[str, np.ndarray], head: str, stored: str | None, source: str
) -> dict[str, np.ndarray]:
    """`tensors` less those named as `head`'s head parameters when the checkpoint holds the other labelled head (a
    sequence classifier read as a token one, or the reverse): its classifier means something else, so `head` starts
    fresh, as it does over a masked-LM checkpoint."""
    if stored == head or stored not in LABELLED or head not in LABELLED:
        return tensors
    try:
        fresh = {row.hf for row in key_table(cfg, head) if row.head}
    except UserError as e:
        raise UserError(f"{source}: {e}") from None
    return {k: v for k, v in normalise_keys(tensors, cfg).items() if k not in fresh}


def _match_weights(cfg: ModelConfig, flat: dict, tensors: dict[str, np.ndarray], head: str, source: str) -> list[str]:
    """Put each tensor into `flat` (parameter path -> array or shape struct), checking shapes; returns the
    missing head parameters."""
    tensors = normalise_keys(tensors, cfg)
    missing_head = _absent_head_weights(cfg, tensors, head, source)
    for row in key_table(cfg, head):
        if row.hf not in tensors:
            continue
        value = tensors[row.hf].T if row.transpose else tensors[row.hf]
        expected = tuple(flat[row.path].shape)
        if tuple(value.shape) != expected:
            want = expected[::-1] if row.transpose else expected
            raise UserError(
                f"{source}: {row.hf} has shape {tuple(tensors[row.hf].shape)} but config.json implies {want}"
            )
        flat[row.path] = np.ascontiguousarray(value)
    return missing_head


def export_weights(model: Model, head: str) -> dict[str, np.ndarray]:
    flat = flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    out = {}
    for row in key_table(model.config, head):
        value = np.asarray(flat[row.path], dtype=np.float32)
        out[row.hf] = np.ascontiguousarray(value.T if row.transpose else value)
    return out


# ------------------------------------------------------------------------------------------------------ folders
@dataclasses.dataclass
class Pretrained:
    model: Model
    tokenizer: Tokenizer | None
    head: str
    id2label: dict[int, str]
    problem_type: str | None
    folder: Path
    missing_head: list[str]  # head parameters initialised fresh because the checkpoint lacks them
    step: int | None = None  # a run's checkpoint step

    def label_names(self) -> list[str]:
        """The name of each output (config.json's id2label; its index where the folder names none)."""
        return [self.id2label.get(j, str(j)) for j in range(self.model.num_labels)]


def resolve(name: str | os.PathLike) -> Path:
    """A local folder, or a hub id resolved through huggingface_hub (its cache when offline). Never runs code."""
    path = Path(name)
    if path.is_dir():
        return path
    if path.exists():
        raise UserError(f"{name}: is a file; a model is a folder with config.json and model.safetensors")
    text = str(name)
    if not re.fullmatch(r"[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?", text):
        raise UserError(f"{name}: no such model folder")
    from huggingface_hub import snapshot_download

    patterns = [
        "config.json",
        "*.safetensors",
        "model.safetensors.index.json",
        "tokenizer*",
        "vocab*",
        "*.txt",
    ]
    patterns += ["special_tokens_map.json", "merges.txt", "spm.model", "added_tokens.json"]
    try:
        return Path(snapshot_download(repo_id=text, allow_patterns=patterns))
    except Exception as e:  # offline, unknown repo, no cache: all the same to the user
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{name}: no such folder, and the Hugging Face hub cannot provide it ({reason})") from None


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.exists():
        raise UserError(f"{folder}: no config.json (is this a model folder?)")
    return read_json_object(path)


def fine_tuned_head(name: str | os.PathLike) -> str:
    """The head a fine-tuned folder (or hub id) predicts with: the one its config.json names when that is a
    fine-tuning head, else 'embedding' for a sentence-transformers folder, else the sequence head."""
    folder = resolve(name)
    _, info = config_from_hf(_read_config(folder), str(folder / "config.json"))
    if info.head not in LABELLED and (folder / sentence_folder.MODULES).is_file():
        return "embedding"
    return info.head if info.head in LABELLED else "sequence"


def embedding_pooling(folder: Path) -> dict[str, Any]:
    """The pooling an embedding model of `folder` starts with: its sentence-transformers modules', else the mean of
    the tokens, not normalised (what sentence-transformers gives a plain encoder)."""
    found = sentence_folder.read_pooling(folder)
    return {"pooling": "mean", "normalize": False} if found is None else {"pooling": found.pooling,
                                                                            "normalize": found.normalize}  # fmt: skip


def load_pretrained(
    name: str | os.PathLike,
    head: str | None = None,
    require_head: bool = False,
    num_labels: int | None = None,
    need_tokenizer: bool = True,
    dtype: str | None = None,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
) -> Pretrained:
    """Load a Hugging Face BERT/RoBERTa folder (or hub id) into a bertforge model; model.load.load_model takes runs too.

    head None takes the head that config.json names (a bare encoder gets the MLM head). With `require_head` a
    checkpoint without that head's weights is an error; otherwise the head starts fresh and is listed.
    `overrides` replaces ModelConfig fields that do not change the weights' shapes (dropout, pooling, dtype).
    """
    folder = resolve(name)
    overrides = dict(overrides or {})
    if dtype is not None:
        overrides["dtype"] = dtype
    data = _read_config(folder)
    source = str(folder / "config.json")
    cfg, info = config_from_hf(data, source)
    head = head or info.head or "mlm"
    if head == "embedding":
        overrides = {**embedding_pooling(folder), **overrides}
    cfg = _with_overrides(cfg, overrides, source)
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}")
    files = weight_files(folder)  # refuses pickles before anything else is read
    tokenizer = None
    if need_tokenizer:
        tokenizer = Tokenizer.load(folder)
        if tokenizer.vocab_size > cfg.vocab_size:
            raise UserError(
                f"{folder}: the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding table "
                f"(config.json vocab_size) has only {cfg.vocab_size} rows"
            )
    id2label = info.id2label
    if num_labels is not None and num_labels != len(id2label):
        id2label = {i: f"LABEL_{i}" for i in range(num_labels)}
    tensors = without_other_head(cfg, read_weights(files), head, info.head, str(folder))
    model, missing = build_with_weights(cfg, tensors, head, len(id2label), seed, str(folder))
    if missing and require_head:
        kind = HEAD_KINDS[head]
        raise UserError(f"{folder}: has no {kind} head weights (missing {missing[0]}); is it the right model?")
    return Pretrained(model, tokenizer, head, id2label, info.problem_type, folder, missing)


def _with_overrides(cfg: ModelConfig, overrides: dict[str, Any], source: str) -> ModelConfig:
    try:
        return dataclasses.replace(cfg, **overrides)
    except (TypeError, ValueError) as e:
        raise UserError(f"{source}: {e}") from None


# What a folder's weights may be written in (config.json's "dtype" says which); they are read back as float32.
WEIGHT_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": jax.numpy.bfloat16}


def weights_blob(tensors: dict[str, np.ndarray], dtype: str = "float32") -> bytes:
    """model.safetensors' bytes: `tensors` rounded to `dtype` (one of WEIGHT_DTYPES, to nearest, ties to even)."""
    return safetensors_bytes(
        {k: v.astype(WEIGHT_DTYPES[dtype], copy=False) for k, v in tensors.items()}, metadata={"format": "pt"}
    )


def _weight_files_or_none(folder: Path | None) -> list[Path]:
    try:
        return weight_files(folder) if folder is not None else []
    except UserError:  # a run's checkpoint, not a folder of weights
        return []


def save_pretrained(
    model: Model,
    out: str | os.PathLike,
    tokenizer: Tokenizer | None = None,
    id2label: dict[int, str] | None = None,
    extra_files: dict[str, str | bytes | Future] | None = None,
    dtype: str = "float32",
    base: Path | None = None,
) -> Path:
    """Write a folder that transformers' AutoModelForMaskedLM, AutoModelForSequenceClassification,
    AutoModelForTokenClassification, AutoModelForQuestionAnswering or AutoModelForMultipleChoice (as the model's
    head) loads; an embedding model's is an AutoModel folder that SentenceTransformer loads with its pooling.

    Files are written into a temporary folder and moved into place, so a crash never leaves a half-written export.
    Over an existing folder, its config.json goes first and the new one comes last: a folder caught in between has
    none, and neither transformers nor bertforge loads it. `dtype` is the weights' (WEIGHT_DTYPES): half of them
    halves the folder. An extra file may come as a Future of its contents, waited for after the weights are written.
    An embedding model of BERT or RoBERTa keeps the pooler of `base` (the folder it was fine-tuned from) unused.
    """
    out = Path(out)
    head = model.task
    if head in LABELLED:
        id2label = id2label or {i: f"LABEL_{i}" for i in range(model.num_labels)}
        if len(id2label) != model.num_labels:
            raise ValueError(f"id2label has {len(id2label)} labels, the model {model.num_labels}")
    if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding table has only "
            f"{model.config.vocab_size} rows"
        )
    if head == "embedding":  # a sentence-transformers folder too
        extra_files = {**sentence_folder.files(model.config, model.config.max_seq_len), **(extra_files or {})}

    def fill(tmp: Path) -> None:
        config = {**config_to_hf(model.config, head, id2label), "dtype": dtype}
        write_atomic(tmp / "config.json", json.dumps(config, indent=2) + "\n")
        tensors = export_weights(model, head)
        if head == "embedding":
            tensors |= sentence_folder.pooler_weights(model.config, _weight_files_or_none(base))
        write_atomic(tmp / "model.safetensors", weights_blob(tensors, dtype))
        if tokenizer is not None:
            tokenizer.save(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            write_atomic(tmp / name, text.result() if isinstance(text, Future) else text)

    fill_folder_into(out, fill)
    return out
