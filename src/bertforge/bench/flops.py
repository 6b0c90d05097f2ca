"""Model FLOPs per token and device peaks, for MFU (model FLOPs utilisation).

Training FLOPs per token are 6x the multiply-adds of the forward pass: the dense layers (6 * params), the
attention products (6 * 2 * T * D per layer), and the vocabulary projection at the positions that are predicted
(all of them, or only the masked ones with the sparse head).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from bertforge.model.config import ModelConfig

# Dense bf16 peak FLOP/s per device (chip for TPUs; TPU v2/v3 count one chip = 2 cores).
PEAK_FLOPS = {
    "TPU v2": 45e12,
    "TPU v3": 123e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "Trillium": 918e12,
    "A100": 312e12,
    "H100": 989e12,
    "H200": 989e12,
}


def train_flops_per_token(cfg: ModelConfig, seq_len: int, predicted_fraction: float = 1.0) -> float:
    d, f, v, layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    dense = layers * (4 * d * d + 2 * d * f)  # q, k, v, out; feed-forward in and out
    attention = layers * 2 * seq_len * d  # scores and weighted values
    head = (d * d + d * v) * predicted_fraction  # transform + tied projection
    return 6.0 * (dense + attention + head)


@functools.cache
def measured_matmul_flops(dtype: str = "float32", n: int = 1024) -> float:
    """A CPU has no published peak here: take the rate of a large jitted matmul, measured once."""
    dt = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    a = jnp.ones((n, n), dt)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def device_peak_flops(dtype: str = "bfloat16") -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from)."""
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", "") or ""
    for name, peak in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return peak, f"{kind} datasheet"
    if device.platform == "cpu":
        # Simulated devices share the same cores: the measured rate is that of the whole CPU.
        return measured_matmul_flops(dtype) / jax.local_device_count(), "measured matmul"
    return float("nan"), f"{kind}: peak unknown"
