"""bf16 compute over float32 parameters: the products' gradients by the mixed-precision formula, and on CPU the
backward products kept in bf16 (XLA upcasts a bf16 product to float32 when an operand is not row-major)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from bertforge.model.architectures import build
from bertforge.model.config import preset
from bertforge.model.layers import mixed_matmul

BF16 = ml_dtypes.bfloat16


def _round(a: np.ndarray) -> np.ndarray:
    """float64 values of `a` rounded to bf16 (round to nearest even, as XLA's convert)."""
    return np.asarray(a, np.float32).astype(BF16).astype(np.float64)


def test_mixed_matmul_forward_and_gradients_follow_the_formula():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 24, 48)).astype(BF16)  # (B, T, din)
    kernel = rng.normal(size=(48, 40)).astype(np.float32)  # (din, dout), a float32 parameter
    cot = rng.normal(size=(2, 24, 40)).astype(np.float32)  # the cotangent reaching the output

    out, vjp = jax.vjp(mixed_matmul, jnp.asarray(x), jnp.asarray(kernel))
    dx, dkernel = vjp(jnp.asarray(cot))

    x64, k16, c16 = x.astype(np.float64), _round(kernel), _round(cot)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), x64 @ k16, rtol=1e-5, atol=1e-5)
    # The kernel's gradient: bf16 operands, float32 accumulation, kept in float32 (no rounding to bf16).
    assert dkernel.dtype == jnp.float32
    ref_dk = x64.reshape(-1, 48).T @ c16.reshape(-1, 40)
    np.testing.assert_allclose(np.asarray(dkernel), ref_dk, rtol=1e-5, atol=1e-4)
    # The input's gradient is x's dtype: the float32 sum rounded once to bf16.
    assert dx.dtype == jnp.bfloat16
    ref_dx = c16 @ k16.T
    np.testing.assert_array_equal(np.asarray(dx).astype(np.float64), _round(ref_dx))


def test_mixed_matmul_is_plain_autodiff_up_to_the_cotangent_rounding():
    # With a cotangent that bf16 holds exactly, the formula is what automatic differentiation of the float32
    # accumulated product gives, so the custom backward changes only where the cotangent is rounded.
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(32, 16)), jnp.bfloat16)
    kernel = jnp.asarray(rng.normal(size=(16, 24)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(32, 24)), jnp.bfloat16).astype(jnp.float32)

    def plain(x, kernel):
        return jnp.matmul(x, kernel.astype(x.dtype), preferred_element_type=jnp.float32)

    ours = jax.vjp(mixed_matmul, x, kernel)[1](cot)
    theirs = jax.vjp(plain, x, kernel)[1](cot)
    np.testing.assert_array_equal(np.asarray(ours[0], np.float32), np.asarray(theirs[0], np.float32))
    # autodiff rounds the kernel's gradient to bf16 on its way back through the cast; ours keeps float32.
    np.testing.assert_allclose(np.asarray(ours[1]), np.asarray(theirs[1]), rtol=2**-8)


def _loss_and_state(cfg, ids, mask):
    model = build(cfg, head="sequence", num_labels=16)
    model.eval()  # no dropout: the same function in both precisions
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, rest):
        logits = nnx.merge(graphdef, params, rest)(ids, mask)  # (B, labels)
        return jnp.mean(jax.nn.log_softmax(logits)[:, 3])

    return loss, params, rest


def _model_inputs(b: int = 4, t: int = 32):
    ids = jax.random.randint(jax.random.key(0), (b, t), 5, 1000)
    mask = jnp.ones((b, t), jnp.int32).at[1, 20:].set(0)
    return ids, mask


def test_bf16_model_gradients_stay_close_to_float32():
    cfg = dataclasses.replace(preset("test"), hidden_dropout=0.0, attention_dropout=0.0)
    ids, mask = _model_inputs()
    grads = {}
    for dtype in ("float32", "bfloat16"):
        loss, params, rest = _loss_and_state(dataclasses.replace(cfg, dtype=dtype), ids, mask)
        grads[dtype] = jax.tree.leaves(jax.jit(jax.grad(loss))(params, rest))
    checked = 0
    for a, b in zip(grads["float32"], grads["bfloat16"], strict=True):
        assert b.dtype == jnp.float32
        a, b = np.asarray(a), np.asarray(b)
        if np.linalg.norm(a) < 1e-9:
            continue  # the key projection's bias: softmax ignores it, its gradient is 0 up to rounding
        # A few bf16 roundings per product (8 bits of mantissa, 0.4% each); a wiring error is order 1.
        assert np.linalg.norm(a - b) / np.linalg.norm(a) < 0.02
        checked += 1
    assert checked == len(grads["float32"]) - cfg.num_layers


def _dot_operand_types(hlo: str) -> list[tuple[str, str, str]]:
    """(lhs type, rhs type, output shape) of every dot in an optimised HLO module's text."""
    types = dict(re.findall(r"%(\S+) = (\w+)\[", hlo))
    types.update(re.findall(r"(\w[\w.]*): (\w+)\[", hlo))  # fused computations' parameters
    dots = re.findall(r"= \w+(\[[\d,]*\])\S* dot\(%(\S+?), %(\S+?)\)", hlo)
    return [(types[a], types[b], shape) for shape, a, b in dots]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA's CPU backend")
def test_bf16_training_step_products_stay_bf16_on_cpu():
    cfg = dataclasses.replace(preset("test", hidden_size=64, num_heads=4, intermediate_size=128), dtype="bfloat16")
    ids, mask = _model_inputs()
    loss, params, rest = _loss_and_state(cfg, ids, mask)
    hlo = jax.jit(jax.grad(loss)).lower(params, rest).compile().as_text()
    dots = _dot_operand_types(hlo)
    # The [CLS]-only last layer's attention has one query row: XLA's fast kernels take no vectors, so those
    # products are the only float32 ones left. Every other: 12 projections forward and backward (the last
    # layer's on [CLS] rows), the attention of the first layer both ways, the head.
    rows = [d for d in dots if 1 not in (int(n) for n in d[2][1:-1].split(","))]
    assert len(rows) >= 3 * 12 + 6
    assert [d for d in rows if d[:2] != ("bf16", "bf16")] == []


def test_bf16_fine_tuning_step_on_8_devices_follows_1_device():
    # data 2 x fsdp 4: sharded kernels and a split batch through the bf16 products' own backward and row-major
    # copies. The float32 sums run in another order, so the updates agree to float32's precision, not to the bit.
    from bertforge.runtime.devices import make_mesh, param_shardings
    from bertforge.train.optim import OptimConfig, make_optimizer
    from bertforge.train.sequence_step import SequenceStepConfig, compile_train_step
    from bertforge.train.step import new_train_state

    cfg = preset("test", hidden_dropout=0.0, attention_dropout=0.0, dtype="bfloat16")
    rng = np.random.default_rng(3)
    mask = (np.arange(16)[None, :] < rng.integers(4, 17, (8, 1))).astype(np.int32)  # (B, T)
    batch = {
        "input_ids": np.where(mask, rng.integers(5, 900, (8, 16)), 0).astype(np.int32),
        "attention_mask": mask,
        "token_type_ids": np.zeros((8, 16), np.int32),
        "targets": rng.normal(size=(8, 1)).astype(np.float32),
        "weight": np.ones(8, np.float32),
    }
    updates = []
    for mesh in (make_mesh(devices=jax.devices()[:1]), make_mesh(data=2, fsdp=4)):
        model = build(cfg, "sequence", num_labels=1, seed=1)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        start = jax.device_get(nnx.to_pure_dict(params))
        tx = make_optimizer(OptimConfig(lr=1e-3), params, cfg.num_layers)
        state = new_train_state(jax.device_put(params, param_shardings(model, mesh)), tx, mesh)
        shardings = jax.tree.map(lambda x: x.sharding, state)
        step = compile_train_step(graphdef, rest, tx, SequenceStepConfig("mse"), shardings)
        state, _ = step(state, batch, jnp.float32(1e-3), jax.random.key(0))
        end = jax.device_get(nnx.to_pure_dict(state.params))
        updates.append(jax.tree.leaves(jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), end, start)))
    for one, eight in zip(*updates, strict=True):
        assert np.linalg.norm(one - eight) <= 1e-5 * np.linalg.norm(one) + 1e-12
