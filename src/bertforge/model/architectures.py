"""The model families bertforge runs, collected from their modules, and what is the same for all of them: building
a model, its key table, and reading and writing its Hugging Face config.json.

Each family's module (bert.py, deberta.py, modernbert.py, electra.py, distilbert.py) declares what FamilyModule
lists; `satisfies(module)` names what a module lacks. FAMILIES, FAMILY_NAMES, SEGMENT_FAMILIES and MODEL_TYPES are
derived from the Family records the modules declare.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, Protocol

import jax
from flax import nnx

from bertforge.errors import UserError
from bertforge.model import bert, deberta, distilbert, electra, family, modernbert
from bertforge.model.config import HeadInfo, ModelConfig
from bertforge.model.family import Family
from bertforge.model.heads import (
    ChoiceClassifier,
    Discriminator,
    Embedder,
    MaskedLM,
    MlmHead,
    Model,
    RtdHead,
    SequenceClassifier,
    SequenceHead,
    SpanClassifier,
    TokenClassifier,
    TokenHead,
)
from bertforge.model.keys import Row


class FamilyModule(Protocol):
    """What a family's module declares; the module itself is the implementation (structural typing)."""

    FAMILIES: tuple[Family, ...]  # the families it serves (bert.py: BERT and RoBERTa)
    HF_FIELDS: Mapping[str, str]  # ModelConfig field -> config.json key
    HF_DEFAULTS: Mapping[str, Any]  # config.json key -> what transformers assumes when it is absent
    PRETRAINING_HEAD: str | None  # the head of its *ForPreTraining class, None when that is not a masked-LM head
    NATIVE_POOLINGS: tuple[str, ...]  # the poolings transformers' own sequence head does
    SCORE_BUFFERS: int  # float32 (B, N, T, T) buffers a layer's training step keeps, for plan
    # A transformers class holding a replaced-token detection head (ELECTRA) and that head's rows; with None a
    # discriminator is written as the bare encoder ({hf_prefix}Model).
    RTD_ARCHITECTURE: str | None
    rtd_rows: Callable[[ModelConfig], list[Row]] | None
    Encoder: Callable[..., nnx.Module]  # Encoder(cfg, rngs=...)

    def mlm_head(self, cfg: ModelConfig, rngs: nnx.Rngs) -> MlmHead: ...

    def sequence_head(self, cfg: ModelConfig, num_labels: int, rngs: nnx.Rngs) -> SequenceHead: ...

    def token_head(self, cfg: ModelConfig, num_labels: int, rngs: nnx.Rngs) -> TokenHead: ...

    def span_head(self, cfg: ModelConfig, rngs: nnx.Rngs) -> TokenHead: ...

    def choice_head(self, cfg: ModelConfig, rngs: nnx.Rngs) -> SequenceHead: ...

    def key_table(self, cfg: ModelConfig, head: str) -> list[Row]:
        """Every parameter of a model of `head` ('mlm', 'sequence', 'token', 'span' or 'choice') with its Hugging Face
        name."""
        ...

    def hf_fields(self, data: dict[str, Any], family: str, source: str) -> dict[str, Any]:
        """ModelConfig fields from its config.json; an option bertforge does not implement is a UserError."""
        ...

    def hf_config(self, cfg: ModelConfig, head: str) -> dict[str, Any]:
        """Its config.json for a model of `head`, apart from the labels."""
        ...

    def normalise_keys(self, tensors: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        """A checkpoint's tensor names as key_table spells them."""
        ...


MEMBERS = tuple(
    [*FamilyModule.__annotations__]
    + [name for name, value in vars(FamilyModule).items() if callable(value) and not name.startswith("_")]
)


def satisfies(module: ModuleType) -> list[str]:
    """The members of FamilyModule that `module` lacks, or has as a non-callable where a function belongs."""
    missing = [name for name in MEMBERS if not hasattr(module, name)]
    methods = [name for name in MEMBERS if name not in FamilyModule.__annotations__]
    return missing + [f"{n} (not callable)" for n in methods if n not in missing and not callable(getattr(module, n))]


FAMILY_MODULES: tuple[FamilyModule, ...] = (bert, deberta, modernbert, electra, distilbert)
MODULES: dict[str, FamilyModule] = {f.name: m for m in FAMILY_MODULES for f in m.FAMILIES}
FAMILIES: dict[str, Family] = {f.name: f for m in FAMILY_MODULES for f in m.FAMILIES}
FAMILY_NAMES = tuple(FAMILIES)
# Encoders that take segment_ids: rows packing several sequences, each attending within itself at its own positions.
SEGMENT_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.segments)
MODEL_TYPES = {t: f.name for f in FAMILIES.values() for t in (f.name, *f.model_types)}  # config.json's -> family
HEADS = ("mlm", "sequence", "token", "span", "choice", "rtd", "embedding")
# The fine-tuning heads: config.json's id2label, and a fresh head when a checkpoint holds another of them.
LABELLED = ("sequence", "token", "span", "choice")
SPAN_LABELS = {0: "start", 1: "end"}  # a span head's two outputs
CHOICE_LABELS = {0: "score"}  # a choice head's one output per choice
family.install(FAMILIES.values())


def family_module(cfg: ModelConfig) -> FamilyModule:
    return MODULES[family.lookup(cfg.family).name]


def check_head(head: str) -> None:
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r} (one of {', '.join(HEADS)})")


class ParamStream(nnx.RngStream):
    """nnx's random stream with its count stored by set_value: the same keys, where `count[...] += 1` under a trace
    (eval_shape, jit) asks the traced count for its sharding, and that error's message walks the whole trace so far,
    most of a traced build's time."""

    def __call__(self) -> jax.Array:
        count = self.count.get_value()
        key = jax.random.fold_in(self.key.get_value(), count)
        self.count.set_value(count + 1)
        return key


def build(cfg: ModelConfig, head: str = "mlm", num_labels: int = 1, seed: int | jax.Array = 0) -> Model:
    """A freshly initialised model of cfg's architecture: head 'mlm', 'sequence', 'token', 'span' (start and end
    logits), 'choice' (a score per choice), 'rtd' (a discriminator) or 'embedding' (pooled vectors). `num_labels` is
    the sequence and token heads'. `seed` may be a traced uint32 scalar, which draws what the same int would."""
    check_head(head)
    arch = family_module(cfg)

    def key(s: int | jax.Array) -> int | jax.Array:
        return s if isinstance(s, int) else jax.random.key(s)  # nnx would take a uint32 array as a key's raw words

    rngs = nnx.Rngs(dropout=key(seed + 1))
    rngs.params = ParamStream(key(seed), tag="params")
    encoder = arch.Encoder(cfg, rngs=rngs)
    if head == "mlm":
        return MaskedLM(cfg, encoder, arch.mlm_head(cfg, rngs))
    if head == "rtd":
        return Discriminator(cfg, encoder, RtdHead(cfg, rngs=rngs))
    if head == "embedding":
        return Embedder(cfg, encoder)
    if head == "token":
        return TokenClassifier(cfg, num_labels, encoder, arch.token_head(cfg, num_labels, rngs))
    if head == "span":
        return SpanClassifier(cfg, len(SPAN_LABELS), encoder, arch.span_head(cfg, rngs))
    if head == "choice":
        return ChoiceClassifier(cfg, 1, encoder, arch.choice_head(cfg, rngs))
    return SequenceClassifier(cfg, num_labels, encoder, arch.sequence_head(cfg, num_labels, rngs))


def count_params(params: Any) -> int:
    """The number of values in a parameter tree (nnx.State or arrays); a tied decoder is one table, counted once."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


def key_table(cfg: ModelConfig, head: str) -> list[Row]:
    """Every parameter of a model of `head` with its Hugging Face name."""
    check_head(head)
    arch = family_module(cfg)
    if head == "rtd":
        # The encoder as the masked-LM model names it, and the detection head where transformers has one.
        rows = [row for row in arch.key_table(cfg, "mlm") if not row.head]
        return rows + (arch.rtd_rows(cfg) if arch.rtd_rows is not None else [])
    if head == "embedding":  # the encoder alone, named as the masked-LM model names it
        return [row for row in arch.key_table(cfg, "mlm") if not row.head]
    rows = arch.key_table(cfg, head)
    if head in ("sequence", "choice") and cfg.pooling == "attention":
        # Not a transformers parameter: a bertforge folder with attention pooling is read back by bertforge.
        rows = [*rows, Row("bertforge_pooling.score", ("head", "score"), False, True)]
    return rows


def normalise_keys(tensors: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """A checkpoint's tensor names as key_table spells them."""
    return family_module(cfg).normalise_keys(tensors, cfg)


def config_from_hf(data: dict[str, Any], source: str) -> tuple[ModelConfig, HeadInfo]:
    """A Hugging Face config.json (as a dict) -> ModelConfig and what it says of the head."""
    model_type = data.get("model_type")
    if model_type not in MODEL_TYPES:
        archs = ", ".join(data.get("architectures") or []) or "none given"
        raise UserError(
            f"{source}: unsupported architecture model_type={model_type!r} (architectures: {archs}); "
            f"bertforge loads {', '.join(MODEL_TYPES)}"
        )
    name = MODEL_TYPES[model_type]
    arch = MODULES[name]
    fields = arch.hf_fields(data, name, source)
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
    elif any(a.endswith("ForTokenClassification") for a in names):
        head = "token"
    elif any(a.endswith("ForQuestionAnswering") for a in names):
        head = "span"
    elif any(a.endswith("ForMultipleChoice") for a in names):
        head = "choice"
    id2label = {int(k): str(v) for k, v in (data.get("id2label") or {}).items()}
    num_labels = int(data.get("num_labels") or len(id2label) or 2)
    if not id2label:
        id2label = {i: f"LABEL_{i}" for i in range(num_labels)}
    return cfg, HeadInfo(head, len(id2label), id2label, data.get("problem_type"))


def config_to_hf(cfg: ModelConfig, head: str, id2label: dict[int, str] | None = None) -> dict[str, Any]:
    """The config.json of a model of `head` ('mlm', 'sequence', 'token', 'span', 'choice', 'rtd' or 'embedding');
    runtime choices (dtype, remat, attention) stay out of it."""
    arch = family_module(cfg)
    out = {**arch.hf_config(cfg, "mlm" if head in ("rtd", "embedding") else head), "dtype": "float32"}
    if head == "rtd":
        out["architectures"] = [arch.RTD_ARCHITECTURE or f"{FAMILIES[cfg.family].hf_prefix}Model"]
    if head == "embedding":  # sentence-transformers' files beside it say how its tokens are pooled
        out["architectures"] = [f"{FAMILIES[cfg.family].hf_prefix}Model"]
    if head in LABELLED:
        labels = {"span": SPAN_LABELS, "choice": CHOICE_LABELS}.get(head) or id2label or {0: "LABEL_0"}
        out["id2label"] = {str(k): v for k, v in sorted(labels.items())}
        out["label2id"] = {v: k for k, v in sorted(labels.items())}
    if head == "sequence" and len(labels) == 1:
        out["problem_type"] = "regression"
    if head in ("sequence", "choice") and cfg.pooling not in arch.NATIVE_POOLINGS:
        out["bertforge_pooling"] = cfg.pooling  # transformers' own head cannot pool this way
    return out
