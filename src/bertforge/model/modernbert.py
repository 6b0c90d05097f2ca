"""ModernBERT (Warner et al. 2024) in Flax NNX: a pre-LayerNorm encoder with rotary positions, GeGLU feed-forward
layers and alternating attention: every global_attn_every_n_layers-th layer (layer i with i % n == 0) attends
globally with RoPE base global_rope_theta, the others within local_attention // 2 tokens on each side with base
local_rope_theta. No biases but where the config asks, no token types, no position table.

Shapes: B batch, T tokens, Q queries, D hidden, N heads, H head dim, F feed-forward, V vocabulary, L labels.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from bertforge.model import layers
from bertforge.model.attention import attend, segment_positions
from bertforge.model.config import ACTIVATIONS, ModelConfig, refuse, write_fields
from bertforge.model.dropout import Dropout, split_key
from bertforge.model.family import Family
from bertforge.model.heads import MlmHead, SequenceHead, TokenHead, classifier_rate
from bertforge.model.keys import Row, layernorm_rows, linear_rows, table_row
from bertforge.model.layers import EncoderBase, KeyedLayer, dense, embed, input_mask, layer_norm, rematerialized

# ModernBERT's recipe: no biases but the decoder's, no dropout, pre-norm, RoPE, no token types.
MODERNBERT = Family(
    "modernbert",
    "ModernBert",
    pad_token_id=0,
    position_offset=0,
    type_vocab_size=0,
    layer_norm_eps=1e-5,
    fields={
        "attention_bias": False,
        "mlp_bias": False,
        "norm_bias": False,
        "classifier_bias": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "classifier_act": "gelu",
    },
)
FAMILIES = (MODERNBERT,)


def is_global(cfg: ModelConfig, index: int) -> bool:
    return index % cfg.global_attn_every_n_layers == 0


def rotary(x: jax.Array, theta: float, positions: jax.Array | None = None) -> jax.Array:
    """x (B, Q, N, H) at positions 0..Q-1 (or `positions` (B, Q)) rotated by RoPE of base `theta`, in float32: the
    two halves of each head are the real and imaginary parts of H/2 complex numbers, each turned by
    position * theta^(-2i/H)."""
    h = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))  # (H/2,)
    at = jnp.arange(x.shape[1], dtype=jnp.float32) if positions is None else positions.astype(jnp.float32)
    angle = at[..., None] * inv_freq  # (Q, H/2) or (B, Q, H/2)
    cos, sin = jnp.cos(angle)[..., None, :], jnp.sin(angle)[..., None, :]  # (Q, 1, H/2) or (B, Q, 1, H/2)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Embeddings(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.word = embed(cfg, cfg.vocab_size, "vocab", rngs)
        self.norm = layer_norm(cfg, rngs, bias=cfg.norm_bias)
        self.dropout = Dropout(cfg.hidden_dropout, rngs=rngs)

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        return self.dropout(self.norm(self.word(input_ids)).astype(self.cfg.compute_dtype))  # (B, T, D)


class Layer(KeyedLayer):
    def __init__(self, cfg: ModelConfig, index: int, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, f = cfg.hidden_size, cfg.intermediate_size
        # The embedding LayerNorm already normalises the first layer's input.
        self.attn_norm = layer_norm(cfg, rngs, bias=cfg.norm_bias) if index > 0 else None
        self.qkv = dense(cfg, d, 3 * d, ("embed", "heads"), rngs, bias=cfg.attention_bias)
        self.attn_out = dense(cfg, d, d, ("heads", "embed"), rngs, bias=cfg.attention_bias)
        self.mlp_norm = layer_norm(cfg, rngs, bias=cfg.norm_bias)
        self.mlp_in = dense(cfg, d, 2 * f, ("embed", "mlp"), rngs, bias=cfg.mlp_bias)  # input and gate
        self.mlp_out = dense(cfg, f, d, ("mlp", "embed"), rngs, bias=cfg.mlp_bias)
        self.dropout = Dropout(cfg.hidden_dropout, rngs=rngs)
        # ModernBERT's attention_dropout drops both the probabilities and the attention's output.
        self.attn_dropout = Dropout(cfg.attention_dropout, rngs=rngs)
        self.theta = cfg.global_rope_theta if is_global(cfg, index) else cfg.local_rope_theta
        self.window = None if is_global(cfg, index) else cfg.local_attention // 2

    def __call__(
        self,
        x: jax.Array,
        mask: jax.Array,
        positions: jax.Array | None = None,
        first_only: bool = False,
        keys: tuple[jax.Array | None, jax.Array | None] | None = None,
        queries: jax.Array | None = None,
    ) -> jax.Array:
        """x (B, T, D), mask (B, 1, 1, T) True where a key may be attended (or (B, 1, T, T)), positions (B, T) or
        None for 0..T-1 -> (B, T, D); `first_only` and `queries` as in bert.Layer: (B, 1, D) and (Nq, 1, D)."""
        hidden_key, attn_key = self.dropout_keys() if keys is None else keys
        probs_key, out_key = split_key(attn_key, 2)
        b, t, d = x.shape
        n, h = self.cfg.num_heads, self.cfg.head_dim
        y = x if self.attn_norm is None else self.attn_norm(x).astype(x.dtype)
        # (B*T, D) matrices for the dense layers: see bert.Layer.
        qkv = self.qkv(y.reshape(b * t, d)).reshape(b, t, 3, n, h)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (B, T, N, H)
        k = rotary(k, self.theta, positions)
        q, qpos, window = (q[:, :1] if first_only else q), positions, self.window
        if queries is not None:
            qpos = (queries % t if positions is None else positions.reshape(-1)[queries])[:, None]  # (Nq, 1)
            (q, k, v, mask), window = layers.own_rows(q, k, v, queries, mask, window), None
        elif positions is not None:
            qpos = positions[:, : q.shape[1]]
        bq, tq = q.shape[:2]
        q = rotary(q, self.theta, qpos)
        ctx = attend(q, k, v, mask, self.cfg.attention, self.cfg.dtype, self.attn_dropout, probs_key, window=window,
                     prefix=queries is None)  # (Bq, Q, N, H)  # fmt: skip
        attn = self.attn_dropout(self.attn_out(ctx.reshape(bq * tq, d)), rngs=out_key)
        x = layers.query_tokens(x, first_only, queries) + attn.astype(x.dtype)  # (Bq*Q, D)
        inp, gate = jnp.split(self.mlp_in(self.mlp_norm(x).astype(x.dtype)), 2, axis=-1)  # (Bq*Q, F) each
        hidden = self.dropout(ACTIVATIONS[self.cfg.hidden_act](inp) * gate, rngs=hidden_key)
        return (x + self.mlp_out(hidden).astype(x.dtype)).reshape(bq, tq, d)


class Encoder(EncoderBase):
    """Embeddings, the layers and the final LayerNorm: (B, T) ids -> (B, T, D) hidden states."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.global_attn_every_n_layers < 1 or cfg.local_attention < 0:
            raise ValueError(
                f"ModernBERT needs global_attn_every_n_layers >= 1 and local_attention >= 0, got "
                f"{cfg.global_attn_every_n_layers} and {cfg.local_attention}"
            )
        self.cfg = cfg
        self.embeddings = Embeddings(cfg, rngs=rngs)
        self.layers = nnx.List([Layer(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
        self.final_norm = layer_norm(cfg, rngs, bias=cfg.norm_bias)

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        token_type_ids: jax.Array | None = None,
        first_only: bool = False,
        segment_ids: jax.Array | None = None,
        starts: jax.Array | None = None,
    ) -> jax.Array:
        """-> (B, T, D); with `first_only`, the last layer computes the first token only: (B, 1, D). ModernBERT has
        no token types: token_type_ids is ignored. `segment_ids` and `starts` as in bert.Encoder: packed rows, each
        sequence attending within itself and rotated by its own positions (ModernBERT's unpadding)."""
        mask = input_mask(input_ids, attention_mask, segment_ids, first_only and starts is None)
        positions = None if segment_ids is None else segment_positions(segment_ids)  # (B, T)
        x = self.embeddings(input_ids)
        for i, layer in enumerate(self.layers):
            last = first_only and i == len(self.layers) - 1
            if last and starts is not None:
                x = layer(x, layers.first_token_mask(segment_ids, starts), positions, queries=starts)
                break
            args = (x, mask, positions)
            x = rematerialized(layer, args, first_only=last) if self.cfg.remat else layer(*args, first_only=last)
        return self.final_norm(x).astype(self.cfg.compute_dtype)


def mlm_head(cfg: ModelConfig, rngs: nnx.Rngs) -> MlmHead:
    return MlmHead(
        cfg,
        act=cfg.classifier_act,
        rngs=rngs,
        dense_bias=cfg.classifier_bias,
        norm_bias=cfg.norm_bias,
        decoder_bias=cfg.decoder_bias,
    )


def sequence_head(cfg: ModelConfig, num_labels: int, rngs: nnx.Rngs) -> SequenceHead:
    return SequenceHead(cfg, num_labels, rngs=rngs, norm=True)


def token_head(cfg: ModelConfig, num_labels: int, rngs: nnx.Rngs) -> TokenHead:
    # ModernBertForTokenClassification: `head` (dense, classifier_activation, norm), `drop`, `classifier`.
    return TokenHead(cfg, num_labels, rngs=rngs, rate=classifier_rate(cfg), transform=True)


def span_head(cfg: ModelConfig, rngs: nnx.Rngs) -> TokenHead:
    # ModernBertForQuestionAnswering: its token head with two outputs.
    return token_head(cfg, 2, rngs)


def choice_head(cfg: ModelConfig, rngs: nnx.Rngs) -> SequenceHead:
    # ModernBertForMultipleChoice: its sequence head (classifier_pooling, head, drop, classifier) with one output.
    return sequence_head(cfg, 1, rngs)


# ------------------------------------------------------------------------------------------- Hugging Face names
def key_table(cfg: ModelConfig, head: str) -> list[Row]:
    """Every parameter of a bertforge ModernBERT of `head` ('mlm', 'sequence' or 'token') with its Hugging Face
    name. The MLM decoder's weight is the word embedding (tied): only its bias is a row."""
    enc, nb = ("encoder",), cfg.norm_bias
    rows = [
        table_row("model.embeddings.tok_embeddings", (*enc, "embeddings", "word")),
        *layernorm_rows("model.embeddings.norm", (*enc, "embeddings", "norm"), bias=nb),
    ]
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}", (*enc, "layers", i)
        if i > 0:
            rows += layernorm_rows(f"{hf}.attn_norm", (*ours, "attn_norm"), bias=nb)
        rows += linear_rows(f"{hf}.attn.Wqkv", (*ours, "qkv"), bias=cfg.attention_bias)
        rows += linear_rows(f"{hf}.attn.Wo", (*ours, "attn_out"), bias=cfg.attention_bias)
        rows += layernorm_rows(f"{hf}.mlp_norm", (*ours, "mlp_norm"), bias=nb)
        rows += linear_rows(f"{hf}.mlp.Wi", (*ours, "mlp_in"), bias=cfg.mlp_bias)
        rows += linear_rows(f"{hf}.mlp.Wo", (*ours, "mlp_out"), bias=cfg.mlp_bias)
    rows += layernorm_rows("model.final_norm", (*enc, "final_norm"), bias=nb)
    if head == "mlm":
        rows += linear_rows("head.dense", ("mlm", "dense"), True, bias=cfg.classifier_bias)
        rows += layernorm_rows("head.norm", ("mlm", "norm"), True, bias=nb)
        rows += [Row("decoder.bias", ("mlm", "bias"), False, True)] if cfg.decoder_bias else []
    else:  # the sequence, token and span heads name their parts alike
        rows += linear_rows("head.dense", ("head", "dense"), True, bias=cfg.classifier_bias)
        rows += layernorm_rows("head.norm", ("head", "norm"), True, bias=nb)
        rows += linear_rows("classifier", ("head", "out"), True)
    return rows


rtd_rows = None  # transformers has no ModernBERT discriminator: one exports as ModernBertModel


def normalise_keys(tensors: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """Checkpoint names as key_table spells them: a bare ModernBertModel has no "model." prefix."""
    bare = re.compile(r"(embeddings|layers|final_norm)\.")
    return {f"model.{k}" if bare.match(k) else k: v for k, v in tensors.items()}


# ------------------------------------------------------------------------------------------------------ config.json
PRETRAINING_HEAD = None  # there is no ModernBertForPreTraining
RTD_ARCHITECTURE = None
NATIVE_POOLINGS = ("cls", "mean")  # ModernBertForSequenceClassification's classifier_pooling
SCORE_BUFFERS = 4  # float32 (B, N, T, T) buffers a layer's training step keeps, for plan (fitted; no dropout)
GLOBAL, LOCAL = "full_attention", "sliding_attention"  # transformers' layer_types
# ModelConfig field -> config.json key. hidden_dropout is mlp_dropout's, and also drops the embeddings (see
# hf_fields); attention_dropout drops the probabilities and the attention's output, as in transformers.
HF_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "intermediate_size": "intermediate_size",
    "max_position_embeddings": "max_position_embeddings",
    "layer_norm_eps": "norm_eps",
    "hidden_dropout": "mlp_dropout",
    "attention_dropout": "attention_dropout",
    "classifier_dropout": "classifier_dropout",
    "initializer_range": "initializer_range",
    "hidden_act": "hidden_activation",
    "classifier_act": "classifier_activation",
    "attention_bias": "attention_bias",
    "mlp_bias": "mlp_bias",
    "norm_bias": "norm_bias",
    "classifier_bias": "classifier_bias",
    "decoder_bias": "decoder_bias",
    "local_attention": "local_attention",
    "pooling": "classifier_pooling",
}
# transformers' ModernBertConfig defaults, for keys a config.json leaves out.
HF_DEFAULTS = {
    "vocab_size": 50368,
    "hidden_size": 768,
    "intermediate_size": 1152,
    "num_hidden_layers": 22,
    "num_attention_heads": 12,
    "hidden_activation": "gelu",
    "max_position_embeddings": 8192,
    "initializer_range": 0.02,
    "norm_eps": 1e-5,
    "norm_bias": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "local_attention": 128,
    "mlp_bias": False,
    "mlp_dropout": 0.0,
    "decoder_bias": True,
    "classifier_pooling": "cls",
    "classifier_dropout": 0.0,
    "classifier_bias": False,
    "classifier_activation": "gelu",
    "global_attn_every_n_layers": 3,
    "global_rope_theta": 160_000.0,
    "local_rope_theta": 10_000.0,
}


def _every_n(data: dict[str, Any], layers: int, source: str) -> int:
    """global_attn_every_n_layers, or the n of a layer_types list (transformers' form), which must be the pattern
    "layer i global when i % n == 0"."""
    types = data.get("layer_types")
    if types is None:
        n = data["global_attn_every_n_layers"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            refuse(source, "global_attn_every_n_layers", n, "a positive integer")
        return n
    why = f"bertforge makes layer i {GLOBAL} when i % n == 0, else {LOCAL}"
    if not isinstance(types, list):
        refuse(source, "layer_types", types, why)
    later = [i for i, kind in enumerate(types) if kind == GLOBAL and i > 0]
    n = later[0] if later else max(len(types), 1)
    if types != [GLOBAL if i % n == 0 else LOCAL for i in range(layers if isinstance(layers, int) else 0)]:
        refuse(source, "layer_types", types, why)
    return n


def _rope_thetas(data: dict[str, Any], source: str) -> tuple[float, float]:
    """(global, local) RoPE bases from rope_parameters (keyed by layer type) or the older global_rope_theta and
    local_rope_theta; any RoPE type but the default is refused."""
    scaling = data.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
        if kind != "default":
            refuse(source, "rope_scaling", scaling, "only the default RoPE")
    params = data.get("rope_parameters") or {}
    if not isinstance(params, dict) or not set(params) <= {GLOBAL, LOCAL}:
        refuse(source, "rope_parameters", params, f"a dict keyed by {GLOBAL} and {LOCAL}")
    thetas = []
    for kind, old in ((GLOBAL, "global_rope_theta"), (LOCAL, "local_rope_theta")):
        rope = params.get(kind) or {}
        if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) != "default":
            refuse(source, f"rope_parameters.{kind}", rope, "only the default RoPE")
        thetas.append(rope.get("rope_theta", data[old]))
    return thetas[0], thetas[1]


def hf_fields(data: dict[str, Any], family: str, source: str) -> dict[str, Any]:
    """ModelConfig fields from a ModernBERT config.json; an option bertforge does not implement is a UserError.

    Dropout: bertforge has one hidden dropout, taken from mlp_dropout; it also drops the embeddings, whatever
    embedding_dropout says (every public checkpoint has both 0). Runtime flags (reference_compile,
    sparse_prediction, deterministic_flash_attn, ...) change no number and are accepted."""
    data = {**HF_DEFAULTS, **{k: v for k, v in data.items() if v is not None or k == "pad_token_id"}}
    half = data.get("sliding_window")  # transformers' half-width alias, which sets local_attention
    if half is not None:
        if not isinstance(half, int) or isinstance(half, bool) or half < 0:
            refuse(source, "sliding_window", half, "a window of 0 or more tokens")
        data["local_attention"] = 2 * half
    for key in ("hidden_activation", "classifier_activation"):
        if data[key] not in ACTIVATIONS:
            refuse(source, key, data[key], f"bertforge has {', '.join(ACTIVATIONS)}")
    if data["classifier_pooling"] not in NATIVE_POOLINGS:
        refuse(source, "classifier_pooling", data["classifier_pooling"], "only cls or mean")
    if data.get("tie_word_embeddings", True) is not True:
        refuse(source, "tie_word_embeddings", data["tie_word_embeddings"], "the decoder is the embedding")
    heads, hidden = data["num_attention_heads"], data["hidden_size"]
    head_dim = data.get("head_dim")
    if head_dim is not None and isinstance(heads, int) and heads > 0 and head_dim * heads != hidden:
        refuse(source, "head_dim", head_dim, "only hidden_size / num_attention_heads")
    local = data["local_attention"]
    if not isinstance(local, int) or isinstance(local, bool) or local < 0:
        refuse(source, "local_attention", local, "a window of 0 or more tokens")
    global_theta, local_theta = _rope_thetas(data, source)
    fields = {ours: data[theirs] for ours, theirs in HF_FIELDS.items()}
    return {
        **fields,
        "family": family,
        "pad_token_id": MODERNBERT.pad_token_id if data.get("pad_token_id") is None else data["pad_token_id"],
        "type_vocab_size": 0,
        "global_attn_every_n_layers": _every_n(data, data["num_hidden_layers"], source),
        "global_rope_theta": global_theta,
        "local_rope_theta": local_theta,
    }


def hf_config(cfg: ModelConfig, head: str) -> dict[str, Any]:
    """config.json of a ModernBERT model of `head`, apart from the labels. The layer pattern and RoPE bases are
    written in both transformers' current form (layer_types, rope_parameters) and the original one."""
    fields = write_fields(cfg, HF_FIELDS)
    dropout = classifier_rate(cfg)
    return {
        "architectures": [MODERNBERT.architecture(head)],
        "model_type": "modernbert",
        **fields,
        "embedding_dropout": cfg.hidden_dropout,
        "classifier_dropout": dropout,
        # attention pooling is bertforge's own (config_to_hf adds bertforge_pooling); transformers reads cls.
        "classifier_pooling": cfg.pooling if cfg.pooling in NATIVE_POOLINGS else "cls",
        "pad_token_id": cfg.pad_token_id,
        # transformers' defaults are ModernBERT's own tokenizer's ids; the tokenizer saved beside holds the real ones.
        **dict.fromkeys(("bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id")),
        "global_attn_every_n_layers": cfg.global_attn_every_n_layers,
        "global_rope_theta": cfg.global_rope_theta,
        "local_rope_theta": cfg.local_rope_theta,
        "layer_types": [GLOBAL if is_global(cfg, i) else LOCAL for i in range(cfg.num_layers)],
        "rope_parameters": {
            GLOBAL: {"rope_type": "default", "rope_theta": cfg.global_rope_theta},
            LOCAL: {"rope_type": "default", "rope_theta": cfg.local_rope_theta},
        },
        "tie_word_embeddings": True,
    }
