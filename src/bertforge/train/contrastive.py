"""The losses that train embedding models, over a whole batch of embeddings: multiple-negatives ranking (in-batch
negatives, with hard negatives and a symmetric option), CoSENT for scored pairs, and distillation of a teacher's
scores of each anchor's candidates (MarginMSE, KL divergence), each optionally summed over Matryoshka sizes. Pure
functions of (B, N, D) embeddings, as sentence-transformers defines its losses of the same names.

A batch's rows are (anchor, positive, negative_1, ..., negative_{N-2}) texts, or a scored pair (N = 2). `real` (B,)
is 1 for a row of data and 0 for a filler row that pads the batch to its size: a filler row is no anchor, no
candidate and no pair. A distilled row carries the teacher's score of each of its N - 1 candidates.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from bertforge.model.heads import unit_length

NEG = -1e9  # the similarity given to a filler row's texts: finite, so that nothing becomes NaN


@dataclasses.dataclass(frozen=True)
class ContrastiveConfig:
    loss: str = "mnrl"  # mnrl (multiple-negatives ranking), cosent, margin_mse or kl
    scale: float = 20.0  # the cosine similarities' multiplier (sentence-transformers' default for both losses)
    symmetric: bool = False  # mnrl: also rank the anchors for each positive, and average the two
    matryoshka: tuple[int, ...] = ()  # the loss summed over the embeddings cut to each of these sizes
    temperature: float = 1.0  # kl: the student's and the teacher's scores are divided by it

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss {self.loss!r} is not one of {', '.join(LOSSES)}")
        if self.scale <= 0 or self.temperature <= 0 or any(d < 1 for d in self.matryoshka):
            raise ValueError("scale and temperature must be positive and matryoshka sizes at least 1")


def cosine_matrix(a: jax.Array, b: jax.Array) -> jax.Array:
    """(M, D), (K, D) -> (M, K) cosine similarities in float32."""
    return jnp.einsum("md,kd->mk", unit_length(a.astype(jnp.float32)), unit_length(b.astype(jnp.float32)))


def mnrl(
    emb: jax.Array, real: jax.Array, scale: float, symmetric: bool = False, positive: jax.Array | None = None
) -> jax.Array:
    """Multiple-negatives ranking: emb (B, N, D) -> (B,) per anchor, the cross-entropy of its own positive among
    every row's positive and hard negatives (scale x cosine); 0 for filler rows. Symmetric: averaged with the
    cross-entropy of the anchor among all anchors, for its positive. `positive` (B,): an id of each row's positive
    text; another row's positive with the same id (the same passage, found by several queries) is not counted as
    a negative, as sentence-transformers' no-duplicates batches avoid it."""
    b, n, d = emb.shape
    candidates = jnp.swapaxes(emb[:, 1:], 0, 1).reshape((n - 1) * b, d)  # positives, then each negative column
    scores = scale * cosine_matrix(emb[:, 0], candidates)  # (B, (N-1) B)
    open_ = jnp.tile(real > 0, n - 1)[None, :]  # (1, (N-1) B): a filler row's texts are no candidates
    labels = jnp.arange(b)
    if positive is not None:  # (B, B): another row's copy of the own positive is closed
        copy = (positive[:, None] == positive[None, :]) & (labels[:, None] != labels[None, :])
        open_ = open_ & jnp.concatenate([~copy, jnp.ones((b, (n - 2) * b), bool)], axis=1)
    forward = optax.softmax_cross_entropy_with_integer_labels(jnp.where(open_, scores, NEG), labels)
    if symmetric:
        backward = jnp.where(open_[:, :b].T & (real[:, None] > 0), scores[:, :b].T, NEG)  # each positive's anchors
        forward = (forward + optax.softmax_cross_entropy_with_integer_labels(backward, labels)) / 2
    return jnp.where(real > 0, forward, 0.0)


def cosent(emb: jax.Array, scores: jax.Array, real: jax.Array, scale: float) -> jax.Array:
    """CoSENT (Su 2022) of scored pairs emb (B, 2, D), scores (B,): log(1 + sum over pairs (i, j) of real rows with
    score_i < score_j of exp(scale (cos_i - cos_j))). One number for the batch, returned as (B,): that number for
    every real row (whose mean is the batch's loss), 0 for filler rows."""
    cos = scale * jnp.sum(unit_length(emb[:, 0].astype(jnp.float32)) * unit_length(emb[:, 1].astype(jnp.float32)), -1)
    both = (real[:, None] > 0) & (real[None, :] > 0)
    ordered = both & (scores[:, None] < scores[None, :])  # (B, B)
    diffs = jnp.where(ordered, cos[:, None] - cos[None, :], -jnp.inf).reshape(-1)
    total = jax.nn.logsumexp(jnp.concatenate([jnp.zeros(1), diffs]))
    return jnp.where(real > 0, total, 0.0)


def candidate_scores(emb: jax.Array) -> jax.Array:
    """(B, N, D) -> (B, N - 1): each anchor's dot product with its own candidates (sentence-transformers'
    pairwise_dot_score, the distillation losses' default; a cosine when the vectors are unit length)."""
    return jnp.einsum("bd,bkd->bk", emb[:, 0].astype(jnp.float32), emb[:, 1:].astype(jnp.float32))


def margin_mse(emb: jax.Array, teacher: jax.Array, real: jax.Array) -> jax.Array:
    """MarginMSE (Hofstaetter et al. 2020): (B,) per anchor, the mean over its negatives of the squared difference
    between the student's margin s(q, pos) - s(q, neg_k) and the teacher's; teacher (B, N - 1) holds the teacher's
    score of the positive, then of each negative."""
    student = candidate_scores(emb)
    margins = student[:, :1] - student[:, 1:]  # (B, N - 2)
    wanted = teacher[:, :1] - teacher[:, 1:]
    return jnp.where(real > 0, jnp.mean((margins - wanted) ** 2, axis=1), 0.0)


def distill_kl(emb: jax.Array, teacher: jax.Array, real: jax.Array, temperature: float) -> jax.Array:
    """KL divergence from the teacher's softmax over each anchor's candidates (its scores / temperature) to the
    student's, times temperature^2 (the gradient's scale at any temperature), (B,) per anchor."""
    student = jax.nn.log_softmax(candidate_scores(emb) / temperature, axis=1)
    target = jax.nn.log_softmax(teacher.astype(jnp.float32) / temperature, axis=1)
    kl = jnp.sum(jnp.exp(target) * (target - student), axis=1) * temperature**2
    return jnp.where(real > 0, kl, 0.0)


LOSSES = ("mnrl", "cosent", "margin_mse", "kl")
DISTILLED = ("margin_mse", "kl")  # the losses that learn from a teacher's scores (targets[:, 4:])


def batch_loss(cfg: ContrastiveConfig, emb: jax.Array, targets: jax.Array) -> jax.Array:
    """The batch's loss: per_row's mean over its real rows."""
    real = targets[:, 1] > 0
    return jnp.sum(per_row(cfg, emb, targets)) / jnp.maximum(jnp.sum(real), 1)


def per_row(cfg: ContrastiveConfig, emb: jax.Array, targets: jax.Array) -> jax.Array:
    """emb (B, N, D), targets (B, 2+): [score, real, row, positive's id, the teacher's score of each of the N - 1
    candidates (distillation)] -> (B,) losses, whose mean over the real rows is the batch's; summed over
    cfg.matryoshka's sizes when given (each the loss of the vectors' first d values, as sentence-transformers'
    MatryoshkaLoss with weights 1)."""
    scores, real = targets[:, 0], targets[:, 1]
    positive = targets[:, 3] if targets.shape[1] > 3 else None
    teacher = targets[:, 4 : 4 + emb.shape[1] - 1]

    def one(e: jax.Array) -> jax.Array:
        if cfg.loss == "cosent":
            return cosent(e, scores, real, cfg.scale)
        if cfg.loss == "margin_mse":
            return margin_mse(e, teacher, real)
        if cfg.loss == "kl":
            return distill_kl(e, teacher, real, cfg.temperature)
        return mnrl(e, real, cfg.scale, cfg.symmetric, positive)

    if not cfg.matryoshka:
        return one(emb)
    return sum(one(emb[..., :d]) for d in cfg.matryoshka)
