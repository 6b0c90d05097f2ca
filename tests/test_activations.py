"""The exact GELU against PyTorch's (torch.nn.functional.gelu, which the transformers models run)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bertforge.model.activations import gelu

X = np.concatenate([np.linspace(-12.0, 12.0, 20_001), [-40.0, -0.0, 0.0, 40.0]]).astype(np.float32)


def _torch(x: np.ndarray, dtype: torch.dtype = torch.float32) -> tuple[np.ndarray, np.ndarray]:
    t = torch.tensor(x, dtype=dtype, requires_grad=True)
    y = torch.nn.functional.gelu(t)
    y.sum().backward()
    return y.detach().float().numpy(), t.grad.float().numpy()


def test_value_and_derivative_equal_torch_in_float32():
    want, dwant = _torch(X)
    got = np.asarray(gelu(jnp.asarray(X)))
    dgot = np.asarray(jax.grad(lambda x: gelu(x).sum())(jnp.asarray(X)))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    np.testing.assert_allclose(dgot, dwant, rtol=0, atol=1e-6)
    assert np.all(np.isfinite(dgot))


def test_derivative_is_the_vector_jacobian_product():
    """The written-out backward scales an arbitrary cotangent as jax's own GELU derivative does."""
    x = jnp.asarray(X)
    g = jnp.asarray(np.random.default_rng(0).normal(size=X.shape).astype(np.float32))
    got = jax.vjp(gelu, x)[1](g)[0]
    want = jax.vjp(lambda v: jax.nn.gelu(v, approximate=False), x)[1](g)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_keeps_its_dtype_and_torch_values(dtype):
    x = X[np.abs(X) < 8]
    torch_dtype = torch.bfloat16 if dtype == jnp.bfloat16 else torch.float16
    want, dwant = _torch(np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)), torch_dtype)
    y, back = jax.vjp(gelu, jnp.asarray(x, dtype))
    (dx,) = back(jnp.ones_like(y))
    assert y.dtype == dtype and dx.dtype == dtype
    tol = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(dx, np.float32), dwant, rtol=tol, atol=tol)
