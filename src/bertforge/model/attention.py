"""Softmax attention over padded batches: one implementation per platform, and the rule that picks one.

Every implementation takes q (B, Q, N, H), k and v (B, T, N, H) and mask (B, 1, 1, T), True where a key may be
attended (or (B, 1, Q, T) for rows that pack several sequences, see segment_mask), and returns (B, Q, N, H):
softmax(q k^T / sqrt(H) + padding) v. Q is T, or 1 when a layer computes only its first token: query i is the
token at position i. An optional `window` w makes the attention local (ModernBERT's sliding window): query i
attends only to keys j with |i - j| <= w, on top of the padding.

- custom: the plain formula with a hand-written backward (jax.custom_vjp), with or without dropout on the
  probabilities; the CPU default.
- xla: jax.nn.dot_product_attention with implementation "xla"; on a TPU, XLA fuses it.
- cudnn: cuDNN's fused flash attention (NVIDIA GPUs, bfloat16 or float16 only); the GPU default.
- explicit: einsum and softmax with dropout on the probabilities, differentiated automatically.
- pallas: fused kernels written in Pallas for NVIDIA GPUs (flash_attention.py), with dropout on the probabilities
  and any mask; `explicit` where its lengths or head size do not fit the kernels' blocks.
- splash: jax's splash kernel for TPUs (splash_attention.py), padding and packed rows as segment ids; `xla` where
  its lengths do not fit its blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from bertforge.model.dropout import dropped, keep_mask
from bertforge.model.flash_attention import fits, flash_attention
from bertforge.model.layout import row_major
from bertforge.model.mask_value import MASK_VALUE
from bertforge.model.splash_attention import QKV_AXES
from bertforge.model.splash_attention import fits as splash_fits
from bertforge.model.splash_attention import splash_attention as splash_kernel
from bertforge.runtime.devices import per_device

ATTENTIONS = ("auto", "custom", "xla", "cudnn", "explicit", "pallas", "splash")
HALF_DTYPES = ("bfloat16", "float16")


def padding_bias(mask: jax.Array) -> jax.Array:
    """(B, 1, 1, T) bool, True where a key may be attended -> additive float32 bias (0 or MASK_VALUE)."""
    return jnp.where(mask, 0.0, MASK_VALUE).astype(jnp.float32)


def segment_mask(segments: jax.Array) -> jax.Array:
    """(B, T) segment ids (0 for padding) -> (B, 1, T, T) bool, True where query i and key j are in one segment:
    the attention of rows that pack several sequences (block-diagonal)."""
    same = segments[:, :, None] == segments[:, None, :]  # (B, T, T)
    return (same & (segments != 0)[:, None, :])[:, None]


def segment_positions(segments: jax.Array) -> jax.Array:
    """(B, T) segment ids -> (B, T) int32: each token's index within its segment."""
    t = jnp.arange(segments.shape[1], dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    return t - jax.lax.cummax(jnp.where(starts, t, 0), axis=1)


def band(q_len: int, t_len: int, window: int) -> jax.Array:
    """(1, 1, Q, T) bool, True where key j is within `window` positions of query i: |i - j| <= window."""
    dist = jnp.arange(q_len)[:, None] - jnp.arange(t_len)[None, :]  # (Q, T)
    return (jnp.abs(dist) <= window)[None, None]


def _scores(q, k, v, bias, window, scale):
    """q, k, v as (B, N, *, H) and the attention's scores q k^T * scale + bias, (B, N, Q, T) float32."""
    if window is not None:
        # A key outside the window gets exactly MASK_VALUE, as a padded one: a query with no key left (a padded
        # token far from any real one) then has a uniform softmax over all keys, as in every other implementation.
        bias = jnp.where(band(q.shape[1], k.shape[1], window), bias, MASK_VALUE)
    qt, kt, vt = (row_major(x.transpose(0, 2, 1, 3)) for x in (q, k, v))  # (B, N, *, H)
    logits = jnp.matmul(qt, row_major(kt.swapaxes(-1, -2)), preferred_element_type=jnp.float32)  # (B, N, Q, T)
    return qt, kt, vt, logits * scale + bias


def _attention_forward(q, k, v, bias, key, window, rate, scale):
    """q (B, Q, N, H), k and v (B, T, N, H), bias broadcastable to (B, N, Q, T) -> output (B, Q, N, H) and what the
    backward needs. With a dropout `key`, the probabilities are dropped at `rate` by dropout.keep_mask, the mask
    dropout.Dropout draws from the same key: the numbers of explicit_attention."""
    qt, kt, vt, scores = _scores(q, k, v, bias, window, scale)
    probs = jax.nn.softmax(scores, axis=-1)
    keep = None if key is None else keep_mask(key, rate, probs.shape)  # (B, N, Q, T) bool
    weights = dropped(probs, keep, rate)
    out = jnp.matmul(weights.astype(vt.dtype), vt, preferred_element_type=jnp.float32).astype(v.dtype)  # (B, N, Q, H)
    return out.transpose(0, 2, 1, 3), (qt, kt, vt, probs, keep, out)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array,
    key: jax.Array | None = None,
    window: int | None = None,
    rate: float = 0.0,
    scale: float | None = None,
) -> jax.Array:
    """softmax(q k^T * scale + bias) v, with an additive bias of 4 dimensions broadcastable to (B, N, Q, T) (the
    padding's, see padding_bias, or a score term of the model's own, which receives its gradient), an optional
    local window and, given a key, dropout on the probabilities at `rate`. `scale` defaults to 1 / sqrt(H); without
    dropout the numbers of jax.nn.dot_product_attention.

    Its hand-written backward uses the FlashAttention identity rowsum(dP * P) = rowsum(dO * O), which holds for
    the dropped probabilities too, and makes fewer passes over the (B, N, Q, T) probabilities than automatic
    differentiation does: on a CPU, 40% less time for the attention's forward and backward (a third less with
    dropout, whose boolean mask is kept for the backward). The window is a static int, so the band is built from
    iota in the forward and never stored: the saved probabilities already hold it; nor is the bias kept."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _attention(q, k, v, bias, key, window, rate, scale, tuple(bias.shape))


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _attention(q, k, v, bias, key, window, rate, scale, bias_shape):
    """The forward where no gradient is taken (evaluation, predict, embed): the softmax's exponentials stay
    unnormalised and the (B, N, Q, H) output is divided by their sums, a pass over the (B, N, Q, T) scores fewer
    (docs/benchmarks.md). Differentiated, _attention_fwd keeps the normalised probabilities for the backward."""
    _, _, vt, scores = _scores(q, k, v, bias, window, scale)
    exps = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))  # (B, N, Q, T)
    inv = 1.0 / jnp.sum(exps, axis=-1, keepdims=True)  # (B, N, Q, 1)
    weights = dropped(exps, None if key is None else keep_mask(key, rate, exps.shape), rate)
    out = jnp.matmul(weights.astype(vt.dtype), vt, preferred_element_type=jnp.float32) * inv  # (B, N, Q, H)
    return out.astype(v.dtype).transpose(0, 2, 1, 3)


def _attention_fwd(q, k, v, bias, key, window, rate, scale, bias_shape):
    return _attention_forward(q, k, v, bias, key, window, rate, scale)


def _attention_bwd(window, rate, scale, bias_shape, residuals, d_out):
    qt, kt, vt, probs, keep, out = residuals
    dt = row_major(d_out.transpose(0, 2, 1, 3))  # (B, N, Q, H)
    f32 = jnp.float32
    weights_t = row_major(dropped(probs, keep, rate).astype(dt.dtype).swapaxes(-1, -2))  # (B, N, T, Q)
    dv = jnp.matmul(weights_t, dt, preferred_element_type=f32)
    # The gradient reaching the probabilities through the mask; the identity below holds for the dropped ones.
    dp = dropped(jnp.matmul(dt, row_major(vt.swapaxes(-1, -2)), preferred_element_type=f32), keep, rate)  # (B, N, Q, T)
    row = jnp.sum(dt.astype(f32) * out.astype(f32), axis=-1, keepdims=True)  # (B, N, Q, 1)
    d_logits = probs * (dp - row)  # (B, N, Q, T)
    ds = (d_logits * scale).astype(qt.dtype)
    dq = jnp.matmul(ds, kt, preferred_element_type=f32)
    dk = jnp.matmul(row_major(ds.swapaxes(-1, -2)), qt, preferred_element_type=f32)
    back = lambda x, like: x.transpose(0, 2, 1, 3).astype(like.dtype)  # noqa: E731
    # Summed over the bias's broadcast axes; XLA drops it where the bias is a constant (the padding's).
    summed = tuple(i for i, n in enumerate(bias_shape) if n == 1 and d_logits.shape[i] != 1)
    d_bias = jnp.sum(d_logits, axis=summed, keepdims=True).reshape(bias_shape)
    return back(dq, qt), back(dk, kt), back(dv, vt), d_bias, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def custom_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    dropout: nnx.Dropout | None = None,
    key: jax.Array | None = None,
    window: int | None = None,
) -> jax.Array:
    """`attention` with the padding mask as its bias (mask may be any boolean broadcastable to (B, 1, Q, T)), and
    `dropout`'s rate on the probabilities when a `key` is given."""
    rate = _dropout_rate(dropout, key)
    return attention(q, k, v, padding_bias(mask), key if rate else None, window, rate)


def _dropout_rate(dropout: nnx.Dropout | None, key: jax.Array | None) -> float:
    """The rate at which the attention probabilities are dropped: 0 without a key or a dropout."""
    return 0.0 if key is None or dropout is None else dropout.rate


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, window: int | None = None) -> jax.Array:
    """jax.nn.dot_product_attention's XLA implementation, which XLA fuses on a TPU."""
    return jax.nn.dot_product_attention(q, k, v, mask=mask, local_window_size=window, implementation="xla")


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, window: int | None = None) -> jax.Array:
    """cuDNN's fused attention; q, k, v in bfloat16 or float16.

    cuDNN rejects a (B, 1, 1, T) boolean mask, so the padding is given as the number of valid keys of each row,
    which assumes that a row's padding is at its end: true of every bertforge batch (tokenizers and the shard
    reader pad on the right). An all-padding filler row is given one key, so that its output stays finite.
    cuDNN's own sliding window is one-sided (causal), so a two-sided window goes in as a (1, 1, Q, T) boolean
    mask, which the kernel takes as a bias of that shape: the same for every row, so no (B, ...) array is built.
    It still computes every logit, yet costs far less than XLA's local window (docs/gpu.md, section 4).
    """
    tq = q.shape[1]
    lengths = jnp.maximum(mask.reshape(mask.shape[0], -1).sum(axis=-1), 1).astype(jnp.int32)  # (B,)
    # cuDNN's backward takes even lengths only: an odd count gets one more query, whose output is dropped, or one
    # more key, past every row's length and so never attended. Q is odd whenever a layer computes its first token.
    q = _pad_to_even(q)
    k, v = _pad_to_even(k), _pad_to_even(v)
    local = None if window is None else band(q.shape[1], k.shape[1], window)
    out = jax.nn.dot_product_attention(q, k, v, mask=local, key_value_seq_lengths=lengths, implementation="cudnn")
    return out[:, :tq]  # (B, Q, N, H)


def cudnn_masked_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, window: int | None = None
) -> jax.Array:
    """cuDNN's fused attention given a mask per query, (B, 1, Q, T): rows that pack several sequences, whose
    attention is block-diagonal. The kernel takes the mask as a bias of that shape, so every logit is still
    computed, but on the tensor cores and without the (B, N, Q, T) probabilities XLA's attention keeps for its
    backward. The local window is folded into the mask; a padding query attends to every key (kernel_mask)."""
    tq, tk = q.shape[1], k.shape[1]
    if window is not None:
        mask = mask & band(tq, tk, window)  # (B, 1, Q, T)
    q, k, v = _pad_to_even(q), _pad_to_even(k), _pad_to_even(v)  # even lengths, as in cudnn_attention
    out = jax.nn.dot_product_attention(q, k, v, mask=kernel_mask(mask, q.shape[1], k.shape[1]), implementation="cudnn")
    return out[:, :tq]  # (B, Q, N, H)


def kernel_mask(mask: jax.Array, q_len: int, k_len: int) -> jax.Array:
    """(B, 1, Q, T) bool -> (B, 1, q_len, k_len) for cuDNN's masked kernel. A query with no key to attend (a
    packed row's padding) attends to every key instead, where cuDNN's backward gave NaN for it (bfloat16, H200);
    no text's token attends to padding, so nothing reads its output. Appended queries attend to every key too;
    appended keys to none."""
    q, t = mask.shape[2:]
    mask = mask | ~mask.any(axis=-1, keepdims=True)
    mask = jnp.pad(mask, ((0, 0), (0, 0), (0, q_len - q), (0, 0)), constant_values=True)
    return jnp.pad(mask, ((0, 0), (0, 0), (0, 0), (0, k_len - t)))


def _pad_to_even(x: jax.Array) -> jax.Array:
    """(B, L, N, H) -> (B, L + L % 2, N, H), zeros appended."""
    return jnp.pad(x, ((0, 0), (0, x.shape[1] % 2), (0, 0), (0, 0)))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def mixed_einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """jnp.einsum(spec, a, b) of two operands of one dtype, accumulated in and returned as float32. As in
    layers.mixed_matmul, its backward rounds the cotangent to their dtype first, so that in bf16 both backward
    products run in bf16 too: automatic differentiation would multiply the float32 cotangent by an operand cast up
    to float32. In float32 it is the plain einsum, forward and backward."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _mixed_einsum_fwd(spec, a, b):
    return mixed_einsum(spec, a, b), (a, b)


def _mixed_einsum_bwd(spec, res, g):
    a, b = res
    _, vjp = jax.vjp(lambda a, b: jnp.einsum(spec, a, b, preferred_element_type=a.dtype), a, b)
    return vjp(g.astype(a.dtype))


mixed_einsum.defvjp(_mixed_einsum_fwd, _mixed_einsum_bwd)


def explicit_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    dropout: nnx.Dropout | None = None,
    key: jax.Array | None = None,
    window: int | None = None,
) -> jax.Array:
    """The formula written out, with `dropout` (keyed by `key`) on the probabilities when given.

    No fused kernel has dropout on the probabilities, so attention dropout costs the fused kernel: this path
    materialises the (B, N, Q, T) probabilities and is differentiated automatically.
    """
    scale = q.shape[-1] ** -0.5
    if window is not None:
        mask = mask & band(q.shape[1], k.shape[1], window)  # (B, 1, Q, T)
    logits = mixed_einsum("bqnh,btnh->bnqt", q, k) * scale  # (B, N, Q, T) float32
    probs = jax.nn.softmax(jnp.where(mask, logits, MASK_VALUE), axis=-1)
    if rate := _dropout_rate(dropout, key):
        probs = dropped(probs, keep_mask(key, rate, probs.shape), rate)
    return jnp.einsum("bnqt,btnh->bqnh", probs.astype(v.dtype), v)  # (B, Q, N, H)


def pallas_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    dropout: nnx.Dropout | None = None,
    key: jax.Array | None = None,
    window: int | None = None,
) -> jax.Array:
    """flash_attention's fused kernels, with `dropout`'s rate on the probabilities when a `key` is given: the masks
    custom and explicit draw for that key. Lengths or a head size the kernels do not take (a layer that computes
    its first token only, say) go to explicit_attention."""
    if not fits(q.shape[1], k.shape[1], q.shape[-1]):
        return explicit_attention(q, k, v, mask, dropout, key, window)
    rate = _dropout_rate(dropout, key)

    def on_device(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, starts: tuple) -> jax.Array:
        # Each device's rows and heads (several devices: XLA cannot split a Pallas call), drawing the whole batch's
        # dropout masks from its first row and head.
        return flash_attention(q, k, v, mask, key if rate else None, rate, window, first=(starts[0], starts[2]))

    axes = (QKV_AXES, QKV_AXES, QKV_AXES, ("batch", None, None, None))
    return per_device(on_device, (q, k, v, mask), axes, starts=True)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, window: int | None = None) -> jax.Array:
    """The splash kernel on a TPU; lengths it does not take (a layer that computes its first token only, a row
    that is not whole blocks of 128) go to xla_attention."""
    if not splash_fits(q.shape[1], k.shape[1]):
        return xla_attention(q, k, v, mask, window=window)
    return splash_kernel(q, k, v, mask, window=window)


IMPLEMENTATIONS: dict[str, Callable[..., jax.Array]] = {
    "custom": custom_attention,
    "xla": xla_attention,
    "cudnn": cudnn_attention,
    "explicit": explicit_attention,
    "pallas": pallas_attention,
    "splash": splash_attention,
}
WITH_DROPOUT = ("custom", "explicit", "pallas")


def cudnn_takes(dtype: str, head_dim: int, max_head_dim: int = 256) -> bool:
    """Whether cuDNN's fused attention runs this compute dtype and head size (at most 256 from Hopper on, 128
    before; a multiple of 8)."""
    return dtype in HALF_DTYPES and head_dim % 8 == 0 and head_dim <= max_head_dim


def unavailable(requested: str, platform: str) -> str:
    """Why the implementation `requested` cannot run on `platform` (jax.default_backend()); '' when it can."""
    if requested in ("cudnn", "pallas") and platform != "gpu":
        return f"attention {requested!r} needs an NVIDIA GPU; this program runs on {platform}"
    if requested == "splash" and platform != "tpu":
        return f"attention 'splash' needs a TPU; this program runs on {platform}"
    return ""


def choose_attention(
    requested: str, platform: str, dropout: bool, dtype: str = "bfloat16", head_dim: int | None = None
) -> str:
    """The implementation to run: `requested` (one of ATTENTIONS) on `platform` (jax.default_backend()), with
    attention dropout active or not, in compute `dtype`, with heads of `head_dim` (None: any cuDNN takes).

    Only `custom`, `explicit` and `pallas` have attention dropout: with it, `custom` and `pallas` are kept when
    asked for, `auto` takes `custom` on a CPU and `pallas` on a GPU in a half dtype (faster than `explicit` there,
    docs/gpu.md; float32 is not measured), and anything else becomes `explicit`, at the cost of a fused kernel.
    `cudnn` and `pallas` need an NVIDIA GPU, `splash` a TPU. Without dropout a named implementation is kept, and
    `auto` takes `custom` on a CPU (its hand-written backward is the fastest there), `cudnn` on a GPU (`xla` where
    cuDNN does not run: float32, or a head size every GPU generation does not take) and `xla` on a TPU (`splash`
    is not yet measured on one).
    """
    if requested not in ATTENTIONS:
        raise ValueError(f"attention {requested!r} is not one of {', '.join(ATTENTIONS)}")
    if why := unavailable(requested, platform):
        raise ValueError(why)
    if dropout:
        if requested in ("custom", "pallas"):
            return requested
        if requested == "auto" and platform == "cpu":
            return "custom"
        if requested == "auto" and platform == "gpu" and dtype in HALF_DTYPES:
            return "pallas"
        return "explicit"
    if requested != "auto":
        return requested
    if platform == "gpu":
        return "cudnn" if cudnn_takes(dtype, 8 if head_dim is None else head_dim, max_head_dim=128) else "xla"
    if platform == "tpu":
        return "xla"
    return "custom"


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    requested: str = "auto",
    dtype: str = "float32",
    dropout: nnx.Dropout | None = None,
    key: jax.Array | None = None,
    window: int | None = None,
    prefix: bool = True,
) -> jax.Array:
    """Attention by the implementation choose_attention picks for this platform; `key` is the attention dropout
    key, None where dropout is inactive; `window` the local window's half-width (None: global attention). `prefix`:
    each row's valid keys are its first ones (padding at its end), so cuDNN may take them as a length; not so for
    the first tokens of packed texts, whose keys are their own text's span of the row. Shapes as in the module
    docstring."""
    name = choose_attention(requested, jax.default_backend(), key is not None, dtype, q.shape[-1])
    # Projections come out in float32 (their products accumulate in it); the products here run in the compute
    # dtype, whichever implementation runs them (each keeps its logits and softmax in float32).
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    if name in WITH_DROPOUT:
        return IMPLEMENTATIONS[name](q, k, v, mask, dropout, key, window=window)
    if name == "cudnn" and (mask.shape[2] > 1 or not prefix):
        # A mask per query (packed rows), or keys that are not a row's first: cudnn_attention describes padding by
        # row lengths only.
        return cudnn_masked_attention(q, k, v, mask, window=window)
    return IMPLEMENTATIONS[name](q, k, v, mask, window=window)
