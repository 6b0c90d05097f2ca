"""MLM training throughput: bertforge (JAX) against transformers' BertForMaskedLM (PyTorch), eager and compiled.

Same model config (a BERT preset, vocabulary 30522), same batch and sequence length, AdamW, 15% masking. Each
implementation runs in a fresh process: compile / warm-up steps first, then the median step time of the timed
steps. The bertforge rows switch its levers one at a time: the vocabulary projection only at the masked positions
(sparse head) and bf16 matmuls with fp32 accumulation. MFU counts the FLOPs each variant needs (a sparse head
projects 15% of the positions) against the device's peak (for a CPU, a measured large-matmul rate).

    .venv/bin/python benchmarks/investigations/pretrain_throughput.py [--presets mini small] [--device cpu|gpu]

On a GPU the transformers rows add torch.compile with bf16 autocast, and the PyTorch processes see no GPU through
JAX (JAX_PLATFORMS=cpu), so that only PyTorch holds its memory. Every child process runs with the interpreter
running this script.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import _path  # noqa: F401 (the benchmarks' folder on the path)
import numpy as np
import report

VOCAB, RATE = 30522, 0.15


def batches(n: int, batch: int, seq_len: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, VOCAB, size=(batch, seq_len), dtype=np.int32) for _ in range(n)]


def run_bertforge(preset: str, batch: int, seq_len: int, steps: int, sparse: bool, dtype: str) -> dict:
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bertforge.data.masking import MaskingSpec
    from bertforge.model.architectures import build
    from bertforge.model.config import preset as get_preset
    from bertforge.train.flops import device_peak_flops, train_flops_per_token
    from bertforge.train.optim import OptimConfig, make_optimizer
    from bertforge.train.step import StepConfig, TrainState, prediction_capacity, train_step

    cfg = get_preset(preset, vocab_size=VOCAB, dtype=dtype, hidden_dropout=0.1, attention_dropout=0.1)
    model = build(cfg, "mlm")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = make_optimizer(OptimConfig(lr=1e-4))
    state = TrainState(jnp.int32(0), params, tx.init(params))
    step_cfg = StepConfig(
        masking=MaskingSpec(mask_id=4, vocab_size=VOCAB, special_ids=(0, 1, 2, 3, 4), rate=RATE),
        pad_id=0,
        sparse_head=sparse,
        capacity=prediction_capacity(batch * seq_len, RATE),
    )
    step = jax.jit(functools.partial(train_step, graphdef, rest, tx=tx, cfg=step_cfg), donate_argnums=(0,))
    key = jax.random.key(0)
    data = [jnp.asarray(b) for b in batches(steps + 2, batch, seq_len)]
    times = []
    for i, ids in enumerate(data):
        start = time.perf_counter()
        state, metrics = step(state, ids, jnp.float32(1e-4), key)
        jax.block_until_ready(metrics["loss"])
        if i >= 2:  # the first steps compile
            times.append(time.perf_counter() - start)
    peak, source = device_peak_flops(dtype)
    flops = train_flops_per_token(cfg, seq_len, RATE if sparse else 1.0)
    return {"step_s": float(np.median(times)), "flops_per_token": flops, "peak": peak, "peak_source": source,
            "jax": jax.__version__}  # fmt: skip


def run_torch(preset: str, batch: int, seq_len: int, steps: int, compiled: bool, bf16: bool, device: str) -> dict:
    import torch
    from transformers import BertConfig, BertForMaskedLM

    from bertforge.model.config import preset as get_preset
    from bertforge.train.flops import measured_matmul_flops, train_flops_per_token

    cfg = get_preset(preset, vocab_size=VOCAB)
    hf = BertConfig(
        vocab_size=VOCAB,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        attn_implementation="sdpa",  # torch.nn.functional.scaled_dot_product_attention (fused kernels on a GPU)
    )
    torch.manual_seed(0)
    model = BertForMaskedLM(hf).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    rng = np.random.default_rng(1)
    data = []
    for ids in batches(steps + 3, batch, seq_len):
        labels = np.where(rng.random(ids.shape) < RATE, ids, -100)
        inputs = np.where(labels != -100, 4, ids)
        data.append(
            (
                torch.tensor(inputs, dtype=torch.long, device=device),
                torch.tensor(labels, dtype=torch.long, device=device),
            )
        )

    def train_step(inputs, labels):
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=inputs, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    fn = torch.compile(train_step) if compiled else train_step
    times = []
    compile_s = 0.0
    for i, (inputs, labels) in enumerate(data):
        start = time.perf_counter()
        fn(inputs, labels).item()
        if device == "cuda":
            torch.cuda.synchronize()
        if i < 3:
            compile_s += time.perf_counter() - start
        else:
            times.append(time.perf_counter() - start)
    if device == "cuda":
        from bertforge.train.flops import PEAK_FLOPS

        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_FLOPS.items() if k in name), float("nan"))
        source = f"{name} datasheet"
    else:
        peak, source = measured_matmul_flops("bfloat16" if bf16 else "float32"), "measured matmul"
    flops = train_flops_per_token(cfg, seq_len, 1.0)
    return {"step_s": float(np.median(times)), "flops_per_token": flops, "peak": peak, "peak_source": source,
            "warmup_s": compile_s, "attn_implementation": model.config._attn_implementation,
            "torch": torch.__version__}  # fmt: skip


VARIANTS = [
    ("transformers eager fp32", "torch", {"compiled": False, "bf16": False}),
    ("transformers torch.compile fp32", "torch", {"compiled": True, "bf16": False}),
    ("transformers eager bf16 autocast", "torch", {"compiled": False, "bf16": True}),
    ("bertforge fp32, dense head", "jax", {"sparse": False, "dtype": "float32"}),
    ("bertforge fp32, sparse head", "jax", {"sparse": True, "dtype": "float32"}),
    ("bertforge bf16, dense head", "jax", {"sparse": False, "dtype": "bfloat16"}),
    ("bertforge bf16, sparse head", "jax", {"sparse": True, "dtype": "bfloat16"}),
]
# On a GPU, PyTorch's fastest setting as well.
GPU_VARIANTS = [("transformers torch.compile bf16 autocast", "torch", {"compiled": True, "bf16": True})]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["mini", "small"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6, help="timed steps after 2-3 warm-up steps")
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--timeout", type=float, help="seconds after which a variant's process is stopped and skipped")
    ap.add_argument("--budget", type=float, help="seconds for all variants: later ones are skipped, results saved")
    ap.add_argument("--variants", nargs="+", help="run only these implementations (names as in the table)")
    ap.add_argument("--keep", action="store_true", help="add to the saved results, replacing only the rows run now")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        spec = json.loads(args.child)
        if spec["impl"] == "torch":
            out = run_torch(spec["preset"], args.batch, args.seq_len, args.steps, device=spec["device"], **spec["kw"])
        else:
            out = run_bertforge(spec["preset"], args.batch, args.seq_len, args.steps, **spec["kw"])
        print(json.dumps(out))
        return

    env = dict(os.environ)
    if args.device == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    torch_env = dict(env, JAX_PLATFORMS="cpu") if args.device == "gpu" else env
    variants = VARIANTS[:3] + GPU_VARIANTS + VARIANTS[3:] if args.device == "gpu" else VARIANTS
    order = [v[0] for v in variants]
    if args.variants:
        unknown = set(args.variants) - set(order)
        if unknown:
            ap.error(f"unknown variants {sorted(unknown)}; choose from {order}")
        variants = [next(v for v in variants if v[0] == n) for n in dict.fromkeys(args.variants)]  # in this order
    began = time.perf_counter()
    rows = []
    for preset in args.presets:
        for name, impl, kw in variants:
            timeout = args.timeout
            if args.budget is not None:
                left = args.budget - (time.perf_counter() - began)
                if left < 10:
                    print(f"{preset} {name} skipped: the time budget is spent", file=sys.stderr)
                    continue
                timeout = left if timeout is None else min(timeout, left)
            spec = {"impl": impl, "preset": preset, "kw": kw, "device": "cuda" if args.device == "gpu" else "cpu"}
            cmd = [sys.executable, __file__, "--child", json.dumps(spec), "--batch", str(args.batch),
                   "--seq-len", str(args.seq_len), "--steps", str(args.steps)]  # fmt: skip
            start = time.perf_counter()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, env=torch_env if impl == "torch" else env,
                                      check=False, timeout=timeout)  # fmt: skip
            except subprocess.TimeoutExpired:
                print(f"{preset} {name} stopped after {timeout:g} s", file=sys.stderr)
                continue
            if proc.returncode:
                print(f"{preset} {name} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            tokens_s = args.batch * args.seq_len / r["step_s"]
            rows.append({"preset": preset, "implementation": name, "tokens_per_s": tokens_s,
                         "mfu": r["flops_per_token"] * tokens_s / r["peak"], **r,
                         "process_s": time.perf_counter() - start})  # fmt: skip
            print(
                f"{preset:6} {name:40} {tokens_s:10,.0f} tokens/s  (process {rows[-1]['process_s']:.0f} s)", flush=True
            )

    name = f"pretrain_{args.device}" if args.seq_len == 128 else f"pretrain_{args.seq_len}_{args.device}"
    if args.keep and (report.RESULTS / f"{name}.json").exists():
        ran = {(r["preset"], r["implementation"]) for r in rows}
        saved = json.loads((report.RESULTS / f"{name}.json").read_text())["rows"]
        rows = [r for r in saved if (r["preset"], r["implementation"]) not in ran] + rows
    presets = list(dict.fromkeys([r["preset"] for r in rows] + args.presets))
    rows.sort(key=lambda r: (presets.index(r["preset"]), order.index(r["implementation"])))
    gpu = args.device == "gpu"  # a GPU adds a column: against the best transformers row, bf16 included
    lines = [
        "| preset | implementation | tokens/s | x best transformers (eager or compiled fp32) | "
        + ("x best transformers (any) | " if gpu else "")
        + "MFU |",
        "|---|---|---|---|" + ("---|" if gpu else "") + "---|",
    ]
    for preset in presets:
        ours = [r for r in rows if r["preset"] == preset]
        base = max(
            (
                r["tokens_per_s"]
                for r in ours
                if r["implementation"].startswith("transformers") and "bf16" not in r["implementation"]
            ),
            default=float("nan"),
        )  # noqa: E501
        best = max((r["tokens_per_s"] for r in ours if r["implementation"].startswith("transformers")),
                   default=float("nan"))  # fmt: skip
        for r in ours:
            lines.append(f"| {preset} | {r['implementation']} | {r['tokens_per_s']:,.0f} | "
                         f"{r['tokens_per_s'] / base:.2f} | " + (f"{r['tokens_per_s'] / best:.2f} | " if gpu else "")
                         + f"{100 * r['mfu']:.1f}% |")  # fmt: skip
    import jax

    device = jax.devices()[0].device_kind if args.device == "gpu" else f"CPU, {os.cpu_count()} cores"
    title = f"MLM training step, batch {args.batch} x {args.seq_len}, vocabulary {VOCAB}, AdamW, {device}"
    bars = [(f"{r['preset']}: {r['implementation']}", r["tokens_per_s"],
             "C0" if r["implementation"].startswith("bertforge") else "C1") for r in rows]  # fmt: skip
    report.save(name, title, "\n".join(lines), rows, bars, "training tokens / s (higher is better)")


if __name__ == "__main__":
    main()
