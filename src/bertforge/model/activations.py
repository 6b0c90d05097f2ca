"""Activation functions whose automatic derivatives cost more time and memory than they need to."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_SQRT_HALF = np.float32(np.sqrt(0.5))
_INV_SQRT_2PI = np.float32(1.0 / np.sqrt(2.0 * np.pi))


@jax.custom_vjp
def gelu(x: jax.Array) -> jax.Array:
    """Exact GELU, x * Phi(x) = x / 2 * (1 + erf(x / sqrt(2))), as PyTorch computes it, in float32 whatever the
    input's dtype.

    jax.nn.gelu(approximate=False) goes through erfc, which XLA evaluates as two branches and a select, and its
    derivative differentiates that; erf is one polynomial, and the derivative Phi(x) + x phi(x) is written out.
    """
    return _gelu(x)


def _phi(f: jax.Array) -> jax.Array:
    """The standard normal CDF of float32 f: (1 + erf(f / sqrt(2))) / 2."""
    return 0.5 * (1.0 + jax.lax.erf(f * _SQRT_HALF))


def _gelu(x: jax.Array) -> jax.Array:
    f = x.astype(jnp.float32)
    return (f * _phi(f)).astype(x.dtype)


def _gelu_fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _gelu(x), x


def _gelu_bwd(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    f = x.astype(jnp.float32)
    slope = _phi(f) + f * _INV_SQRT_2PI * jnp.exp(-0.5 * f * f)  # Phi(x) + x phi(x)
    return ((g.astype(jnp.float32) * slope).astype(g.dtype),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)
