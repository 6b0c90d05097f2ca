"""Task heads on top of an encoder's hidden states: the masked-LM head and the sequence (classification or
regression) head with its poolings.

Shapes: B batch, T tokens, D hidden, V vocabulary, L labels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from bertforge.model.attention import MASK_VALUE
from bertforge.model.config import ACTIVATIONS, ModelConfig
from bertforge.model.layers import axes, dense, layer_norm


class MlmHead(nnx.Module):
    """Transform + vocabulary projection tied to the word embeddings, with its own bias."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dense = dense(cfg, cfg.hidden_size, cfg.hidden_size, ("embed", None), rngs)
        self.norm = layer_norm(cfg, rngs)
        self.bias = nnx.Param(jnp.zeros((cfg.vocab_size,), jnp.float32), **axes("vocab"))

    def __call__(self, hidden: jax.Array, word_embedding: jax.Array) -> jax.Array:
        """hidden (..., D), word_embedding (V, D) -> float32 logits (..., V)."""
        # RoBERTa's head always uses exact GELU; BERT's follows hidden_act.
        act = ACTIVATIONS["gelu" if self.cfg.flavor == "roberta" else self.cfg.hidden_act]
        h = self.norm(act(self.dense(hidden))).astype(self.cfg.compute_dtype)
        emb = word_embedding.astype(self.cfg.compute_dtype)
        logits = jnp.einsum("...d,vd->...v", h, emb, preferred_element_type=jnp.float32)
        return logits + self.bias[...]


class SequenceHead(nnx.Module):
    """A pooled vector through dense + tanh to num_labels outputs (BERT's pooler + classifier, RoBERTa's head).

    Pooling 'cls' takes the first token (what Hugging Face models do); 'mean' averages the tokens; 'attention'
    weights them by a learned score, as many regression recipes do.
    """

    def __init__(self, cfg: ModelConfig, num_labels: int, *, rngs: nnx.Rngs):
        self.cfg = cfg
        rate = cfg.hidden_dropout if cfg.classifier_dropout is None else cfg.classifier_dropout
        if cfg.pooling == "attention":
            init = nnx.initializers.normal(cfg.initializer_range)
            self.score = nnx.Param(init(rngs.params(), (cfg.hidden_size,), jnp.float32), **axes("embed"))
        self.dense = dense(cfg, cfg.hidden_size, cfg.hidden_size, ("embed", None), rngs)
        self.out = dense(cfg, cfg.hidden_size, num_labels, (None, None), rngs)
        self.dropout = nnx.Dropout(rate, rngs=rngs)

    def pool(self, hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """hidden (B, T, D), attention_mask (B, T) -> (B, D)."""
        if self.cfg.pooling == "cls":
            return hidden[:, 0]
        valid = attention_mask.astype(bool)  # (B, T)
        if self.cfg.pooling == "mean":
            weights = valid.astype(jnp.float32) / jnp.maximum(valid.sum(axis=1, keepdims=True), 1)
        else:
            scores = jnp.einsum("btd,d->bt", hidden.astype(jnp.float32), self.score[...])
            weights = jax.nn.softmax(jnp.where(valid, scores, MASK_VALUE), axis=-1)
        return jnp.einsum("bt,btd->bd", weights, hidden.astype(jnp.float32)).astype(hidden.dtype)

    def __call__(self, hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """hidden (B, T, D), attention_mask (B, T) -> float32 (B, L)."""
        x = self.pool(hidden, attention_mask)  # (B, D)
        if self.cfg.flavor == "roberta":
            x = self.dropout(x)
        x = self.dropout(jnp.tanh(self.dense(x)))
        return self.out(x).astype(jnp.float32)
