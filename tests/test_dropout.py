"""The dropout mask drawn from a keyed hash of each element's position: its keep rate, its independence across
positions, rows and keys, its scale, its keys, its sharding."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bertforge.model.dropout import LEVELS, Dropout, derive, keep_mask, keep_threshold, next_key


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_fraction_is_the_keep_probability(rate):
    shape = (8, 4, 63, 257)  # odd last dimension: half of its last word goes unused
    keep = np.asarray(keep_mask(jax.random.key(0), rate, shape))
    assert keep.shape == shape and keep.dtype == bool
    p = keep_threshold(rate) / LEVELS
    assert abs(p - (1 - rate)) <= 0.5 / LEVELS
    # Binomial: the kept fraction is within 5 standard deviations of p.
    n = keep.size
    assert abs(keep.mean() - p) < 5 * np.sqrt(p * (1 - p) / n)
    # Neighbouring elements are independent: their joint keep rate is p^2.
    _assert_independent(keep[..., 0:256:2], keep[..., 1:256:2], p)


def _assert_independent(a: np.ndarray, b: np.ndarray, p: float) -> None:
    """Two masks of keep probability p keep an element together at rate p^2 (within 5 standard deviations)."""
    both = a & b
    assert abs(both.mean() - p * p) < 5 * np.sqrt(p * p * (1 - p * p) / both.size)


def test_rows_distant_positions_and_keys_draw_independently():
    # The hash is keyed per row and per key, over each element's index in its row: masks must not repeat across
    # rows, across the heads of a row (index offsets of T * T), or between two keys split from one.
    shape, rate = (64, 4, 48, 48), 0.5
    k1, k2 = jax.random.split(jax.random.key(7))
    a, b = (np.asarray(keep_mask(k, rate, shape)) for k in (k1, k2))
    p = keep_threshold(rate) / LEVELS
    _assert_independent(a[:-1], a[1:], p)
    _assert_independent(a[:, :-1], a[:, 1:], p)
    _assert_independent(a, b, p)
    # A key whose words differ in one bit (a plain seed 0 against 1) gives another mask, not a shifted copy.
    c, d = (np.asarray(keep_mask(jax.random.key(s), rate, shape)) for s in (0, 1))
    _assert_independent(c, d, p)
    _assert_independent(c[:, :, :, :-1], d[:, :, :, 1:], p)
    # Keys derived inside a model (a layer's hidden-dropout keys, a stream's next key) draw independent masks too.
    e, f = (np.asarray(keep_mask(derive(k1, i), rate, shape)) for i in (0, 1))
    _assert_independent(e, f, p)
    _assert_independent(a, e, p)


def test_a_stream_gives_a_new_key_each_call_and_the_same_keys_from_the_same_state():
    stream = nnx.Rngs(dropout=5).dropout
    first, second = next_key(stream), next_key(stream)
    assert int(stream.count[...]) == 2
    assert not np.array_equal(jax.random.key_data(first), jax.random.key_data(second))
    again = nnx.Rngs(dropout=5).dropout
    np.testing.assert_array_equal(jax.random.key_data(next_key(again)), jax.random.key_data(first))


def test_a_sharded_mask_is_the_one_device_mask():
    # Each device computes its own rows of the mask from iota: under a data-parallel sharding the mask equals the
    # one a single device draws for the whole batch.
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = np.array(jax.devices()[:8])
    mesh = Mesh(devices, ("data",))
    key, shape = jax.random.key(11), (len(devices) * 2, 3, 20, 20)
    sharded = jax.jit(lambda k: keep_mask(k, 0.1, shape), out_shardings=NamedSharding(mesh, PartitionSpec("data")))
    np.testing.assert_array_equal(np.asarray(sharded(key)), np.asarray(keep_mask(key, 0.1, shape)))


def test_dropout_zeroes_or_scales_by_the_exact_keep_probability():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 300)), jnp.float32)
    layer = Dropout(0.25, rngs=nnx.Rngs(dropout=0))
    key = jax.random.key(3)
    y = np.asarray(layer(x, deterministic=False, rngs=key))
    keep = np.asarray(keep_mask(key, 0.25, x.shape))
    np.testing.assert_array_equal(y[~keep], 0.0)
    np.testing.assert_allclose(y[keep], np.asarray(x)[keep] * LEVELS / keep_threshold(0.25), rtol=1e-6)
    # Unbiased: the mean over many draws of a constant is the constant.
    ones = jnp.ones((512, 512))
    spread = np.sqrt(0.25 / 0.75 / ones.size)  # standard deviation of the mean of kept-and-scaled ones
    assert float(jnp.mean(layer(ones, deterministic=False))) == pytest.approx(1.0, abs=5 * spread)


def test_keys_and_switches():
    x = jnp.ones((4, 64))
    layer = Dropout(0.5, rngs=nnx.Rngs(dropout=0))
    a, b = (np.asarray(layer(x, deterministic=False, rngs=jax.random.key(k))) for k in (1, 2))
    np.testing.assert_array_equal(a, np.asarray(layer(x, deterministic=False, rngs=jax.random.key(1))))
    assert (a != b).any()
    # Its own stream advances between calls, as nnx.Dropout's does.
    assert (np.asarray(layer(x, deterministic=False)) != np.asarray(layer(x, deterministic=False))).any()
    np.testing.assert_array_equal(np.asarray(layer(x, deterministic=True)), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(Dropout(1.0, rngs=nnx.Rngs(0))(x, deterministic=False)), 0.0)
    layer.eval()
    np.testing.assert_array_equal(np.asarray(layer(x)), np.asarray(x))


def test_broadcast_dimensions_share_one_draw():
    x = jnp.ones((6, 5, 40))
    y = np.asarray(Dropout(0.5, broadcast_dims=(1,), rngs=nnx.Rngs(dropout=0))(x, deterministic=False))
    assert (y == y[:, :1]).all()  # one mask for every position along dimension 1
    assert 0 < (y == 0).mean() < 1


def test_rates_at_the_ends_of_the_range():
    # A rate too small for 16 bits keeps every element unscaled (2^16 levels out of 2^16: beyond uint16's range);
    # one too close to 1 keeps one level rather than dividing by zero.
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 33)), jnp.float32)
    key = jax.random.key(0)
    assert keep_threshold(1e-12) == LEVELS
    np.testing.assert_array_equal(np.asarray(Dropout(1e-12, rngs=nnx.Rngs(0))(x, rngs=key)), np.asarray(x))
    assert keep_threshold(1 - 1e-9) == 1
    y = np.asarray(Dropout(1 - 1e-9, rngs=nnx.Rngs(0))(x, rngs=key))
    assert np.all(np.isfinite(y))


@pytest.mark.parametrize("family", ["bert", "deberta-v2", "modernbert", "distilbert", "electra"])
def test_a_model_draws_dropout_exactly_when_its_training_forward_depends_on_the_key(family):
    # The fine-tuning step draws dropout keys only for a model that draws (dropout.draws): a model that draws but
    # is reported not to would repeat one mask at every step.
    from bertforge.model.architectures import FAMILIES, build
    from bertforge.model.config import ModelConfig, preset
    from bertforge.model.dropout import draws
    from bertforge.train.step import with_dropout_key

    ids = jnp.asarray(np.random.default_rng(0).integers(5, 1000, (2, 12)), jnp.int32)
    rates = ("hidden_dropout", "attention_dropout", "classifier_dropout")
    conventions = FAMILIES[family].apply(dataclasses.asdict(preset("test")))  # as `init --model.family` builds it
    for on in (None, *rates):
        cfg = ModelConfig(**{**conventions, "family": family, **{r: 0.1 if r == on else 0.0 for r in rates}})
        model = build(cfg, "sequence", num_labels=2)
        model.train()
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        out = [
            nnx.merge(graphdef, params, with_dropout_key(rest, jax.random.key(k)))(ids, jnp.ones_like(ids))
            for k in (0, 1)
        ]
        varies = not np.array_equal(np.asarray(out[0]), np.asarray(out[1]))
        assert draws(model) == (on is not None) == varies, (family, on)
