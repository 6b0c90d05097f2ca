"""What a model is, apart from its weights: ModelConfig, the size presets, each Hugging Face family's conventions,
and the conversion to and from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from bertforge.errors import UserError
from bertforge.model.attention import ATTENTIONS, cudnn_takes

ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
FLAVORS = ("bert", "roberta")
POOLINGS = ("cls", "mean", "attention")
POSITION_INITS = ("normal", "sinusoidal")


# Upper bounds of the sizes a config may give: token ids are int32, and nothing in the BERT family comes near the
# others; a vocabulary of 10^12 is a broken file, not a model to allocate.
SIZE_LIMITS = {
    "vocab_size": 2**31 - 1,
    "hidden_size": 65_536,
    "num_layers": 1_024,
    "num_heads": 1_024,
    "intermediate_size": 262_144,
    "max_position_embeddings": 1_048_576,
    "type_vocab_size": 65_536,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    flavor: str = "bert"  # "bert" or "roberta"
    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    classifier_dropout: float | None = None
    initializer_range: float = 0.02
    pad_token_id: int = 0
    dtype: str = "float32"  # compute dtype; parameters are always float32
    pooling: str = "cls"  # sequence head: the [CLS] vector, the mean of the tokens, or learned attention weights
    remat: bool = False  # keep only each layer's input for the backward pass and recompute the rest (less memory)
    # A fresh model's position table: random as BERT's, or sinusoids (Vaswani et al. 2017) whose dot products depend
    # only on the distance between positions, a start from which attention to neighbours is learned sooner.
    position_init: str = "normal"
    # The attention implementation (see model/attention.py): auto picks the fastest of the platform. A runtime
    # choice, not part of the weights: never written to config.json.
    attention: str = "auto"

    def __post_init__(self) -> None:
        if self.flavor not in FLAVORS:
            raise ValueError(f"flavor {self.flavor!r} is not one of {', '.join(FLAVORS)}")
        # Checked before anything is allocated: a config file can ask for any size.
        for name, limit in SIZE_LIMITS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if not 1 <= value <= limit:
                raise ValueError(f"{name} must be between 1 and {limit:,}, got {value:,}")
        for name in ("layer_norm_eps", "initializer_range", "hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if not isinstance(self.pad_token_id, int) or isinstance(self.pad_token_id, bool):
            raise ValueError(f"pad_token_id must be an integer, got {self.pad_token_id!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not one of {', '.join(ACTIVATIONS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling {self.pooling!r} is not one of {', '.join(POOLINGS)}")
        if self.position_init not in POSITION_INITS:
            raise ValueError(f"position_init {self.position_init!r} is not one of {', '.join(POSITION_INITS)}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention {self.attention!r} is not one of {', '.join(ATTENTIONS)}")
        if self.attention == "cudnn" and not cudnn_takes(self.dtype, self.hidden_size // self.num_heads):
            raise ValueError(
                f"attention 'cudnn' needs dtype bfloat16 and a head size that is a multiple of 8 up to 256; this "
                f"model has {self.dtype} and heads of {self.hidden_size // self.num_heads}"
            )
        for name in ("hidden_dropout", "attention_dropout", "classifier_dropout"):
            rate = getattr(self, name)
            if rate is not None and not 0.0 <= rate < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {rate}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id {self.pad_token_id} is outside the vocabulary of {self.vocab_size}")
        if self.max_seq_len < 1:
            raise ValueError(f"max_position_embeddings {self.max_position_embeddings} leaves no room for tokens")

    @property
    def max_seq_len(self) -> int:
        """The longest input the position table holds (RoBERTa spends pad_token_id + 1 rows on its offset)."""
        if self.flavor == "roberta":
            return self.max_position_embeddings - self.pad_token_id - 1
        return self.max_position_embeddings

    @property
    def compute_dtype(self) -> Any:
        return DTYPES[self.dtype]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def num_params(self) -> int:
        """Parameter count of the encoder and MLM head (tied decoder counted once)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        embed = (v + self.max_position_embeddings + self.type_vocab_size) * d + 2 * d
        layer = 4 * (d * d + d) + 2 * d * f + f + d + 4 * d
        mlm = d * d + d + 2 * d + v
        return embed + self.num_layers * layer + mlm

    @classmethod
    def resolve_config_dict(cls, data: dict[str, Any], where: str) -> dict[str, Any]:
        """A `preset: NAME` key in YAML starts from that preset; the other keys override it. A `flavor` other than
        the preset's brings that family's conventions (see FAMILIES) before the other keys apply."""
        if "preset" not in data:
            return data
        name = data.pop("preset")
        key = f"{where}.preset" if where else "preset"
        base = dataclasses.asdict(preset(name, key=key))
        flavor = data.get("flavor")
        if isinstance(flavor, str) and flavor != base["flavor"] and flavor in FAMILIES:
            base = FAMILIES[flavor].apply(base)
        return {**base, **data}


# ------------------------------------------------------------------------------------------------------ families
@dataclasses.dataclass(frozen=True)
class Family:
    """A Hugging Face family's conventions beyond its sizes."""

    hf_prefix: str  # of its class names: BertForMaskedLM, RobertaForSequenceClassification
    pad_token_id: int
    position_offset: int  # position rows before the first token's (RoBERTa: pad_token_id + 1)
    type_vocab_size: int
    layer_norm_eps: float
    special_ids: dict[str, int] = dataclasses.field(default_factory=dict)  # more config.json keys

    def apply(self, fields: dict[str, Any]) -> dict[str, Any]:
        """A BERT config's fields (e.g. a preset's) with this family's conventions, for the same sequence length."""
        return {
            **fields,
            "pad_token_id": self.pad_token_id,
            "max_position_embeddings": fields["max_position_embeddings"] + self.position_offset,
            "type_vocab_size": self.type_vocab_size,
            "layer_norm_eps": self.layer_norm_eps,
        }


FAMILIES = {
    "bert": Family("Bert", pad_token_id=0, position_offset=0, type_vocab_size=2, layer_norm_eps=1e-12),
    "roberta": Family(
        "Roberta",
        pad_token_id=1,
        position_offset=2,
        type_vocab_size=1,
        layer_norm_eps=1e-5,
        special_ids={"bos_token_id": 0, "eos_token_id": 2},
    ),
}
# model_type -> flavor; XLM-R and CamemBERT are RoBERTa's architecture with other vocabularies.
MODEL_TYPES = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta", "camembert": "roberta"}


# ------------------------------------------------------------------------------------------------------ presets
def _size(layers: int, hidden: int, heads: int, **extra: Any) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_heads=heads, intermediate_size=4 * hidden, **extra)


# Model sizes by name: Google's BERT miniatures (Turc et al. 2019) and the original BERT sizes.
PRESETS: dict[str, ModelConfig] = {
    # The test suite's model: small enough to compile in a second on a laptop CPU.
    "test": _size(2, 32, 2, vocab_size=1024, max_position_embeddings=128),
    "tiny": _size(2, 128, 2),
    "mini": _size(4, 256, 4),
    "small": _size(4, 512, 8),
    "medium": _size(8, 512, 8),
    "base": _size(12, 768, 12),
    "large": _size(24, 1024, 16),
}


def preset(name: str, key: str = "preset", **overrides: Any) -> ModelConfig:
    """The named preset with field overrides; an unknown name is a UserError listing the known ones."""
    if not isinstance(name, str) or name not in PRESETS:
        raise UserError(f"unknown preset '{name}' for config key '{key}' (choose from {', '.join(PRESETS)})")
    return dataclasses.replace(PRESETS[name], **overrides)


# ------------------------------------------------------------------------------------------------------ config.json
@dataclasses.dataclass(frozen=True)
class HeadInfo:
    head: str | None  # 'mlm', 'sequence' or None (a bare encoder such as BertModel)
    num_labels: int
    id2label: dict[int, str]
    problem_type: str | None


def config_from_hf(data: dict[str, Any], source: str) -> tuple[ModelConfig, HeadInfo]:
    """A Hugging Face config.json (as a dict) -> ModelConfig and what it says of the head."""
    model_type = data.get("model_type")
    if model_type not in MODEL_TYPES:
        arch = ", ".join(data.get("architectures") or []) or "none given"
        raise UserError(
            f"{source}: unsupported architecture model_type={model_type!r} (architectures: {arch}); "
            f"bertforge loads {', '.join(MODEL_TYPES)}"
        )
    pos = data.get("position_embedding_type", "absolute")
    if pos != "absolute":
        raise UserError(f"{source}: position_embedding_type={pos!r} is not supported (only 'absolute')")
    act = data.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise UserError(f"{source}: hidden_act={act!r} is not supported ({', '.join(ACTIVATIONS)})")
    flavor = MODEL_TYPES[model_type]
    fields = {
        "vocab_size": "vocab_size",
        "hidden_size": "hidden_size",
        "num_layers": "num_hidden_layers",
        "num_heads": "num_attention_heads",
        "intermediate_size": "intermediate_size",
        "max_position_embeddings": "max_position_embeddings",
        "type_vocab_size": "type_vocab_size",
        "layer_norm_eps": "layer_norm_eps",
        "hidden_dropout": "hidden_dropout_prob",
        "attention_dropout": "attention_probs_dropout_prob",
        "classifier_dropout": "classifier_dropout",
        "initializer_range": "initializer_range",
        "pad_token_id": "pad_token_id",
    }
    kwargs: dict[str, Any] = {"flavor": flavor, "hidden_act": act, "pooling": data.get("bertforge_pooling", "cls")}
    for ours, theirs in fields.items():
        if theirs in data and (data[theirs] is not None or ours == "classifier_dropout"):
            kwargs[ours] = data[theirs]
    if "pad_token_id" not in data:
        kwargs["pad_token_id"] = FAMILIES[flavor].pad_token_id
    try:
        cfg = ModelConfig(**kwargs)
    except (TypeError, ValueError) as e:
        raise UserError(f"{source}: {e}") from None
    archs = data.get("architectures") or []
    head = None
    if any(a.endswith("ForMaskedLM") or a.endswith("ForPreTraining") for a in archs):
        head = "mlm"
    elif any(a.endswith("ForSequenceClassification") for a in archs):
        head = "sequence"
    id2label = {int(k): str(v) for k, v in (data.get("id2label") or {}).items()}
    num_labels = int(data.get("num_labels") or len(id2label) or 2)
    if not id2label:
        id2label = {i: f"LABEL_{i}" for i in range(num_labels)}
    return cfg, HeadInfo(head, len(id2label), id2label, data.get("problem_type"))


def config_to_hf(cfg: ModelConfig, head: str, id2label: dict[int, str] | None = None) -> dict[str, Any]:
    """The config.json of a model of `head` ('mlm' or 'sequence'); runtime choices (dtype, remat, attention) stay
    out of it."""
    family = FAMILIES[cfg.flavor]
    arch = f"{family.hf_prefix}ForMaskedLM" if head == "mlm" else f"{family.hf_prefix}ForSequenceClassification"
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": cfg.flavor,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": cfg.hidden_act,
        "hidden_dropout_prob": cfg.hidden_dropout,
        "attention_probs_dropout_prob": cfg.attention_dropout,
        "classifier_dropout": cfg.classifier_dropout,
        "max_position_embeddings": cfg.max_position_embeddings,
        "type_vocab_size": cfg.type_vocab_size,
        "initializer_range": cfg.initializer_range,
        "layer_norm_eps": cfg.layer_norm_eps,
        "pad_token_id": cfg.pad_token_id,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
        "dtype": "float32",
    }
    out.update(family.special_ids)
    if head == "sequence":
        labels = id2label or {0: "LABEL_0"}
        out["id2label"] = {str(k): v for k, v in sorted(labels.items())}
        out["label2id"] = {v: k for k, v in sorted(labels.items())}
        if len(labels) == 1:
            out["problem_type"] = "regression"
        if cfg.pooling != "cls":
            out["bertforge_pooling"] = cfg.pooling  # transformers' own heads always pool [CLS]
    return out
