"""The Pallas attention kernels (model/flash_attention.py) against the hand-written `custom` attention: the same
outputs and gradients, dropout masks included, for padded rows, packed rows and a local window. On a CPU the
kernels run in Pallas's interpreter, the same kernel code a GPU compiles; the test marked gpu compiles them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from bertforge.model import attention as attn
from bertforge.model.architectures import build
from bertforge.model.config import preset
from bertforge.model.dropout import Dropout
from bertforge.model.flash_attention import fits, flash_attention
from bertforge.runtime.devices import logical_to_mesh, make_mesh, run_mesh

# Three blocks of 16 keys and queries in the forward and the backward; one full row, one padded, one filler.
B, T, N, H = 3, 48, 2, 16
LENGTHS = (48, 30, 0)


def arrays(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.standard_normal((B, T, N, H)), dtype) for _ in range(4)]  # q, k, v, d_out


def mask_of(kind: str) -> jax.Array:
    """(B, 1, 1, T) padding, or (B, 1, T, T) block-diagonal for rows that pack texts of 20, 20 and 8 tokens (the
    second row: 13 and 17, then padding; the third all padding)."""
    if kind == "padding":
        return jnp.asarray(np.arange(T)[None] < np.asarray(LENGTHS)[:, None])[:, None, None, :]
    segments = np.zeros((B, T), np.int32)
    segments[0] = np.repeat([1, 2, 3], [20, 20, 8])
    segments[1, :30] = np.repeat([1, 2], [13, 17])
    return attn.segment_mask(jnp.asarray(segments))


def value_and_grads(fn, q, k, v, d_out):
    """fn(q, k, v) and the gradients of sum(fn(q, k, v) * d_out), float32 products at full precision."""
    with jax.default_matmul_precision("float32"):
        out, vjp = jax.vjp(fn, q, k, v)
        return [np.asarray(x, np.float32) for x in (out, *vjp(d_out.astype(out.dtype)))]


@pytest.mark.parametrize(
    "kind, rate, window",
    [("padding", 0.0, None), ("padding", 0.1, None), ("packed", 0.1, None), ("padding", 0.1, 5), ("packed", 0.0, 5)],
)
def test_kernels_equal_the_custom_attention(kind, rate, window):
    q, k, v, d_out = arrays()
    mask = mask_of(kind)
    dropout = Dropout(rate, rngs=nnx.Rngs(dropout=0)) if rate else None
    key = jax.random.key(7) if rate else None
    want = value_and_grads(lambda q, k, v: attn.custom_attention(q, k, v, mask, dropout, key, window), q, k, v, d_out)
    got = value_and_grads(lambda q, k, v: flash_attention(q, k, v, mask, key, rate, window), q, k, v, d_out)
    for name, g, w in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, err_msg=name)
    if rate:  # the masks matter: without them the numbers differ
        plain = value_and_grads(lambda q, k, v: flash_attention(q, k, v, mask, None, 0.0, window), q, k, v, d_out)
        assert np.abs(plain[0] - got[0]).max() > 0.05


def test_pallas_attention_takes_what_the_kernels_do_not_to_explicit():
    q, k, v, d_out = arrays()
    mask = mask_of("padding")
    dropout, key = Dropout(0.1, rngs=nnx.Rngs(dropout=0)), jax.random.key(1)
    first = q[:, :1]  # a layer that computes its first token only
    assert not fits(1, T, H) and fits(T, T, H) and not fits(T, T, 24) and not fits(40, 40, H)
    got = attn.pallas_attention(first, k, v, mask, dropout, key)
    want = attn.explicit_attention(first, k, v, mask, dropout, key)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_on_8_devices_each_device_draws_its_part_of_the_whole_batchs_dropout():
    # data 2 x fsdp 2 split the 4 rows, tensor 2 the 2 heads: each device's kernels see 1 row and 1 head and draw
    # the masks of that row and head of the whole batch, so the numbers are one device's.
    rng = np.random.default_rng(5)
    q, k, v, d_out = (jnp.asarray(rng.standard_normal((4, T, N, H)), jnp.float32) for _ in range(4))
    segments = np.zeros((4, T), np.int32)
    segments[:, :40] = np.repeat([1, 2], [22, 18])
    segments[1, 40:] = 3
    mask = attn.segment_mask(jnp.asarray(segments))
    dropout, key = Dropout(0.1, rngs=nnx.Rngs(dropout=0)), jax.random.key(11)
    want = value_and_grads(lambda q, k, v: attn.custom_attention(q, k, v, mask, dropout, key), q, k, v, d_out)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    rows = NamedSharding(mesh, logical_to_mesh(("batch", "length", "heads", None)))
    q, k, v, d_out = (jax.device_put(x, rows) for x in (q, k, v, d_out))
    with run_mesh(mesh):
        fn = jax.jit(lambda q, k, v: attn.pallas_attention(q, k, v, mask, dropout, key))
        got = value_and_grads(fn, q, k, v, d_out)
        text = fn.lower(q, k, v).as_text()
    assert "shard_map" in text or "sdy.manual_computation" in text  # each device on its own part
    for name, g, w in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, err_msg=name)


def test_the_rule_keeps_pallas_with_dropout_on_a_gpu_only():
    assert attn.choose_attention("pallas", "gpu", True, "bfloat16") == "pallas"
    assert attn.choose_attention("pallas", "gpu", False, "float32") == "pallas"
    with pytest.raises(ValueError, match="attention 'pallas' needs an NVIDIA GPU; this program runs on cpu"):
        attn.choose_attention("pallas", "cpu", True, "float32")


@pytest.mark.slow  # `make slow`: the kernels' equality to custom attention, dropout included, runs in every suite
def test_a_model_trains_the_same_on_pallas_as_on_custom(monkeypatch):
    # BERT's layers with dropout on the hidden states and the probabilities, the last layer on its first token
    # only (explicit, past the kernels): the same dropout keys reach every implementation, so the loss and every
    # parameter's gradient agree.
    monkeypatch.setattr(attn, "choose_attention", lambda requested, *_: requested)
    ids = jnp.asarray(np.random.default_rng(0).integers(5, 1000, (3, 16)))
    mask = jnp.asarray(np.arange(16)[None, :] < np.array([[16], [9], [4]])).astype(jnp.int32)
    losses, grads = {}, {}
    for name in ("custom", "pallas"):
        model = build(dataclasses.replace(preset("test"), attention=name), head="sequence", num_labels=2, seed=0)
        model.train()
        with jax.default_matmul_precision("float32"):
            losses[name], g = nnx.value_and_grad(lambda m: jnp.sum(m(ids, mask) ** 2))(model)
        grads[name] = np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
    assert float(losses["pallas"]) == pytest.approx(float(losses["custom"]), rel=1e-5)
    np.testing.assert_allclose(grads["pallas"], grads["custom"], atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiling the kernels needs an NVIDIA GPU")
@pytest.mark.parametrize("kind", ["padding", "packed"])
def test_compiled_kernels_equal_the_interpreted_ones_on_a_gpu(kind):
    # float32: the compiled Triton kernels against the same kernels interpreted (products in float32 both, not
    # TF32), dropout on. bfloat16: against `custom` in float32 from the same bf16-rounded inputs, within the
    # tolerances of test_attention's cuDNN test (one bf16 rounding of outputs up to 2 and gradients up to 4).
    q, k, v, d_out = arrays()
    mask, key = mask_of(kind), jax.random.key(7)
    compiled = value_and_grads(lambda q, k, v: flash_attention(q, k, v, mask, key, 0.1, None), q, k, v, d_out)
    interpreted = value_and_grads(
        lambda q, k, v: flash_attention(q, k, v, mask, key, 0.1, None, interpret=True), q, k, v, d_out
    )
    for g, w in zip(compiled, interpreted, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    dropout = Dropout(0.1, rngs=nnx.Rngs(dropout=0))
    want = value_and_grads(
        lambda q, k, v: attn.custom_attention(q, k, v, mask, dropout, key), *[x.astype(jnp.float32) for x in low], d_out
    )
    got = value_and_grads(lambda q, k, v: flash_attention(q, k, v, mask, key, 0.1, None), *low, d_out)
    for g, w, tol in zip(got, want, (1e-2, 3e-2, 3e-2, 3e-2), strict=True):
        np.testing.assert_allclose(g, w, atol=tol)


@pytest.mark.parametrize("kind, window", [("padding", None), ("packed", 5)])
def test_kernels_lower_to_triton_for_a_gpu_on_any_machine(kind, window):
    # Lowering for CUDA runs Pallas's Triton lowering of every kernel here (each primitive must have a Triton
    # rule: the uint32 hash, the scalar seed loads, the masked blocks), without a GPU; only Triton's own
    # compilation to the GPU's code is left to a GPU (the test above).
    spec = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)

    def grads(q, k, v, mask):
        loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v, mask, jax.random.key(0), 0.1, window, False))  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    text = jax.jit(grads).trace(spec, spec, spec, mask_of(kind)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3  # the forward, the queries' and the keys' gradients
