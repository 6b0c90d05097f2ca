"""The BERT-family encoder in Flax NNX. BERT and RoBERTa are two configurations of this one model.

Post-LayerNorm transformer with learned absolute positions and token types (Devlin et al. 2019); RoBERTa differs
only in its position ids, which start after the padding index and skip padding (Liu et al. 2019). ELECTRA and
DistilBERT reuse these modules (electra.py, distilbert.py): a narrower embedding table projected to the hidden size,
no token-type table, no dropout on the attention output. Parameters
carry logical axis names ('vocab', 'embed', 'mlp', 'heads', ...); runtime/devices.py maps them onto the device mesh.
Shapes: B batch, T tokens, D hidden, N heads, H head dim, F feed-forward, V vocabulary, L labels, M masked.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bertforge.errors import UserError
from bertforge.model.attention import attend, segment_positions
from bertforge.model.config import ACTIVATIONS, ModelConfig, read_fields, refuse, write_fields
from bertforge.model.dropout import Dropout, split_key
from bertforge.model.family import Family, lookup
from bertforge.model.heads import MlmHead, SequenceHead, TokenHead, classifier_rate
from bertforge.model.keys import Row, layernorm_rows, linear_rows, table_row
from bertforge.model.layers import (
    EncoderBase,
    KeyedLayer,
    dense,
    embed,
    first_token_mask,
    input_mask,
    layer_norm,
    query_tokens,
    rematerialized,
    sinusoids,
)


# ------------------------------------------------------------------------------------------------------ families
def num_params(cfg: ModelConfig) -> int:
    """Parameter count of a BERT or RoBERTa encoder and MLM head (tied decoder counted once), in closed form."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    embed = (v + cfg.max_position_embeddings + cfg.type_vocab_size) * d + 2 * d
    layer = 4 * (d * d + d) + 2 * d * f + f + d + 4 * d
    mlm = d * d + d + 2 * d + v
    return embed + cfg.num_layers * layer + mlm


def roberta_max_seq_len(cfg: ModelConfig) -> int:
    """RoBERTa spends pad_token_id + 1 rows of its position table on an offset."""
    return cfg.max_position_embeddings - cfg.pad_token_id - 1


BERT = Family(
    "bert", "Bert", pad_token_id=0, position_offset=0, type_vocab_size=2, layer_norm_eps=1e-12, num_params=num_params
)
# XLM-R and CamemBERT are RoBERTa's architecture with other vocabularies.
ROBERTA = Family(
    "roberta",
    "Roberta",
    pad_token_id=1,
    position_offset=2,
    type_vocab_size=1,
    layer_norm_eps=1e-5,
    special_ids={"bos_token_id": 0, "eos_token_id": 2},
    model_types=("xlm-roberta", "camembert"),
    max_seq_len=roberta_max_seq_len,
    num_params=num_params,
)
FAMILIES = (BERT, ROBERTA)


def position_ids(cfg: ModelConfig, input_ids: jax.Array, segments: jax.Array | None = None) -> jax.Array:
    """(B, T) ids -> (B, T) positions: 0..T-1 for BERT; for RoBERTa pad+1.. on tokens and pad on padding. With
    `segments` (B, T) (rows packing several sequences) each segment counts from its own start."""
    if segments is not None:
        within = segment_positions(segments)
        if cfg.family == "roberta":
            return jnp.where(segments != 0, within + 1 + cfg.pad_token_id, cfg.pad_token_id)
        return within
    if cfg.family == "roberta":
        not_pad = (input_ids != cfg.pad_token_id).astype(jnp.int32)
        return jnp.cumsum(not_pad, axis=1) * not_pad + cfg.pad_token_id
    return jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)


class Embeddings(nnx.Module):
    """Word + position (+ token type) embeddings of width E, LayerNorm, dropout, then (when E != D) a projection to
    the hidden size D: ELECTRA's small models keep a narrower table than their hidden size."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        e = cfg.embed_dim
        self.word = embed(cfg, cfg.vocab_size, "vocab", rngs, width=e)
        self.position = embed(cfg, cfg.max_position_embeddings, "position", rngs, width=e)
        if cfg.position_init == "sinusoidal":
            rows, std = cfg.max_position_embeddings, cfg.initializer_range
            self.position.embedding.value = sinusoids(rows, e, std)
        # DistilBERT has no token types: no table, and token_type_ids are ignored.
        self.token_type = embed(cfg, cfg.type_vocab_size, "token_type", rngs, width=e) if cfg.type_vocab_size else None
        self.norm = layer_norm(cfg, rngs, size=e)
        self.dropout = Dropout(cfg.hidden_dropout, rngs=rngs)
        self.project = dense(cfg, e, cfg.hidden_size, (None, "embed"), rngs) if e != cfg.hidden_size else None

    def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        x = self.word(input_ids) + self.position(position_ids(self.cfg, input_ids, segments))  # (B, T, E)
        if self.token_type is not None:
            x = x + self.token_type(token_type_ids)
        x = self.dropout(self.norm(x).astype(self.cfg.compute_dtype))
        return x if self.project is None else self.project(x)  # (B, T, D)


class Layer(KeyedLayer):
    """Post-LN self-attention and feed-forward. `attn_out_dropout` False leaves out the dropout on the attention
    output (DistilBERT has none there)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, attn_out_dropout: bool = True):
        self.cfg = cfg
        self.attn_out_dropout = attn_out_dropout
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.query = dense(cfg, d, d, ("embed", "heads"), rngs)
        self.key = dense(cfg, d, d, ("embed", "heads"), rngs)
        self.value = dense(cfg, d, d, ("embed", "heads"), rngs)
        self.attn_out = dense(cfg, d, d, ("heads", "embed"), rngs)
        self.attn_norm = layer_norm(cfg, rngs)
        self.mlp_in = dense(cfg, d, f, ("embed", "mlp"), rngs)
        self.mlp_out = dense(cfg, f, d, ("mlp", "embed"), rngs)
        self.mlp_norm = layer_norm(cfg, rngs)
        self.dropout = Dropout(cfg.hidden_dropout, rngs=rngs)
        self.attn_dropout = Dropout(cfg.attention_dropout, rngs=rngs)

    def __call__(
        self,
        x: jax.Array,
        mask: jax.Array,
        first_only: bool = False,
        keys: tuple[jax.Array | None, jax.Array | None] | None = None,
        queries: jax.Array | None = None,
    ) -> jax.Array:
        """x (B, T, D), mask (B, 1, 1, T) True where a key may be attended -> (B, T, D).

        With `first_only` only the first token's output is computed, (B, 1, D): all a [CLS] head needs from the
        last layer. Keys and values still come from every token, so that output is exactly the full layer's.
        With `queries` (Nq,), flat indices into the B*T tokens, only those tokens' outputs are computed, (Nq, 1, D),
        each attending to the keys of its own row under mask (Nq, 1, 1, T): the first token of each text of rows
        that pack several. `keys` are the dropout keys of `dropout_keys()`, drawn here when not given.
        """
        hidden_key, attn_key = self.dropout_keys() if keys is None else keys
        k1, k2 = split_key(hidden_key, 2)
        b, t, d = x.shape
        n, h = self.cfg.num_heads, self.cfg.head_dim
        # Dense layers see tokens as one (B*T, D) matrix: XLA's CPU backward of a matmul that contracts two
        # batch dimensions is slower than of the same 2-D matmul.
        x2 = x.reshape(b * t, d)
        xq = query_tokens(x, first_only, queries)  # (Bq*Q, D): the tokens whose outputs are computed
        bq, tq = (b, 1 if first_only else t) if queries is None else (queries.shape[0], 1)
        q = self.query(xq).reshape(bq, tq, n, h)
        k = self.key(x2).reshape(b, t, n, h)
        v = self.value(x2).reshape(b, t, n, h)
        if queries is not None:  # each query's own row of keys and values
            k, v = k[queries // t], v[queries // t]  # (Nq, T, N, H)
        ctx = attend(
            q, k, v, mask, self.cfg.attention, self.cfg.dtype, self.attn_dropout, attn_key, prefix=queries is None
        )  # (Bq, Q, N, H)
        attn = self.attn_out(ctx.reshape(bq * tq, d))
        if self.attn_out_dropout:
            attn = self.dropout(attn, rngs=k1)
        y = self.attn_norm(xq + attn).astype(x.dtype)
        hidden = ACTIVATIONS[self.cfg.hidden_act](self.mlp_in(y))  # (B*Q, F)
        y = self.mlp_norm(y + self.dropout(self.mlp_out(hidden), rngs=k2)).astype(x.dtype)
        return y.reshape(bq, tq, d)


class Encoder(EncoderBase):
    """Embeddings and the transformer stack: (B, T) ids -> (B, T, D) hidden states."""

    attn_out_dropout = True  # see Layer; a subclass's choice

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embeddings = Embeddings(cfg, rngs=rngs)
        self.layers = nnx.List(
            [Layer(cfg, rngs=rngs, attn_out_dropout=self.attn_out_dropout) for _ in range(cfg.num_layers)]
        )

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        token_type_ids: jax.Array | None = None,
        first_only: bool = False,
        segment_ids: jax.Array | None = None,
        starts: jax.Array | None = None,
    ) -> jax.Array:
        """-> (B, T, D); with `first_only`, the last layer computes the first token only: (B, 1, D). `segment_ids`
        (B, T), for rows that pack several sequences: k on the k-th sequence's tokens, 0 on padding; each sequence
        then attends within itself and counts its positions from its start (attention_mask is not needed); with
        first_only, `starts` (N,) are the sequences' first tokens (flat indices), the last layer's only: (N, 1, D)."""
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        mask = input_mask(input_ids, attention_mask, segment_ids, first_only and starts is None)
        x = self.embeddings(input_ids, token_type_ids, segment_ids)
        for i, layer in enumerate(self.layers):
            last = first_only and i == len(self.layers) - 1
            if last and starts is not None:
                return layer(x, first_token_mask(segment_ids, starts), queries=starts)
            x = rematerialized(layer, (x, mask), first_only=last) if self.cfg.remat else layer(x, mask, first_only=last)
        return x


def mlm_head(cfg: ModelConfig, rngs: nnx.Rngs) -> MlmHead:
    # RoBERTa's head always uses exact GELU; BERT's follows hidden_act.
    return MlmHead(cfg, act="gelu" if cfg.family == "roberta" else cfg.hidden_act, rngs=rngs)


def sequence_head(cfg: ModelConfig, num_labels: int, rngs: nnx.Rngs) -> SequenceHead:
    return SequenceHead(cfg, num_labels, rngs=rngs, dropout_first=cfg.family == "roberta")


def token_head(cfg: ModelConfig, num_labels: int, rngs: nnx.Rngs) -> TokenHead:
    # Bert/RobertaForTokenClassification (XLM-R's too): dropout (classifier_dropout, else hidden), classifier.
    return TokenHead(cfg, num_labels, rngs=rngs, rate=classifier_rate(cfg))


def span_head(cfg: ModelConfig, rngs: nnx.Rngs) -> TokenHead:
    # Bert/RobertaForQuestionAnswering: qa_outputs on each token, no dropout.
    return TokenHead(cfg, 2, rngs=rngs, rate=0.0)


def choice_head(cfg: ModelConfig, rngs: nnx.Rngs) -> SequenceHead:
    # Bert/RobertaForMultipleChoice: the pooler (dense, tanh), dropout, a classifier of one output; RoBERTa's too.
    return SequenceHead(cfg, 1, rngs=rngs)


# ------------------------------------------------------------------------------------------- Hugging Face names
def encoder_rows(cfg: ModelConfig, p: str) -> list[Row]:
    """The embeddings' and layers' rows under the prefix `p` of *For* models ("bert", "roberta", "electra": the
    three name them alike), the token-type table's when there is one; not the projection's."""
    enc = ("encoder",)
    rows = [
        table_row(f"{p}.embeddings.word_embeddings", (*enc, "embeddings", "word")),
        table_row(f"{p}.embeddings.position_embeddings", (*enc, "embeddings", "position")),
    ]
    if cfg.type_vocab_size:
        rows.append(table_row(f"{p}.embeddings.token_type_embeddings", (*enc, "embeddings", "token_type")))
    rows += layernorm_rows(f"{p}.embeddings.LayerNorm", (*enc, "embeddings", "norm"))
    for i in range(cfg.num_layers):
        hf, ours = f"{p}.encoder.layer.{i}", (*enc, "layers", i)
        rows += linear_rows(f"{hf}.attention.self.query", (*ours, "query"))
        rows += linear_rows(f"{hf}.attention.self.key", (*ours, "key"))
        rows += linear_rows(f"{hf}.attention.self.value", (*ours, "value"))
        rows += linear_rows(f"{hf}.attention.output.dense", (*ours, "attn_out"))
        rows += layernorm_rows(f"{hf}.attention.output.LayerNorm", (*ours, "attn_norm"))
        rows += linear_rows(f"{hf}.intermediate.dense", (*ours, "mlp_in"))
        rows += linear_rows(f"{hf}.output.dense", (*ours, "mlp_out"))
        rows += layernorm_rows(f"{hf}.output.LayerNorm", (*ours, "mlp_norm"))
    return rows


def key_table(cfg: ModelConfig, head: str) -> list[Row]:
    """Every parameter of a bertforge model of `head` ('mlm', 'sequence', 'token', 'span' or 'choice') with its
    Hugging Face name."""
    prefix = lookup(cfg.family).hf_prefix
    if cfg.embed_dim != cfg.hidden_size:
        raise UserError(
            f"embedding_size={cfg.embedding_size}: {prefix} has no embedding projection; "
            f"use 0 or hidden_size ({cfg.hidden_size}), or family electra"
        )
    if not cfg.type_vocab_size:
        raise UserError(f"type_vocab_size=0: {prefix} needs a token-type table (1 or more)")
    rows = encoder_rows(cfg, cfg.family)  # "bert." or "roberta." prefix of the encoder in *For* models
    if head == "mlm" and cfg.family == "bert":
        rows += linear_rows("cls.predictions.transform.dense", ("mlm", "dense"), True)
        rows += layernorm_rows("cls.predictions.transform.LayerNorm", ("mlm", "norm"), True)
        rows += [Row("cls.predictions.bias", ("mlm", "bias"), False, True)]
    elif head == "mlm":
        rows += linear_rows("lm_head.dense", ("mlm", "dense"), True)
        rows += layernorm_rows("lm_head.layer_norm", ("mlm", "norm"), True)
        rows += [Row("lm_head.bias", ("mlm", "bias"), False, True)]
    elif head == "token":  # *ForTokenClassification: no pooler
        rows += linear_rows("classifier", ("head", "out"), True)
    elif head == "span":
        rows += linear_rows("qa_outputs", ("head", "out"), True)
    elif cfg.family == "bert" or head == "choice":
        rows += linear_rows(f"{cfg.family}.pooler.dense", ("head", "dense"), True)
        rows += linear_rows("classifier", ("head", "out"), True)
    else:
        rows += linear_rows("classifier.dense", ("head", "dense"), True)
        rows += linear_rows("classifier.out_proj", ("head", "out"), True)
    return rows


rtd_rows = None  # transformers has no BERT discriminator: one exports as BertModel (RobertaModel)


# ------------------------------------------------------------------------------------------------------ config.json
PRETRAINING_HEAD = "mlm"  # BertForPreTraining carries the MLM head (and a next-sentence head bertforge ignores)
RTD_ARCHITECTURE = None
NATIVE_POOLINGS = ("cls",)  # what transformers' own sequence head pools
SCORE_BUFFERS = 2  # float32 (B, N, T, T) buffers a layer's training step keeps, for plan (fitted to the compiled step)
# ModelConfig field -> config.json key, in BERT's and RoBERTa's config.json
HF_FIELDS = {
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
    "hidden_act": "hidden_act",
}
HF_DEFAULTS: dict[str, Any] = {}  # a key left out takes ModelConfig's default, which is BERT's


def hf_fields(data: dict[str, Any], family: str, source: str) -> dict[str, Any]:
    """ModelConfig fields from a BERT-family config.json; an option bertforge does not implement is a UserError."""
    pos = data.get("position_embedding_type", "absolute")
    if pos != "absolute":
        refuse(source, "position_embedding_type", pos, "only 'absolute'")
    fields = {"family": family, "pad_token_id": lookup(family).pad_token_id}
    return {**fields, **read_fields({**HF_DEFAULTS, **data}, HF_FIELDS)}


def hf_config(cfg: ModelConfig, head: str) -> dict[str, Any]:
    """config.json of a BERT or RoBERTa model of `head`, apart from the labels."""
    family = lookup(cfg.family)
    return {
        "architectures": [family.architecture(head)],
        "model_type": cfg.family,
        **write_fields(cfg, HF_FIELDS),
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
        **family.special_ids,
    }


def normalise_keys(tensors: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """Checkpoint names as key_table spells them: old TF-converted checkpoints name LayerNorm weights gamma/beta;
    bare encoders (BertModel) have no prefix."""
    out = {}
    for key, value in tensors.items():
        key = re.sub(r"\.gamma$", ".weight", key)
        key = re.sub(r"\.beta$", ".bias", key)
        if key.startswith(("embeddings.", "encoder.", "pooler.")):
            key = f"{cfg.family}.{key}"
        out[key] = value
    return out


def check_tied(tensors: dict[str, Any], decoder: str, word: str) -> None:
    """A decoder weight stored beside the word embeddings must equal them: bertforge ties the two."""
    if decoder in tensors and word in tensors and not np.array_equal(tensors[decoder], tensors[word]):
        raise UserError(f"{decoder} differs from {word}: an untied decoder is not supported (bertforge ties them)")
