"""Attention on a TPU by jax's splash kernel (jax.experimental.pallas.ops.tpu.splash_attention): blockwise, so the
(B, N, Q, T) probabilities are never stored, and the blocks a local window never reaches are skipped.

Padding and rows that pack several texts reach the kernel as segment ids (a query attends to the keys of its own
segment), derived from attention's mask; ModernBERT's local window is the kernel's static mask. The kernel has no
dropout on the probabilities and computes every query of a row, so attention.py sends attention dropout, a layer
that computes its first token only, and lengths that are not whole blocks of 128 elsewhere. Away from a TPU it runs
in Pallas's TPU interpreter, which is what the tests compare with the formula. XLA cannot split a Pallas call over
devices (it would gather the operands), so in a run of several devices each device runs the kernel on its own rows
and heads (runtime/devices.py's per_device).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from bertforge.runtime.devices import per_device

LANES = 128  # a block of queries or keys is a multiple of the TPU's 128 lanes
BLOCKS = (512, 256, LANES)  # the largest that divides the length is taken
QKV_AXES = ("batch", "length", "heads", None)  # the logical axes of q, k and v (B, T, N, H) that per_device splits


def fits(q_len: int, t_len: int) -> bool:
    """Whether the kernel takes these lengths: every query of the row, in whole blocks."""
    return q_len == t_len and t_len % LANES == 0


def segment_ids(mask: jax.Array) -> jax.Array:
    """attention's mask -> (B, T) int32 segment ids: of padding (B, 1, 1, T), 1 for a token and 0 for padding; of
    packed rows (B, 1, T, T), the first key each token may attend (its text's first token), and -1 for padding.
    Padding then attends padding, where the formula's padding queries see no key: outputs no loss reads."""
    if mask.shape[2] == 1:
        return mask[:, 0, 0, :].astype(jnp.int32)
    rows = mask[:, 0]  # (B, T, T)
    return jnp.where(rows.any(-1), jnp.argmax(rows, axis=-1), -1).astype(jnp.int32)


def _modules() -> tuple[Any, Any]:
    """jax's splash kernel and mask modules, imported at first use: every command imports this module, and only a
    run on the kernel needs them (50 ms)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernels
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    return kernels, masks


@functools.cache
def _kernel(length: int, heads: int, window: int | None, interpret: bool) -> Any:
    """The kernel of rows of `length` tokens with `heads` heads, global or local to `window`."""
    kernels, masks = _modules()
    shape = (length, length)
    one = masks.FullMask(shape) if window is None else masks.LocalMask(shape, (window, window), offset=0)
    b = next(b for b in BLOCKS if length % b == 0)
    sizes = kernels.BlockSizes(
        block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b, block_kv_dkv_compute=b,
        block_q_dq=b, block_kv_dq=b,
    )  # fmt: skip
    multi = masks.MultiHeadMask([one] * heads)
    # Built as concrete arrays even when first asked for inside a trace: the kernel is kept for every program.
    with jax.ensure_compile_time_eval():
        return kernels.make_splash_mha(multi, head_shards=1, q_seq_shards=1, block_sizes=sizes, interpret=interpret)


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    window: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """q, k, v (B, T, N, H), mask (B, 1, 1, T) or (B, 1, T, T) -> (B, T, N, H): softmax(q k^T / sqrt(H)) v within
    each query's segment (and `window`), by the splash kernel; fits(Q, T) must hold. `interpret`: in Pallas's
    TPU interpreter (None: where this process has no TPU)."""
    h = k.shape[-1]
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    scaled = (q.astype(jnp.float32) * h**-0.5).astype(q.dtype)  # the kernel does not scale its logits

    def on_device(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array) -> jax.Array:
        # Each device's rows and heads: (b, t, n, h), its own kernel for its n heads.
        kernel = _kernel(k.shape[1], k.shape[2], window, interpret)
        heads_first = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731  (b, n, t, h)

        def one_row(q: jax.Array, k: jax.Array, v: jax.Array, s: jax.Array) -> jax.Array:
            return kernel(q, k, v, segment_ids=_modules()[0].SegmentIds(q=s, kv=s))

        out = jax.vmap(one_row)(heads_first(q), heads_first(k), heads_first(v), segments)  # (b, n, t, h)
        return out.transpose(0, 2, 1, 3)

    axes = (QKV_AXES, QKV_AXES, QKV_AXES, ("batch", "length"))
    out = per_device(on_device, (scaled, k, v, segment_ids(mask)), axes)
    return out.astype(q.dtype)
