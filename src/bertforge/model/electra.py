"""ELECTRA (Clark et al. 2020) in Flax NNX: BERT's post-LN encoder (bert.py) with an embedding table of its own width
E projected to the hidden size D when they differ, as the small models have (128 -> 256).

The generator is the masked-LM model (ElectraForMaskedLM); the discriminator (ElectraForPreTraining) is what one
fine-tunes. Its replaced-token head is not a masked-LM head, so a discriminator checkpoint loads as an encoder and a
task head starts fresh. Shapes: B batch, T tokens, D hidden, E embedding width, V vocabulary.
"""

from __future__ import annotations

import re
from typing import Any

from flax import nnx

from bertforge.errors import UserError
from bertforge.model import bert
from bertforge.model.config import ModelConfig, read_fields, refuse, write_fields
from bertforge.model.family import Family
from bertforge.model.heads import MlmHead, SequenceHead, TokenHead, classifier_rate
from bertforge.model.keys import Row, layernorm_rows, linear_rows

PREFIX = "electra"  # of the encoder's parameters in *For* models
DECODER = "generator_lm_head.weight"  # tied to the word embeddings; absent from tied checkpoints
ELECTRA = Family(
    "electra",
    "Electra",
    pad_token_id=0,
    position_offset=0,
    type_vocab_size=2,
    layer_norm_eps=1e-12,
    fields={"classifier_act": "gelu"},
)
FAMILIES = (ELECTRA,)


class Encoder(bert.Encoder):
    """Embeddings of width E (projected to D when E != D) and BERT's layers: (B, T) ids -> (B, T, D)."""


def mlm_head(cfg: ModelConfig, rngs: nnx.Rngs) -> MlmHead:
    # generator_predictions: dense D -> E, exact GELU whatever hidden_act says, LayerNorm(E); then the tied decoder.
    return MlmHead(cfg, act="gelu", rngs=rngs)


def sequence_head(cfg: ModelConfig, num_labels: int, rngs: nnx.Rngs) -> SequenceHead:
    # ElectraClassificationHead: dropout, dense, GELU, dropout, out_proj. Its activation is fixed in transformers.
    if cfg.classifier_act != "gelu":
        raise UserError(f"classifier_act={cfg.classifier_act!r}: ELECTRA's classification head applies 'gelu'")
    return SequenceHead(cfg, num_labels, rngs=rngs, dropout_first=True)


def token_head(cfg: ModelConfig, num_labels: int, rngs: nnx.Rngs) -> TokenHead:
    # ElectraForTokenClassification: dropout (classifier_dropout, else hidden_dropout_prob), classifier.
    return TokenHead(cfg, num_labels, rngs=rngs, rate=classifier_rate(cfg))


def span_head(cfg: ModelConfig, rngs: nnx.Rngs) -> TokenHead:
    # ElectraForQuestionAnswering: qa_outputs on each token, no dropout.
    return TokenHead(cfg, 2, rngs=rngs, rate=0.0)


def choice_head(cfg: ModelConfig, rngs: nnx.Rngs) -> SequenceHead:
    # ElectraForMultipleChoice: the sequence summary (the first token, a projection, GELU, dropout), a classifier of
    # one output; no dropout before the projection (SUMMARY writes no summary_first_dropout).
    return SequenceHead(cfg, 1, rngs=rngs)


# ------------------------------------------------------------------------------------------- Hugging Face names
def key_table(cfg: ModelConfig, head: str) -> list[Row]:
    """Every parameter of a bertforge model of `head` ('mlm', 'sequence', 'token', 'span' or 'choice') with its
    Hugging Face name."""
    rows = bert.encoder_rows(cfg, PREFIX)
    if cfg.embed_dim != cfg.hidden_size:
        rows += linear_rows(f"{PREFIX}.embeddings_project", ("encoder", "embeddings", "project"))
    if head == "mlm":
        rows += linear_rows("generator_predictions.dense", ("mlm", "dense"), True)
        rows += layernorm_rows("generator_predictions.LayerNorm", ("mlm", "norm"), True)
        rows += [Row("generator_lm_head.bias", ("mlm", "bias"), False, True)]
    elif head == "token":
        rows += linear_rows("classifier", ("head", "out"), True)
    elif head == "span":
        rows += linear_rows("qa_outputs", ("head", "out"), True)
    elif head == "choice":
        rows += linear_rows("sequence_summary.summary", ("head", "dense"), True)
        rows += linear_rows("classifier", ("head", "out"), True)
    else:
        rows += linear_rows("classifier.dense", ("head", "dense"), True)
        rows += linear_rows("classifier.out_proj", ("head", "out"), True)
    return rows


def rtd_rows(cfg: ModelConfig) -> list[Row]:
    """ElectraForPreTraining's head: the discriminator's (see heads.RtdHead)."""
    rows = linear_rows("discriminator_predictions.dense", ("head", "dense"), True)
    return rows + linear_rows("discriminator_predictions.dense_prediction", ("head", "prediction"), True)


# ------------------------------------------------------------------------------------------------------ config.json
RTD_ARCHITECTURE = "ElectraForPreTraining"
PRETRAINING_HEAD = None  # ElectraForPreTraining's head tells replaced tokens apart: no MLM head to load
NATIVE_POOLINGS = ("cls",)
SCORE_BUFFERS = bert.SCORE_BUFFERS  # BERT's layers
# ModelConfig field -> config.json key
HF_FIELDS = {
    "vocab_size": "vocab_size",
    "embedding_size": "embedding_size",
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
    "hidden_act": "hidden_act",
}
# transformers' ElectraConfig defaults: what a config.json that leaves a key out means (they are not BERT's).
HF_DEFAULTS = {
    "vocab_size": 30522,
    "embedding_size": 128,
    "hidden_size": 256,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "intermediate_size": 1024,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "initializer_range": 0.02,
    "layer_norm_eps": 1e-12,
    "pad_token_id": 0,
}
# The sequence-summary keys, as the head ElectraForSequenceClassification builds has them: the first token, a
# projection, GELU. transformers reads these keys only for multiple choice; a value that asks for another summary is
# refused rather than silently replaced by this head. Their dropouts do not change outputs and are ignored: the head
# uses classifier_dropout (or hidden_dropout_prob).
SUMMARY = {"summary_type": "first", "summary_use_proj": True, "summary_activation": "gelu"}


def hf_fields(data: dict[str, Any], family: str, source: str) -> dict[str, Any]:
    """ModelConfig fields from an ELECTRA config.json; an option bertforge does not implement is a UserError."""
    for key, want in SUMMARY.items():
        if key in data and data[key] != want:
            refuse(source, key, data[key], f"only {want!r}")
    refused = {
        "summary_proj_to_labels": lambda v: bool(v),
        "position_embedding_type": lambda v: v != "absolute",
        "is_decoder": lambda v: bool(v),
        # An untied decoder is a weight bertforge does not hold; only a masked-LM head has one.
        "tie_word_embeddings": lambda v: v is False and _names_mlm(data),
    }
    for key, bad in refused.items():
        if key in data and bad(data[key]):
            refuse(source, key, data[key])
    fields = {"family": family, "classifier_act": "gelu", "pad_token_id": ELECTRA.pad_token_id}
    fields.update(read_fields({**HF_DEFAULTS, **data}, HF_FIELDS))
    if fields.get("embedding_size") == fields.get("hidden_size"):
        fields["embedding_size"] = 0  # no projection: the canonical "as wide as the hidden size"
    return fields


def _names_mlm(data: dict[str, Any]) -> bool:
    return any(str(a).endswith(("ForMaskedLM", "ForCausalLM")) for a in data.get("architectures") or [])


def hf_config(cfg: ModelConfig, head: str) -> dict[str, Any]:
    """config.json of an ELECTRA model of `head`, apart from the labels."""
    rate = classifier_rate(cfg)
    return {
        "architectures": [ELECTRA.architecture(head)],
        "model_type": "electra",
        **write_fields(cfg, HF_FIELDS),
        "embedding_size": cfg.embed_dim,
        **SUMMARY,
        "summary_last_dropout": rate,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
    }


def normalise_keys(tensors: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """Checkpoint names as key_table spells them: TF-converted checkpoints name LayerNorm weights gamma/beta; a bare
    ElectraModel has no "electra." prefix. A stored decoder weight must equal the word embeddings it is tied to."""
    out = {}
    for key, value in tensors.items():
        key = re.sub(r"\.gamma$", ".weight", key)
        key = re.sub(r"\.beta$", ".bias", key)
        if key.startswith(("embeddings.", "embeddings_project.", "encoder.")):
            key = f"{PREFIX}.{key}"
        out[key] = value
    bert.check_tied(out, DECODER, f"{PREFIX}.embeddings.word_embeddings.weight")
    return out
