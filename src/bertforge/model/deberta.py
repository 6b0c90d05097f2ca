"""DeBERTa-v2/v3 in Flax NNX (He et al. 2021, 2023): BERT's post-LayerNorm stack with disentangled attention, whose
scores add to q_i.k_j a content-to-position term (c2p) q_i.r_{i-j} and a position-to-content term (p2c) k_j.r'_{i-j}
from one table of relative-position embeddings (log-bucketed beyond position_buckets/2) shared by all layers. No fused
kernel adds such terms: relative.py computes them, and they enter attention.attention (the hand-written backward) as
its bias.
transformers' DebertaV2* classes are the reference.
Shapes: B batch, T tokens, D hidden, E embedding width, N heads, H head dim, F feed-forward, R relative rows read.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from bertforge.model.attention import MASK_VALUE, attention
from bertforge.model.config import ACTIVATIONS, SIZE_LIMITS, ModelConfig, read_fields, refuse, write_fields
from bertforge.model.dropout import Dropout, split_key
from bertforge.model.family import Family
from bertforge.model.heads import Ids, MlmHead, SequenceHead, TokenHead, classifier_rate
from bertforge.model.keys import Row, layernorm_rows, linear_rows, table_row
from bertforge.model.layers import EncoderBase, KeyedLayer, axes, dense, embed, layer_norm, rematerialized, sinusoids
from bertforge.model.relative import RelativePlan, relative_plan, relative_reach, relative_scores

TERMS = ("c2p", "p2c")


def max_seq_len(cfg: ModelConfig) -> int:
    """Without absolute positions only relative ones remain, which clamp at any distance."""
    return cfg.max_position_embeddings if cfg.position_biased_input else SIZE_LIMITS["max_position_embeddings"]


# DeBERTa-v3's recipe: relative positions only, shared attention keys, 256 log buckets, no token types.
# fmt: off
DEBERTA = Family(
    "deberta-v2", "DebertaV2", pad_token_id=0, position_offset=0, type_vocab_size=0, layer_norm_eps=1e-7,
    fields={
        "relative_attention": True, "position_buckets": 256, "pos_att_type": ("p2c", "c2p"), "share_att_key": True,
        "position_biased_input": False, "norm_rel_ebd": "layer_norm", "classifier_act": "gelu",
    },
    segments=False, max_seq_len=max_seq_len,  # no packing: its attention has no segment mask
)
# fmt: on
FAMILIES = (DEBERTA,)


# ------------------------------------------------------------------------------------------------------ model
class Embeddings(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg, e = cfg, cfg.embed_dim
        self.word = embed(cfg, cfg.vocab_size, "vocab", rngs, width=e)
        self.position = embed(cfg, cfg.max_position_embeddings, "position", rngs, width=e)
        self.position = self.position if cfg.position_biased_input else None
        if self.position is not None and cfg.position_init == "sinusoidal":
            self.position.embedding.value = sinusoids(cfg.max_position_embeddings, e, cfg.initializer_range)
        self.token_type = embed(cfg, cfg.type_vocab_size, "token_type", rngs, width=e) if cfg.type_vocab_size else None
        self.proj = dense(cfg, e, cfg.hidden_size, (None, "embed"), rngs, bias=False) if e != cfg.hidden_size else None
        self.norm = layer_norm(cfg, rngs)
        self.dropout = Dropout(cfg.hidden_dropout, rngs=rngs)

    def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array, mask: jax.Array) -> jax.Array:
        """ids, token types (B, T), mask (B, T) bool -> (B, T, D), zero on padding."""
        x = self.word(input_ids)  # (B, T, E)
        x = x if self.position is None else x + self.position(jnp.arange(input_ids.shape[1]))[None]
        x = x if self.token_type is None else x + self.token_type(token_type_ids)
        x = x if self.proj is None else self.proj(x)  # (B, T, D)
        return self.dropout((self.norm(x) * mask[..., None]).astype(self.cfg.compute_dtype))


class Layer(KeyedLayer):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg, d, f = cfg, cfg.hidden_size, cfg.intermediate_size
        heads = functools.partial(dense, cfg, d, d, ("embed", "heads"), rngs)
        self.query, self.key, self.value = heads(), heads(), heads()
        own = cfg.relative_attention and not cfg.share_att_key  # projections of the table apart from q and k
        self.pos_key = heads() if own and "c2p" in cfg.pos_att_type else None
        self.pos_query = heads() if own and "p2c" in cfg.pos_att_type else None
        self.attn_out = dense(cfg, d, d, ("heads", "embed"), rngs)
        self.attn_norm = layer_norm(cfg, rngs)
        self.mlp_in = dense(cfg, d, f, ("embed", "mlp"), rngs)
        self.mlp_out = dense(cfg, f, d, ("mlp", "embed"), rngs)
        self.mlp_norm = layer_norm(cfg, rngs)
        self.dropout = Dropout(cfg.hidden_dropout, rngs=rngs)
        self.attn_dropout = Dropout(cfg.attention_dropout, rngs=rngs)

    def __call__(
        self, x: jax.Array, mask: jax.Array, rel: jax.Array | None, plan: RelativePlan | None, keys: Any = None
    ) -> jax.Array:
        """x (B, T, D), mask (B, T) bool, rel (R, D) the table rows that `plan` reads (None without relative
        attention) -> (B, T, D). `keys` are the dropout keys of dropout_keys(), drawn here when not given."""
        hidden_key, attn_key = self.dropout_keys() if keys is None else keys
        k1, k2, k3 = split_key(hidden_key, 3)
        cfg, (b, t, d) = self.cfg, x.shape
        n, h, dt = cfg.num_heads, cfg.head_dim, cfg.compute_dtype
        terms = [term for term in TERMS if term in cfg.pos_att_type]
        # One scale for the content and relative terms alike: their sum keeps the variance of one term.
        scale = 1.0 / math.sqrt(h * (1 + len(terms)))
        x2 = x.reshape(b * t, d)
        q = (self.query(x2) * scale).astype(dt).reshape(b, t, n, h)
        k = self.key(x2).astype(dt).reshape(b, t, n, h)
        v = self.value(x2).astype(dt).reshape(b, t, n, h)
        relative = jnp.zeros((), jnp.float32)
        if rel is not None and terms:
            rel = self.dropout(rel, rngs=k3)
            shared = cfg.share_att_key
            pos_k = (self.key if shared else self.pos_key)(rel).reshape(-1, n, h) if "c2p" in terms else None
            pos_q = (self.query if shared else self.pos_query)(rel) * scale if "p2c" in terms else None
            pos_q = None if pos_q is None else pos_q.reshape(-1, n, h)
            relative = relative_scores(q, k, pos_q, pos_k, plan)  # (B, N, T, T)
        # Padded queries see no key at all (transformers masks both sides): a uniform softmax, as there.
        valid = mask[:, None, :, None] & mask[:, None, None, :]  # (B, 1, T, T)
        # The content scores and the softmax in the attention with a hand-written backward, the relative scores
        # its bias: it keeps the probabilities (and the dropout mask) only, not every term of the sum.
        bias = jnp.where(valid, relative, MASK_VALUE)  # (B, N or 1, T, T)
        ctx = attention(q, k, v, bias, attn_key, rate=cfg.attention_dropout, scale=1.0)  # (B, T, N, H), q scaled
        attn = self.dropout(self.attn_out(ctx.reshape(b * t, d)), rngs=k1)
        y = self.attn_norm(x2 + attn).astype(x.dtype)
        hidden = ACTIVATIONS[cfg.hidden_act](self.mlp_in(y))  # (B*T, F)
        y = self.mlp_norm(y + self.dropout(self.mlp_out(hidden), rngs=k2)).astype(x.dtype)
        return y.reshape(b, t, d)


class ConvLayer(nnx.Module):
    """DeBERTa-v2's convolution over the embeddings, added to the first layer's output (n-gram features)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg, width, pad = cfg, cfg.conv_kernel_size, (cfg.conv_kernel_size - 1) // 2
        # fmt: off
        self.conv = nnx.Conv(
            cfg.hidden_size, cfg.hidden_size, (width,), padding=[(pad, pad)], feature_group_count=cfg.conv_groups,
            dtype=cfg.compute_dtype, param_dtype=jnp.float32, preferred_element_type=jnp.float32,
            kernel_init=nnx.initializers.normal(cfg.initializer_range), kernel_metadata=axes(None, None, "embed"),
            bias_metadata=axes("embed"), rngs=rngs,
        )
        # fmt: on
        self.norm = layer_norm(cfg, rngs)
        self.dropout = Dropout(cfg.hidden_dropout, rngs=rngs)

    def __call__(self, x: jax.Array, residual: jax.Array, mask: jax.Array) -> jax.Array:
        """x the embeddings and residual the first layer's output (B, T, D), mask (B, T) bool -> (B, T, D)."""
        keep = mask[..., None]
        out = ACTIVATIONS[self.cfg.conv_act](self.dropout(jnp.where(keep, self.conv(x), 0.0)))
        return (self.norm(residual + out) * keep).astype(residual.dtype)


class Encoder(EncoderBase):
    """Embeddings, the relative table and the transformer stack: (B, T) ids -> (B, T, D) hidden states."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embeddings = Embeddings(cfg, rngs=rngs)
        self.layers = nnx.List([Layer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        rows = 2 * relative_reach(cfg)[0]
        self.rel_embeddings = embed(cfg, rows, "position", rngs) if cfg.relative_attention else None
        # transformers has this LayerNorm whenever norm_rel_ebd asks, relative attention or not.
        self.rel_norm = layer_norm(cfg, rngs) if cfg.norm_rel_ebd == "layer_norm" else None
        self.conv = ConvLayer(cfg, rngs=rngs) if cfg.conv_kernel_size > 0 else None

    def __call__(
        self, input_ids: jax.Array, attention_mask: Ids = None, token_type_ids: Ids = None, first_only: bool = False
    ) -> jax.Array:
        """-> (B, T, D), every token (first_only is not used: the attention has no one-query path)."""
        cfg = self.cfg
        mask = (jnp.ones_like(input_ids) if attention_mask is None else attention_mask).astype(bool)
        types = jnp.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = first = self.embeddings(input_ids, types, mask)
        plan, rel = None, None
        if self.rel_embeddings is not None:
            plan = relative_plan(input_ids.shape[1], *relative_reach(cfg), cfg.position_buckets)
            rel = self.rel_embeddings.embedding[plan.lo : plan.hi]  # (R, D)
            if self.rel_norm is not None:
                rel = self.rel_norm(rel)
        for i, layer in enumerate(self.layers):
            x = rematerialized(layer, (x, mask, rel), plan=plan) if cfg.remat else layer(x, mask, rel, plan)
            if i == 0 and self.conv is not None:
                x = self.conv(first, x, mask)
        return x


def mlm_head(cfg: ModelConfig, rngs: nnx.Rngs) -> MlmHead:
    return MlmHead(cfg, act=cfg.hidden_act, rngs=rngs)


def sequence_head(cfg: ModelConfig, num_labels: int, rngs: nnx.Rngs) -> SequenceHead:
    # ContextPooler: dropout, dense, pooler_hidden_act; then dropout and the classifier.
    return SequenceHead(cfg, num_labels, rngs=rngs, dropout_first=True)


def token_head(cfg: ModelConfig, num_labels: int, rngs: nnx.Rngs) -> TokenHead:
    # DebertaV2ForTokenClassification drops with hidden_dropout_prob (an nn.Dropout), not cls_dropout.
    return TokenHead(cfg, num_labels, rngs=rngs, rate=cfg.hidden_dropout)


def span_head(cfg: ModelConfig, rngs: nnx.Rngs) -> TokenHead:
    # DebertaV2ForQuestionAnswering: qa_outputs on each token, no dropout.
    return TokenHead(cfg, 2, rngs=rngs, rate=0.0)


def choice_head(cfg: ModelConfig, rngs: nnx.Rngs) -> SequenceHead:
    # DebertaV2ForMultipleChoice: its sequence head (ContextPooler, dropout, classifier) with one output.
    return sequence_head(cfg, 1, rngs)


# ------------------------------------------------------------------------------------------- Hugging Face names
def key_table(cfg: ModelConfig, head: str) -> list[Row]:
    """Every parameter of a bertforge model of `head` ('mlm', 'sequence', 'token', 'span' or 'choice') with its
    Hugging Face name."""
    enc, emb, e = ("encoder",), ("encoder", "embeddings"), "deberta.embeddings"
    tables = ["word"] + ["position"] * cfg.position_biased_input + ["token_type"] * bool(cfg.type_vocab_size)
    rows = [table_row(f"{e}.{name}_embeddings", (*emb, name)) for name in tables]
    if cfg.embed_dim != cfg.hidden_size:
        rows += linear_rows(f"{e}.embed_proj", (*emb, "proj"), bias=False)
    rows += layernorm_rows(f"{e}.LayerNorm", (*emb, "norm"))
    own = [] if cfg.share_att_key or not cfg.relative_attention else cfg.pos_att_type
    names = ["query", "key", "value"] + ["pos_key"] * ("c2p" in own) + ["pos_query"] * ("p2c" in own)
    linears = [(f"attention.self.{name}_proj", name) for name in names]
    linears += [("attention.output.dense", "attn_out"), ("intermediate.dense", "mlp_in"), ("output.dense", "mlp_out")]
    for i in range(cfg.num_layers):
        hf, ours = f"deberta.encoder.layer.{i}", (*enc, "layers", i)
        for name, attr in linears:
            rows += linear_rows(f"{hf}.{name}", (*ours, attr))
        rows += layernorm_rows(f"{hf}.attention.output.LayerNorm", (*ours, "attn_norm"))
        rows += layernorm_rows(f"{hf}.output.LayerNorm", (*ours, "mlp_norm"))
    if cfg.relative_attention:
        rows += [table_row("deberta.encoder.rel_embeddings", (*enc, "rel_embeddings"))]
    if cfg.norm_rel_ebd == "layer_norm":
        rows += layernorm_rows("deberta.encoder.LayerNorm", (*enc, "rel_norm"))
    if cfg.conv_kernel_size > 0:  # torch's Conv1d weight (out, in/groups, width), reversed: (width, in/groups, out)
        rows += linear_rows("deberta.encoder.conv.conv", (*enc, "conv", "conv"))
        rows += layernorm_rows("deberta.encoder.conv.LayerNorm", (*enc, "conv", "norm"))
    if head == "mlm":  # the `legacy` head, which transformers builds by default
        rows += linear_rows("cls.predictions.transform.dense", ("mlm", "dense"), True)
        rows += layernorm_rows("cls.predictions.transform.LayerNorm", ("mlm", "norm"), True)
        return [*rows, Row("cls.predictions.bias", ("mlm", "bias"), False, True)]
    if head == "span":
        return rows + linear_rows("qa_outputs", ("head", "out"), True)
    # ContextPooler's dense, then the classifier (multiple choice: one output); the token and span heads have no pooler
    if head in ("sequence", "choice"):
        rows += linear_rows("pooler.dense", ("head", "dense"), True)
    return rows + linear_rows("classifier", ("head", "out"), True)


rtd_rows = None  # transformers has no DeBERTa discriminator: one exports as DebertaV2Model


# The non-legacy MLM head (legacy: false, and the original DeBERTa checkpoints) under the legacy head's names: the
# same computation when embedding_size == hidden_size, which hf_fields requires of such a config.
RENAMES = {
    "lm_predictions.lm_head.dense.": "cls.predictions.transform.dense.",
    "lm_predictions.lm_head.LayerNorm.": "cls.predictions.transform.LayerNorm.",
    "lm_predictions.lm_head.bias": "cls.predictions.bias",
}


def normalise_keys(tensors: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """Checkpoint names as key_table spells them: a bare DebertaV2Model has no "deberta." prefix; the non-legacy MLM
    head's names become the legacy head's (where a checkpoint has both, the legacy ones win)."""
    out = {}
    for key, value in sorted(tensors.items(), key=lambda item: item[0].startswith("cls.")):  # cls.* written last
        key = f"deberta.{key}" if key.startswith(("embeddings.", "encoder.")) else key
        old = next((old for old in RENAMES if key.startswith(old)), "")
        out[RENAMES[old] + key[len(old) :] if old else key] = value
    return out


# ------------------------------------------------------------------------------------------------------ config.json
PRETRAINING_HEAD = None  # transformers has no DebertaV2ForPreTraining; RTD discriminators load as encoders
RTD_ARCHITECTURE = None
NATIVE_POOLINGS = ("cls",)  # ContextPooler takes the first token
SCORE_BUFFERS = 4  # float32 (B, N, T, T) buffers a layer's step keeps, for plan (fitted): BERT's and relative scores'
# ModelConfig field -> config.json key, read and written as is.
# fmt: off
HF_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads", "intermediate_size": "intermediate_size",
    "max_position_embeddings": "max_position_embeddings", "type_vocab_size": "type_vocab_size",
    "layer_norm_eps": "layer_norm_eps", "hidden_dropout": "hidden_dropout_prob",
    "attention_dropout": "attention_probs_dropout_prob", "initializer_range": "initializer_range",
    "pad_token_id": "pad_token_id", "hidden_act": "hidden_act", "classifier_act": "pooler_hidden_act",
    "relative_attention": "relative_attention", "max_relative_positions": "max_relative_positions",
    "position_buckets": "position_buckets", "share_att_key": "share_att_key",
    "position_biased_input": "position_biased_input", "conv_kernel_size": "conv_kernel_size",
    "conv_groups": "conv_groups", "conv_act": "conv_act",
}
# transformers' DebertaV2Config defaults: what a config.json that leaves a key out means.
HF_DEFAULTS = {
    "vocab_size": 128100, "hidden_size": 1536, "num_hidden_layers": 24, "num_attention_heads": 24,
    "intermediate_size": 6144, "max_position_embeddings": 512, "type_vocab_size": 0, "layer_norm_eps": 1e-7,
    "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1, "initializer_range": 0.02, "pad_token_id": 0,
    "hidden_act": "gelu", "pooler_hidden_act": "gelu", "relative_attention": False, "max_relative_positions": -1,
    "position_buckets": -1, "share_att_key": False, "position_biased_input": True, "conv_kernel_size": 0,
    "conv_groups": 1, "conv_act": "tanh",
}
# fmt: on
FLAGS = ("relative_attention", "share_att_key", "position_biased_input", "legacy", "tie_word_embeddings")
INTEGERS = ("hidden_size", "num_attention_heads", "max_position_embeddings", "max_relative_positions",
            "position_buckets", "conv_kernel_size", "conv_groups", "embedding_size")  # fmt: skip


def hf_fields(data: dict[str, Any], family: str, source: str) -> dict[str, Any]:
    """ModelConfig fields from a DeBERTa-v2/v3 config.json; an option bertforge does not implement is a UserError."""
    d = {**HF_DEFAULTS, "norm_rel_ebd": "none", "legacy": True, "tie_word_embeddings": True}
    d.update((k, v) for k, v in data.items() if v is not None)
    d.setdefault("embedding_size", d["hidden_size"])
    for key in FLAGS + INTEGERS:
        if not isinstance(d[key], int) or (key in INTEGERS and isinstance(d[key], bool)):
            refuse(source, key, d[key], "an integer" if key in INTEGERS else "true or false")
    for key in ("hidden_act", "pooler_hidden_act", "conv_act"):
        if not isinstance(d[key], str) or d[key] not in ACTIVATIONS:
            refuse(source, key, d[key], f"activations: {', '.join(ACTIVATIONS)}")
    hidden, heads, width = d["hidden_size"], d["num_attention_heads"], d["embedding_size"]
    kernel, buckets, rel_max = d["conv_kernel_size"], d["position_buckets"], d["max_relative_positions"]
    if "attention_head_size" in d and d["attention_head_size"] * heads != hidden:
        refuse(source, "attention_head_size", d["attention_head_size"], "must be hidden_size / num_attention_heads")
    if d.get("pooler_hidden_size", hidden) != hidden:
        refuse(source, "pooler_hidden_size", d["pooler_hidden_size"], f"must equal hidden_size {hidden}")
    pos = d.get("pos_att_type", [])
    if isinstance(pos, str):  # the older spelling "p2c|c2p"
        pos = [x.strip() for x in pos.lower().split("|") if x.strip() not in ("", "none")]
    for term in pos if isinstance(pos, list) else [pos]:
        if term not in TERMS:
            refuse(source, "pos_att_type", term, "entries are c2p and p2c")
    if not d["legacy"] and width != hidden:
        refuse(source, "legacy", d["legacy"], "the non-legacy MLM head needs embedding_size == hidden_size")
    if d["legacy"] and not d["tie_word_embeddings"] and "ForMaskedLM" in str(d.get("architectures")):
        refuse(source, "tie_word_embeddings", False, "the MLM decoder is the word embedding table")
    if kernel > 0 and kernel % 2 == 0:
        refuse(source, "conv_kernel_size", kernel, "an odd width keeps the length")
    if kernel > 0 and (d["conv_groups"] < 1 or hidden % d["conv_groups"]):
        refuse(source, "conv_groups", d["conv_groups"], f"must divide hidden_size {hidden}")
    reach = rel_max if rel_max >= 1 else d["max_position_embeddings"]
    if buckets > 0 and (buckets < 2 or reach - 1 == buckets // 2):  # transformers divides by zero
        refuse(source, "position_buckets", buckets, f"with max_relative_positions {reach} no bucket is defined")
    # bertforge's one head dropout rate, before and after the dense: transformers' classifier dropout (cls_dropout,
    # hidden_dropout_prob when absent), or pooler_dropout (before the dense there) when only that is set.
    dropout = data["cls_dropout"] if "cls_dropout" in data else (d.get("pooler_dropout") or None)
    # Parts of norm_rel_ebd other than layer_norm do nothing in transformers either.
    norm = "layer_norm" if "layer_norm" in [x.strip() for x in str(d["norm_rel_ebd"]).lower().split("|")] else "none"
    fields = read_fields(d, HF_FIELDS) | {key: bool(d[key]) for key in FLAGS[:3]}
    fields |= dict(family=family, pos_att_type=tuple(dict.fromkeys(pos)), norm_rel_ebd=norm, classifier_dropout=dropout)
    fields |= dict(max_relative_positions=max(rel_max, 0) or -1, position_buckets=max(buckets, 0) or -1)
    return fields | dict(embedding_size=0 if width == hidden else width, conv_kernel_size=max(kernel, 0))


def hf_config(cfg: ModelConfig, head: str) -> dict[str, Any]:
    """config.json of a DeBERTa-v2/v3 model of `head`, apart from the labels."""
    return {
        "architectures": [DEBERTA.architecture(head)],
        "model_type": "deberta-v2",
        **write_fields(cfg, HF_FIELDS),
        **{"pos_att_type": list(cfg.pos_att_type), "norm_rel_ebd": cfg.norm_rel_ebd, "embedding_size": cfg.embed_dim},
        **{"pooler_hidden_size": cfg.hidden_size, "pooler_dropout": classifier_rate(cfg)},
        "cls_dropout": cfg.classifier_dropout,
        "legacy": True,  # the MLM head's names: cls.predictions.*
        "tie_word_embeddings": True,
    }
