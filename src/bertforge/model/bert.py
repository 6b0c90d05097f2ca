"""The BERT-family encoder in Flax NNX. BERT and RoBERTa are two configurations of this one model.

Post-LayerNorm transformer with learned absolute positions and token types (Devlin et al. 2019); RoBERTa differs
only in its position ids, which start after the padding index and skip padding (Liu et al. 2019). Parameters
carry logical axis names ('vocab', 'embed', 'mlp', 'heads', ...); parallel.py maps them onto the device mesh.
Shapes: B batch, T tokens, D hidden, N heads, H head dim, F feed-forward, V vocabulary, L labels, M masked.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

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
        """A `preset: NAME` key in YAML starts from that preset; the other keys override it."""
        from bertforge.model.presets import preset

        if "preset" not in data:
            return data
        name = data.pop("preset")
        key = f"{where}.preset" if where else "preset"
        base = dataclasses.asdict(preset(name, key=key))
        if data.get("flavor") == "roberta":
            # RoBERTa's conventions: pad id 1, positions offset by pad + 1, one token type, eps 1e-5.
            base.update(
                pad_token_id=1,
                max_position_embeddings=base["max_position_embeddings"] + 2,
                type_vocab_size=1,
                layer_norm_eps=1e-5,
            )
        return {**base, **data}


def _axes(*names: str | None) -> dict[str, Any]:
    # Logical names only; eager sharding off so that a model builds without a mesh (parallel.py shards it).
    return {"out_sharding": names, "eager_sharding": False}


def _dense(cfg: ModelConfig, din: int, dout: int, axes: tuple[str | None, str | None], rngs: nnx.Rngs):
    return nnx.Linear(
        din,
        dout,
        dtype=cfg.compute_dtype,
        param_dtype=jnp.float32,
        # bf16 products accumulate in float32, not in bf16: more exact.
        preferred_element_type=jnp.float32,
        kernel_init=nnx.initializers.normal(cfg.initializer_range),
        kernel_metadata=_axes(*axes),
        bias_metadata=_axes(axes[1]),
        rngs=rngs,
    )


def _norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    # LayerNorm statistics in float32 whatever the compute dtype.
    return nnx.LayerNorm(
        cfg.hidden_size,
        epsilon=cfg.layer_norm_eps,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        use_fast_variance=False,
        scale_metadata=_axes("embed"),
        bias_metadata=_axes("embed"),
        rngs=rngs,
    )


def _embed(cfg: ModelConfig, rows: int, axis: str, rngs: nnx.Rngs) -> nnx.Embed:
    return nnx.Embed(
        rows,
        cfg.hidden_size,
        param_dtype=jnp.float32,
        embedding_init=nnx.initializers.normal(cfg.initializer_range),
        embedding_metadata=_axes(axis, "embed"),
        rngs=rngs,
    )


def position_ids(cfg: ModelConfig, input_ids: jax.Array) -> jax.Array:
    """(B, T) ids -> (B, T) positions: 0..T-1 for BERT; for RoBERTa pad+1.. on tokens and pad on padding."""
    if cfg.flavor == "roberta":
        not_pad = (input_ids != cfg.pad_token_id).astype(jnp.int32)
        return jnp.cumsum(not_pad, axis=1) * not_pad + cfg.pad_token_id
    return jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)


def sinusoids(rows: int, dim: int, std: float) -> jax.Array:
    """(rows, dim) table: sin and cos of position / 10000^(2i/dim) interleaved, scaled to standard deviation `std`."""
    pos = jnp.arange(rows, dtype=jnp.float32)[:, None]
    freq = 10000.0 ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)  # (dim/2,)
    angle = pos * freq  # (rows, dim/2)
    table = jnp.stack([jnp.sin(angle), jnp.cos(angle)], axis=-1).reshape(rows, -1)[:, :dim]
    return table * (std * math.sqrt(2.0))  # sin and cos have variance 1/2 over positions


class Embeddings(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.word = _embed(cfg, cfg.vocab_size, "vocab", rngs)
        self.position = _embed(cfg, cfg.max_position_embeddings, "position", rngs)
        if cfg.position_init == "sinusoidal":
            rows, std = cfg.max_position_embeddings, cfg.initializer_range
            self.position.embedding.value = sinusoids(rows, cfg.hidden_size, std)
        self.token_type = _embed(cfg, cfg.type_vocab_size, "token_type", rngs)
        self.norm = _norm(cfg, rngs)
        self.dropout = nnx.Dropout(cfg.hidden_dropout, rngs=rngs)

    def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array) -> jax.Array:
        x = self.word(input_ids) + self.position(position_ids(self.cfg, input_ids))  # (B, T, D)
        x = x + self.token_type(token_type_ids)
        return self.dropout(self.norm(x).astype(self.cfg.compute_dtype))


def _attention_forward(q, k, v, bias):
    """q (B, Q, N, H), k and v (B, T, N, H), bias (B, 1, 1, T) -> output (B, Q, N, H) and what the backward needs."""
    scale = q.shape[-1] ** -0.5
    qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # (B, N, *, H)
    logits = jnp.matmul(qt, kt.swapaxes(-1, -2), preferred_element_type=jnp.float32) * scale + bias  # (B, N, Q, T)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.matmul(probs.astype(vt.dtype), vt, preferred_element_type=jnp.float32).astype(v.dtype)  # (B, N, Q, H)
    return out.transpose(0, 2, 1, 3), (qt, kt, vt, probs, out)


@jax.custom_vjp
def attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array) -> jax.Array:
    """Softmax attention with an additive key bias (0 or -1e30 for padding); the same numbers as
    jax.nn.dot_product_attention. Its hand-written backward uses the FlashAttention identity
    rowsum(dP * P) = rowsum(dO * O) and makes fewer passes over the (B, N, Q, T) probabilities than automatic
    differentiation does: on a CPU, 40% less time for the attention's forward and backward."""
    return _attention_forward(q, k, v, bias)[0]


def _attention_fwd(q, k, v, bias):
    out, saved = _attention_forward(q, k, v, bias)
    return out, (saved, bias)


def _attention_bwd(residuals, d_out):
    (qt, kt, vt, probs, out), bias = residuals
    scale = qt.shape[-1] ** -0.5
    dt = d_out.transpose(0, 2, 1, 3)  # (B, N, Q, H)
    f32 = jnp.float32
    dv = jnp.matmul(probs.astype(dt.dtype).swapaxes(-1, -2), dt, preferred_element_type=f32)
    dp = jnp.matmul(dt, vt.swapaxes(-1, -2), preferred_element_type=f32)  # (B, N, Q, T)
    row = jnp.sum(dt.astype(f32) * out.astype(f32), axis=-1, keepdims=True)  # (B, N, Q, 1)
    ds = (probs * (dp - row) * scale).astype(qt.dtype)
    dq = jnp.matmul(ds, kt, preferred_element_type=f32)
    dk = jnp.matmul(ds.swapaxes(-1, -2), qt, preferred_element_type=f32)
    back = lambda x, like: x.transpose(0, 2, 1, 3).astype(like.dtype)  # noqa: E731
    return back(dq, qt), back(dk, kt), back(dv, vt), jnp.zeros_like(bias)


attention.defvjp(_attention_fwd, _attention_bwd)


def padding_bias(mask: jax.Array) -> jax.Array:
    """(B, 1, 1, T) bool, True where a key may be attended -> additive float32 bias."""
    return jnp.where(mask, 0.0, -1e30).astype(jnp.float32)


def _attention_with_dropout(q, k, v, mask, dropout: nnx.Dropout, key: jax.Array) -> jax.Array:
    # jax.nn.dot_product_attention has no dropout on the probabilities; this path runs only in training with
    # attention_dropout > 0, and equals the fused one when dropout is off (tested).
    scale = q.shape[-1] ** -0.5
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32) * scale  # (B, N, T, T)
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = dropout(jax.nn.softmax(logits, axis=-1), rngs=key).astype(v.dtype)
    return jnp.einsum("bnts,bsnh->btnh", probs, v)  # (B, T, N, H)


class Layer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.query = _dense(cfg, d, d, ("embed", "heads"), rngs)
        self.key = _dense(cfg, d, d, ("embed", "heads"), rngs)
        self.value = _dense(cfg, d, d, ("embed", "heads"), rngs)
        self.attn_out = _dense(cfg, d, d, ("heads", "embed"), rngs)
        self.attn_norm = _norm(cfg, rngs)
        self.mlp_in = _dense(cfg, d, f, ("embed", "mlp"), rngs)
        self.mlp_out = _dense(cfg, f, d, ("mlp", "embed"), rngs)
        self.mlp_norm = _norm(cfg, rngs)
        self.dropout = nnx.Dropout(cfg.hidden_dropout, rngs=rngs)
        self.attn_dropout = nnx.Dropout(cfg.attention_dropout, rngs=rngs)

    def dropout_keys(self) -> tuple[jax.Array | None, jax.Array | None]:
        """This call's dropout keys (hidden, attention), drawn from the layer's streams; None where inactive."""

        def draw(d: nnx.Dropout) -> jax.Array | None:
            return d.rngs() if d.rate > 0 and not d.deterministic else None

        return draw(self.dropout), draw(self.attn_dropout)

    def __call__(
        self,
        x: jax.Array,
        mask: jax.Array,
        first_only: bool = False,
        keys: tuple[jax.Array | None, jax.Array | None] | None = None,
    ) -> jax.Array:
        """x (B, T, D), mask (B, 1, 1, T) True where a key may be attended -> (B, T, D).

        With `first_only` only the first token's output is computed, (B, 1, D): all a [CLS] head needs from the
        last layer. Keys and values still come from every token, so that output is exactly the full layer's.
        `keys` are the dropout keys of `dropout_keys()`, drawn here when not given.
        """
        hidden_key, attn_key = self.dropout_keys() if keys is None else keys
        k1, k2 = jax.random.split(hidden_key) if hidden_key is not None else (None, None)
        b, t, d = x.shape
        n, h = self.cfg.num_heads, self.cfg.head_dim
        xq = x[:, :1] if first_only else x  # (B, Q, D): the tokens whose outputs are computed
        tq = xq.shape[1]
        # Dense layers see tokens as one (B*T, D) matrix: XLA's CPU backward of a matmul that contracts two
        # batch dimensions is about 1.6x slower than of the same 2-D matmul.
        x2 = x.reshape(b * t, d)
        xq = xq.reshape(b * tq, d)
        q = self.query(xq).reshape(b, tq, n, h)
        k = self.key(x2).reshape(b, t, n, h)
        v = self.value(x2).reshape(b, t, n, h)
        if attn_key is not None:
            ctx = _attention_with_dropout(q, k, v, mask, self.attn_dropout, attn_key)
        else:
            ctx = attention(q, k, v, padding_bias(mask))  # (B, Q, N, H)
        attn = self.dropout(self.attn_out(ctx.reshape(b * tq, d)), rngs=k1)
        y = self.attn_norm(xq + attn).astype(x.dtype)
        hidden = ACTIVATIONS[self.cfg.hidden_act](self.mlp_in(y))  # (B*Q, F)
        y = self.mlp_norm(y + self.dropout(self.mlp_out(hidden), rngs=k2)).astype(x.dtype)
        return y.reshape(b, tq, d)


def _rematerialized(layer: Layer, x: jax.Array, mask: jax.Array, first_only: bool) -> jax.Array:
    """layer(x, mask) keeping only its inputs for the backward pass, which runs the layer again.

    The dropout keys are drawn outside, as the plain call draws them, and handed in: inside jax.checkpoint the
    layer is a pure function of its state, and the numbers are those of the plain call."""
    keys = layer.dropout_keys()
    graphdef, state = nnx.split(layer)

    def run(state: nnx.State, x: jax.Array, mask: jax.Array, keys: tuple) -> jax.Array:
        return nnx.merge(graphdef, state)(x, mask, first_only=first_only, keys=keys)

    return jax.checkpoint(run)(state, x, mask, keys)


class Encoder(nnx.Module):
    """Embeddings and the transformer stack: (B, T) ids -> (B, T, D) hidden states."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embeddings = Embeddings(cfg, rngs=rngs)
        self.layers = nnx.List([Layer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        token_type_ids: jax.Array | None = None,
        first_only: bool = False,
    ) -> jax.Array:
        """-> (B, T, D); with `first_only`, the last layer computes the first token only: (B, 1, D)."""
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        mask = attention_mask.astype(bool)[:, None, None, :]  # (B, 1, 1, T)
        x = self.embeddings(input_ids, token_type_ids)
        for i, layer in enumerate(self.layers):
            last = first_only and i == len(self.layers) - 1
            x = _rematerialized(layer, x, mask, last) if self.cfg.remat else layer(x, mask, first_only=last)
        return x


class MlmHead(nnx.Module):
    """Transform + vocabulary projection tied to the word embeddings, with its own bias."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dense = _dense(cfg, cfg.hidden_size, cfg.hidden_size, ("embed", None), rngs)
        self.norm = _norm(cfg, rngs)
        self.bias = nnx.Param(jnp.zeros((cfg.vocab_size,), jnp.float32), **_axes("vocab"))

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
            self.score = nnx.Param(init(rngs.params(), (cfg.hidden_size,), jnp.float32), **_axes("embed"))
        self.dense = _dense(cfg, cfg.hidden_size, cfg.hidden_size, ("embed", None), rngs)
        self.out = _dense(cfg, cfg.hidden_size, num_labels, (None, None), rngs)
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
            weights = jax.nn.softmax(jnp.where(valid, scores, -1e9), axis=-1)
        return jnp.einsum("bt,btd->bd", weights, hidden.astype(jnp.float32)).astype(hidden.dtype)

    def __call__(self, hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """hidden (B, T, D), attention_mask (B, T) -> float32 (B, L)."""
        x = self.pool(hidden, attention_mask)  # (B, D)
        if self.cfg.flavor == "roberta":
            x = self.dropout(x)
        x = self.dropout(jnp.tanh(self.dense(x)))
        return self.out(x).astype(jnp.float32)


class MaskedLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.encoder = Encoder(cfg, rngs=rngs)
        self.mlm = MlmHead(cfg, rngs=rngs)

    def logits_at(self, hidden: jax.Array) -> jax.Array:
        """MLM logits for any selection of hidden states (..., D) -> (..., V), e.g. only the masked positions."""
        return self.mlm(hidden, self.encoder.embeddings.word.embedding[...])

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        token_type_ids: jax.Array | None = None,
    ) -> jax.Array:
        """(B, T) -> (B, T, V) float32 logits."""
        return self.logits_at(self.encoder(input_ids, attention_mask, token_type_ids))


class SequenceClassifier(nnx.Module):
    def __init__(self, cfg: ModelConfig, num_labels: int, *, rngs: nnx.Rngs):
        if num_labels < 1:
            raise ValueError(f"num_labels must be positive, got {num_labels}")
        self.config = cfg
        self.num_labels = num_labels
        self.encoder = Encoder(cfg, rngs=rngs)
        self.head = SequenceHead(cfg, num_labels, rngs=rngs)

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        token_type_ids: jax.Array | None = None,
    ) -> jax.Array:
        """(B, T) -> (B, L) float32: regression values when L == 1, else class logits."""
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        # A [CLS] head needs one token of the last layer; computing only it is exact and saves most of that layer.
        first_only = self.config.pooling == "cls"
        return self.head(self.encoder(input_ids, attention_mask, token_type_ids, first_only), attention_mask)


def build(cfg: ModelConfig, head: str = "mlm", num_labels: int = 1, seed: int = 0) -> MaskedLM | SequenceClassifier:
    """A freshly initialised model: head 'mlm' or 'sequence'."""
    rngs = nnx.Rngs(params=seed, dropout=seed + 1)
    if head == "mlm":
        return MaskedLM(cfg, rngs=rngs)
    if head == "sequence":
        return SequenceClassifier(cfg, num_labels, rngs=rngs)
    raise ValueError(f"unknown head {head!r} (mlm or sequence)")
