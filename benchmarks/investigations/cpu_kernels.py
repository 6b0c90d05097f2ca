"""XLA's CPU products and attention against PyTorch's, each alone, at the shapes of the fine-tuning benchmarks.

Two measurements, each against PyTorch in the same process:
1. The three products of a dense layer's step (the forward x @ W, the input's gradient g @ W^T and the weight's
   gradient x^T @ g) at a packed step's tokens and each model's widths: GFLOP/s, the median of 50 calls.
2. One attention layer's forward and backward: bertforge's attention on the CPU (model.attention.custom_attention,
   float32, a padding mask) against `torch.nn.functional.scaled_dot_product_attention` with the same mask; the
   median of 15 calls.

Each runs in two processes: under glibc's defaults, and under the allocator tunables `bertforge finetune` runs
with (runtime/allocator.py). Alone, a program's outputs over glibc's mmap threshold are mapped afresh and faulted
in at every call under the defaults, which a product or an attention of tens of megabytes pays in full; the
tunables keep that memory. Both libraries run on the same 2 threads.

    .venv/bin/python benchmarks/investigations/cpu_kernels.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (model, tokens of a micro-batch, hidden, intermediate): MiniLM's packed NER micro-batch (17 x 128), the Japanese
# BERT mini's (12 x 128), and the short-text task's (5 x 64).
DENSE = (("all-MiniLM-L6-v2", 2176, 384, 1536), ("BERT mini", 1536, 256, 1024), ("all-MiniLM-L6-v2", 320, 384, 1536))
# (where, rows, length, heads, head size)
ATTENTION = (
    ("CommonLit, MiniLM", 16, 256, 12, 32),
    ("NER, MiniLM", 17, 128, 12, 32),
    ("NER, BERT mini", 12, 128, 4, 64),
)
SETTINGS = ("glibc defaults", "finetune's tunables")


def _median(call, reps: int) -> float:
    call()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rates(fn, arrays: tuple, flop: float) -> tuple[float, float]:
    """GFLOP/s of `fn` on `arrays` (numpy) in XLA and in PyTorch."""
    import jax
    import torch

    jitted, on_device = jax.jit(fn), [jax.numpy.asarray(a) for a in arrays]
    xla = _median(lambda: jitted(*on_device).block_until_ready(), 50)
    tensors = [torch.from_numpy(a) for a in arrays]
    return flop / xla, flop / _median(lambda: fn(*tensors), 50)


def dense_rates() -> list[dict]:
    """GFLOP/s of XLA and PyTorch for each dense product at DENSE's shapes."""
    import numpy as np

    rng = np.random.default_rng(0)
    products = {"x @ W": lambda x, w, g: x @ w, "g @ W^T": lambda x, w, g: g @ w.T, "x^T @ g": lambda x, w, g: x.T @ g}
    rows = []
    for model, m, d, inner in DENSE:
        for din, dout in ((d, d), (d, inner), (inner, d)):
            arrays = tuple(rng.normal(size=s).astype(np.float32) for s in ((m, din), (din, dout), (m, dout)))
            for name, fn in products.items():
                xla, pt = _rates(fn, arrays, 2 * m * din * dout / 1e9)
                rows.append({"model": model, "shape": f"{m} x {din} x {dout}", "product": name,
                             "xla_gflops": xla, "torch_gflops": pt})  # fmt: skip
    return rows


def _attention_ms(q, k, v, keep) -> tuple[float, float]:
    """Milliseconds of bertforge's attention and of PyTorch's SDPA, forward and backward; q, k, v (B, T, N, H) and
    keep (B, T) numpy arrays."""
    import jax
    import jax.numpy as jnp
    import torch

    from bertforge.model.attention import custom_attention

    mask = jnp.asarray(keep)[:, None, None, :]  # (B, 1, 1, T)
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(custom_attention(q, k, v, mask) ** 2), argnums=(0, 1, 2)))
    arrays = [jnp.asarray(a) for a in (q, k, v)]
    ours = _median(lambda: jax.block_until_ready(grad(*arrays)), 15)
    tq, tk, tv = (torch.from_numpy(a).transpose(1, 2).contiguous().requires_grad_() for a in (q, k, v))
    tmask = torch.from_numpy(keep)[:, None, None, :]

    def torch_step() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tmask)
        (out**2).sum().backward()
        tq.grad = tk.grad = tv.grad = None

    return 1e3 * ours, 1e3 * _median(torch_step, 15)


def attention_times() -> list[dict]:
    """Milliseconds of one attention layer's forward and backward, bertforge's against PyTorch's SDPA."""
    import numpy as np

    rng = np.random.default_rng(0)
    rows = []
    for where, b, t, n, h in ATTENTION:
        q, k, v = (rng.normal(size=(b, t, n, h)).astype(np.float32) for _ in range(3))
        keep = np.arange(t)[None, :] < rng.integers(t // 2, t + 1, b)[:, None]  # (B, T)
        ours, theirs = _attention_ms(q, k, v, keep)
        rows.append({"where": where, "shape": f"{b} x {t}, {n} heads of {h}", "bertforge_ms": ours,
                     "torch_ms": theirs})  # fmt: skip
    return rows


def _worker() -> None:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    print(json.dumps({"dense": dense_rates(), "attention": attention_times()}))


def _run(setting: str) -> dict:
    from bertforge.runtime.allocator import tunables

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "JAX_PLATFORMS": "cpu"}
    env.pop("GLIBC_TUNABLES", None)
    if setting == SETTINGS[1]:
        env["GLIBC_TUNABLES"] = ":".join(f"{k}={v}" for k, v in tunables("finetune").items())
    out = subprocess.run([sys.executable, __file__, "--worker"], check=True, env=env, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _tables(results: dict[str, dict]) -> str:
    plain, tuned = (results[s] for s in SETTINGS)
    lines = ["| model | product (M x K x N) | XLA, glibc defaults | XLA, finetune's tunables | PyTorch, same process "
             "| XLA / PyTorch |", "|---|---|---|---|---|---|"]  # fmt: skip
    for a, r in zip(plain["dense"], tuned["dense"], strict=True):
        lines.append(f"| {r['model']} | {r['product']} ({r['shape']}) | {a['xla_gflops']:.0f} GFLOP/s | "
                     f"{r['xla_gflops']:.0f} GFLOP/s | {r['torch_gflops']:.0f} GFLOP/s | "
                     f"{r['xla_gflops'] / r['torch_gflops']:.2f} |")  # fmt: skip
    lines += ["", "| attention, forward and backward | shape | bertforge, glibc defaults | bertforge, finetune's "
              "tunables | PyTorch SDPA, same process | bertforge / PyTorch |", "|---|---|---|---|---|---|"]  # fmt: skip
    for a, r in zip(plain["attention"], tuned["attention"], strict=True):
        lines.append(f"| {r['where']} | {r['shape']} | {a['bertforge_ms']:.1f} ms | {r['bertforge_ms']:.1f} ms | "
                     f"{r['torch_ms']:.1f} ms | {r['bertforge_ms'] / r['torch_ms']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--name", default="cpu_kernels", help="results/<name>.{md,json,png}")
    args = p.parse_args()
    if args.worker:
        _worker()
        return
    sys.path.insert(0, str(ROOT / "src"))
    from report import save

    results = {setting: _run(setting) for setting in SETTINGS}
    tuned = results[SETTINGS[1]]
    bars = [(f"{r['where']}: bertforge", r["bertforge_ms"], "C0") for r in tuned["attention"]]
    bars += [(f"{r['where']}: PyTorch SDPA", r["torch_ms"], "grey") for r in tuned["attention"]]
    title = f"XLA's CPU products and attention against PyTorch's, alone, {os.cpu_count()} cores, float32"
    xlabel = "attention forward and backward (ms), finetune's tunables"
    save(args.name, title, _tables(results), [results], bars, xlabel)


if __name__ == "__main__":
    main()
