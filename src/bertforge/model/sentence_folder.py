"""sentence-transformers folders: the files that make a model folder an embedding model for `SentenceTransformer`
(modules.json naming its Transformer, Pooling and Normalize modules, with their configs), written beside every
embedding model bertforge saves, and the pooling read back from such a folder (all-MiniLM-L6-v2 is one).

bertforge writes the classic layout (`sentence_transformers.models.*`), which every sentence-transformers release
from 2 to 6 loads, and reads both it and the layout sentence-transformers 6 writes (`pooling_mode`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from bertforge.errors import UserError
from bertforge.fileio import read_json_object
from bertforge.model.config import ModelConfig

MODULES = "modules.json"
POOLING = "1_Pooling"
# sentence-transformers' pooling modes that bertforge computes, by its own name for them.
MODES = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens"}
POOLER = ("pooler.dense.weight", "pooler.dense.bias")
KNOWN = ("Transformer", "Pooling", "Normalize")  # the modules an embedding model may have (Dense is not computed)


@dataclasses.dataclass(frozen=True)
class Pooling:
    """How a sentence-transformers folder turns tokens into one vector."""

    pooling: str  # cls, mean or max
    normalize: bool  # a Normalize module follows
    max_length: int | None  # sentence_bert_config.json's max_seq_length, when given


def files(cfg: ModelConfig, max_length: int) -> dict[str, str]:
    """The sentence-transformers files of an embedding model of `cfg` (path in the folder -> JSON text)."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": POOLING, "type": "sentence_transformers.models.Pooling"},
    ]
    if cfg.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    pooling: dict[str, Any] = {"word_embedding_dimension": cfg.hidden_size}
    pooling |= {key: cfg.pooling == mode for mode, key in MODES.items()}
    pooling |= {"pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
                "pooling_mode_lasttoken": False, "include_prompt": True}  # fmt: skip
    about = {"prompts": {}, "default_prompt_name": None, "similarity_fn_name": "cosine"}
    text = lambda data: json.dumps(data, indent=2) + "\n"  # noqa: E731
    return {
        MODULES: text(modules),
        f"{POOLING}/config.json": text(pooling),
        "sentence_bert_config.json": text({"max_seq_length": max_length, "do_lower_case": False}),
        "config_sentence_transformers.json": text(about),
    }


def pooler_weights(cfg: ModelConfig, base_files: list[Path]) -> dict[str, np.ndarray]:
    """The pooler an embedding folder of BERT or RoBERTa holds unused: transformers' AutoModel builds BertModel
    (RobertaModel) with one and, finding none, says it was "newly initialized", which reads as a broken model. The
    pooler of the base model's weights `base_files` where they hold one, else one drawn as transformers initialises it
    (normal with std initializer_range, zero bias); no other family's AutoModel has a pooler."""
    if cfg.family not in ("bert", "roberta"):
        return {}
    found: dict[str, np.ndarray] = {}
    for path in base_files:
        with safe_open(str(path), framework="numpy") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = key.removeprefix(f"{cfg.family}.")
                if name in POOLER:
                    found[name] = np.asarray(f.get_tensor(key), np.float32)
    if set(found) == set(POOLER) and found[POOLER[0]].shape == (cfg.hidden_size, cfg.hidden_size):
        return found
    rng = np.random.default_rng(0)
    weight = rng.normal(0.0, cfg.initializer_range, (cfg.hidden_size, cfg.hidden_size)).astype(np.float32)
    return {POOLER[0]: weight, POOLER[1]: np.zeros(cfg.hidden_size, np.float32)}


def read_pooling(folder: Path) -> Pooling | None:
    """The pooling of a sentence-transformers folder; None for a folder without modules.json. A module bertforge
    does not compute (Dense, a pooling mode other than cls, mean or max) is a UserError naming it."""
    path = folder / MODULES
    if not path.is_file():
        return None
    try:
        modules = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise UserError(f"{path}: expected a list of modules")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    odd = [k for k in kinds if k not in KNOWN]
    if odd:
        raise UserError(f"{path}: has a {odd[0]} module; bertforge computes Transformer, Pooling and Normalize only")
    if "Pooling" not in kinds:
        raise UserError(f"{path}: has no Pooling module")
    inside = str(modules[kinds.index("Pooling")].get("path", ""))
    if Path(inside).is_absolute() or ".." in Path(inside).parts:  # nothing outside the model's folder is read
        raise UserError(f"{path}: the Pooling module's path {inside!r} leaves the folder")
    where = folder / inside / "config.json"
    return Pooling(_mode(where), "Normalize" in kinds, _max_length(folder / "sentence_bert_config.json"))


def _mode(path: Path) -> str:
    if not path.is_file():
        raise UserError(f"{path}: missing (the Pooling module's config)")
    config = read_json_object(path)
    if "pooling_mode" in config:  # sentence-transformers 6
        modes = [str(config["pooling_mode"])]
        modes = ["cls" if m == "cls_token" else m.removesuffix("_tokens") for m in modes]
    else:
        modes = [key.removeprefix("pooling_mode_") for key, on in config.items() if key.startswith("pooling_mode_")
                 and on is True]  # fmt: skip
        modes = ["cls" if m == "cls_token" else m.removesuffix("_tokens") for m in modes]
    if len(modes) != 1 or modes[0] not in MODES:
        raise UserError(f"{path}: pooling {' + '.join(modes) or 'none'}; bertforge pools by one of cls, mean, max")
    return modes[0]


def _max_length(path: Path) -> int | None:
    if not path.is_file():
        return None
    value = read_json_object(path).get("max_seq_length")
    return int(value) if isinstance(value, int) and value > 0 else None
