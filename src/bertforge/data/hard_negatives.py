"""Hard negatives mined by an exact similarity search: for each query, the K passages of the corpus its embedding
model scores highest, less its own positives, its own text and the candidates that score too close to its positive
(likely false negatives), by sentence-transformers' `mine_hard_negatives` filters (NV-Retriever's): an absolute
margin removes a candidate whose score + margin exceeds the positive's; a relative margin one whose score exceeds the
positive's - |positive's| x margin; with several positives, the lowest-scored is the positive.

Scores are cosine similarities: unit vectors kept as a float16 matrix (a million passages of 768 values: 1.5 GB),
queries taken in blocks, each block split over the devices with the corpus on every one, its top K found on the
device, so that no (queries x corpus) matrix comes back to the host.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

NONE = -1  # an index of no passage (padding of a query's positives)


@dataclasses.dataclass(frozen=True)
class Margins:
    absolute: float | None = None  # a candidate must score at least this much below the positive
    relative: float | None = None  # ... at most the positive's score less this fraction of its magnitude


def unit(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length in float32 (a zero row stays zero)."""
    v = np.asarray(vectors, np.float32)
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)


def select(scores: jax.Array, positives: jax.Array, own: jax.Array, margins: Margins, k: int):
    """scores (Q, C), positives (Q, P) corpus indices (NONE pads), own (Q,) the index of the query's own text or
    NONE -> (the K best remaining candidates' scores (Q, K), -inf where fewer remain; their indices (Q, K); each
    query's positive score (Q,), the lowest of its positives')."""
    q, c = scores.shape
    rows = jnp.arange(q)[:, None]
    given = positives >= 0
    positive = jnp.min(jnp.where(given, scores[rows, jnp.maximum(positives, 0)], jnp.inf), axis=1)  # (Q,)
    out = jnp.where(given, positives, c)  # out of range: dropped
    scores = scores.at[rows, out].set(-jnp.inf, mode="drop")
    scores = scores.at[jnp.arange(q), jnp.where(own >= 0, own, c)].set(-jnp.inf, mode="drop")
    if margins.absolute is not None:
        scores = jnp.where(scores + margins.absolute > positive[:, None], -jnp.inf, scores)
    if margins.relative is not None:
        threshold = positive - jnp.abs(positive) * margins.relative
        scores = jnp.where(scores > threshold[:, None], -jnp.inf, scores)
    best, index = jax.lax.top_k(scores, k)
    return best, index, positive


@functools.partial(jax.jit, static_argnames=("margins", "k"))
def _block(queries: jax.Array, corpus: jax.Array, positives: jax.Array, own: jax.Array, margins: Margins, k: int):
    scores = jnp.dot(queries.astype(corpus.dtype), corpus.T, preferred_element_type=jnp.float32)  # (Qb, C)
    return select(scores, positives, own, margins, k)


def mine(
    queries: np.ndarray,
    corpus: np.ndarray,
    positives: Sequence[Sequence[int]],
    own: Sequence[int],
    k: int,
    margins: Margins = Margins(),
    block: int = 1024,
    dtype: str = "float16",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(negatives' indices (Q, K), NONE where fewer than K candidates remain; their scores (Q, K); each query's
    positive score (Q,)) for query vectors (Q, D) against corpus vectors (C, D), whose every query has at least one
    positive (indices into the corpus) and maybe its own text there (`own`, NONE if not)."""
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("data",))
    rows, whole = NamedSharding(mesh, PartitionSpec("data")), NamedSharding(mesh, PartitionSpec())
    k = min(k, len(corpus))
    block = max(len(devices), block // len(devices) * len(devices))
    corpus_on = jax.device_put(unit(corpus).astype(dtype), whole)
    width = max(len(p) for p in positives) if positives else 1
    given = np.full((len(queries), width), NONE, np.int32)
    for i, p in enumerate(positives):
        given[i, : len(p)] = p
    own_all, q_unit = np.asarray(own, np.int32), unit(queries)
    found: tuple[list, list, list] = ([], [], [])
    for start in range(0, len(queries), block):
        stop = min(start + block, len(queries))
        parts = [jax.device_put(_padded(a[start:stop], block, fill), rows)
                 for a, fill in ((q_unit, 0.0), (given, NONE), (own_all, NONE))]  # fmt: skip
        for out, part in zip(found, _block(parts[0], corpus_on, parts[1], parts[2], margins, k), strict=True):
            out.append(np.asarray(part)[: stop - start])
    best, index, positive = (np.concatenate(f) if f else np.zeros((0, k)) for f in found)
    index = np.where(np.isfinite(best), index, NONE).astype(np.int64)
    return index, best, positive


def _padded(a: np.ndarray, rows: int, fill: float) -> np.ndarray:
    """`a` with rows of `fill` up to `rows` (a block's last part)."""
    return np.concatenate([a, np.full((rows - len(a), *a.shape[1:]), fill, a.dtype)])
