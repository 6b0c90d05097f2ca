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
from bertforge.model.relative import relative_reach

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


def _attended_keys(cfg: ModelConfig, seq_len: int) -> int:
    """Keys each query attends to, summed over the layers: ModernBERT's local layers see a window of
    local_attention + 1 keys (local_attention // 2 on each side), its global ones, and every other family's, all."""
    if cfg.family != "modernbert":
        return cfg.num_layers * seq_len
    local = min(seq_len, 2 * (cfg.local_attention // 2) + 1)
    n_global = len(range(0, cfg.num_layers, cfg.global_attn_every_n_layers))
    return n_global * seq_len + (cfg.num_layers - n_global) * local


def _relative_rows(cfg: ModelConfig, seq_len: int) -> int:
    """DeBERTa's disentangled attention: each query's scores against the relative-position table (2 x its span
    rows, at most 2 x seq_len distances), once per kind of it (c2p, p2c), in every layer; 0 for other families."""
    if not cfg.relative_attention:
        return 0
    span, _ = relative_reach(cfg)
    return cfg.num_layers * len(cfg.pos_att_type) * min(2 * span, 2 * seq_len)


def train_flops_per_token(cfg: ModelConfig, seq_len: int, predicted_fraction: float = 1.0) -> float:
    d, f, v, layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    ffn = 3 * d * f if cfg.family == "modernbert" else 2 * d * f  # ModernBERT's is gated (GeGLU): in is d x 2f
    dense = layers * (4 * d * d + ffn)  # q, k, v, out; feed-forward in and out
    attention = (2 * _attended_keys(cfg, seq_len) + _relative_rows(cfg, seq_len)) * d  # scores, weighted values
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
