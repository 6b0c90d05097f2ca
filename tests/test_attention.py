"""Attention implementations against the plain formula, the rule that picks one, and the one mask constant."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bertforge.model import attention as attn
from bertforge.model import heads
from bertforge.model.architectures import build, config_to_hf
from bertforge.model.config import ModelConfig, preset
from bertforge.model.dropout import Dropout, dropped, keep_mask
from bertforge.model.hf import load_pretrained, save_pretrained

B, T, N, H = 4, 8, 2, 16
LENGTHS = (8, 5, 2, 0)  # a full row, two partly padded rows, one all-padding filler row
MODEL_DIR = Path(attn.__file__).parent


def inputs(q_len: int = T, dtype=jnp.float32):
    """q (B, Q, N, H), k, v (B, T, N, H), mask (B, 1, 1, T) padded at the end of each row, cotangent (B, Q, N, H)."""
    rng = np.random.default_rng(0)
    q, k, v, d_out = (
        jnp.asarray(rng.standard_normal(shape), dtype)
        for shape in ((B, q_len, N, H), (B, T, N, H), (B, T, N, H), (B, q_len, N, H))
    )
    mask = jnp.asarray(np.arange(T)[None, :] < np.asarray(LENGTHS)[:, None])[:, None, None, :]
    return q, k, v, mask, d_out


def formula(q, k, v, mask):
    """softmax(q k^T / sqrt(H) + mask) v in float32 at the highest precision."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    hp = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("bqnh,btnh->bnqt", q, k, precision=hp) / np.sqrt(q.shape[-1])
    probs = jax.nn.softmax(logits + jnp.where(mask, 0.0, attn.MASK_VALUE), axis=-1)
    return jnp.einsum("bnqt,btnh->bqnh", probs, v, precision=hp)


def forward_and_grads(fn, q, k, v, mask, d_out):
    """fn's output and the gradients of sum(output * d_out) with respect to q, k, v, with float32 matmuls at full
    precision (a GPU's default would round them to TF32)."""

    def loss(q, k, v):
        out = fn(q, k, v, mask)
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), out

    with jax.default_matmul_precision("float32"):
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


def runs_here(name: str) -> bool:
    return name != "cudnn" or jax.default_backend() == "gpu"


def assert_matches(out, grads, want, want_grads, atol: float) -> None:
    """Output and the v gradient on every row; q and k gradients on the rows with a valid key.

    The filler row has no such gradient to match: the formula's additive mask is rounded away next to its logits
    (-1e30 + x == -1e30 in float32) yet passes their gradients on, while a masking `where` (xla, explicit) cuts
    them to 0. Training gives such rows no weight, so their gradients are 0 either way; here they must be finite."""
    rows = [i for i, n in enumerate(LENGTHS) if n > 0]
    (out, dq, dk, dv), (want, wq, wk, wv) = (
        [np.asarray(x, np.float32) for x in xs] for xs in ((out, *grads), (want, *want_grads))
    )
    for x in (out, dq, dk, dv):
        assert np.all(np.isfinite(x))
    np.testing.assert_allclose(out, want, atol=atol)
    np.testing.assert_allclose(dv, wv, atol=atol)
    np.testing.assert_allclose(dq[rows], wq[rows], atol=atol)
    np.testing.assert_allclose(dk[rows], wk[rows], atol=atol)


@pytest.mark.parametrize("q_len", [T, 1])
@pytest.mark.parametrize("name", ["custom", "xla", "explicit"])
def test_implementation_equals_the_formula_with_padding(name, q_len):
    q, k, v, mask, d_out = inputs(q_len)
    out, grads = forward_and_grads(attn.IMPLEMENTATIONS[name], q, k, v, mask, d_out)
    want, want_grads = forward_and_grads(formula, q, k, v, mask, d_out)
    assert_matches(out, grads, want, want_grads, atol=1e-5)


def test_explicit_with_dropout_rate_zero_equals_the_formula():
    q, k, v, mask, d_out = inputs()
    dropout = nnx.Dropout(0.0, rngs=nnx.Rngs(dropout=0))
    key = jax.random.key(1)
    out, grads = forward_and_grads(
        lambda q, k, v, m: attn.explicit_attention(q, k, v, m, dropout, key), q, k, v, mask, d_out
    )
    want, want_grads = forward_and_grads(formula, q, k, v, mask, d_out)
    assert_matches(out, grads, want, want_grads, atol=1e-5)


@pytest.mark.parametrize("window", [None, 2])
def test_custom_with_dropout_equals_explicit(window):
    # The hand-written backward against automatic differentiation of the same dropped formula, one key for both.
    q, k, v, mask, d_out = inputs()
    if window is not None:  # no loss on queries whose window holds no real key: see windowed_cotangent
        d_out, _ = windowed_cotangent(windowed(mask, T), d_out)
    dropout = Dropout(0.3, rngs=nnx.Rngs(dropout=0))
    key = jax.random.key(7)
    runs = {
        name: forward_and_grads(
            lambda q, k, v, m, _n=name: attn.IMPLEMENTATIONS[_n](q, k, v, m, dropout, key, window=window),
            q,
            k,
            v,
            mask,
            d_out,
        )  # fmt: skip
        for name in ("custom", "explicit")
    }
    assert_matches(*runs["custom"], *runs["explicit"], atol=1e-5)
    undropped = attn.custom_attention(q, k, v, mask, window=window)
    assert np.abs(np.asarray(runs["custom"][0]) - np.asarray(undropped)).max() > 0.1  # the dropout did drop


@pytest.mark.parametrize("case", ["padding", "first token", "window", "dropout", "packed rows"])
def test_custom_without_gradients_equals_its_differentiated_forward(case):
    # Evaluation and prediction take the primal forward (unnormalised exponentials), training the one whose
    # probabilities the backward keeps: both must give the same outputs.
    q, k, v, mask, _ = inputs(1 if case == "first token" else T)
    if case == "packed rows":
        seg = jnp.asarray(SEGMENTS)
        mask = attn.segment_mask(seg)
    dropout, key = (Dropout(0.3, rngs=nnx.Rngs(dropout=0)), jax.random.key(7)) if case == "dropout" else (None, None)
    window = WINDOW if case == "window" else None
    fn = lambda q, k, v: attn.custom_attention(q, k, v, mask, dropout, key, window=window)  # noqa: E731
    with jax.default_matmul_precision("float32"):
        alone = jax.jit(fn)(q, k, v)
        differentiated, _ = jax.vjp(fn, q, k, v)
    np.testing.assert_allclose(np.asarray(alone), np.asarray(differentiated), atol=1e-6, rtol=1e-6)
    if case == "padding":  # and both the formula's
        np.testing.assert_allclose(np.asarray(alone), np.asarray(formula(q, k, v, mask)), atol=1e-5)


def dot_operands(jaxpr) -> list[tuple[str, ...]]:
    """The operand dtypes of every dot_general in a jaxpr, those of its nested jaxprs (custom_vjp, pjit) too."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(str(x.aval.dtype) for x in eqn.invars))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += dot_operands(inner)
    return found


@pytest.mark.parametrize("rate", [0.0, 0.1])
@pytest.mark.parametrize("name", ["custom", "explicit"])
def test_attention_multiplies_in_the_compute_dtype_forward_and_backward(name, rate):
    # The projections hand attention float32; in a bfloat16 model each of its products, the backward's too, runs
    # in bfloat16 (`explicit` ran all six in float32: float32 GEMMs in the bf16 step of an H200's profile).
    q, k, v, mask, d_out = inputs()
    dropout = Dropout(rate, rngs=nnx.Rngs(dropout=0)) if rate else None
    key = jax.random.key(3) if rate else None
    fn = lambda q, k, v, m: attn.attend(q, k, v, m, name, "bfloat16", dropout=dropout, key=key)  # noqa: E731

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v, mask).astype(jnp.float32) * d_out)

    dots = dot_operands(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr)
    assert len(dots) >= 6 and set(dots) == {("bfloat16", "bfloat16")}
    if rate:
        return
    # The numbers: the float32 formula from the same bfloat16-rounded inputs, within one bfloat16 rounding of the
    # outputs and gradients (tolerances as in test_cudnn_equals_the_formula_with_padding); no loss on the filler
    # row, whose q and k gradients differ by design (assert_matches).
    seen = np.broadcast_to((np.asarray(LENGTHS) > 0)[:, None], (B, T))
    d_out = d_out * jnp.asarray(seen, d_out.dtype)[..., None, None]
    low = [x.astype(jnp.bfloat16).astype(jnp.float32) for x in (q, k, v)]
    out, grads = forward_and_grads(fn, *low, mask, d_out)
    want, want_grads = forward_and_grads(formula, *low, mask, d_out)
    assert_seen_close(out, grads, want, want_grads, seen)


@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_a_score_bias_receives_its_gradient(rate):
    # DeBERTa's relative scores enter as a full (B, N, Q, T) bias, with their own scale on q: the hand-written
    # backward against automatic differentiation of the formula, the bias's gradient included.
    q, k, v, _, d_out = inputs()
    bias = jnp.asarray(np.random.default_rng(1).standard_normal((B, N, T, T)), jnp.float32)
    key = jax.random.key(5) if rate else None

    def formula_with_bias(q, k, v, bias):
        logits = jnp.einsum("bqnh,btnh->bnqt", q, k, precision=jax.lax.Precision.HIGHEST) * 0.3 + bias
        probs = jax.nn.softmax(logits, axis=-1)
        probs = probs if key is None else dropped(probs, keep_mask(key, rate, probs.shape), rate)
        return jnp.einsum("bnqt,btnh->bqnh", probs, v, precision=jax.lax.Precision.HIGHEST)

    def grads(fn):
        loss = lambda *a: jnp.sum(fn(*a) * d_out)  # noqa: E731
        with jax.default_matmul_precision("float32"):
            return fn(q, k, v, bias), jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)

    out, got = grads(lambda q, k, v, b: attn.attention(q, k, v, b, key, rate=rate, scale=0.3))
    want_out, want = grads(formula_with_bias)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=1e-5)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)
    assert np.abs(np.asarray(got[3])).max() > 1e-3  # a gradient that is there to compare


@pytest.mark.gpu
@pytest.mark.skipif(not runs_here("cudnn"), reason="cuDNN attention needs a GPU")
@pytest.mark.parametrize("q_len", [T, 1])
def test_cudnn_equals_the_formula_with_padding(q_len):
    # cuDNN takes bfloat16 only: the formula runs in float32 from the same bfloat16 inputs. Outputs reach 2 and
    # gradients 4, where one bfloat16 rounding (8 bits of mantissa) is up to 0.008 and 0.016; an H100 was measured
    # at 0.005 and 0.016.
    q, k, v, mask, d_out = inputs(q_len, jnp.bfloat16)
    out, grads = forward_and_grads(attn.cudnn_attention, q, k, v, mask, d_out)
    want, want_grads = forward_and_grads(formula, q, k, v, mask, d_out)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))  # the filler row included
    rows = [i for i, n in enumerate(LENGTHS) if n > 0]  # cuDNN gives the filler row one key, the formula all keys
    f32 = lambda x: np.asarray(x, np.float32)[rows]  # noqa: E731
    np.testing.assert_allclose(f32(out), f32(want), atol=1e-2)
    for got, expected in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(f32(got), f32(expected), atol=3e-2)


# ---------------------------------------------------------------------------------------------------- local window
WINDOW = 2  # T = 8 > 2 * WINDOW + 1: the band cuts keys off every query's row


def windowed(mask, q_len: int):
    """The padding mask (B, 1, 1, T) with the band |i - j| <= WINDOW, built here from numpy: (B, 1, Q, T)."""
    near = np.abs(np.arange(q_len)[:, None] - np.arange(T)[None, :]) <= WINDOW  # (Q, T)
    return mask & jnp.asarray(near)[None, None]


def windowed_cotangent(local, d_out):
    """d_out with 0 at the queries whose window holds no real key (padding far from any token, the filler row).
    Training gives them no loss; with a cotangent they would differ as the filler row does in assert_matches."""
    seen = np.asarray(local).any(-1)[:, 0]  # (B, Q)
    assert seen.any() and not seen.all()  # the batch has such queries, and others
    return d_out * jnp.asarray(seen, d_out.dtype)[..., None, None], seen


def assert_seen_close(out, grads, want, want_grads, seen) -> None:
    """bfloat16 kernels against the formula: every value finite, the output at the queries that see a key, every
    gradient (their cotangent is 0 elsewhere); tolerances as in test_cudnn_equals_the_formula_with_padding."""
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    for x in (out, *grads):
        assert np.all(np.isfinite(f32(x)))
    np.testing.assert_allclose(f32(out)[seen], f32(want)[seen], atol=1e-2)
    for got, expected in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(f32(got), f32(expected), atol=3e-2)


@pytest.mark.parametrize("q_len", [T, 1])
@pytest.mark.parametrize("name", ["custom", "xla", "explicit"])
def test_windowed_implementation_equals_the_formula_with_padding(name, q_len):
    q, k, v, mask, d_out = inputs(q_len)
    local = windowed(mask, q_len)
    d_out, _ = windowed_cotangent(local, d_out)
    fn = lambda q, k, v, m: attn.IMPLEMENTATIONS[name](q, k, v, m, window=WINDOW)  # noqa: E731
    out, grads = forward_and_grads(fn, q, k, v, mask, d_out)
    want, want_grads = forward_and_grads(formula, q, k, v, local, d_out)
    for got, expected in zip((out, *grads), (want, *want_grads), strict=True):  # every row: see windowed_cotangent
        assert np.all(np.isfinite(np.asarray(got)))
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5)
    if q_len > 1:  # the window changes the numbers
        assert np.abs(np.asarray(out) - np.asarray(formula(q, k, v, mask))).max() > 0.1


def test_attend_passes_the_window_to_every_implementation():
    q, k, v, mask, _ = inputs()
    want = formula(q, k, v, windowed(mask, T))
    dropout = nnx.Dropout(0.0, rngs=nnx.Rngs(dropout=0))
    with jax.default_matmul_precision("float32"):
        for name in ("custom", "xla", "explicit"):
            got = attn.attend(q, k, v, mask, name, window=WINDOW)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, err_msg=name)
        with_dropout = attn.attend(q, k, v, mask, "auto", dropout=dropout, key=jax.random.key(0), window=WINDOW)
    np.testing.assert_allclose(np.asarray(with_dropout), np.asarray(want), atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not runs_here("cudnn"), reason="cuDNN attention needs a GPU")
@pytest.mark.parametrize("q_len", [T, 1])
def test_windowed_cudnn_equals_the_formula_with_padding(q_len):
    # bfloat16 inputs, tolerances as in test_cudnn_equals_the_formula_with_padding.
    q, k, v, mask, d_out = inputs(q_len, jnp.bfloat16)
    local = windowed(mask, q_len)
    d_out, seen = windowed_cotangent(local, d_out)  # cuDNN gives the unseen queries other keys (the filler row one)
    fn = lambda q, k, v, m: attn.cudnn_attention(q, k, v, m, window=WINDOW)  # noqa: E731
    out, grads = forward_and_grads(fn, q, k, v, mask, d_out)
    want, want_grads = forward_and_grads(formula, q, k, v, local, d_out)
    assert_seen_close(out, grads, want, want_grads, seen)


# ---------------------------------------------------------------------------------------------------- packed rows
SEGMENTS = ((1, 1, 1, 2, 2, 2, 2, 2), (1, 1, 2, 2, 2, 3, 0, 0), (1, 1, 1, 1, 1, 0, 0, 0), (0,) * 8)


def packed_mask(q_len: int) -> jax.Array:
    """(B, 1, Q, T): each query attends within its own sequence of the row (segment_mask's rows of the first Q)."""
    return attn.segment_mask(jnp.asarray(SEGMENTS, jnp.int32))[:, :, :q_len]


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("q_len", [T, 1])
def test_cudnn_masked_attention_prepares_what_the_kernel_is_given(monkeypatch, q_len, window):
    # The kernel itself runs on a GPU only (test below); here XLA's stands in for it, so that the padding to even
    # lengths, the padded mask and the window folded into it are checked against the formula on any machine.
    xla = jax.nn.dot_product_attention
    seen = []

    def kernel(q, k, v, mask=None, implementation=None, **kw):
        seen.append((q.shape[1], k.shape[1], mask.shape, implementation))
        return xla(q, k, v, mask=mask, implementation="xla", **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", kernel)
    q, k, v, _, d_out = inputs(q_len)
    mask = packed_mask(q_len)
    local = mask if window is None else windowed(mask, q_len)
    d_out = d_out * jnp.asarray(np.asarray(local).any(-1)[:, 0], d_out.dtype)[..., None, None]
    fn = lambda q, k, v, m: attn.cudnn_masked_attention(q, k, v, m, window=window)  # noqa: E731
    out, grads = forward_and_grads(fn, q, k, v, mask, d_out)
    want, want_grads = forward_and_grads(formula, q, k, v, local, d_out)
    assert seen[0] == (q_len + q_len % 2, T, (B, 1, q_len + q_len % 2, T), "cudnn")
    # A query that sees no key sees every key in the kernel (kernel_mask): only the others' outputs are the
    # formula's; as no loss reaches the former, every gradient is.
    sees = np.asarray(local).any(-1)[:, 0]  # (B, Q)
    np.testing.assert_allclose(np.asarray(out)[sees], np.asarray(want)[sees], atol=1e-5)
    rows = [i for i, s in enumerate(SEGMENTS) if any(s)]  # the filler row: see assert_matches
    assert all(np.all(np.isfinite(np.asarray(x))) for x in (out, *grads))
    for got, expected in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(got)[rows], np.asarray(expected)[rows], atol=1e-5)


def test_the_masked_cudnn_kernel_gives_every_query_a_key():
    # cuDNN's backward gave NaN for a query that sees no key (bfloat16 on an H200: a packed row's padding, a filler
    # row), so kernel_mask lets such a query see every key; rows that see a key are given as they are.
    mask = np.asarray(packed_mask(T))
    assert not mask.any(-1).all()  # padding queries and the filler row see nothing
    got = np.asarray(attn.kernel_mask(jnp.asarray(mask), T + 2, T + 1))
    assert got.shape == (B, 1, T + 2, T + 1)
    assert got.any(-1).all()  # appended queries too
    assert not got[..., T:].any()  # the appended key is never attended
    seen = mask.any(-1)
    np.testing.assert_array_equal(got[:, :, :T, :T][seen], mask[seen])
    assert got[:, :, :T, :T][~seen].all()


def test_attend_gives_packed_rows_to_the_masked_cudnn_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(attn, "choose_attention", lambda *a: "cudnn")
    monkeypatch.setattr(attn, "cudnn_masked_attention", lambda q, k, v, m, window: calls.append(m.shape) or q)
    q, k, v, mask, _ = inputs()
    attn.attend(q, k, v, packed_mask(T), "cudnn", "bfloat16")
    assert calls == [(B, 1, T, T)]


@pytest.mark.gpu
@pytest.mark.skipif(not runs_here("cudnn"), reason="cuDNN attention needs a GPU")
@pytest.mark.parametrize("window", [None, WINDOW])
def test_cudnn_masked_attention_equals_the_formula_on_packed_rows(window):
    # bfloat16 inputs, tolerances as in test_cudnn_equals_the_formula_with_padding.
    # Padding queries see no key: cuDNN's output there is its own business (training gives them no loss), so
    # their cotangent is 0 and only the queries that see a key are compared.
    q, k, v, _, d_out = inputs(T, jnp.bfloat16)
    mask = packed_mask(T)
    local = mask if window is None else windowed(mask, T)
    d_out, seen = windowed_cotangent(local, d_out)
    out, grads = forward_and_grads(lambda q, k, v, m: attn.cudnn_masked_attention(q, k, v, m, window), q, k, v,
                                   mask, d_out)  # fmt: skip
    want, want_grads = forward_and_grads(formula, q, k, v, local, d_out)
    assert_seen_close(out, grads, want, want_grads, seen)


# ---------------------------------------------------------------------------------------------------- selection
@pytest.mark.parametrize(
    ("requested", "platform", "dropout", "dtype", "chosen"),
    [
        ("auto", "cpu", False, "float32", "custom"),
        ("auto", "cpu", False, "bfloat16", "custom"),
        ("auto", "gpu", False, "bfloat16", "cudnn"),
        ("auto", "gpu", False, "float32", "xla"),  # cuDNN's fused kernel takes half precision only
        ("auto", "tpu", False, "bfloat16", "xla"),
        ("auto", "tpu", False, "float32", "xla"),
        ("auto", "cpu", True, "float32", "custom"),
        ("custom", "gpu", True, "bfloat16", "custom"),
        ("auto", "gpu", True, "bfloat16", "pallas"),
        ("auto", "gpu", True, "float16", "pallas"),
        ("auto", "gpu", True, "float32", "explicit"),  # pallas is not measured in float32
        ("cudnn", "gpu", True, "bfloat16", "explicit"),
        ("xla", "gpu", True, "bfloat16", "explicit"),
        ("xla", "tpu", True, "float32", "explicit"),
        ("custom", "gpu", False, "bfloat16", "custom"),
        ("xla", "cpu", False, "float32", "xla"),
        ("cudnn", "gpu", False, "bfloat16", "cudnn"),
        ("explicit", "tpu", False, "bfloat16", "explicit"),
    ],
)
def test_choose_attention(requested, platform, dropout, dtype, chosen):
    assert attn.choose_attention(requested, platform, dropout, dtype) == chosen
    assert attn.choose_attention(requested, platform, dropout, dtype, head_dim=64) == chosen


def test_auto_leaves_cudnn_for_head_sizes_it_does_not_take():
    assert attn.choose_attention("auto", "gpu", False, "bfloat16", head_dim=128) == "cudnn"
    assert attn.choose_attention("auto", "gpu", False, "bfloat16", head_dim=20) == "xla"  # not a multiple of 8
    assert attn.choose_attention("auto", "gpu", False, "bfloat16", head_dim=256) == "xla"  # only Hopper takes it


def test_unknown_or_impossible_attention_is_refused():
    with pytest.raises(ValueError, match="attention 'flash' is not one of auto, custom, xla, cudnn, explicit"):
        ModelConfig(attention="flash")
    with pytest.raises(ValueError, match="attention 'cudnn' needs dtype bfloat16 .* this model has float32"):
        ModelConfig(attention="cudnn", dtype="float32")
    with pytest.raises(ValueError, match="attention 'cudnn' needs .* heads of 20"):
        ModelConfig(attention="cudnn", dtype="bfloat16", hidden_size=40, num_heads=2)
    assert ModelConfig(attention="cudnn", dtype="bfloat16").attention == "cudnn"
    with pytest.raises(ValueError, match="attention 'cudnn' needs an NVIDIA GPU; this program runs on cpu"):
        attn.choose_attention("cudnn", "cpu", False, "bfloat16")


def _model_inputs():
    ids = jnp.asarray(np.random.default_rng(0).integers(5, 1000, (3, 12)))
    mask = jnp.asarray(np.arange(12)[None, :] < np.array([[12], [7], [3]])).astype(jnp.int32)
    return ids, mask


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's choice")
def test_auto_runs_the_custom_path_on_cpu(monkeypatch):
    calls = []
    for name, fn in list(attn.IMPLEMENTATIONS.items()):
        spy = lambda *a, _name=name, _fn=fn, **kw: calls.append(_name) or _fn(*a, **kw)  # noqa: E731
        monkeypatch.setitem(attn.IMPLEMENTATIONS, name, spy)
    explicit = attn.explicit_attention
    monkeypatch.setattr(attn, "explicit_attention", lambda *a: calls.append("explicit") or explicit(*a))
    cfg = preset("test")
    assert cfg.attention == "auto"
    model = build(cfg)
    ids, mask = _model_inputs()
    model.eval()
    jaxpr = str(jax.make_jaxpr(lambda ids, mask: model(ids, mask))(ids, mask))
    assert calls == ["custom"] * cfg.num_layers
    assert "custom_vjp_call" in jaxpr  # the hand-written backward is in the program
    calls.clear()
    model.train()  # attention dropout 0.1: the custom path has it too
    graphdef, state = nnx.split(model)  # the dropout streams advance: a pure function of the state to trace
    jaxpr = str(jax.make_jaxpr(lambda state, ids, mask: nnx.merge(graphdef, state)(ids, mask))(state, ids, mask))
    assert calls == ["custom"] * cfg.num_layers
    assert "custom_vjp_call" in jaxpr


def test_model_outputs_agree_across_implementations():
    cfg = dataclasses.replace(preset("test"), hidden_dropout=0.0, attention_dropout=0.0)
    ids, mask = _model_inputs()
    outputs = {}
    for name in ("custom", "xla", "explicit"):
        model = build(dataclasses.replace(cfg, attention=name), head="sequence", num_labels=2)
        model.eval()
        outputs[name] = np.asarray(model(ids, mask))
    for name in ("xla", "explicit"):
        np.testing.assert_allclose(outputs[name], outputs["custom"], atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not runs_here("cudnn"), reason="cuDNN attention needs a GPU")
@pytest.mark.parametrize("seq_len", [12, 11])
def test_bf16_model_on_cudnn_stays_close_to_custom(seq_len):
    # A [CLS] head: the last layer's one query is odd-sized for cuDNN, as is an odd sequence length.
    cfg = dataclasses.replace(preset("test"), dtype="bfloat16", hidden_dropout=0.0, attention_dropout=0.0)
    ids, mask = (x[:, :seq_len] for x in _model_inputs())
    losses, grads = {}, {}
    for name in ("custom", "cudnn"):
        model = build(dataclasses.replace(cfg, attention=name), head="sequence", num_labels=2)
        model.train()
        losses[name], g = nnx.value_and_grad(lambda m: jnp.sum(m(ids, mask) ** 2))(model)
        grads[name] = np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
    # bf16 matmuls in both, rounded in different places: agreement to a few bf16 steps (2^-8 relative).
    assert float(losses["cudnn"]) == pytest.approx(float(losses["custom"]), rel=0.02)
    diff = np.linalg.norm(grads["cudnn"] - grads["custom"]) / np.linalg.norm(grads["custom"])
    assert diff < 0.02


def test_attention_is_not_written_to_config_json_and_loads_from_overrides(tmp_path):
    cfg = dataclasses.replace(preset("test"), attention="xla")
    assert "attention" not in config_to_hf(cfg, "mlm")
    folder = save_pretrained(build(cfg), tmp_path / "m")
    assert "attention" not in json.loads((folder / "config.json").read_text())
    assert load_pretrained(folder, need_tokenizer=False).model.config.attention == "auto"
    loaded = load_pretrained(folder, need_tokenizer=False, overrides={"attention": "explicit"})
    assert loaded.model.config.attention == "explicit"


# ---------------------------------------------------------------------------------------------------- mask value
def test_one_mask_constant_in_the_model_package():
    # Any other large negative literal, finfo minimum or -inf in model code would be a second mask value.
    other = re.compile(r"-\s*\d+(\.\d*)?e\+?\d+|finfo\([^)]*\)\.min|-\s*(jnp|np|math)\.inf|float\(\s*['\"]-inf")
    found = []
    for path in sorted(MODEL_DIR.glob("*.py")):
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if other.search(line) and not line.startswith("MASK_VALUE = "):
                found.append(f"{path.name}:{i}: {line.strip()}")
    assert not found
    assert heads.MASK_VALUE is attn.MASK_VALUE


def test_attention_pooling_masks_with_the_constant():
    cfg = dataclasses.replace(preset("test"), pooling="attention", hidden_dropout=0.0)
    head = heads.SequenceHead(cfg, 1, rngs=nnx.Rngs(0))
    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, cfg.hidden_size)), jnp.float32)
    valid = jnp.asarray([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    scores = hidden @ head.score[...]  # (B, T)
    weights = jax.nn.softmax(jnp.where(valid.astype(bool), scores, attn.MASK_VALUE), axis=-1)
    want = jnp.einsum("bt,btd->bd", weights, hidden)
    pooled = head.pool(hidden, valid)
    np.testing.assert_allclose(pooled, want, atol=1e-6)
    np.testing.assert_allclose(pooled[1], hidden[1].mean(axis=0), atol=1e-6)  # no valid token: uniform, finite
