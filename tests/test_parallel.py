"""Logical axis names on parameters, mapped by one rules table onto a simulated 8-device mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from bertforge.model.architectures import build
from bertforge.model.config import preset
from bertforge.runtime.devices import batch_sharding, make_mesh, param_shardings, shard_model


def test_eight_simulated_devices():
    assert jax.device_count() == 8


def test_sharded_forward_equals_single_device():
    cfg = preset("test", hidden_dropout=0.0, attention_dropout=0.0)
    reference = build(cfg, "mlm", seed=0)
    reference.eval()
    ids = jax.random.randint(jax.random.key(0), (8, 16), 5, cfg.vocab_size)
    mask = jnp.ones_like(ids).at[:, 12:].set(0)
    expected = np.asarray(reference(ids, mask))

    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    model = build(cfg, "mlm", seed=0)
    model.eval()
    shard_model(model, mesh)
    kernel = model.encoder.layers[0].mlp_in.kernel[...]
    assert kernel.sharding.spec == P("fsdp", "tensor")  # ('embed', 'mlp') through the rules table
    assert kernel.addressable_shards[0].data.shape == (
        cfg.hidden_size // 2,
        cfg.intermediate_size // 2,
    )  # really split, not replicated
    specs = jax.tree.leaves(param_shardings(model, mesh))
    assert any(s.spec != P() for s in specs)

    ids_s = jax.device_put(ids, batch_sharding(mesh))
    mask_s = jax.device_put(mask, batch_sharding(mesh))
    out = nnx.jit(lambda m, i, a: m(i, a))(model, ids_s, mask_s)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)


def test_mesh_sizes_are_checked():
    assert make_mesh().shape == {"data": 8, "fsdp": 1, "tensor": 1}
    assert make_mesh(fsdp=4).shape == {"data": 2, "fsdp": 4, "tensor": 1}
    try:
        make_mesh(data=3)
    except ValueError as e:
        assert "needs 3 devices" in str(e)
    else:
        raise AssertionError("a 3-device mesh on 8 devices was accepted")
