"""Building blocks every family uses: dense layers, LayerNorm and embedding tables with logical axis names,
sinusoidal position tables, a layer's dropout keys and an encoder's tied word table. Parameters are float32
whatever the compute dtype."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from bertforge.model.attention import segment_mask
from bertforge.model.config import ModelConfig
from bertforge.model.dropout import next_key
from bertforge.model.layout import row_major


def axes(*names: str | None) -> dict[str, Any]:
    """Variable metadata giving a parameter's logical axis names (runtime/devices.py maps them onto the mesh)."""
    # Eager sharding off so that a model builds without a mesh (runtime/devices.py shards it).
    return {"out_sharding": names, "eager_sharding": False}


@jax.custom_vjp
def mixed_matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x @ kernel with x's low-precision dtype on both passes and float32 accumulation; float32 out.

    Automatic differentiation of a float32-accumulated product differentiates it in float32 (the output's
    cotangent is float32, so the backward products upcast their bf16 operands), at a fraction of the bf16 rate on
    AMX, tensor cores and TPUs. Here the cotangent is rounded to x's dtype first, as mixed-precision training
    does, and the kernel's gradient stays float32 (not rounded to bf16 on its way to the float32 parameter).
    """
    return jnp.matmul(x, kernel.astype(x.dtype), preferred_element_type=jnp.float32)  # (..., dout)


def _mixed_matmul_fwd(x: jax.Array, kernel: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    low = kernel.astype(x.dtype)
    return jnp.matmul(x, low, preferred_element_type=jnp.float32), (x, low)


def _mixed_matmul_bwd(res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, low = res
    g = g.astype(x.dtype)  # (..., dout)
    dx = jnp.matmul(g, row_major(low.T), preferred_element_type=jnp.float32).astype(x.dtype)  # (..., din)
    rows = row_major(x.reshape(-1, x.shape[-1]).T)  # (din, N)
    dkernel = jnp.matmul(rows, g.reshape(-1, g.shape[-1]), preferred_element_type=jnp.float32)  # (din, dout)
    return dx, dkernel


mixed_matmul.defvjp(_mixed_matmul_fwd, _mixed_matmul_bwd)


class Dense(nnx.Linear):
    """nnx.Linear with float32 parameters; in bf16 or fp16 its products run in that dtype forward and backward."""

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        if self.dtype is None or jnp.dtype(self.dtype) == jnp.float32:
            return super().__call__(inputs, out_sharding)
        y = mixed_matmul(inputs.astype(self.dtype), self.kernel[...])  # (..., dout) float32
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def dense(
    cfg: ModelConfig,
    din: int,
    dout: int,
    names: tuple[str | None, str | None],
    rngs: nnx.Rngs,
    bias: bool = True,
) -> nnx.Linear:
    """A (din, dout) linear layer computing in cfg's dtype, its kernel's axes named `names`."""
    return Dense(
        din,
        dout,
        use_bias=bias,
        dtype=cfg.compute_dtype,
        param_dtype=jnp.float32,
        # bf16 products accumulate in float32, not in bf16: more exact.
        preferred_element_type=jnp.float32,
        kernel_init=nnx.initializers.normal(cfg.initializer_range),
        kernel_metadata=axes(*names),
        bias_metadata=axes(names[1]),
        rngs=rngs,
    )


def layer_norm(cfg: ModelConfig, rngs: nnx.Rngs, size: int | None = None, bias: bool = True) -> nnx.LayerNorm:
    """LayerNorm over the hidden size (or `size`), with or without its bias."""
    # Statistics in float32 whatever the compute dtype.
    return nnx.LayerNorm(
        size or cfg.hidden_size,
        use_bias=bias,
        epsilon=cfg.layer_norm_eps,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        use_fast_variance=False,
        scale_metadata=axes("embed"),
        bias_metadata=axes("embed"),
        rngs=rngs,
    )


def embed(cfg: ModelConfig, rows: int, axis: str, rngs: nnx.Rngs, width: int | None = None) -> nnx.Embed:
    """A (rows, D) embedding table (or (rows, width)), its first axis named `axis`."""
    return nnx.Embed(
        rows,
        width or cfg.hidden_size,
        param_dtype=jnp.float32,
        embedding_init=nnx.initializers.normal(cfg.initializer_range),
        embedding_metadata=axes(axis, "embed"),
        rngs=rngs,
    )


def sinusoids(rows: int, dim: int, std: float) -> jax.Array:
    """(rows, dim) table: sin and cos of position / 10000^(2i/dim) interleaved, scaled to standard deviation `std`."""
    pos = jnp.arange(rows, dtype=jnp.float32)[:, None]
    freq = 10000.0 ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)  # (dim/2,)
    angle = pos * freq  # (rows, dim/2)
    table = jnp.stack([jnp.sin(angle), jnp.cos(angle)], axis=-1).reshape(rows, -1)[:, :dim]
    return table * (std * math.sqrt(2.0))  # sin and cos have variance 1/2 over positions


def dropout_keys(*dropouts: nnx.Dropout) -> tuple[jax.Array | None, ...]:
    """This call's key of each dropout, drawn from its stream; None where it is inactive."""
    return tuple(next_key(d.rngs) if d.rate > 0 and not d.deterministic else None for d in dropouts)


class KeyedLayer(nnx.Module):
    """A transformer layer whose hidden dropout is `self.dropout` and attention dropout `self.attn_dropout`, called
    with `keys=` the keys dropout_keys() draws (see rematerialized)."""

    def dropout_keys(self) -> tuple[jax.Array | None, ...]:
        """This call's dropout keys (hidden, attention); None where inactive."""
        return dropout_keys(self.dropout, self.attn_dropout)


class EncoderBase(nnx.Module):
    """An encoder whose word table is `self.embeddings.word`, which the masked-LM head's decoder is tied to."""

    def word_embedding(self) -> jax.Array:
        return self.embeddings.word.embedding[...]  # (V, E)


def rematerialized(layer: nnx.Module, arrays: tuple, **static: Any) -> jax.Array:
    """layer(*arrays, **static) keeping only its inputs for the backward pass, which runs the layer again.

    The layer's dropout keys (its dropout_keys()) are drawn outside, as the plain call draws them, and handed in as
    `keys`: inside jax.checkpoint the layer is a pure function of its state, and the numbers are the plain call's.
    """
    keys = layer.dropout_keys()
    graphdef, state = nnx.split(layer)

    def run(state: nnx.State, arrays: tuple, keys: tuple) -> jax.Array:
        return nnx.merge(graphdef, state)(*arrays, **static, keys=keys)

    return jax.checkpoint(run)(state, arrays, keys)


def query_tokens(x: jax.Array, first_only: bool, queries: jax.Array | None) -> jax.Array:
    """x (B, T, D) -> the tokens a layer computes the outputs of, as one matrix: all (B*T, D), the first of each
    row with first_only (B, D), or the flat indices `queries` (Nq, D)."""
    b, t, d = x.shape
    if queries is not None:
        return x.reshape(b * t, d)[queries]
    return (x[:, :1] if first_only else x).reshape(-1, d)


def first_token_mask(segments: jax.Array, starts: jax.Array) -> jax.Array:
    """(B, T) segment ids of packed rows and (N,) flat indices of the sequences' first tokens -> (N, 1, 1, T) bool:
    the keys of each one's own sequence, in its row."""
    t = segments.shape[1]
    own = segments.reshape(-1)[starts]  # (N,)
    return (segments[starts // t] == own[:, None])[:, None, None, :]


def own_rows(
    q: jax.Array, k: jax.Array, v: jax.Array, queries: jax.Array, mask: jax.Array, window: int | None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """q, k, v (B, T, N, H) -> the queries at the flat indices `queries` (Nq, 1, N, H), the keys and values of each
    one's own row (Nq, T, N, H), and mask (Nq, 1, 1, T) narrowed to the local `window` about each query's column
    (so attend must not apply it again: its band is about columns 0..Q-1)."""
    b, t = k.shape[:2]
    q = q.reshape(b * t, *q.shape[2:])[queries][:, None]
    if window is not None:
        near = jnp.abs(jnp.arange(t)[None, :] - (queries % t)[:, None]) <= window  # (Nq, T)
        mask = mask & near[:, None, None, :]
    return q, k[queries // t], v[queries // t], mask


def input_mask(
    input_ids: jax.Array, attention_mask: jax.Array | None, segments: jax.Array | None, first_only: bool
) -> jax.Array:
    """The attention mask an encoder's layers take: (B, 1, 1, T) from the padding mask, or (B, 1, T, T) from the
    segment ids of rows that pack several sequences."""
    if segments is None:
        padding = jnp.ones_like(input_ids) if attention_mask is None else attention_mask
        return padding.astype(bool)[:, None, None, :]  # (B, 1, 1, T)
    if first_only:
        raise ValueError("first_only computes the first token of a row; a packed row has one per sequence")
    return segment_mask(segments)  # (B, 1, T, T)
