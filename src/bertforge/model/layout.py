"""Memory layouts that the CPU backend's fast kernels need."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint


def row_major(a: jax.Array) -> jax.Array:
    """`a` laid out row-major in memory on CPU; as it is on other platforms.

    XLA's CPU backend runs a bf16 product on its fast kernels (AMX, AVX512-BF16) only when both operands are
    row-major, and otherwise upcasts it to float32, at a quarter of the speed or less. A transpose is a
    column-major view until a copy is forced. GPUs and TPUs read transposed operands directly: no copy there.
    """
    if jax.default_backend() != "cpu" or a.dtype == jnp.float32:
        return a
    return with_layout_constraint(a, Layout(major_to_minor=tuple(range(a.ndim))))
