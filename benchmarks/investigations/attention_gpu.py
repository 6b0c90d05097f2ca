"""Attention forward and backward on an accelerator: bertforge's attention against jax.nn.dot_product_attention.

BERT-base shapes (12 heads of 64), batch 32, sequence lengths 128 and 512, bf16, with a padding mask (each row
keeps a random length between half and all of the sequence, padded on the right as tokenizers pad). Variants:

- bertforge attention: `bertforge.model.attention.attention` with `padding_bias`, the path of every layer without
  attention dropout (fine-tuning, evaluation), with its hand-written backward;
- bertforge attention with dropout 0.1: the einsum path layers take in training with attention dropout (the
  pretraining default), differentiated automatically;
- jax.nn.dot_product_attention with implementation 'xla' (what None selects) and 'cudnn' (cuDNN's fused attention),
  each given the padding as a boolean mask, as a mask broadcast to every query, or as key lengths.

Times are the median over repeats of a loop of jitted calls, per call. Numerics: the largest absolute difference
of the output and of the gradients of q, k, v (for a random output cotangent) from the plain formula computed in
float32 at the highest matmul precision from the same bf16 inputs (dropout variants excluded).

    python benchmarks/investigations/attention_gpu.py [--batch 32] [--seq-lens 128 512] [--heads 12] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import _path  # noqa: F401 (the benchmarks' folder on the path)
import jax
import jax.numpy as jnp
import report
from flax import nnx

from bertforge.model.attention import attention, explicit_attention, padding_bias


def reference(q, k, v, mask):
    """The plain formula in float32, highest precision; mask (B, 1, 1, T) bool."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    hp = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("bqnh,bknh->bnqk", q, k, precision=hp) * q.shape[-1] ** -0.5
    probs = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bnqk,bknh->bqnh", probs, v, precision=hp)


def variants() -> dict:
    """name -> attention function of (q, k, v, pad); pad holds the padding as a mask (B, 1, 1, T), as lengths (B,)
    and the dropout key, passed to the jitted functions as arguments (as a training step receives them)."""
    dpa = jax.nn.dot_product_attention
    dropout = nnx.Dropout(0.1, rngs=nnx.Rngs(0))

    def full(mask):  # (B, 1, 1, T) -> (B, 1, Q, T)
        return jnp.broadcast_to(mask, (mask.shape[0], 1, mask.shape[-1], mask.shape[-1]))

    return {
        "bertforge attention (hand-written backward)": lambda q, k, v, p: attention(q, k, v, padding_bias(p["mask"])),
        "bertforge attention, dropout 0.1 (training path)": lambda q, k, v, p: explicit_attention(
            q, k, v, p["mask"], dropout, p["key"]
        ),
        "jax dpa, XLA, mask (B,1,1,T)": lambda q, k, v, p: dpa(q, k, v, mask=p["mask"], implementation="xla"),
        "jax dpa, XLA, key lengths": lambda q, k, v, p: dpa(
            q, k, v, key_value_seq_lengths=p["lengths"], implementation="xla"
        ),
        "jax dpa, cuDNN, mask (B,1,1,T)": lambda q, k, v, p: dpa(q, k, v, mask=p["mask"], implementation="cudnn"),
        "jax dpa, cuDNN, mask (B,1,T,T)": lambda q, k, v, p: dpa(q, k, v, mask=full(p["mask"]), implementation="cudnn"),
        "jax dpa, cuDNN, key lengths": lambda q, k, v, p: dpa(
            q, k, v, key_value_seq_lengths=p["lengths"], implementation="cudnn"
        ),
    }


def timed(fn, args, inner: int, repeats: int) -> float:
    """Median seconds per call over `repeats` loops of `inner` calls."""
    jax.block_until_ready(fn(*args))  # compile
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def max_diff(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def run_shape(batch: int, seq_len: int, heads: int, head_dim: int, dtype, inner: int, repeats: int) -> list[dict]:
    keys = jax.random.split(jax.random.key(0), 6)
    shape = (batch, seq_len, heads, head_dim)
    q, k, v, ct = (jax.random.normal(kk, shape, jnp.float32).astype(dtype) for kk in keys[:4])
    lengths = jax.random.randint(keys[4], (batch,), seq_len // 2, seq_len + 1).astype(jnp.int32)
    mask = (jnp.arange(seq_len)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, T)

    pad = {"mask": mask, "lengths": lengths, "key": keys[5]}

    def loss_of(fn):
        return lambda q, k, v, p, ct: jnp.sum(fn(q, k, v, p).astype(jnp.float32) * ct.astype(jnp.float32))

    ref = lambda q, k, v, p: reference(q, k, v, p["mask"])  # noqa: E731
    ref_out = jax.jit(ref)(q, k, v, pad)
    ref_grads = jax.jit(jax.grad(loss_of(ref), argnums=(0, 1, 2)))(q, k, v, pad, ct)
    ref_scale = max(float(jnp.max(jnp.abs(ref_out))), *(float(jnp.max(jnp.abs(g))) for g in ref_grads))
    rows = []
    for name, fn in variants().items():
        row = {"batch": batch, "seq_len": seq_len, "heads": heads, "head_dim": head_dim,
               "dtype": jnp.dtype(dtype).name, "implementation": name}  # fmt: skip
        try:
            fwd = jax.jit(fn)
            bwd = jax.jit(jax.value_and_grad(loss_of(fn), argnums=(0, 1, 2)))
            row["fwd_ms"] = 1e3 * timed(fwd, (q, k, v, pad), inner, repeats)
            row["fwd_bwd_ms"] = 1e3 * timed(bwd, (q, k, v, pad, ct), inner, repeats)
            if "dropout" not in name:
                out = fwd(q, k, v, pad)
                _, grads = bwd(q, k, v, pad, ct)
                row["out_max_abs_diff"] = max_diff(out, ref_out)
                row["grad_max_abs_diff"] = max(max_diff(g, r) for g, r in zip(grads, ref_grads, strict=True))
                row["ref_max_abs"] = ref_scale
        except Exception as e:  # an implementation that refuses these inputs: record why
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--inner", type=int, default=20, help="calls per timed loop")
    ap.add_argument("--repeats", type=int, default=10, help="timed loops; the median is reported")
    ap.add_argument("--name", help="results name (default attention_<platform>)")
    args = ap.parse_args()
    dtype = jnp.dtype(args.dtype)
    rows = []
    for t in args.seq_lens:
        rows += run_shape(args.batch, t, args.heads, args.head_dim, dtype, args.inner, args.repeats)

    def cell(r, key, fmt):
        return format(r[key], fmt) if key in r else "-"

    lines = [
        "| B x T | implementation | forward ms | forward + backward ms | x bertforge (fwd + bwd) "
        "| max abs diff, output | max abs diff, grads |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in args.seq_lens:
        ours = [r for r in rows if r["seq_len"] == t]
        base = ours[0].get("fwd_bwd_ms", float("nan"))
        for r in ours:
            if "error" in r:
                lines.append(f"| {r['batch']} x {t} | {r['implementation']} | fails: {r['error'][:120]} "
                             "| | | | |")  # fmt: skip
                continue
            speed = base / r["fwd_bwd_ms"]
            lines.append(f"| {r['batch']} x {t} | {r['implementation']} | {r['fwd_ms']:.3f} | "
                         f"{r['fwd_bwd_ms']:.3f} | {speed:.2f} | {cell(r, 'out_max_abs_diff', '.2e')} | "
                         f"{cell(r, 'grad_max_abs_diff', '.2e')} |")  # fmt: skip
    device = jax.devices()[0]
    kind = device.device_kind if device.platform != "cpu" else "CPU"
    title = (
        f"Attention forward + backward, {args.heads} heads x {args.head_dim}, {args.dtype}, padding mask, {kind}, "
        f"jax {jax.__version__}"
    )
    timed_rows = [r for r in rows if "fwd_bwd_ms" in r]
    bars = [(f"{r['seq_len']}: {r['implementation']}", r["fwd_bwd_ms"],
             "C0" if r["implementation"].startswith("bertforge") else "C1") for r in timed_rows]  # fmt: skip
    platform = "gpu" if device.platform == "gpu" else device.platform
    report.save(args.name or f"attention_{platform}", title, "\n".join(lines), rows, bars,
                "forward + backward ms per call (lower is better)")  # fmt: skip


if __name__ == "__main__":
    main()
