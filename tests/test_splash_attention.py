"""The splash attention for TPUs (model/splash_attention.py) against the hand-written `custom` attention: the same
outputs and gradients for padded rows, packed rows and a local window, and a model's loss and gradients. On a CPU
the kernel runs in Pallas's TPU interpreter; lowering it for a TPU (Mosaic) needs no TPU and is tested here too."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from bertforge.model import attention as attn
from bertforge.model import splash_attention as splash
from bertforge.model.architectures import build
from bertforge.model.config import preset
from bertforge.model.splash_attention import _kernel, fits, segment_ids, splash_attention
from bertforge.runtime.devices import logical_to_mesh, make_mesh, run_mesh

# One block of 128; a full row, a padded row and a filler row; N heads of H.
B, T, N, H = 3, 128, 2, 16
LENGTHS = (128, 70, 0)
SEGMENTS = (np.repeat([1, 2, 3], [50, 60, 18]), np.repeat([1, 2, 0], [33, 40, 55]), np.zeros(T, int))


def arrays(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.standard_normal((B, T, N, H)), dtype) for _ in range(4)]  # q, k, v, d_out


def mask_of(kind: str) -> jax.Array:
    """(B, 1, 1, T) padding, or (B, 1, T, T) for rows packing texts of 50, 60 and 18 tokens; 33 and 40, then
    padding; padding only."""
    if kind == "padding":
        return jnp.asarray(np.arange(T)[None] < np.asarray(LENGTHS)[:, None])[:, None, None, :]
    return attn.segment_mask(jnp.asarray(np.stack(SEGMENTS), jnp.int32))


def value_and_grads(fn, q, k, v, d_out, seen):
    """fn(q, k, v) at the texts' tokens `seen`, and the gradients of sum(fn(q, k, v) * d_out) over them (padding
    takes no loss: the kernel lets a padding query attend padding, the formula the text or nothing)."""
    d_out = jnp.where(seen[:, :, None, None], d_out, 0.0)
    with jax.default_matmul_precision("float32"):
        out, vjp = jax.vjp(fn, q, k, v)
        out = jnp.where(seen[:, :, None, None], out, 0.0)
        return [np.asarray(x, np.float32) for x in (out, *vjp(d_out))]


def tokens_of(kind: str) -> jax.Array:
    """(B, T): the texts' tokens, not padding."""
    if kind == "padding":
        return jnp.asarray(np.arange(T)[None] < np.asarray(LENGTHS)[:, None])
    return jnp.asarray(np.stack(SEGMENTS) > 0)


@pytest.mark.parametrize("kind, window", [("padding", None), ("packed", None), ("padding", 9), ("packed", 9)])
def test_the_kernel_equals_the_custom_attention(kind, window):
    q, k, v, d_out = arrays()
    mask = mask_of(kind)
    seen = tokens_of(kind)
    want = value_and_grads(lambda q, k, v: attn.custom_attention(q, k, v, mask, window=window), q, k, v, d_out, seen)
    got = value_and_grads(lambda q, k, v: splash_attention(q, k, v, mask, window), q, k, v, d_out, seen)
    for name, g, w in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, err_msg=name)
    if window is not None:  # the window matters: without it the numbers differ
        wide = value_and_grads(lambda q, k, v: splash_attention(q, k, v, mask), q, k, v, d_out, seen)
        assert np.abs(wide[0] - got[0]).max() > 0.05


def test_segment_ids_give_each_text_its_own_id_and_padding_another():
    packed = np.asarray(segment_ids(mask_of("packed")))
    for row, segs in zip(packed, SEGMENTS, strict=True):
        texts = [row[segs == s] for s in np.unique(segs[segs > 0])]
        assert all(len(set(t)) == 1 for t in texts)  # one id a text
        assert len({t[0] for t in texts} | ({-1} if (segs == 0).any() else set())) == len(texts) + (segs == 0).any()
        assert (row[segs == 0] == -1).all()
    padded = np.asarray(segment_ids(mask_of("padding")))
    np.testing.assert_array_equal(padded, np.arange(T)[None] < np.asarray(LENGTHS)[:, None])


def test_lengths_the_kernel_does_not_take_go_to_xla():
    q, k, v, _ = arrays()
    mask = mask_of("padding")
    assert fits(T, T) and not fits(1, T) and not fits(96, 96)
    first = q[:, :1]  # a layer that computes its first token only
    np.testing.assert_array_equal(
        np.asarray(attn.splash_attention(first, k, v, mask)), np.asarray(attn.xla_attention(first, k, v, mask))
    )
    short, mask = [x[:, :96] for x in (q, k, v)], mask[..., :96]
    np.testing.assert_array_equal(
        np.asarray(attn.splash_attention(*short, mask)), np.asarray(attn.xla_attention(*short, mask))
    )


def test_programs_of_other_shapes_share_the_kernel_compiled_ahead_or_not():
    # The kernel is kept across programs (a training step, then an evaluation of another batch): built inside the
    # first one's trace, its arrays were that trace's and broke every later program.
    _kernel.cache_clear()  # first built inside a trace, as in a run
    q, k, v, d_out = arrays()
    mask = mask_of("packed")
    grads = jax.jit(lambda q, k, v: jax.vjp(lambda *x: splash_attention(*x, mask), q, k, v)[1](d_out))
    forward = jax.jit(lambda q, k, v, m: splash_attention(q, k, v, m))
    two = (q[:2], k[:2], v[:2], mask[:2])  # another batch size: another program
    seen = np.asarray(tokens_of("packed"))[:2]
    want = np.asarray(attn.custom_attention(*two))[seen]
    assert len(grads(q, k, v)) == 3
    for run in (forward, forward.lower(*two).compile()):
        np.testing.assert_allclose(np.asarray(run(*two))[seen], want, atol=1e-5)


def test_on_8_devices_each_device_runs_the_kernel_on_its_own_rows_and_heads(monkeypatch):
    # data 2 x fsdp 2 split the 4 rows, tensor 2 the 2 heads: each device's kernel has 1 head and 1 row.
    built = []
    monkeypatch.setattr(splash, "_kernel", lambda t, n, w, i: built.append(n) or _kernel(t, n, w, i))
    rng = np.random.default_rng(3)
    q, k, v, d_out = (jnp.asarray(rng.standard_normal((4, T, N, H)), jnp.float32) for _ in range(4))
    segments = np.stack([*SEGMENTS[:2], np.repeat([1, 2], [64, 64]), SEGMENTS[0]])
    mask = attn.segment_mask(jnp.asarray(segments, jnp.int32))
    seen = jnp.asarray(segments > 0)
    want = value_and_grads(lambda q, k, v: attn.custom_attention(q, k, v, mask), q, k, v, d_out, seen)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    rows = NamedSharding(mesh, logical_to_mesh(("batch", "length", "heads", None)))
    q, k, v, d_out = (jax.device_put(x, rows) for x in (q, k, v, d_out))
    with run_mesh(mesh):
        got = value_and_grads(jax.jit(lambda q, k, v: splash_attention(q, k, v, mask)), q, k, v, d_out, seen)
    assert built and set(built) == {1}
    for name, g, w in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, err_msg=name)


def test_the_rule_keeps_splash_on_a_tpu_without_dropout_only():
    assert attn.choose_attention("splash", "tpu", False, "bfloat16") == "splash"
    assert attn.choose_attention("splash", "tpu", True, "bfloat16") == "explicit"  # the kernel has no dropout
    assert attn.choose_attention("auto", "tpu", False, "bfloat16") == "xla"  # until it is measured on a TPU
    with pytest.raises(ValueError, match="attention 'splash' needs a TPU; this program runs on gpu"):
        attn.choose_attention("splash", "gpu", False, "bfloat16")


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_a_model_on_packed_rows_has_the_same_loss_and_gradients_on_splash(family, monkeypatch):
    # Every layer of BERT, and ModernBERT's global and local (window 8) layers, on rows packing several texts.
    monkeypatch.setattr(attn, "choose_attention", lambda requested, *_: requested)
    calls = []
    counted = lambda *a, **kw: calls.append(kw["window"]) or splash_attention(*a, **kw)  # noqa: E731
    monkeypatch.setattr(attn, "splash_kernel", counted)
    extra = {"family": "modernbert", "intermediate_size": 48, "local_attention": 8, "global_attn_every_n_layers": 2}
    segments = jnp.asarray(np.stack(SEGMENTS[:2]), jnp.int32)
    ids = jnp.where(segments > 0, jnp.asarray(np.random.default_rng(0).integers(5, 1000, (2, T))), 0)
    weights = jnp.asarray(np.random.default_rng(1).standard_normal((2, T, 32)), jnp.float32) * (segments > 0)[..., None]
    losses, grads = {}, {}
    for name in ("custom", "splash"):
        cfg = preset("test", hidden_dropout=0.0, attention_dropout=0.0, **(extra if family == "modernbert" else {}))
        model = build(dataclasses.replace(cfg, attention=name), "mlm", seed=0)
        with jax.default_matmul_precision("float32"):
            loss_fn = lambda m: jnp.mean(m.encoder(ids, segment_ids=segments) * weights)  # noqa: E731
            losses[name], g = nnx.value_and_grad(loss_fn)(model)
        grads[name] = np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
    # Every layer on the kernel; ModernBERT's second is local, a window of 8 tokens: 4 on each side.
    assert calls == ([None, None] if family == "bert" else [None, 4])
    assert float(losses["splash"]) == pytest.approx(float(losses["custom"]), rel=1e-5)
    np.testing.assert_allclose(grads["splash"], grads["custom"], atol=1e-5)


@pytest.mark.parametrize("kind, window", [("padding", None), ("packed", 64)])
def test_the_kernel_lowers_for_a_tpu_on_any_machine(kind, window):
    # Lowering for a TPU runs Pallas's Mosaic lowering of the forward and both backward kernels at these shapes in
    # bfloat16, without a TPU; only Mosaic's own compilation is left to a TPU.
    spec = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)

    def grads(q, k, v, mask):
        loss = lambda q, k, v: jnp.sum(splash_attention(q, k, v, mask, window, False).astype(jnp.float32))  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    text = jax.jit(grads).trace(spec, spec, spec, mask_of(kind)).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 3  # the forward, the queries' and the keys' gradients
