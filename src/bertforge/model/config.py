"""What a model is, apart from its weights: ModelConfig, the size presets, and the helpers each family's module
uses to read and write its Hugging Face config.json (the families themselves: family.py, architectures.py)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NoReturn

import jax
import jax.numpy as jnp

from bertforge.errors import UserError
from bertforge.model import activations
from bertforge.model import family as families
from bertforge.model.attention import ATTENTIONS, cudnn_takes

ACTIVATIONS = {
    "gelu": activations.gelu,
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "tanh": jnp.tanh,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}
# Compute dtypes; parameters stay float32. float16 (GPUs without bfloat16) trains with a dynamic loss scale.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
POOLINGS = ("cls", "mean", "max", "attention")
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
    "embedding_size": 65_536,
}
# Sizes that may be 0: DeBERTa-v3 and ModernBERT have no token-type table.
ZERO_SIZES = ("type_vocab_size",)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str = "bert"  # bert, roberta, deberta-v2, modernbert, electra or distilbert (see architectures.py)
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
    pooling: str = "cls"  # the [CLS] vector, the tokens' mean or maximum, or learned attention weights (sequence head)
    normalize: bool = False  # embedding head: vectors scaled to unit length (sentence-transformers' Normalize)
    remat: bool = False  # keep only each layer's input for the backward pass and recompute the rest (less memory)
    # A fresh model's position table: random as BERT's, or sinusoids (Vaswani et al. 2017) whose dot products depend
    # only on the distance between positions, a start from which attention to neighbours is learned sooner.
    position_init: str = "normal"
    # The attention implementation (see model/attention.py): auto picks the fastest of the platform. A runtime
    # choice, not part of the weights: never written to config.json.
    attention: str = "auto"
    # The sequence head's activation after its dense layer: tanh (BERT's pooler, RoBERTa), gelu (ELECTRA, DeBERTa's
    # pooler_hidden_act, ModernBERT's classifier_activation), relu (DistilBERT).
    classifier_act: str = "tanh"
    # Width of the embedding table when it differs from hidden_size (ELECTRA, DeBERTa): a projection follows it.
    # 0: the hidden size.
    embedding_size: int = 0
    # Biases: BERT has them everywhere; ModernBERT has none but the decoder's (its checkpoints say which).
    attention_bias: bool = True
    mlp_bias: bool = True
    norm_bias: bool = True
    classifier_bias: bool = True
    decoder_bias: bool = True
    # DeBERTa-v2/v3 (deberta.py): disentangled attention over log-bucketed relative positions.
    relative_attention: bool = False
    max_relative_positions: int = -1  # -1: max_position_embeddings
    position_buckets: int = -1  # -1: no log buckets
    pos_att_type: tuple[str, ...] = ()  # of "c2p", "p2c"
    share_att_key: bool = False
    position_biased_input: bool = True  # absolute position embeddings added to the input
    norm_rel_ebd: str = "none"  # "layer_norm": the relative embeddings pass through a LayerNorm
    conv_kernel_size: int = 0  # > 0: the v2 convolution layer after the first layer
    conv_groups: int = 1
    conv_act: str = "tanh"
    # ModernBERT (modernbert.py): rotary positions, every global_attn_every_n_layers-th layer global, the others
    # attending within a window of local_attention tokens.
    global_rope_theta: float = 160_000.0
    local_rope_theta: float = 10_000.0
    local_attention: int = 128
    global_attn_every_n_layers: int = 3

    def __post_init__(self) -> None:
        # config.py's presets (all BERT) are built while the family modules import, before their table is installed.
        if families.installed():
            families.lookup(self.family)
        # Checked before anything is allocated: a config file can ask for any size.
        for name, limit in SIZE_LIMITS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            low = 0 if name in ZERO_SIZES or name == "embedding_size" else 1
            if not low <= value <= limit:
                raise ValueError(f"{name} must be between 1 and {limit:,}, got {value:,}")
        for name in (
            "layer_norm_eps",
            "initializer_range",
            "hidden_dropout",
            "attention_dropout",
            "global_rope_theta",
            "local_rope_theta",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if not isinstance(self.pad_token_id, int) or isinstance(self.pad_token_id, bool):
            raise ValueError(f"pad_token_id must be an integer, got {self.pad_token_id!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        for name in ("hidden_act", "classifier_act", "conv_act"):
            if getattr(self, name) not in ACTIVATIONS:
                raise ValueError(f"{name} {getattr(self, name)!r} is not one of {', '.join(ACTIVATIONS)}")
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
                f"attention 'cudnn' needs dtype bfloat16 or float16 and a head size that is a multiple of 8 up to "
                f"256; this model has {self.dtype} and heads of {self.hidden_size // self.num_heads}"
            )
        for name in ("hidden_dropout", "attention_dropout", "classifier_dropout"):
            rate = getattr(self, name)
            if rate is not None and not 0.0 <= rate < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {rate}")
        for name, low in (("global_attn_every_n_layers", 1), ("local_attention", 0), ("conv_kernel_size", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer of at least {low}, got {value!r}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id {self.pad_token_id} is outside the vocabulary of {self.vocab_size}")
        if families.installed() and self.max_seq_len < 1:
            raise ValueError(f"max_position_embeddings {self.max_position_embeddings} leaves no room for tokens")

    @property
    def max_seq_len(self) -> int:
        """The longest input the positions allow (RoBERTa spends pad_token_id + 1 rows of its table on an offset;
        DeBERTa without absolute positions has only relative ones, which clamp at any distance)."""
        rule = families.lookup(self.family).max_seq_len
        return self.max_position_embeddings if rule is None else rule(self)

    @property
    def embed_dim(self) -> int:
        """Width of the embedding table (embedding_size, or the hidden size)."""
        return self.embedding_size or self.hidden_size

    @property
    def compute_dtype(self) -> Any:
        return DTYPES[self.dtype]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def num_params(self) -> int:
        """Parameter count of an encoder and MLM head (tied decoder counted once) in closed form, for the families
        that have one (BERT, RoBERTa: the published sizes). Others: architectures.count_params of a built model."""
        count = families.lookup(self.family).num_params
        if count is None:
            raise ValueError(f"num_params is BERT's closed form; count a built {self.family} model's parameters")
        return count(self)

    @classmethod
    def resolve_config_dict(cls, data: dict[str, Any], where: str) -> dict[str, Any]:
        """A `preset: NAME` key in YAML starts from that preset; the other keys override it. A `family` other than
        the preset's brings that family's conventions (see family.Family) before the other keys apply."""
        if "flavor" in data:
            # Run folders and YAML written before `flavor` was renamed `family` still resume.
            data.setdefault("family", data.pop("flavor"))
        if "preset" not in data:
            return data
        name = data.pop("preset")
        key = f"{where}.preset" if where else "preset"
        base = dataclasses.asdict(preset(name, key=key))
        family = data.get("family")
        if isinstance(family, str) and family != base["family"] and family in families.table():
            base = families.lookup(family).apply(base)
        return {**base, **data}


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


def read_fields(data: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """ModelConfig fields from config.json keys (`names`: field -> key); absent or null keys are left out, except
    classifier_dropout, whose null means "hidden_dropout"."""
    return {
        ours: data[theirs]
        for ours, theirs in names.items()
        if theirs in data and (data[theirs] is not None or ours == "classifier_dropout")
    }


def write_fields(cfg: ModelConfig, names: dict[str, str]) -> dict[str, Any]:
    """config.json keys from ModelConfig fields (`names`: field -> key)."""
    return {theirs: getattr(cfg, ours) for ours, theirs in names.items()}


def refuse(source: str, key: str, value: Any, why: str = "") -> NoReturn:
    """Raises the UserError for a config.json option bertforge does not implement, `why` (e.g. what it takes) after."""
    raise UserError(f"{source}: {key}={value!r} is not supported" + (f" ({why})" if why else ""))
