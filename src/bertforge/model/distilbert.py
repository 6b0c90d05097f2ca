"""DistilBERT (Sanh et al. 2019) in Flax NNX: BERT's post-LN layer (bert.py) under other names, with no token types
and no dropout on the attention output.

Its config.json has names of its own (dim, n_layers, hidden_dim, ...) and its LayerNorms a fixed epsilon of 1e-12.
Shapes: B batch, T tokens, D hidden, V vocabulary.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from bertforge.errors import UserError
from bertforge.model import bert
from bertforge.model.config import ModelConfig, read_fields, refuse, write_fields
from bertforge.model.family import Family
from bertforge.model.heads import MlmHead, SequenceHead, TokenHead, classifier_rate
from bertforge.model.keys import Row, layernorm_rows, linear_rows, table_row

PREFIX = "distilbert"  # of the encoder's parameters in *For* models
DECODER = "vocab_projector.weight"  # tied to the word embeddings; absent from tied checkpoints
LAYER_NORM_EPS = 1e-12  # transformers builds every DistilBERT LayerNorm with it; config.json cannot change it
DISTILBERT = Family(
    "distilbert",
    "DistilBert",
    pad_token_id=0,
    position_offset=0,
    type_vocab_size=0,
    layer_norm_eps=LAYER_NORM_EPS,
    fields={"classifier_act": "relu"},
)
FAMILIES = (DISTILBERT,)


def check(cfg: ModelConfig) -> None:
    """What a DistilBERT config must be for transformers to build the same model."""
    if cfg.type_vocab_size:
        raise UserError(f"type_vocab_size={cfg.type_vocab_size}: DistilBERT has no token types (use 0)")
    if cfg.layer_norm_eps != LAYER_NORM_EPS:
        raise UserError(f"layer_norm_eps={cfg.layer_norm_eps}: DistilBERT's LayerNorms use {LAYER_NORM_EPS}")


class Encoder(bert.Encoder):
    """Word + position embeddings and BERT's layers without the attention-output dropout: (B, T) ids -> (B, T, D).
    token_type_ids are accepted and ignored (the embeddings have no token-type table)."""

    attn_out_dropout = False

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        check(cfg)
        super().__init__(cfg, rngs=rngs)


def mlm_head(cfg: ModelConfig, rngs: nnx.Rngs) -> MlmHead:
    # vocab_transform, the model's activation, vocab_layer_norm, then vocab_projector tied to the word embeddings.
    return MlmHead(cfg, act=cfg.hidden_act, rngs=rngs)


def sequence_head(cfg: ModelConfig, num_labels: int, rngs: nnx.Rngs) -> SequenceHead:
    # pre_classifier, ReLU, dropout, classifier: no dropout before the dense layer. The ReLU is fixed in transformers.
    if cfg.classifier_act != "relu":
        raise UserError(f"classifier_act={cfg.classifier_act!r}: DistilBERT's classification head applies 'relu'")
    return SequenceHead(cfg, num_labels, rngs=rngs)


def token_head(cfg: ModelConfig, num_labels: int, rngs: nnx.Rngs) -> TokenHead:
    # DistilBertForTokenClassification drops with config.dropout (the hidden one), not seq_classif_dropout.
    return TokenHead(cfg, num_labels, rngs=rngs, rate=cfg.hidden_dropout)


def span_head(cfg: ModelConfig, rngs: nnx.Rngs) -> TokenHead:
    # DistilBertForQuestionAnswering: dropout (config.qa_dropout, which defaults to the hidden rate), qa_outputs.
    return TokenHead(cfg, 2, rngs=rngs, rate=cfg.hidden_dropout)


def choice_head(cfg: ModelConfig, rngs: nnx.Rngs) -> SequenceHead:
    # DistilBertForMultipleChoice: its sequence head (pre_classifier, ReLU, dropout, classifier) with one output.
    return sequence_head(cfg, 1, rngs)


# ------------------------------------------------------------------------------------------- Hugging Face names
def key_table(cfg: ModelConfig, head: str) -> list[Row]:
    """Every parameter of a bertforge model of `head` ('mlm', 'sequence', 'token', 'span' or 'choice') with its
    Hugging Face name."""
    emb = ("encoder", "embeddings")
    rows = [
        table_row(f"{PREFIX}.embeddings.word_embeddings", (*emb, "word")),
        table_row(f"{PREFIX}.embeddings.position_embeddings", (*emb, "position")),
        *layernorm_rows(f"{PREFIX}.embeddings.LayerNorm", (*emb, "norm")),
    ]
    for i in range(cfg.num_layers):
        hf, ours = f"{PREFIX}.transformer.layer.{i}", ("encoder", "layers", i)
        rows += linear_rows(f"{hf}.attention.q_lin", (*ours, "query"))
        rows += linear_rows(f"{hf}.attention.k_lin", (*ours, "key"))
        rows += linear_rows(f"{hf}.attention.v_lin", (*ours, "value"))
        rows += linear_rows(f"{hf}.attention.out_lin", (*ours, "attn_out"))
        rows += layernorm_rows(f"{hf}.sa_layer_norm", (*ours, "attn_norm"))
        rows += linear_rows(f"{hf}.ffn.lin1", (*ours, "mlp_in"))
        rows += linear_rows(f"{hf}.ffn.lin2", (*ours, "mlp_out"))
        rows += layernorm_rows(f"{hf}.output_layer_norm", (*ours, "mlp_norm"))
    if head == "mlm":
        rows += linear_rows("vocab_transform", ("mlm", "dense"), True)
        rows += layernorm_rows("vocab_layer_norm", ("mlm", "norm"), True)
        rows += [Row("vocab_projector.bias", ("mlm", "bias"), False, True)]
    elif head == "token":
        rows += linear_rows("classifier", ("head", "out"), True)
    elif head == "span":
        rows += linear_rows("qa_outputs", ("head", "out"), True)
    else:
        rows += linear_rows("pre_classifier", ("head", "dense"), True)
        rows += linear_rows("classifier", ("head", "out"), True)
    return rows


rtd_rows = None  # transformers has no DistilBERT discriminator: one exports as DistilBertModel


# ------------------------------------------------------------------------------------------------------ config.json
PRETRAINING_HEAD = "mlm"  # DistilBERT has no *ForPreTraining class; its pretrained checkpoints are ForMaskedLM
RTD_ARCHITECTURE = None
NATIVE_POOLINGS = ("cls",)
SCORE_BUFFERS = bert.SCORE_BUFFERS  # BERT's layers
# ModelConfig field -> config.json key. qa_dropout belongs to the question-answering head bertforge does not have.
HF_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "num_layers": "n_layers",
    "num_heads": "n_heads",
    "intermediate_size": "hidden_dim",
    "max_position_embeddings": "max_position_embeddings",
    "hidden_act": "activation",
    "hidden_dropout": "dropout",
    "attention_dropout": "attention_dropout",
    "classifier_dropout": "seq_classif_dropout",
    "initializer_range": "initializer_range",
    "pad_token_id": "pad_token_id",
}
# transformers' DistilBertConfig defaults: what a config.json that leaves a key out means.
HF_DEFAULTS = {
    "vocab_size": 30522,
    "dim": 768,
    "n_layers": 6,
    "n_heads": 12,
    "hidden_dim": 3072,
    "max_position_embeddings": 512,
    "activation": "gelu",
    "dropout": 0.1,
    "attention_dropout": 0.1,
    "seq_classif_dropout": 0.2,
    "initializer_range": 0.02,
    "pad_token_id": 0,
}
ALIASES = {"hidden_size": "dim", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers"}  # as transformers


def hf_fields(data: dict[str, Any], family: str, source: str) -> dict[str, Any]:
    """ModelConfig fields from a DistilBERT config.json; an option bertforge does not implement is a UserError."""
    refused = {
        # A fixed sinusoidal table at initialisation; the tables checkpoints hold are learned ones.
        "sinusoidal_pos_embds": lambda v: bool(v),
        # Untied decoders are weights bertforge does not hold (tie_weights_ is the older transformers' name).
        "tie_weights_": lambda v: v is False,
        "tie_word_embeddings": lambda v: v is False and _names_mlm(data),
    }
    for key, bad in refused.items():
        if key in data and bad(data[key]):
            refuse(source, key, data[key])
    named = {real: data[alias] for alias, real in ALIASES.items() if alias in data and real not in data}
    fields = {
        "family": family,
        "type_vocab_size": 0,
        "layer_norm_eps": LAYER_NORM_EPS,
        "classifier_act": "relu",
        "pad_token_id": DISTILBERT.pad_token_id,
    }
    return {**fields, **read_fields({**HF_DEFAULTS, **data, **named}, HF_FIELDS)}


def _names_mlm(data: dict[str, Any]) -> bool:
    return any(str(a).endswith("ForMaskedLM") for a in data.get("architectures") or [])


def hf_config(cfg: ModelConfig, head: str) -> dict[str, Any]:
    """config.json of a DistilBERT model of `head`, apart from the labels."""
    check(cfg)
    rate = classifier_rate(cfg)
    return {
        "architectures": [DISTILBERT.architecture(head)],
        "model_type": "distilbert",
        **write_fields(cfg, HF_FIELDS),
        "seq_classif_dropout": rate,  # transformers needs a number here
        "qa_dropout": cfg.hidden_dropout,
        "sinusoidal_pos_embds": False,
        "tie_word_embeddings": True,
    }


def normalise_keys(tensors: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """Checkpoint names as key_table spells them: a bare DistilBertModel has no "distilbert." prefix. A stored
    decoder weight must equal the word embeddings it is tied to."""
    out = {}
    for key, value in tensors.items():
        if key.startswith(("embeddings.", "transformer.")):
            key = f"{PREFIX}.{key}"
        out[key] = value
    bert.check_tied(out, DECODER, f"{PREFIX}.embeddings.word_embeddings.weight")
    return out
