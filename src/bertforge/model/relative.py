"""DeBERTa's relative positions (deberta.py): the log buckets distances fall into, the rows of the relative table a
sequence of T tokens reads, and the content-to-position and position-to-content scores from them, as transformers'
DebertaV2* classes compute them.
Shapes: B batch, T tokens, N heads, H head dim, R relative rows read.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bertforge.model.config import ModelConfig

Array = jax.Array


def relative_reach(cfg: ModelConfig) -> tuple[int, int]:
    """(S, the farthest distance told apart): the relative table has 2S rows, for (bucketed) distances -S..S-1."""
    reach = cfg.max_relative_positions if cfg.max_relative_positions >= 1 else cfg.max_position_embeddings
    return (cfg.position_buckets if cfg.position_buckets > 0 else reach), reach


def log_buckets(rel: np.ndarray, buckets: int, max_position: int) -> np.ndarray:
    """Distances -> buckets: exact up to buckets/2, logarithmic beyond, reaching buckets - 1 at max_position. In
    float32, operation for operation as transformers computes it, so that every distance lands in its bucket."""
    mid, f32 = buckets // 2, np.float32
    far = np.where(np.abs(rel) < mid, mid - 1, np.abs(rel)).astype(f32)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_pos = np.ceil(np.log(far / f32(mid)) / np.log(f32((max_position - 1) / mid)) * f32(mid - 1)) + f32(mid)
    return np.where(far <= mid, rel, np.sign(rel) * log_pos).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class RelativePlan:
    """Where a sequence of T tokens reads the relative table: a function of T and the config, known when tracing."""

    lo: int  # rows lo..hi-1 of the table are the only ones read: R = hi - lo
    hi: int
    by_distance: np.ndarray  # (2T-1,) row - lo for the distance i - j = -(T-1)..T-1


@functools.lru_cache(maxsize=64)
def relative_plan(t: int, span: int, reach: int, buckets: int) -> RelativePlan:
    rel = np.arange(1 - t, t)  # i - j
    rows = np.clip((log_buckets(rel, buckets, reach) if buckets > 0 else rel) + span, 0, 2 * span - 1)
    lo, hi = int(rows.min()), int(rows.max()) + 1
    return RelativePlan(lo, hi, (rows - lo).astype(np.int32))


def _shift(x: jax.Array) -> jax.Array:
    """(..., T, 2T-1), column m of row i holding its column j = m - (T-1-i) -> (..., T, T), by pad and reshape."""
    *lead, t, _ = x.shape
    x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, 0), (0, 1)]).reshape(*lead, 2 * t * t)
    return x[..., t - 1 : t - 1 + t * (2 * t - 1)].reshape(*lead, t, 2 * t - 1)[..., :t]


def relative_scores(q: Array, k: Array, pos_q: Array | None, pos_k: Array | None, plan: RelativePlan) -> Array:
    """c2p + p2c, float32 (B, N, T, T), from q, k (B, T, N, H) and the keys pos_k (for c2p) and queries pos_q (for
    p2c) of the R table rows (R, N, H), None for a term left out; each pair (i, j) reads the row of i - j:
    c2p[i, j] = (q_i . pos_k)[row(i - j)], p2c[i, j] = (k_j . pos_q)[row(i - j)]. The shifted products stay in the
    compute dtype until they are read: half the bytes in bf16, as transformers under autocast."""
    # The tables are laid out by distance and the shift puts each distance at its (i, j): a gather of the R-wide
    # products is slower (its backward is a scatter-add, on a CPU a (B, N, T, T, R) one-hot).
    dt, out = q.dtype, jnp.zeros((), jnp.float32)
    if pos_k is not None:  # column m of row i is j = m - (T-1-i): distance T-1-m, the table reversed
        table = pos_k[plan.by_distance[::-1].copy()].astype(dt)  # (2T-1, N, H)
        out = out + _shift(jnp.einsum("bqnh,mnh->bnqm", q, table, preferred_element_type=dt)).astype(jnp.float32)
    if pos_q is not None:  # transposed: row j, column i = m - (T-1-j), distance m - (T-1)
        scores = jnp.einsum("bknh,mnh->bnkm", k, pos_q[plan.by_distance].astype(dt), preferred_element_type=dt)
        out = out + _shift(scores).swapaxes(-1, -2).astype(jnp.float32)
    return out
