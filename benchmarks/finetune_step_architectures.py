"""Fine-tuning step throughput per architecture: bertforge (JAX) against transformers (PyTorch), eager and
torch.compile, on a base-sized config of each family with random weights.

One step = forward, MSE loss of a one-output sequence head, backward, gradient clipping and AdamW, on batches of
16 x 256 token ids with the last fifth of every other row padded. The model configs are the public base
checkpoints' (config.json fields as the hub has them, dropout included), built by transformers' config classes
and read by bertforge's own config.json reader, so both sides run the same architecture. Each implementation runs
in a fresh process: warm-up (compilation) steps first, then the median time of the timed steps. On a CPU,
bertforge's process has the glibc allocator tunables that every bertforge command sets there (runtime/allocator.py).

    .venv/bin/python benchmarks/finetune_step_architectures.py [--archs deberta-v2 modernbert electra distilbert]
        [--device cpu|gpu] [--steps 3]

On a GPU both sides compute in bf16 (bertforge's model.dtype bfloat16; torch autocast) and transformers uses SDPA
attention; the table adds MFU, from the FLOPs XLA counts in bertforge's compiled step (the same arithmetic for
both sides) against the GPU's dense bf16 datasheet peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import report
from timing import exclusive, jax_peak_bytes, torch_timed

from bertforge.runtime.allocator import tuned_environment

BATCH, SEQ = 16, 256

# The public base checkpoints' config.json fields (microsoft/deberta-v3-base, answerdotai/ModernBERT-base,
# google/electra-base-discriminator, distilbert-base-uncased), as transformers' config classes take them.
CONFIGS = {
    "bert": ("BertConfig", {}),
    "deberta-v2": (
        "DebertaV2Config",
        dict(
            vocab_size=128100,
            hidden_size=768,  # DebertaV2Config's defaults are the xlarge model's
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            pooler_hidden_size=768,
            max_position_embeddings=512,
            relative_attention=True,
            position_buckets=256,
            norm_rel_ebd="layer_norm",
            share_att_key=True,
            pos_att_type=["p2c", "c2p"],
            position_biased_input=False,
            type_vocab_size=0,
            layer_norm_eps=1e-7,
            max_relative_positions=-1,
        ),
    ),  # fmt: skip
    "modernbert": ("ModernBertConfig", dict(vocab_size=50368, num_hidden_layers=22, intermediate_size=1152)),
    "electra": (
        "ElectraConfig",
        dict(embedding_size=768, hidden_size=768, num_attention_heads=12, num_hidden_layers=12, intermediate_size=3072),
    ),  # fmt: skip
    "distilbert": ("DistilBertConfig", {}),
}


def hf_config(arch: str, attn: str | None = None):
    import transformers

    name, fields = CONFIGS[arch]
    extra = {} if attn is None else {"attn_implementation": attn}
    if os.environ.get("BENCH_SMOKE"):  # a check of the script itself: tiny models
        extra.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
        extra.update(dim=64, n_layers=2, n_heads=2, hidden_dim=128) if arch == "distilbert" else None
        extra.update(embedding_size=64) if arch == "electra" else None
        extra.update(pooler_hidden_size=64) if arch == "deberta-v2" else None
    return getattr(transformers, name)(num_labels=1, **{**fields, **extra})


def batch(vocab: int, seed: int = 0, rows: int = BATCH, seq: int = SEQ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, min(vocab, 30000), size=(rows, seq), dtype=np.int32)
    mask = np.ones_like(ids)
    mask[::2, seq - seq // 5 :] = 0
    ids[mask == 0] = 0
    return ids, mask, rng.normal(size=(rows, 1)).astype(np.float32)


def run_bertforge(arch: str, steps: int, dtype: str, rows: int = BATCH, seq: int = SEQ) -> dict:
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bertforge.model.architectures import build, config_from_hf
    from bertforge.train.optim import OptimConfig, make_optimizer
    from bertforge.train.sequence_step import SequenceStepConfig, train_step
    from bertforge.train.step import TrainState

    data = hf_config(arch).to_dict()
    cfg, _ = config_from_hf(data, arch)
    cfg = cfg.__class__(**{**cfg.__dict__, "dtype": dtype})
    model = build(cfg, "sequence", num_labels=1)
    model.train()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = make_optimizer(OptimConfig(lr=2e-5))
    state = TrainState(jnp.int32(0), params, tx.init(params))
    step = jax.jit(
        functools.partial(train_step, graphdef, rest, tx=tx, cfg=SequenceStepConfig(loss="mse")), donate_argnums=(0,)
    )
    ids, mask, targets = batch(cfg.vocab_size, rows=rows, seq=seq)
    feed = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask),
            "token_type_ids": jnp.zeros_like(jnp.asarray(ids)), "targets": jnp.asarray(targets),
            "weight": jnp.ones((rows,), jnp.float32)}  # fmt: skip
    lr, key = jnp.float32(2e-5), jax.random.key(0)
    start = time.perf_counter()
    compiled = step.lower(state, feed, lr, key).compile()
    compile_s = time.perf_counter() - start
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    params_count = int(sum(x.size for x in jax.tree.leaves(params)))
    times = []
    with exclusive():
        for i in range(steps + 1):
            start = time.perf_counter()
            state, metrics = compiled(state, feed, lr, key)
            jax.block_until_ready(metrics["loss"])
            if i:
                times.append(time.perf_counter() - start)
    return {"step_s": float(np.median(times)), "compile_s": compile_s, "flops": float(cost.get("flops", 0.0)),
            "params": params_count, "jax": jax.__version__, "peak_bytes": jax_peak_bytes(),
            "loss": float(metrics["loss"])}  # fmt: skip


def run_torch(
    arch: str, steps: int, compiled: bool, bf16: bool, device: str, rows: int = BATCH, seq: int = SEQ
) -> dict:
    import torch
    from transformers import AutoModelForSequenceClassification

    attn = "sdpa" if arch != "deberta-v2" else None  # DeBERTa has only its own attention
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(hf_config(arch, attn)).to(device).train()
    # fused: the Trainer's default optimizer (adamw_torch_fused) where it runs, on a GPU.
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01, fused=device == "cuda")
    ids, mask, targets = (torch.tensor(x, device=device) for x in batch(model.config.vocab_size, rows=rows, seq=seq))
    ids = ids.long()

    def loss_of():
        out = model(input_ids=ids, attention_mask=mask).logits
        return torch.nn.functional.mse_loss(out.float(), targets)

    timed = torch_timed(model, opt, loss_of, device, compiled, warm=2 if compiled else 1, steps=steps, bf16=bf16)
    return {**timed, "torch": torch.__version__, "attn_implementation": model.config._attn_implementation}


def variants(device: str) -> list[tuple[str, str, dict]]:
    if device == "gpu":
        return [
            ("transformers eager bf16 autocast", "torch", {"compiled": False, "bf16": True}),
            ("transformers torch.compile bf16 autocast", "torch", {"compiled": True, "bf16": True}),
            ("bertforge bf16", "jax", {"dtype": "bfloat16"}),
        ]
    return [
        ("transformers eager fp32", "torch", {"compiled": False, "bf16": False}),
        ("transformers torch.compile fp32", "torch", {"compiled": True, "bf16": False}),
        ("bertforge fp32", "jax", {"dtype": "float32"}),
    ]


def peak_flops(device: str) -> tuple[float, str]:
    if device != "gpu":
        return float("nan"), "none (CPU)"
    import torch

    from bertforge.train.flops import PEAK_FLOPS

    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), float("nan")), f"{name} dense bf16 datasheet"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", nargs="+", default=["deberta-v2", "modernbert", "electra", "distilbert"])
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds after which a variant is stopped")
    ap.add_argument("--skip", nargs="*", default=[], help="ARCH=IMPLEMENTATION pairs not to run (reported as skipped)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        spec = json.loads(args.child)
        if spec["impl"] == "torch":
            out = run_torch(spec["arch"], args.steps, device=spec["device"], **spec["kw"])
        else:
            out = run_bertforge(spec["arch"], args.steps, **spec["kw"])
        print(json.dumps(out))
        return

    env = dict(os.environ)
    if args.device == "cpu":
        env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    torch_env = dict(env, JAX_PLATFORMS="cpu")
    # On a CPU every bertforge command runs with its allocator tunables (runtime/allocator.py); its step here does too.
    env = tuned_environment(env, command="finetune") or env
    rows = []
    for arch in args.archs:
        for name, impl, kw in variants(args.device):
            if f"{arch}={name}" in args.skip:
                rows.append({"arch": arch, "implementation": name, "failed": "not run (--skip)"})
                continue
            spec = {"impl": impl, "arch": arch, "kw": kw, "device": "cuda" if args.device == "gpu" else "cpu"}
            cmd = [sys.executable, __file__, "--child", json.dumps(spec), "--steps", str(args.steps)]
            start = time.perf_counter()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=args.timeout,
                                      env=torch_env if impl == "torch" else env)  # fmt: skip
            except subprocess.TimeoutExpired:
                print(f"{arch} {name} stopped after {args.timeout:g} s", file=sys.stderr)
                rows.append({"arch": arch, "implementation": name, "failed": f"no step within {args.timeout:g} s"})
                continue
            if proc.returncode:
                # A process the kernel kills for memory has no traceback: say so in the table.
                why = "killed (out of memory)" if proc.returncode == -9 else f"failed (exit {proc.returncode})"
                print(f"{arch} {name} {why}:\n{proc.stderr[-3000:]}", file=sys.stderr)
                rows.append({"arch": arch, "implementation": name, "failed": why})
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append({"arch": arch, "implementation": name, "tokens_per_s": BATCH * SEQ / r["step_s"], **r,
                         "process_s": time.perf_counter() - start})  # fmt: skip
            print(
                f"{arch:11} {name:42} {rows[-1]['tokens_per_s']:9,.0f} tokens/s  step {r['step_s']:.3f} s", flush=True
            )

    peak, source = peak_flops(args.device)
    lines = [
        "| architecture | implementation | step s | tokens/s | x faster transformers | MFU |",
        "|---|---|---|---|---|---|",
    ]
    bars = []
    for arch in args.archs:
        ours = [r for r in rows if r["arch"] == arch]
        theirs = [
            r["tokens_per_s"] for r in ours if r["implementation"].startswith("transformers") and "failed" not in r
        ]
        flops = next((r["flops"] for r in ours if "flops" in r), float("nan"))
        for r in ours:
            if "failed" in r:
                lines.append(f"| {arch} | {r['implementation']} | {r['failed']} | - | - | - |")
                continue
            r["x_best_transformers"] = r["tokens_per_s"] / max(theirs) if theirs else float("nan")
            r["mfu"] = flops / r["step_s"] / peak
            mfu = f"{r['mfu']:.1%}" if np.isfinite(r["mfu"]) else "-"
            lines.append(f"| {arch} | {r['implementation']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                         f"{r['x_best_transformers']:.2f} | {mfu} |")  # fmt: skip
            colour = "tab:blue" if r["implementation"].startswith("bertforge") else "tab:gray"
            bars.append((f"{arch}: {r['implementation']}", r["tokens_per_s"], colour))
    title = (f"Fine-tuning step, base-sized configs, batch {BATCH} x {SEQ}, AdamW, {args.device.upper()} "
             f"({'bf16' if args.device == 'gpu' else 'fp32'}); MFU against {source}")  # fmt: skip
    report.save(f"finetune_step_architectures_{args.device}", title, "\n".join(lines), rows, bars, "tokens/s")


if __name__ == "__main__":
    main()
