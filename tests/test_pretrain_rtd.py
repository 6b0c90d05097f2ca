"""Replaced-token detection: the discriminator learns, a step's gradients are those of a plain reference,
gradient-disentangled sharing keeps the detection loss out of the generator's table, 8 devices equal 1, and the
exported discriminator is ElectraForPreTraining."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_pretrain import config, losses

from bertforge.cli import main as cli
from bertforge.data.masking import IGNORE, MaskingSpec, mask_tokens
from bertforge.model.config import preset
from bertforge.model.load import load_model, load_run
from bertforge.model.rtd import RtdConfig, build_pair, discriminator_alone, generator_config
from bertforge.tasks import pretrain
from bertforge.train import rtd_step
from bertforge.train.metrics_log import read_metrics
from bertforge.train.step import StepConfig

ELECTRA = {"preset": "test", "family": "electra", "embedding_size": 16, "hidden_dropout": 0.0,
           "attention_dropout": 0.0}  # fmt: skip


def rtd_config(shards, **sections):
    model = {**ELECTRA, **sections.pop("model", {})}
    rtd = {"generator_width": 0.5, **sections.pop("rtd", {})}
    cfg = config(shards, model=model, **sections)
    return dataclasses.replace(cfg, objective="rtd", rtd=RtdConfig(**rtd))


# A long run: the objective's gradients are checked in CI by the tests below; learning is the slow set's.
@pytest.mark.slow
def test_the_discriminator_learns_and_exports_as_electra_for_pretraining(shards, tmp_path, capsys):
    cfg = rtd_config(shards, train={"max_steps": 60}, eval={"every": 20}, checkpoint={"every": 20})
    pretrain.main(cfg, str(tmp_path / "run"))
    train = {m["step"]: m for m in read_metrics(tmp_path / "run") if "disc_loss" in m}
    late = [train[s] for s in range(51, 61)]
    assert np.mean([m["disc_loss"] for m in late]) < train[1]["disc_loss"] - 0.2
    assert np.mean([m["gen_loss"] for m in late]) < train[1]["gen_loss"] - 1.0
    valid = [m for m in read_metrics(tmp_path / "run") if "valid_disc_accuracy" in m][-1]
    # Calling every token original is right on 1 - replaced of them: the discriminator must do better.
    assert valid["valid_disc_accuracy"] > 1 - valid["valid_replaced"] + 0.02
    assert valid["valid_disc_auc"] > 0.6

    assert cli(["export", str(tmp_path / "run"), "--out", str(tmp_path / "disc")]) == 0
    assert cli(["export", str(tmp_path / "run"), "--part", "generator", "--out", str(tmp_path / "gen")]) == 0
    import torch
    from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification, ElectraForPreTraining

    ids = np.asarray(jax.random.randint(jax.random.key(3), (3, 20), 5, 700))
    mask = np.ones_like(ids)
    mask[1, 12:] = 0
    ours = load_run(tmp_path / "run").model
    assert ours.task == "rtd"
    with torch.no_grad():
        theirs = ElectraForPreTraining.from_pretrained(tmp_path / "disc").eval()
        logits = theirs(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(ids, mask))[mask == 1], logits[mask == 1], atol=1e-4)

    generator = load_run(tmp_path / "run", part="generator").model
    with torch.no_grad():
        hf = AutoModelForMaskedLM.from_pretrained(tmp_path / "gen").eval()
        mlm = hf(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    np.testing.assert_allclose(np.asarray(generator(ids, mask))[mask == 1], mlm[mask == 1], atol=1e-4)
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "disc", num_labels=3).num_labels == 3

    # Fine-tuning a run takes its discriminator's encoder; fill-mask its generator.
    seq = load_model(tmp_path / "run", head="sequence", num_labels=2).model
    np.testing.assert_array_equal(
        nnx.to_pure_dict(nnx.state(seq.encoder, nnx.Param))["embeddings"]["word"]["embedding"],
        nnx.to_pure_dict(nnx.state(ours.encoder, nnx.Param))["embeddings"]["word"]["embedding"],
    )
    capsys.readouterr()
    assert cli(["fill-mask", "--model", str(tmp_path / "run"), "--json", "the [MASK] city"]) == 0
    assert cli(["plot", str(tmp_path / "run")]) == 0 and (tmp_path / "run" / "curves.png").stat().st_size > 0


# ------------------------------------------------------------------------------------------------------ the step
SPECIAL = (0, 1, 2, 3, 4)  # pad, unk, cls, sep, mask
SPEC = MaskingSpec(mask_id=4, vocab_size=100, special_ids=SPECIAL, rate=0.3)


def batch(b: int = 4, t: int = 16) -> jax.Array:
    ids = np.array(jax.random.randint(jax.random.key(11), (b, t), 5, 100))
    ids[:, 0], ids[:, -1] = 2, 3
    ids[1, 9:] = 0  # padding
    ids[1, 8] = 3
    return jnp.asarray(ids)


def small_pair(sharing: str, family: str = "electra"):
    cfg = preset("test", family=family, vocab_size=100, hidden_dropout=0.0, attention_dropout=0.0)
    if family == "electra":
        cfg = dataclasses.replace(cfg, embedding_size=16)
    return build_pair(cfg, RtdConfig(generator_width=0.5, sharing=sharing), seed=1)


def step_config(grad_accum: int = 1, groups: int = 1) -> rtd_step.RtdStepConfig:
    mlm = StepConfig(masking=SPEC, pad_id=0, grad_accum=grad_accum, groups=groups, capacity=64)
    return rtd_step.RtdStepConfig(mlm, disc_weight=50.0)


def bce(x: jax.Array, y: jax.Array) -> jax.Array:
    """Binary cross-entropy of logit x against y in {0, 1}: log(1 + e^x) - x y, written stably."""
    return jnp.maximum(x, 0) - x * y + jnp.log1p(jnp.exp(-jnp.abs(x)))


def reference_loss(graphdef, rest, params, ids, key, step: int):
    """The objective written out over the whole batch: the generator's logits at every token, a draw at every
    token kept only where a token was masked, the detection loss over every token that is not padding."""
    batch_key, _ = jax.random.split(jax.random.fold_in(key, step))
    mask_key, sample_key = jax.random.split(batch_key)
    inputs, labels = mask_tokens(mask_key, ids, SPEC)
    u = jax.random.uniform(sample_key, ids.shape)
    model = nnx.merge(graphdef, params, rest)
    real = ids != 0
    gen_logits = model.generator(inputs, real.astype(jnp.int32))  # (B, T, V)
    masked = labels != IGNORE
    log_p = jax.nn.log_softmax(gen_logits, axis=-1)
    nll = -jnp.take_along_axis(log_p, jnp.where(masked, labels, 0)[..., None], axis=-1)[..., 0]
    gen_loss = jnp.sum(nll * masked) / jnp.sum(masked)
    drawn = rtd_step.sample_tokens(jax.lax.stop_gradient(gen_logits), u, 1.0, SPECIAL)
    corrupted = jnp.where(masked, drawn, ids)
    disc_logits = model.discriminator(corrupted, real.astype(jnp.int32))
    replaced = (corrupted != ids).astype(jnp.float32)
    disc_loss = jnp.sum(bce(disc_logits, replaced) * real) / jnp.sum(real)
    return gen_loss + 50.0 * disc_loss


@pytest.mark.parametrize(
    "sharing", [pytest.param(s, marks=pytest.mark.slow) if s != "gdes" else s for s in ("electra", "gdes", "none")]
)  # electra and none: `make slow`
def test_a_step_has_the_gradients_of_the_objective_written_out(sharing):
    pair = small_pair(sharing)
    graphdef, params, rest = nnx.split(pair, nnx.Param, ...)
    ids, key = batch(), jax.random.key(5)
    reference = jax.jit(functools.partial(reference_loss, graphdef, rest, step=3))
    expected = jax.jit(jax.grad(reference))(params, ids, key)
    # Two micro-batches of two row groups each: the same gradients as the batch at once.
    step = jax.jit(functools.partial(rtd_step.gradients, graphdef, rest, cfg=step_config(2, 2)))
    got, loss, sums = step(params, jnp.int32(3), ids, key)
    assert float(loss) == pytest.approx(float(reference(params, ids, key)), rel=1e-5)
    assert 0 < float(sums[6]) <= float(sums[2])  # some tokens were replaced, never more than were masked
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def detection_gradients(pair):
    """The gradients of the detection loss alone, as a pure dict of the pair's parameters."""
    graphdef, params, rest = nnx.split(pair, nnx.Param, ...)
    cfg = step_config()
    ids = batch()
    inputs, labels, original, u = (x[0] for x in rtd_step._corrupted_batch(jax.random.key(2), ids, cfg))

    def detection(params):
        sums, _ = rtd_step.rtd_sums(nnx.merge(graphdef, params, rest), inputs, labels, original, u, cfg)
        return sums[3]

    return nnx.to_pure_dict(jax.grad(detection)(params))


@pytest.mark.slow  # `make slow`; the fast suite keeps the objective's gradients written out
def test_gradient_disentangled_sharing_keeps_the_detection_loss_out_of_the_generator_table():
    grads = detection_gradients(small_pair("gdes"))
    words = grads["discriminator"]["encoder"]["embeddings"]["word"]
    assert not np.any(np.asarray(words["shared"]["embedding"]))  # exactly zero
    assert np.any(np.asarray(words["delta"]))
    # Nothing of the generator learns from the detection loss: the draw passes no gradient.
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grads["generator"]))
    # With ELECTRA's sharing the one table learns from both losses.
    electra = detection_gradients(small_pair("electra"))["discriminator"]["encoder"]["embeddings"]["word"]
    assert np.any(np.asarray(electra["embedding"]))


def test_the_discriminator_alone_computes_what_it_computed_in_the_pair():
    pair = small_pair("gdes")
    state = nnx.state(pair, nnx.Param)
    words = state["discriminator"]["encoder"]["embeddings"]["word"]
    words["delta"].set_value(jax.random.normal(jax.random.key(4), words["delta"].get_value().shape))
    nnx.update(pair, state)
    ids = batch()
    alone = discriminator_alone(pair)
    np.testing.assert_allclose(alone(ids, ids != 0), pair.discriminator(ids, ids != 0), atol=1e-6)


def test_draws_are_inverse_transform_samples_of_the_softmax():
    logits = jax.random.normal(jax.random.key(0), (4000, 700)) * 3
    u = jax.random.uniform(jax.random.key(1), (4000,))
    got = np.asarray(rtd_step.sample_tokens(logits, u, 1.0, SPECIAL, block=64))
    p = np.exp(np.asarray(logits, np.float64))
    p[:, SPECIAL] = 0
    cdf = np.cumsum(p / p.sum(axis=1, keepdims=True), axis=1)
    t = np.asarray(u, np.float64)
    # The first id whose cumulative probability exceeds u, to float32's rounding of the sums.
    below = np.where(got > 0, cdf[np.arange(len(got)), np.maximum(got - 1, 0)], 0.0)
    assert np.all(below <= t + 1e-5) and np.all(cdf[np.arange(len(got)), got] >= t - 1e-5)
    assert not np.isin(got, SPECIAL).any()
    # At temperature 4 the draws spread out: more distinct ids than at temperature 1.
    hot = np.asarray(rtd_step.sample_tokens(logits[:1].repeat(4000, 0), u, 4.0))
    cold = np.asarray(rtd_step.sample_tokens(logits[:1].repeat(4000, 0), u, 1.0))
    assert len(set(hot)) > len(set(cold))


def test_the_generator_is_the_configured_share_of_the_discriminator():
    disc = preset("mini", family="electra", embedding_size=128)
    gen = generator_config(disc, RtdConfig(generator_width=0.25))
    assert (gen.hidden_size, gen.num_heads, gen.intermediate_size, gen.num_layers) == (64, 1, 256, 4)
    assert gen.embed_dim == 128  # as wide as the discriminator's table, which it shares
    deep = generator_config(preset("mini", family="deberta-v2"), RtdConfig(generator_width=1.0, generator_depth=0.5))
    assert (deep.hidden_size, deep.num_layers) == (256, 2)


# ------------------------------------------------------------------------------------------------------ devices
@pytest.mark.slow  # `make slow`; test_pretrain.py checks 8 devices against 1 for masked LM
def test_eight_devices_with_fsdp_give_the_run_of_one(shards, tmp_path):
    dropout = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
    one = rtd_config(shards, model=dropout, mesh={"num_devices": 1}, train={"max_steps": 10})
    mesh = {"data": 2, "fsdp": 4}  # parameters and moments split 4 ways too
    eight = rtd_config(shards, model=dropout, mesh=mesh, train={"max_steps": 10}, rtd={"sharing": "gdes"})
    one = dataclasses.replace(one, rtd=eight.rtd)
    pretrain.main(one, str(tmp_path / "one"))
    pretrain.main(eight, str(tmp_path / "eight"))
    # The parts agree to 1e-5; the combined loss, gen_loss + disc_weight x disc_loss, to what that carries over.
    atol = {"loss": 1e-5 * (1 + eight.rtd.disc_weight)}
    for key in ("loss", "disc_loss", "gen_loss", "valid_disc_auc"):
        a, b = losses(tmp_path / "one", key), losses(tmp_path / "eight", key)
        assert sorted(a) == sorted(b) and a
        np.testing.assert_allclose([b[s] for s in a], [a[s] for s in a], rtol=0, atol=atol.get(key, 1e-5), err_msg=key)
    for part in ("discriminator", "generator"):
        x, y = (nnx.state(load_run(tmp_path / r, part=part).model, nnx.Param) for r in ("one", "eight"))
        for p, q in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
            np.testing.assert_allclose(q, p, atol=1e-5)


@pytest.mark.parametrize("family", ["deberta-v2", "modernbert"])
def test_other_discriminators_export_as_their_bare_encoder(family, tmp_path):
    from transformers import AutoModel

    from bertforge.model.hf import save_pretrained

    cfg = preset("test", family=family, vocab_size=100, hidden_dropout=0.0, attention_dropout=0.0)
    if family == "modernbert":
        cfg = dataclasses.replace(cfg, intermediate_size=48, local_attention=8, global_attn_every_n_layers=2)
    pair = build_pair(cfg, RtdConfig(generator_width=1.0, generator_depth=0.5, sharing="gdes"), seed=2)
    state = nnx.state(pair, nnx.Param)
    words = state["discriminator"]["encoder"]["embeddings"]["word"]
    words["delta"].set_value(jax.random.normal(jax.random.key(4), words["delta"].get_value().shape) * 0.02)
    nnx.update(pair, state)
    alone = discriminator_alone(pair)
    save_pretrained(alone, tmp_path / "disc")
    import torch

    ids = np.array(batch())
    mask = (ids != 0).astype(np.int64)
    with torch.no_grad():
        theirs = AutoModel.from_pretrained(tmp_path / "disc").eval()
        assert type(theirs).__name__ == {"deberta-v2": "DebertaV2Model", "modernbert": "ModernBertModel"}[family]
        hidden = theirs(torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
    ours = np.asarray(pair.discriminator.encoder(jnp.asarray(ids), jnp.asarray(mask)))
    np.testing.assert_allclose(ours[mask == 1], hidden[mask == 1], atol=1e-4)
