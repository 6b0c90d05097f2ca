"""Task heads on top of an encoder's hidden states (the masked-LM head, the sequence head with its poolings, the
token head, the replaced-token detection head), and the models every family builds from its encoder and these heads.

A family's encoder (bert.py, deberta.py, ...) is called as encoder(input_ids, attention_mask,
token_type_ids, first_only) -> (B, T, D) and gives its word embedding table as encoder.word_embedding() (V, E).
Shapes: B batch, T tokens, D hidden, E embedding width, V vocabulary, L labels.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from bertforge.model.attention import MASK_VALUE
from bertforge.model.config import ACTIVATIONS, ModelConfig
from bertforge.model.dropout import Dropout
from bertforge.model.layers import axes, dense, layer_norm

Ids = jax.Array | None  # (B, T) attention mask or token types; None: all ones, all zeros


def classifier_rate(cfg: ModelConfig) -> float:
    """The sequence head's dropout rate: classifier_dropout, or hidden_dropout where that is None (transformers')."""
    return cfg.hidden_dropout if cfg.classifier_dropout is None else cfg.classifier_dropout


class MlmHead(nnx.Module):
    """dense (D -> E) + activation + LayerNorm, then the vocabulary projection tied to the word embeddings."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        act: str,
        rngs: nnx.Rngs,
        dense_bias: bool = True,
        norm_bias: bool = True,
        decoder_bias: bool = True,
    ):
        self.cfg = cfg
        self.act = act
        self.dense = dense(cfg, cfg.hidden_size, cfg.embed_dim, ("embed", None), rngs, bias=dense_bias)
        self.norm = layer_norm(cfg, rngs, size=cfg.embed_dim, bias=norm_bias)
        if decoder_bias:
            self.bias = nnx.Param(jnp.zeros((cfg.vocab_size,), jnp.float32), **axes("vocab"))

    def __call__(self, hidden: jax.Array, word_embedding: jax.Array) -> jax.Array:
        """hidden (..., D), word_embedding (V, E) -> float32 logits (..., V)."""
        h = self.norm(ACTIVATIONS[self.act](self.dense(hidden))).astype(self.cfg.compute_dtype)
        emb = word_embedding.astype(self.cfg.compute_dtype)
        logits = jnp.einsum("...e,ve->...v", h, emb, preferred_element_type=jnp.float32)
        return logits + self.bias[...] if hasattr(self, "bias") else logits


def pool_tokens(hidden: jax.Array, attention_mask: jax.Array, how: str, score: jax.Array | None = None) -> jax.Array:
    """hidden (B, T, D), attention_mask (B, T) -> float32 (B, D): the first token ('cls'), the mean or the maximum of
    the real tokens, or their mean weighted by softmax(hidden @ score) ('attention'). A row without a real token
    (a batch's filler) pools to zeros."""
    if how == "cls":
        return hidden[:, 0].astype(jnp.float32)
    x = hidden.astype(jnp.float32)
    valid = attention_mask.astype(bool)  # (B, T)
    if how == "max":
        top = jnp.max(jnp.where(valid[..., None], x, MASK_VALUE), axis=1)
        return jnp.where(jnp.any(valid, axis=1, keepdims=True), top, 0.0)
    if how == "mean":
        weights = valid.astype(jnp.float32) / jnp.maximum(valid.sum(axis=1, keepdims=True), 1)
    else:
        weights = jax.nn.softmax(jnp.where(valid, jnp.einsum("btd,d->bt", x, score), MASK_VALUE), axis=-1)
    return jnp.einsum("bt,btd->bd", weights, x)


def pool_packed(hidden: jax.Array, texts: jax.Array, starts: jax.Array, how: str) -> jax.Array:
    """hidden (R, T, D) of rows that pack several texts, texts (R, T) each token's text (N on padding), starts (N,)
    each text's first token in the R * T -> float32 (N, D): each text pooled as pool_tokens pools it alone
    ('mean' or 'max'; a 'cls' head has the encoder compute each text's first token only); a text without tokens
    (a filler) pools to zeros."""
    r, t, d = hidden.shape
    n = starts.shape[0]
    x = hidden.reshape(r * t, d).astype(jnp.float32)  # (R*T, D)
    owner = texts.reshape(r * t)
    counts = jax.ops.segment_sum(jnp.ones(r * t, jnp.float32), owner, num_segments=n + 1)[:n, None]  # (N, 1)
    if how == "mean":
        return jax.ops.segment_sum(x, owner, num_segments=n + 1)[:n] / jnp.maximum(counts, 1.0)
    if how == "max":
        return jnp.where(counts > 0, jax.ops.segment_max(x, owner, num_segments=n + 1)[:n], 0.0)
    raise ValueError(f"pooling {how!r} has no packed form: mean or max (cls: the encoder's first tokens)")


def unit_length(x: jax.Array, eps: float = 1e-12) -> jax.Array:
    """x (..., D) scaled to unit length along D; a zero vector stays zero (torch's F.normalize). The norm is taken
    as sqrt(max(|x|^2, eps^2)), whose gradient at zero is 0, where jnp.linalg.norm's is NaN (a batch's filler
    rows pool to zero vectors)."""
    return x / jnp.sqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), eps * eps))


class SequenceHead(nnx.Module):
    """A pooled vector through dense + cfg.classifier_act (+ LayerNorm for ModernBERT) to num_labels outputs:
    BERT's pooler + classifier, and the classification heads of the other families.

    Pooling 'cls' takes the first token (what Hugging Face models do); 'mean' averages the tokens; 'attention'
    weights them by a learned score, as many regression recipes do. `dropout_first` puts a dropout before the dense
    layer too (RoBERTa, ELECTRA, DeBERTa).
    """

    def __init__(
        self, cfg: ModelConfig, num_labels: int, *, rngs: nnx.Rngs, dropout_first: bool = False, norm: bool = False
    ):
        self.cfg = cfg
        self.dropout_first = dropout_first
        rate = classifier_rate(cfg)
        if cfg.pooling == "attention":
            init = nnx.initializers.normal(cfg.initializer_range)
            self.score = nnx.Param(init(rngs.params(), (cfg.hidden_size,), jnp.float32), **axes("embed"))
        self.dense = dense(cfg, cfg.hidden_size, cfg.hidden_size, ("embed", None), rngs, bias=cfg.classifier_bias)
        self.norm = layer_norm(cfg, rngs, bias=cfg.norm_bias) if norm else None
        self.out = dense(cfg, cfg.hidden_size, num_labels, (None, None), rngs)
        self.dropout = Dropout(rate, rngs=rngs)

    def pool(self, hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """hidden (B, T, D), attention_mask (B, T) -> (B, D)."""
        score = self.score[...] if self.cfg.pooling == "attention" else None
        return pool_tokens(hidden, attention_mask, self.cfg.pooling, score).astype(hidden.dtype)

    def __call__(self, hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """hidden (B, T, D), attention_mask (B, T) -> float32 (B, L)."""
        return self.classify(self.pool(hidden, attention_mask))

    def classify(self, x: jax.Array) -> jax.Array:
        """Pooled vectors (B, D) in the encoder's dtype -> float32 (B, L)."""
        dtype = x.dtype
        if self.dropout_first:
            x = self.dropout(x)
        x = ACTIVATIONS[self.cfg.classifier_act](self.dense(x))
        if self.norm is not None:
            x = self.norm(x).astype(dtype)
        return self.out(self.dropout(x)).astype(jnp.float32)


class TokenHead(nnx.Module):
    """Each token's hidden state through dropout and a Linear(D, L): transformers' *ForTokenClassification heads.

    `transform` puts ModernBERT's prediction head first (dense + cfg.classifier_act + LayerNorm, its `head`), and
    `rate` is the dropout's: the families' token classes do not all take classifier_dropout (see each token_head).
    """

    def __init__(self, cfg: ModelConfig, num_labels: int, *, rngs: nnx.Rngs, rate: float, transform: bool = False):
        self.cfg = cfg
        d = cfg.hidden_size
        self.dense = dense(cfg, d, d, ("embed", None), rngs, bias=cfg.classifier_bias) if transform else None
        self.norm = layer_norm(cfg, rngs, bias=cfg.norm_bias) if transform else None
        self.dropout = Dropout(rate, rngs=rngs)
        self.out = dense(cfg, d, num_labels, (None, None), rngs)

    def __call__(self, hidden: jax.Array) -> jax.Array:
        """hidden (B, T, D) -> float32 (B, T, L)."""
        x = hidden
        if self.dense is not None:
            x = self.norm(ACTIVATIONS[self.cfg.classifier_act](self.dense(x))).astype(hidden.dtype)
        return self.out(self.dropout(x)).astype(jnp.float32)


class RtdHead(nnx.Module):
    """ELECTRA's discriminator head: dense (D -> D), the model's activation, dense (D -> 1): one logit per token,
    positive for a token the generator replaced."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dense = dense(cfg, cfg.hidden_size, cfg.hidden_size, ("embed", None), rngs)
        self.prediction = dense(cfg, cfg.hidden_size, 1, (None, None), rngs)

    def __call__(self, hidden: jax.Array) -> jax.Array:
        """hidden (..., D) -> float32 logits (...)."""
        x = ACTIVATIONS[self.cfg.hidden_act](self.dense(hidden))
        return self.prediction(x)[..., 0].astype(jnp.float32)


class MaskedLM(nnx.Module):
    """An encoder with the masked-LM head."""

    task = "mlm"

    def __init__(self, cfg: ModelConfig, encoder: nnx.Module, mlm: MlmHead):
        self.config = cfg
        self.encoder = encoder
        self.mlm = mlm

    def logits_at(self, hidden: jax.Array) -> jax.Array:
        """MLM logits for any selection of hidden states (..., D) -> (..., V), e.g. only the masked positions."""
        return self.mlm(hidden, self.encoder.word_embedding())

    def __call__(self, input_ids: jax.Array, attention_mask: Ids = None, token_type_ids: Ids = None) -> jax.Array:
        """(B, T) -> (B, T, V) float32 logits."""
        return self.logits_at(self.encoder(input_ids, attention_mask, token_type_ids))


class Labelled(nnx.Module):
    """An encoder with a fine-tuning head of num_labels outputs (the sequence and token classifiers)."""

    def __init__(self, cfg: ModelConfig, num_labels: int, encoder: nnx.Module, head: nnx.Module):
        if num_labels < 1:
            raise ValueError(f"num_labels must be positive, got {num_labels}")
        self.config = cfg
        self.num_labels = num_labels
        self.encoder = encoder
        self.head = head


class SequenceClassifier(Labelled):
    """An encoder with a sequence head."""

    task = "sequence"

    def __call__(self, input_ids: jax.Array, attention_mask: Ids = None, token_type_ids: Ids = None) -> jax.Array:
        """(B, T) -> (B, L) float32: regression values when L == 1, else class logits."""
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        # A [CLS] head needs one token of the last layer; encoders that can compute only it (exact, and most of
        # that layer saved) do, the others return every token.
        first_only = self.config.pooling == "cls"
        return self.head(self.encoder(input_ids, attention_mask, token_type_ids, first_only), attention_mask)

    def packed(
        self, input_ids: jax.Array, token_type_ids: jax.Array, segment_ids: jax.Array, texts: jax.Array,
        starts: jax.Array,
    ) -> jax.Array:  # fmt: skip
        """Rows that pack several texts (data/text_packing.py): (R, T) ids, types, segment ids and texts, (N,)
        starts -> (N, L) float32, each text's outputs as __call__ gives them for the text alone."""
        pooled, dtype = packed_pooled(self.encoder, self.config.pooling, input_ids, token_type_ids, segment_ids,
                                      texts, starts)  # fmt: skip
        return self.head.classify(pooled.astype(dtype))


def packed_pooled(
    encoder: nnx.Module, pooling: str, input_ids: jax.Array, token_type_ids: jax.Array, segment_ids: jax.Array,
    texts: jax.Array, starts: jax.Array,
) -> tuple[jax.Array, Any]:  # fmt: skip
    """Packed rows (data/text_packing.py) -> (N, D) float32, each text pooled as pool_tokens pools it alone, and the
    encoder's dtype. For cls the last layer computes each text's first token only, as the padded forward does."""
    if pooling == "cls":
        hidden = encoder(input_ids, None, token_type_ids, True, segment_ids, starts)  # (N, 1, D)
        return hidden[:, 0].astype(jnp.float32), hidden.dtype
    hidden = encoder(input_ids, None, token_type_ids, False, segment_ids)  # (R, T, D)
    return pool_packed(hidden, texts, starts, pooling), hidden.dtype


class TokenClassifier(Labelled):
    """An encoder with a token head: one row of logits per token (tagging, named entities)."""

    task = "token"

    def __call__(self, input_ids: jax.Array, attention_mask: Ids = None, token_type_ids: Ids = None) -> jax.Array:
        """(B, T) -> (B, T, L) float32 logits; those at padding positions mean nothing."""
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        return self.head(self.encoder(input_ids, attention_mask, token_type_ids))

    def packed(
        self, input_ids: jax.Array, token_type_ids: jax.Array, segment_ids: jax.Array, texts: jax.Array,
        starts: jax.Array,
    ) -> jax.Array:  # fmt: skip
        """Rows that pack several texts (data/text_packing.py): (R, T) ids, types, segment ids and texts, (N,)
        starts -> (N, T, L) float32, text n's logits at its own tokens as __call__ gives them for the text alone,
        counted from its first token, and zeros past its last."""
        logits = self.head(self.encoder(input_ids, None, token_type_ids, False, segment_ids))  # (R, T, L)
        r, t, _ = logits.shape
        at = jnp.minimum(starts[:, None] + jnp.arange(t), r * t - 1)  # (N, T) flat indices from each text's start
        own = texts.reshape(-1)[at] == jnp.arange(starts.shape[0])[:, None]  # (N, T): the text's own tokens
        return jnp.where(own[..., None], logits.reshape(r * t, -1)[at], 0.0)


class SpanClassifier(TokenClassifier):
    """Extractive question answering: each token's start and end logits (B, T, 2), as transformers'
    *ForQuestionAnswering computes them before splitting them."""

    task = "span"


class ChoiceClassifier(SequenceClassifier):
    """Multiple choice: one score per (question, choice) pair, a sequence head with one output over each pair, as
    transformers' *ForMultipleChoice computes it."""

    task = "choice"

    def __call__(self, input_ids: jax.Array, attention_mask: Ids = None, token_type_ids: Ids = None) -> jax.Array:
        """(B, N, T) -> (B, N) float32 scores of each question's N choices."""
        b, n, t = input_ids.shape
        flat = lambda x: None if x is None else x.reshape(b * n, t)  # noqa: E731
        scores = super().__call__(flat(input_ids), flat(attention_mask), flat(token_type_ids))  # (B * N, 1)
        return scores.reshape(b, n)


class Embedder(nnx.Module):
    """An encoder whose tokens are pooled into one vector per text (cfg.pooling: cls, mean or max), scaled to unit
    length when cfg.normalize: a sentence-embedding model, as sentence-transformers' Transformer, Pooling and
    Normalize modules compute it. It has no parameters of its own."""

    task = "embedding"

    def __init__(self, cfg: ModelConfig, encoder: nnx.Module):
        if cfg.pooling == "attention":
            raise ValueError("an embedding model pools by cls, mean or max; attention pooling has learned weights")
        self.config = cfg
        self.encoder = encoder

    @property
    def num_labels(self) -> int:
        return self.config.hidden_size

    def __call__(self, input_ids: jax.Array, attention_mask: Ids = None, token_type_ids: Ids = None) -> jax.Array:
        """(B, T) -> float32 (B, D) embeddings; (B, N, T), N texts per row (a pair and its negatives) -> (B, N, D)."""
        if input_ids.ndim == 3:
            b, n, t = input_ids.shape
            flat = lambda x: None if x is None else x.reshape(b * n, t)  # noqa: E731
            return self(flat(input_ids), flat(attention_mask), flat(token_type_ids)).reshape(b, n, -1)
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        first_only = self.config.pooling == "cls"
        hidden = self.encoder(input_ids, attention_mask, token_type_ids, first_only)  # (B, T, D)
        pooled = pool_tokens(hidden, attention_mask, self.config.pooling)
        return unit_length(pooled) if self.config.normalize else pooled

    def packed(
        self, input_ids: jax.Array, token_type_ids: jax.Array, segment_ids: jax.Array, texts: jax.Array,
        starts: jax.Array,
    ) -> jax.Array:  # fmt: skip
        """Rows that pack several texts (data/text_packing.py) -> float32 (N, D), each text's embedding as
        __call__ gives it for the text alone."""
        pooled, _ = packed_pooled(self.encoder, self.config.pooling, input_ids, token_type_ids, segment_ids, texts,
                                  starts)  # fmt: skip
        return unit_length(pooled) if self.config.normalize else pooled


class Discriminator(nnx.Module):
    """An encoder with the replaced-token detection head: ELECTRA's discriminator (ElectraForPreTraining)."""

    task = "rtd"

    def __init__(self, cfg: ModelConfig, encoder: nnx.Module, head: RtdHead):
        self.config = cfg
        self.encoder = encoder
        self.head = head

    def __call__(self, input_ids: jax.Array, attention_mask: Ids = None, token_type_ids: Ids = None) -> jax.Array:
        """(B, T) -> (B, T) float32 logits, positive where a token looks replaced."""
        return self.head(self.encoder(input_ids, attention_mask, token_type_ids))


Model = MaskedLM | SequenceClassifier | TokenClassifier | Discriminator | Embedder
