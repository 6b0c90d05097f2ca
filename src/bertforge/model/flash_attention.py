"""Fused attention for NVIDIA GPUs written in Pallas (Triton), with dropout on the probabilities.

cuDNN's fused attention, which jax calls, takes its dropout seed as a constant of the compiled program, so a
training step with attention dropout falls back to the written-out formula, which stores the (B, N, Q, T)
probabilities and their mask. These kernels never store them: the forward keeps a running maximum and sum per
query over blocks of keys (FlashAttention), and the backward recomputes each block's probabilities from the
saved row maxima and log-sums. The dropout mask is recomputed as well, in every kernel, from the same keyed hash of the
element's position that dropout.keep_mask draws, so the kernels drop exactly the probabilities the other
implementations drop for the same key, and their results are theirs up to rounding.

Shapes: q (B, Q, N, H), k and v (B, T, N, H), mask (B, 1, 1, T) or (B, 1, Q, T) bool, True where a key may be
attended. Blocks: a program takes BLOCK query (or key) positions of one row and one head.
On any platform but a GPU the kernels run in Pallas's interpreter (tests).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from bertforge.model.dropout import LEVELS, keep_threshold, mix
from bertforge.model.mask_value import MASK_VALUE

BLOCK = 64
BACKWARD_BLOCK = 32


def fits(q_len: int, t_len: int, head_dim: int) -> bool:
    """Whether the kernels take these lengths and head size: lengths in whole blocks of 16 or more, a head size
    that is a power of two from 16 (Triton's products need both)."""
    return all(n >= 16 and n % 16 == 0 for n in (q_len, t_len)) and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _block(length: int, most: int) -> int:
    """The largest power of two up to `most` that divides `length` (a multiple of 16)."""
    block = most
    while length % block:
        block //= 2
    return block


def _allowed(mask_ref, q0, k0, bq: int, bk: int, window: int | None) -> jax.Array:
    """(bq, bk) bool: where query q0 + i may attend key k0 + j (the mask's block, the window's band)."""
    rows = slice(None) if mask_ref.shape[0] == 1 else pl.ds(q0, bq)  # a (1, T) mask: every query alike
    ok = mask_ref[rows, pl.ds(k0, bk)] != 0  # (1 or bq, bk)
    if window is not None:
        dist = (q0 + jnp.arange(bq))[:, None] - (k0 + jnp.arange(bk))[None, :]
        ok = ok & (jnp.abs(dist) <= window)
    return jnp.broadcast_to(ok, (bq, bk))


def _keep(seed_ref, where, bq: int, bk: int, q_len: int, t_len: int, threshold: int) -> jax.Array:
    """(bq, bk) bool: dropout.keep_mask's draw for the elements (b, n, q0 + i, k0 + j) of the (B, N, Q, T)
    probabilities, where = (b, n, q0, k0): mix(mix(index ^ mix(b ^ s0)) + s1), index = (n Q + i) T + j; b and n
    counted from the seed's first row and head (s2, s3: a device's part of the whole batch)."""
    u32 = jnp.uint32
    b, n, q0, k0 = where
    b, n = b.astype(u32) + seed_ref[2], n.astype(u32) + seed_ref[3]
    rows = mix(b ^ seed_ref[0])
    qi = (q0 + jnp.arange(bq)).astype(u32)[:, None]
    kj = (k0 + jnp.arange(bk)).astype(u32)[None, :]
    index = (n * u32(q_len) + qi) * u32(t_len) + kj  # (bq, bk), wrapping as keep_mask's does
    draw = mix(mix(index ^ rows) + seed_ref[1]) >> 16
    return draw.astype(jnp.int32) < threshold


def _dropped(x: jax.Array, keep: jax.Array | None, rate: float) -> jax.Array:
    """dropout.dropped: x scaled by 1 / the keep probability where kept, 0 elsewhere."""
    if keep is None:
        return x
    return jnp.where(keep, x * (LEVELS / keep_threshold(rate)), 0.0)


def _dot(a: jax.Array, b: jax.Array, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """a @ b (either transposed) accumulated in float32; float32 operands multiply in float32, not TF32."""
    return plgpu.dot(a, b, trans_a, trans_b, allow_tf32=False if a.dtype == jnp.float32 else None)


def _scores(q, k, mask_ref, seed_ref, where, dims) -> tuple[jax.Array, jax.Array | None]:
    """A block's (bq, bk) float32 logits q k^T * scale, MASK_VALUE where a key may not be attended, and its dropout
    mask (None at rate 0); where = (b, n, q0, k0), dims = (scale, rate, window, Q, T)."""
    scale, rate, window, q_len, t_len = dims
    s = _dot(q, k, trans_b=True) * scale
    s = jnp.where(_allowed(mask_ref, where[2], where[3], q.shape[0], k.shape[0], window), s, MASK_VALUE)
    keep = _keep(seed_ref, where, q.shape[0], k.shape[0], q_len, t_len, keep_threshold(rate)) if rate else None
    return s, keep


def _probs(q, k, mask_ref, seed_ref, where, stats, dims) -> tuple[jax.Array, jax.Array | None]:
    """A block's (bq, bk) float32 probabilities from the forward's saved row maxima and log-sums (stats), and its
    dropout mask, as _scores takes its arguments."""
    top, log_total = stats
    s, keep = _scores(q, k, mask_ref, seed_ref, where, dims)
    # Not exp(s - lse): a row without a key to attend has top MASK_VALUE, and lse = top + log(sum) rounds back to it.
    return jnp.exp((s - top[:, None]) - log_total[:, None]), keep


def _logit_grads(p, keep, do, v, delta, dims) -> jax.Array:
    """The gradient of a block's scaled logits (bq, bk): p (dP - rowsum(dO * O)) * scale, dP through the dropout."""
    scale, rate = dims[:2]
    dp = _dropped(_dot(do, v, trans_b=True), keep, rate)
    return p * (dp - delta[:, None]) * scale


def _forward_kernel(q_ref, k_ref, v_ref, mask_ref, seed_ref, o_ref, top_ref, log_total_ref, *, dims, block_k):
    """One block of queries against every key, a block of keys at a time (a running maximum and sum per query):
    writes the output and each query's maximum logit and the log of its sum of exponentials."""
    rate, t_len = dims[1], dims[4]
    bq, h = q_ref.shape
    q0, b, n = pl.program_id(0) * bq, pl.program_id(1), pl.program_id(2)
    q = q_ref[...]

    def body(step, carry):
        acc, top, total = carry
        k0 = step * block_k
        k, v = k_ref[pl.ds(k0, block_k), :], v_ref[pl.ds(k0, block_k), :]
        s, keep = _scores(q, k, mask_ref, seed_ref, (b, n, q0, k0), dims)  # (bq, bk)
        new_top = jnp.maximum(top, s.max(axis=-1))
        fix = jnp.exp(top - new_top)
        p = jnp.exp(s - new_top[:, None])
        acc = acc * fix[:, None] + _dot(_dropped(p, keep, rate).astype(v.dtype), v)
        return acc, new_top, total * fix + p.sum(axis=-1)

    start = (jnp.zeros((bq, h), jnp.float32), jnp.full((bq,), MASK_VALUE, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, top, total = jax.lax.fori_loop(0, t_len // block_k, body, start)
    o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype)
    top_ref[...], log_total_ref[...] = top, jnp.log(total)


def _key_grads_kernel(q_ref, k_ref, v_ref, do_ref, top_ref, log_total_ref, delta_ref, mask_ref, seed_ref, dk_ref,
                      dv_ref, *, dims, block_q):  # fmt: skip
    """The gradients of one block of keys and values, over every query, a block of queries at a time."""
    rate, q_len = dims[1], dims[3]
    bk, h = k_ref.shape
    k0, b, n = pl.program_id(0) * bk, pl.program_id(1), pl.program_id(2)
    k, v = k_ref[...], v_ref[...]

    def body(step, carry):
        dk, dv = carry
        q0 = step * block_q
        rows = pl.ds(q0, block_q)
        q, do, stats = q_ref[rows, :], do_ref[rows, :], (top_ref[rows], log_total_ref[rows])
        p, keep = _probs(q, k, mask_ref, seed_ref, (b, n, q0, k0), stats, dims)  # (bq, bk)
        dv = dv + _dot(_dropped(p, keep, rate).astype(do.dtype), do, trans_a=True)
        ds = _logit_grads(p, keep, do, v, delta_ref[rows], dims)
        return dk + _dot(ds.astype(q.dtype), q, trans_a=True), dv

    zeros = jnp.zeros((bk, h), jnp.float32)
    dk, dv = jax.lax.fori_loop(0, q_len // block_q, body, (zeros, zeros))
    dk_ref[...], dv_ref[...] = dk.astype(dk_ref.dtype), dv.astype(dv_ref.dtype)


def _query_grads_kernel(q_ref, k_ref, v_ref, do_ref, top_ref, log_total_ref, delta_ref, mask_ref, seed_ref, dq_ref,
                        *, dims, block_k):  # fmt: skip
    """The gradient of one block of queries, over every key, a block of keys at a time."""
    t_len = dims[4]
    bq, h = q_ref.shape
    q0, b, n = pl.program_id(0) * bq, pl.program_id(1), pl.program_id(2)
    q, do, stats, delta = q_ref[...], do_ref[...], (top_ref[...], log_total_ref[...]), delta_ref[...]

    def body(step, dq):
        k0 = step * block_k
        k, v = k_ref[pl.ds(k0, block_k), :], v_ref[pl.ds(k0, block_k), :]
        p, keep = _probs(q, k, mask_ref, seed_ref, (b, n, q0, k0), stats, dims)
        ds = _logit_grads(p, keep, do, v, delta, dims)
        return dq + _dot(ds.astype(k.dtype), k)

    dq = jax.lax.fori_loop(0, t_len // block_k, body, jnp.zeros((bq, h), jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _tile(block: int, h: int) -> pl.BlockSpec:
    """A (B, L, N, H) array's block of `block` positions of one row and head (grid axis 0 counts blocks)."""
    return pl.BlockSpec((None, block, None, h), lambda i, b, n: (b, i, n, 0))


def _whole(length: int, h: int) -> pl.BlockSpec:
    """A (B, L, N, H) array's whole sequence of one row and head."""
    return pl.BlockSpec((None, length, None, h), lambda i, b, n: (b, 0, n, 0))


def _per_query(block: int, whole: bool = False) -> pl.BlockSpec:
    """A (B, N, Q) array's block of queries of one row and head, or its whole row."""
    if whole:
        return pl.BlockSpec((None, None, block), lambda i, b, n: (b, n, 0))
    return pl.BlockSpec((None, None, block), lambda i, b, n: (b, n, i))


def _shared(mask: jax.Array) -> list[pl.BlockSpec]:
    """The specs of the two inputs every kernel takes last: the row's (Qm, T) mask and the (4,) dropout seed."""
    return [pl.BlockSpec((None, *mask.shape[1:]), lambda i, b, n: (b, 0, 0)), pl.BlockSpec((4,), lambda i, b, n: (0,))]


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret: bool, name: str):
    params = plgpu.CompilerParams(num_warps=4, num_stages=2)
    return pl.pallas_call(
        kernel, out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs, compiler_params=params,
        interpret=interpret, name=name,
    )  # fmt: skip


def _forward(q, k, v, mask, seeds, dims, interpret):
    """(output, (row maxima, log-sums)) of the forward kernel."""
    (b, q_len, n, h), t_len = q.shape, k.shape[1]
    bq, bk = _block(q_len, BLOCK), _block(t_len, BLOCK)
    stat = jax.ShapeDtypeStruct((b, n, q_len), jnp.float32)
    specs = [_tile(bq, h), _whole(t_len, h), _whole(t_len, h), *_shared(mask)]
    out_specs = [_tile(bq, h), _per_query(bq), _per_query(bq)]
    kernel = partial(_forward_kernel, dims=dims, block_k=bk)
    shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype), stat, stat)
    out, top, log_total = _call(kernel, (q_len // bq, b, n), specs, out_specs, shapes, interpret, "flash_fwd")(
        q, k, v, mask, seeds
    )
    return out, (top, log_total)


def _backward(q, k, v, mask, seeds, out, stats, d_out, dims, interpret):
    """(dq, dk, dv): one kernel for the queries' gradient, one for the keys' and values'."""
    (b, q_len, n, h), t_len = q.shape, k.shape[1]
    bq, bk = _block(q_len, BACKWARD_BLOCK), _block(t_len, BACKWARD_BLOCK)
    d_out = d_out.astype(q.dtype)
    # rowsum(dO * O): the FlashAttention identity that stands for rowsum(dP * P), dropped probabilities included.
    delta = jnp.einsum("bqnh,bqnh->bnq", d_out.astype(jnp.float32), out.astype(jnp.float32))  # (B, N, Q)
    args = (q, k, v, d_out, *stats, delta, mask, seeds)
    specs = [_tile(bq, h), _whole(t_len, h), _whole(t_len, h), _tile(bq, h), *[_per_query(bq)] * 3, *_shared(mask)]
    kernel = partial(_query_grads_kernel, dims=dims, block_k=bk)
    shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    dq = _call(kernel, (q_len // bq, b, n), specs, _tile(bq, h), shape, interpret, "flash_dq")(*args)
    specs = [_whole(q_len, h), _tile(bk, h), _tile(bk, h), _whole(q_len, h), *[_per_query(q_len, True)] * 3]
    kernel = partial(_key_grads_kernel, dims=dims, block_q=bq)
    shapes = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
    out_specs = [_tile(bk, h), _tile(bk, h)]
    dk, dv = _call(kernel, (t_len // bk, b, n), [*specs, *_shared(mask)], out_specs, shapes, interpret, "flash_dkv")(
        *args
    )
    return dq, dk, dv


@partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _flash(q, k, v, mask, seeds, dims, interpret):
    return _forward(q, k, v, mask, seeds, dims, interpret)[0]


def _flash_fwd(q, k, v, mask, seeds, dims, interpret):
    out, stats = _forward(q, k, v, mask, seeds, dims, interpret)
    return out, (q, k, v, mask, seeds, out, stats)


def _flash_bwd(dims, interpret, residuals, d_out):
    q, k, v, mask, seeds, out, stats = residuals
    return (*_backward(q, k, v, mask, seeds, out, stats, d_out, dims, interpret), None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    key: jax.Array | None = None,
    rate: float = 0.0,
    window: int | None = None,
    interpret: bool | None = None,
    first: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """softmax(q k^T / sqrt(H), MASK_VALUE where `mask` is False or outside the `window`) v, with the probabilities
    dropped at `rate` by dropout.keep_mask's draw for `key` when one is given: attention.custom_attention's
    numbers. Lengths and head size as `fits` takes them. `interpret`: run in Pallas's interpreter (default: on
    any platform but a GPU). `first`: the row and head of the whole batch that q's first are (a device's part),
    so that the dropout draws are the whole batch's."""
    (b, q_len, _, h), t_len = q.shape, k.shape[1]
    if not fits(q_len, t_len, h):
        raise ValueError(
            f"flash attention takes lengths in blocks of 16 and heads of 16, 32, 64...: {q.shape}, {k.shape}"
        )
    rows = mask.shape[2]
    mask = jnp.broadcast_to(mask, (b, 1, rows, t_len)).reshape(b, rows, t_len).astype(jnp.int8)  # (B, Qm, T)
    rate = float(rate) if key is not None else 0.0
    seeds = jax.random.key_data(key).reshape(-1)[:2].astype(jnp.uint32) if rate else jnp.zeros((2,), jnp.uint32)
    seeds = jnp.concatenate([seeds, jnp.asarray((0, 0) if first is None else first).astype(jnp.uint32)])
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    return _flash(q, k, v, mask, seeds, (h**-0.5, rate, window, q_len, t_len), interpret)
