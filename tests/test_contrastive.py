"""The embedding losses against references: multiple-negatives ranking with hard negatives against a plain NumPy
version and, with its gradient, against sentence-transformers' own loss in torch; CoSENT and Matryoshka likewise;
the cached form (GradCache) against the direct gradients; 8 devices against 1 with the same global batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from sentence_transformers.sentence_transformer.losses import (
    CoSENTLoss,
    DistillKLDivLoss,
    MarginMSELoss,
    MultipleNegativesRankingLoss,
)

from bertforge.model.architectures import build
from bertforge.model.config import preset
from bertforge.train import contrastive
from bertforge.train.contrastive import ContrastiveConfig
from bertforge.train.embedding_step import contrastive_gradients


def numpy_mnrl(emb: np.ndarray, real: np.ndarray, scale: float, positive: np.ndarray | None = None) -> float:
    """The mean over real anchors of -log softmax(scale cos(anchor, candidates))[own positive], the candidates
    every real row's texts but its anchor, less other rows' copies of its positive (same id), written plainly."""
    rows = [i for i in range(len(emb)) if real[i]]
    positive = np.arange(len(emb)) if positive is None else positive
    unit = lambda v: v / np.linalg.norm(v)  # noqa: E731
    losses = []
    for i in rows:
        candidates = [(j, k) for k in range(1, emb.shape[1]) for j in rows
                      if not (k == 1 and j != i and positive[j] == positive[i])]  # fmt: skip
        logits = np.array([scale * unit(emb[i, 0]) @ unit(emb[j, k]) for j, k in candidates], np.float64)
        own = candidates.index((i, 1))
        losses.append(np.log(np.sum(np.exp(logits - logits.max()))) + logits.max() - logits[own])
    return float(np.mean(losses))


def embeddings(b: int, n: int, d: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(b, n, d)).astype(np.float32)


def targets_of(real: np.ndarray, scores: np.ndarray | None = None) -> np.ndarray:
    scores = np.ones(len(real)) if scores is None else scores
    return np.stack([scores, real, np.arange(len(real))], axis=1).astype(np.float32)


def test_multiple_negatives_ranking_with_hard_negatives_matches_numpy_and_ignores_filler_rows():
    emb = embeddings(6, 4, 8, seed=0)  # an anchor, its positive and two hard negatives per row
    real = np.array([1, 1, 1, 1, 0, 0], np.float32)  # two filler rows pad the batch
    cfg = ContrastiveConfig("mnrl", scale=20.0)
    got = float(contrastive.batch_loss(cfg, jnp.asarray(emb), jnp.asarray(targets_of(real))))
    assert got == pytest.approx(numpy_mnrl(emb, real, 20.0), abs=1e-5)
    # Filler rows change nothing, whatever their vectors hold.
    alone = float(contrastive.batch_loss(cfg, jnp.asarray(emb[:4]), jnp.asarray(targets_of(real[:4]))))
    assert got == pytest.approx(alone, abs=1e-6)


def test_a_passage_shared_by_several_anchors_is_no_negative_of_theirs():
    emb = embeddings(5, 3, 8, seed=6)
    positive = np.array([0, 1, 0, 3, 1], np.float32)  # rows 0 and 2 share a passage, rows 1 and 4 another
    emb[2, 1], emb[4, 1] = emb[0, 1], emb[1, 1]
    emb[:, 0] = emb[:, 1] + 0.1 * emb[:, 0]  # each anchor near its passage: its own score dominates
    targets = targets_of(np.ones(5))
    with_ids = np.concatenate([targets, positive[:, None]], axis=1)
    got = float(contrastive.batch_loss(ContrastiveConfig("mnrl"), jnp.asarray(emb), jnp.asarray(with_ids)))
    assert got == pytest.approx(numpy_mnrl(emb, np.ones(5), 20.0, positive), abs=1e-5)
    plain = float(contrastive.batch_loss(ContrastiveConfig("mnrl"), jnp.asarray(emb), jnp.asarray(targets)))
    assert plain > got + 0.5  # counted as negatives, the copies would halve each anchor's chance of its passage


@pytest.mark.parametrize("symmetric", [False, True])
def test_multiple_negatives_ranking_and_its_gradient_match_sentence_transformers(symmetric):
    emb = embeddings(8, 3, 16, seed=1)
    cfg = ContrastiveConfig("mnrl", scale=20.0, symmetric=symmetric)
    loss, grad = jax.value_and_grad(lambda e: contrastive.batch_loss(cfg, e, jnp.asarray(targets_of(np.ones(8)))))(
        jnp.asarray(emb)
    )
    options = {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"} if symmetric else {}
    reference = MultipleNegativesRankingLoss(model=None, scale=20.0, **options)
    columns = [torch.tensor(emb[:, k], requires_grad=True) for k in range(3)]
    ref = reference.compute_loss_from_embeddings(columns, torch.zeros(8))
    ref.backward()
    assert float(loss) == pytest.approx(float(ref), abs=1e-5)
    ref_grad = np.stack([c.grad.numpy() for c in columns], axis=1)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, atol=1e-5)


def test_cosent_and_its_gradient_match_sentence_transformers():
    emb = embeddings(10, 2, 16, seed=2)
    scores = np.array([0.0, 1, 2, 2, 3, 4, 5, 1.5, 0.5, 4], np.float32)  # with ties, which count no pair
    cfg = ContrastiveConfig("cosent", scale=20.0)
    loss, grad = jax.value_and_grad(lambda e: contrastive.batch_loss(cfg, e, jnp.asarray(targets_of(np.ones(10),
                                                                                                     scores))))(
        jnp.asarray(emb)
    )  # fmt: skip
    columns = [torch.tensor(emb[:, k], requires_grad=True) for k in range(2)]
    ref = CoSENTLoss(model=None, scale=20.0).compute_loss_from_embeddings(columns, torch.tensor(scores))
    ref.backward()
    assert float(loss) == pytest.approx(float(ref), abs=1e-5)
    np.testing.assert_allclose(np.asarray(grad), np.stack([c.grad.numpy() for c in columns], 1), atol=1e-5)


@pytest.mark.parametrize(("loss", "temperature"), [("margin_mse", 1.0), ("kl", 1.0), ("kl", 2.5)])
@pytest.mark.parametrize("negatives", [1, 3])
def test_distillation_losses_and_their_gradients_match_sentence_transformers(loss, temperature, negatives):
    n = 2 + negatives  # an anchor, its positive and its negatives
    emb = embeddings(8, n, 16, seed=7) * 0.3
    teacher = np.random.default_rng(8).normal(3.0, 2.0, size=(8, n - 1)).astype(np.float32)
    real = np.array([1, 1, 1, 1, 1, 1, 0, 0], np.float32)  # two filler rows: no anchors, no loss
    targets = np.concatenate([targets_of(real), np.arange(8)[:, None], teacher], axis=1).astype(np.float32)
    cfg = ContrastiveConfig(loss, temperature=temperature)
    value, grad = jax.value_and_grad(lambda e: contrastive.batch_loss(cfg, e, jnp.asarray(targets)))(jnp.asarray(emb))
    columns = [torch.tensor(emb[:6, k], requires_grad=True) for k in range(n)]
    if loss == "margin_mse":
        reference = MarginMSELoss(model=None)
    else:
        reference = DistillKLDivLoss(model=None, temperature=temperature)
    ref = reference.compute_loss_from_embeddings(columns, torch.tensor(teacher[:6]))
    ref.backward()
    assert float(value) == pytest.approx(float(ref), rel=1e-5, abs=1e-6)
    ref_grad = np.stack([c.grad.numpy() for c in columns], axis=1)
    np.testing.assert_allclose(np.asarray(grad)[:6], ref_grad, atol=1e-6, rtol=1e-5)
    assert not np.any(np.asarray(grad)[6:])  # a filler row's vectors get no gradient


@pytest.mark.parametrize("loss", ["mnrl", "cosent"])
def test_matryoshka_is_the_sum_over_the_cut_sizes(loss):
    emb = jnp.asarray(embeddings(6, 2, 32, seed=3))
    targets = jnp.asarray(targets_of(np.ones(6), np.arange(6, dtype=np.float32)))
    sizes = (32, 16, 8)
    summed = contrastive.batch_loss(ContrastiveConfig(loss, matryoshka=sizes), emb, targets)
    parts = [contrastive.batch_loss(ContrastiveConfig(loss), emb[..., :d], targets) for d in sizes]
    assert float(summed) == pytest.approx(float(sum(parts)), rel=1e-6)
    assert float(parts[0]) != pytest.approx(float(parts[2]), rel=1e-3)  # the sizes do differ


# ------------------------------------------------------------------------------------------------ the step
def tiny_embedder():
    cfg = preset("test", vocab_size=120, hidden_dropout=0.0, attention_dropout=0.0, pooling="mean")
    return nnx.split(build(cfg, "embedding", seed=0), nnx.Param, ...)


def pair_batch(b: int, n: int, t: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, t + 1, size=(b, n))
    mask = (np.arange(t)[None, None, :] < lengths[..., None]).astype(np.int32)
    ids = np.where(mask > 0, rng.integers(5, 120, size=(b, n, t)), 0).astype(np.int32)
    real = np.ones(b, np.float32)
    real[-1] = 0.0  # a filler row
    mask[-1] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids),
            "targets": targets_of(real), "weight": real}  # fmt: skip


def grads_of(batch: dict, accum: int, cfg: ContrastiveConfig, shard: bool) -> tuple[float, list[np.ndarray]]:
    graphdef, params, rest = tiny_embedder()
    fn = jax.jit(lambda p, b: contrastive_gradients(graphdef, rest, p, None, b, cfg, accum))
    if shard:  # the global batch split over 8 devices, the parameters on all of them
        mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
        batch = {k: jax.device_put(v, NamedSharding(mesh, PartitionSpec("data"))) for k, v in batch.items()}
        params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    else:
        batch = {k: jax.device_put(v, jax.devices()[0]) for k, v in batch.items()}
        params = jax.device_put(params, jax.devices()[0])
    grads, loss = fn(params, batch)
    found = [np.asarray(g) for g in jax.tree.leaves(grads)]
    assert all(np.all(np.isfinite(g)) for g in found)  # the filler row's zero vector included
    return float(loss), found


@pytest.mark.parametrize("loss", ["mnrl", "cosent"])
def test_cached_gradients_equal_the_direct_ones(loss):
    batch = pair_batch(16, 3 if loss == "mnrl" else 2, 12, seed=4)
    if loss == "cosent":
        batch["targets"][:, 0] = np.arange(16) % 5
    cfg = ContrastiveConfig(loss, symmetric=loss == "mnrl")
    direct_loss, direct = grads_of(batch, 1, cfg, shard=False)
    cached_loss, cached = grads_of(batch, 4, cfg, shard=False)
    assert cached_loss == pytest.approx(direct_loss, abs=1e-5)
    for a, b in zip(direct, cached, strict=True):
        # CoSENT's gradients reach |14| here, where float32's spacing is 1e-6 and the two paths sum in another order:
        # 1e-5 absolute, or a few ulp of the larger ones.
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-6)


def test_eight_devices_give_the_loss_and_gradients_of_one_with_negatives_from_every_device():
    batch = pair_batch(16, 3, 12, seed=5)
    cfg = ContrastiveConfig("mnrl")
    one_loss, one = grads_of(batch, 1, cfg, shard=False)
    for accum in (1, 2):  # directly, and cached in mini-batches of each device's rows
        loss, grads = grads_of(batch, accum, cfg, shard=True)
        assert loss == pytest.approx(one_loss, abs=1e-5)
        for a, b in zip(one, grads, strict=True):
            np.testing.assert_allclose(b, a, atol=1e-5)
    # Negatives from each device's own rows only would give another loss: the equality above is not a given.
    graphdef, params, rest = tiny_embedder()
    model = nnx.merge(graphdef, params, rest)
    emb = model(*(jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "token_type_ids")))
    targets = jnp.asarray(batch["targets"])
    per_device = [contrastive.per_row(cfg, emb[i : i + 2], targets[i : i + 2]) for i in range(0, 16, 2)]
    assert float(jnp.sum(jnp.concatenate(per_device)) / 15) != pytest.approx(one_loss, abs=1e-3)
