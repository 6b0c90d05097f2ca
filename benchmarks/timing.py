"""What the step benchmarks' child processes share: an exclusive hold on the device while they time steps, and
their peak device memory.

Several children may compile at once (compilation runs on the host's cores), but only one at a time runs its
timed steps: the parent names a lock file in BENCH_DEVICE_LOCK, and `exclusive()` holds it. Without that
variable (one child at a time) it holds nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator


@contextlib.contextmanager
def exclusive(path: str | None = None) -> Iterator[None]:
    """Hold the device lock: `path`, else the one BENCH_DEVICE_LOCK names (none: hold nothing)."""
    path = path or os.environ.get("BENCH_DEVICE_LOCK")
    if not path:
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def jax_peak_bytes() -> int | None:
    """The first device's peak bytes in use since the process started (None where JAX keeps no such count: CPU)."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def torch_peak_bytes(device: str) -> int | None:
    import torch

    return torch.cuda.max_memory_allocated() if device == "cuda" else None


def torch_timed(model, opt, loss_of, device: str, compiled: bool, warm: int, steps: int, bf16: bool = True) -> dict:
    """Time training steps of a PyTorch model: `loss_of()` under bf16 autocast, backward, clipping at 1, `opt`'s
    update; `warm` untimed calls first (torch.compile compiles in them), then `steps` timed ones, holding the
    device. -> {step_s (median), warmup_s, loss (the last), peak_bytes}."""
    import time

    import numpy as np
    import torch

    def train_step():
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    fn = torch.compile(train_step) if compiled else train_step
    start = time.perf_counter()
    for _ in range(warm):
        fn().item()
    warmup_s = time.perf_counter() - start
    times = []
    with exclusive():
        for _ in range(steps):
            start = time.perf_counter()
            loss = fn().item()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return {"step_s": float(np.median(times)), "warmup_s": warmup_s, "loss": loss,
            "peak_bytes": torch_peak_bytes(device)}  # fmt: skip
