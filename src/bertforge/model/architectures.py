"""Every architecture bertforge runs, by flavor, and what is the same for all of them: building a model, its key
table, and reading and writing its Hugging Face config.json.

Each architecture's file gives: Encoder(cfg, rngs=...), mlm_head(cfg, rngs), sequence_head(cfg, num_labels, rngs),
key_table(cfg, head), hf_fields(data, flavor, source) (ModelConfig fields from its config.json, refusing options
it does not implement), hf_config(cfg, head) (its config.json apart from the labels), normalise_keys(tensors,
cfg), PRETRAINING_HEAD (the head of its *ForPreTraining class, None when that is not a masked-LM head) and
NATIVE_POOLINGS (the poolings transformers' own sequence head does). An architecture whose transformers class holds
a replaced-token detection head (ELECTRA) gives rtd_rows(cfg) and RTD_ARCHITECTURE; the others' discriminators are
written as their bare encoder ({prefix}Model).
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import jax
from flax import nnx

from bertforge.errors import UserError
from bertforge.model import bert, deberta, distilbert, electra, modernbert
from bertforge.model.config import FAMILIES, HeadInfo, ModelConfig
from bertforge.model.heads import Discriminator, MaskedLM, Model, RtdHead, SequenceClassifier
from bertforge.model.keys import Row

ARCHITECTURES: dict[str, ModuleType] = {
    "bert": bert,
    "roberta": bert,
    "deberta-v2": deberta,
    "modernbert": modernbert,
    "electra": electra,
    "distilbert": distilbert,
}
# Encoders that take segment_ids: rows packing several sequences, each attending within itself at its own positions.
SEGMENT_FLAVORS = ("bert", "roberta", "modernbert", "electra", "distilbert")
# model_type -> flavor; XLM-R and CamemBERT are RoBERTa's architecture with other vocabularies.
MODEL_TYPES = {
    "bert": "bert",
    "roberta": "roberta",
    "xlm-roberta": "roberta",
    "camembert": "roberta",
    "deberta-v2": "deberta-v2",
    "modernbert": "modernbert",
    "electra": "electra",
    "distilbert": "distilbert",
}
HEADS = ("mlm", "sequence", "rtd")


def architecture(cfg: ModelConfig) -> ModuleType:
    return ARCHITECTURES[cfg.flavor]


def build(cfg: ModelConfig, head: str = "mlm", num_labels: int = 1, seed: int = 0) -> Model:
    """A freshly initialised model of cfg's architecture: head 'mlm', 'sequence' or 'rtd' (a discriminator)."""
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r} (mlm or sequence)")
    arch = architecture(cfg)
    rngs = nnx.Rngs(params=seed, dropout=seed + 1)
    encoder = arch.Encoder(cfg, rngs=rngs)
    if head == "mlm":
        return MaskedLM(cfg, encoder, arch.mlm_head(cfg, rngs))
    if head == "rtd":
        return Discriminator(cfg, encoder, RtdHead(cfg, rngs=rngs))
    return SequenceClassifier(cfg, num_labels, encoder, arch.sequence_head(cfg, num_labels, rngs))


def count_params(params: Any) -> int:
    """The number of values in a parameter tree (nnx.State or arrays); a tied decoder is one table, counted once."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


def key_table(cfg: ModelConfig, head: str) -> list[Row]:
    """Every parameter of a model of `head` with its Hugging Face name."""
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}")
    arch = architecture(cfg)
    if head == "rtd":
        # The encoder as the masked-LM model names it, and the detection head where transformers has one.
        rows = [row for row in arch.key_table(cfg, "mlm") if not row.head]
        return rows + (arch.rtd_rows(cfg) if hasattr(arch, "rtd_rows") else [])
    rows = arch.key_table(cfg, head)
    if head == "sequence" and cfg.pooling == "attention":
        # Not a transformers parameter: a bertforge folder with attention pooling is read back by bertforge.
        rows = [*rows, Row("bertforge_pooling.score", ("head", "score"), False, True)]
    return rows


def normalise_keys(tensors: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """A checkpoint's tensor names as key_table spells them."""
    return architecture(cfg).normalise_keys(tensors, cfg)


def config_from_hf(data: dict[str, Any], source: str) -> tuple[ModelConfig, HeadInfo]:
    """A Hugging Face config.json (as a dict) -> ModelConfig and what it says of the head."""
    model_type = data.get("model_type")
    if model_type not in MODEL_TYPES:
        archs = ", ".join(data.get("architectures") or []) or "none given"
        raise UserError(
            f"{source}: unsupported architecture model_type={model_type!r} (architectures: {archs}); "
            f"bertforge loads {', '.join(MODEL_TYPES)}"
        )
    flavor = MODEL_TYPES[model_type]
    arch = ARCHITECTURES[flavor]
    fields = arch.hf_fields(data, flavor, source)
    if "bertforge_pooling" in data or "pooling" not in fields:
        fields["pooling"] = data.get("bertforge_pooling", "cls")
    try:
        cfg = ModelConfig(**fields)
    except (TypeError, ValueError) as e:
        raise UserError(f"{source}: {e}") from None
    names = data.get("architectures") or []
    head = None
    if any(a.endswith("ForMaskedLM") for a in names):
        head = "mlm"
    elif any(a.endswith("ForPreTraining") for a in names):
        head = arch.PRETRAINING_HEAD
    elif any(a.endswith("ForSequenceClassification") for a in names):
        head = "sequence"
    id2label = {int(k): str(v) for k, v in (data.get("id2label") or {}).items()}
    num_labels = int(data.get("num_labels") or len(id2label) or 2)
    if not id2label:
        id2label = {i: f"LABEL_{i}" for i in range(num_labels)}
    return cfg, HeadInfo(head, len(id2label), id2label, data.get("problem_type"))


def config_to_hf(cfg: ModelConfig, head: str, id2label: dict[int, str] | None = None) -> dict[str, Any]:
    """The config.json of a model of `head` ('mlm', 'sequence' or 'rtd'); runtime choices (dtype, remat, attention)
    stay out of it."""
    arch = architecture(cfg)
    out = {**arch.hf_config(cfg, "mlm" if head == "rtd" else head), "dtype": "float32"}
    if head == "rtd":
        out["architectures"] = [getattr(arch, "RTD_ARCHITECTURE", f"{FAMILIES[cfg.flavor].hf_prefix}Model")]
    if head == "sequence":
        labels = id2label or {0: "LABEL_0"}
        out["id2label"] = {str(k): v for k, v in sorted(labels.items())}
        out["label2id"] = {v: k for k, v in sorted(labels.items())}
        if len(labels) == 1:
            out["problem_type"] = "regression"
        if cfg.pooling not in arch.NATIVE_POOLINGS:
            out["bertforge_pooling"] = cfg.pooling  # transformers' own head cannot pool this way
    return out
