"""Masked LM against replaced-token detection at equal pretraining wall time, judged by fine-tuning.

Both objectives pretrain the same discriminator-sized encoder (4 x 256) on the same shards with the same tokenizer,
for the same wall-clock budget; --arch picks the encoder and each objective's recipe:
- `modernbert` (the default): configs/pretrain/modernbert-mini.yaml (pre-norm, 30% masking, lr 1e-3 held then
  decayed); replaced-token detection is configs/pretrain/modernbert-mini-rtd.yaml, the same encoder and masking
  with a generator as wide and half as deep, DeBERTa-v3's sharing and its lr of 3e-4;
- `electra`: ELECTRA's post-norm layers with embeddings of 128; masked LM as configs/pretrain/mini.yaml (BERT's
  masking, lr 1e-3, linear decay), replaced-token detection as configs/pretrain/rtd-mini.yaml (ELECTRA's masking,
  a generator a quarter as wide, ELECTRA's sharing).
Each pretrained encoder is then fine-tuned with the same settings on two tasks:
- `modules`: the demo's module-classification task (which of 8 stdlib modules a docstring comes from, the demo's
  1,080 training rows, 64 tokens), 5 folds, out-of-fold accuracy;
- `commonlit`: CommonLit Readability (Kaggle's `commonlitreadabilityprize` train.csv), fold 0 of 5, RMSE.
Each objective runs with --seeds pretraining seeds (fine-tuning seed 0). The baseline `none` is the same encoder not
pretrained at all (`bertforge init` of the masked-LM config, its seed the pretraining seed), fine-tuned alike: what
either objective's minutes add to it. Each encoder's feature spread is reported too: of the variance of its
mean-pooled last hidden states over the module task's texts, the share between texts (near 0: every text looks
alike to the encoder, and fine-tuning has to build the features the task needs). Every finished stage is kept in
--work, so the command run again continues where it stopped.

    .venv/bin/python benchmarks/investigations/rtd_vs_mlm.py --data data/wikitext-2/*.txt \
        --commonlit data/commonlit/train.csv \
        [--arch modernbert|electra] [--minutes 15] [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import _path  # noqa: F401 (the benchmarks' folder on the path)
import numpy as np
import yaml
from pretrain_quality import BERTFORGE, ROOT, prepare

# arch: {objective: (config, extra flags)}
ARCHES = {
    "modernbert": {
        "mlm": ("configs/pretrain/modernbert-mini.yaml", []),
        "rtd": ("configs/pretrain/modernbert-mini-rtd.yaml", []),
    },
    "electra": {
        "mlm": ("configs/pretrain/mini.yaml", ["--model.family=electra", "--model.embedding_size=128"]),
        "rtd": ("configs/pretrain/rtd-mini.yaml", []),
    },
}
OBJECTIVES = ("none", "mlm", "rtd")  # none: not pretrained, the baseline
# task: (table columns and kind, folds flags, max length)
TASKS = {
    "modules": (["--text-column", "text", "--target-column", "module", "--task", "classification"], 5, 64),
    "commonlit": (["--text-column", "excerpt", "--target-column", "target", "--task", "regression"], 1, 256),
}
FINETUNE = ["--train.batch_size=16", "--train.epochs=3", "--optim.lr=3e-4", "--optim.warmup_fraction=0.1",
            "--train.evals_per_epoch=1", "--train.seed=0"]  # fmt: skip


def write_demo_task(path: Path) -> None:
    """The demo's training table: its classes and rows per class (the defaults of stdlib_module_task)."""
    from bertforge.data import tabular
    from bertforge.data.builtin import stdlib_docstrings, stdlib_module_task

    train, _ = stdlib_module_task(stdlib_docstrings())
    tabular.write_csv(str(path), ["id", "text", "module"], [list(r.values()) for r in train])


def pretrain(objective: str, seed: int, args: argparse.Namespace, tok: Path, shards: Path, work: Path) -> Path:
    out = work / f"{objective}-seed{seed}"
    if (out / "done.json").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    if objective == "none":  # the masked-LM config's model, as `bertforge init` takes it
        config, extra = ARCHES[args.arch]["mlm"]
        model = work / "none-model.yaml"
        model.write_text(yaml.safe_dump({"model": yaml.safe_load((ROOT / config).read_text())["model"]}))
        cmd = [*BERTFORGE, "init", "--config", str(model), "--tokenizer", str(tok), "--out", str(out),
               "--seed", str(seed), *extra]  # fmt: skip
        subprocess.run(cmd, check=True)
        (out / "done.json").write_text(json.dumps({"wall_s": 0.0, "steps": 0}) + "\n")
        return out
    config, extra = ARCHES[args.arch][objective]
    cmd = [*BERTFORGE, "pretrain", "--config", str(ROOT / config), "--data", str(shards), "--out", str(out),
           f"--train.time_budget_minutes={args.minutes}", "--train.max_steps=null", f"--train.seed={seed}",
           f"--train.global_batch={args.batch}", "--eval.every=1000000", "--checkpoint.every=500",
           "--log.tensorboard=false", *extra]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - start
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in metrics if "valid_loss" in m][-1]
    steps = max(m["step"] for m in metrics)
    (out / "done.json").write_text(json.dumps({"wall_s": wall, "steps": steps, **last}) + "\n")
    return out


def feature_spread(model: Path, texts: list[str], max_length: int) -> float:
    """Of the variance of the encoder's mean-pooled last hidden states over `texts`, the share between texts."""
    import jax.numpy as jnp

    from bertforge.data.batching import pad_batch
    from bertforge.model.load import load_model

    pre = load_model(model, head="sequence", num_labels=1)
    pre.model.eval()  # ELECTRA's layers have dropout
    encoded = pre.tokenizer.encode_batch(texts, max_length=max_length)
    batch = pad_batch(encoded, pre.tokenizer.pad_id, max(len(e.ids) for e in encoded))
    arrays = [jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "token_type_ids")]
    hidden = np.asarray(pre.model.encoder(*arrays), np.float64)  # (N, T, D)
    mask = batch["attention_mask"]
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)  # (N, D)
    between = ((pooled - pooled.mean(0)) ** 2).sum()
    return float(between / (pooled**2).sum())


def finetune(run: Path, task: str, data: Path, work: Path) -> dict:
    out = work / f"{run.name}-{task}"
    if not (out / "summary.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        columns, folds, max_length = TASKS[task]
        which = ["--folds", "5"] + (["--fold", "0"] if folds == 1 else [])
        cmd = [*BERTFORGE, "finetune", "--model", str(run), "--data", str(data), "--out", str(out), *columns,
               *which, f"--data.max_length={max_length}", *FINETUNE]  # fmt: skip
        subprocess.run(cmd, check=True)
    summary = json.loads((out / "summary.json").read_text())
    scores = [f["score"] for f in summary["folds"]]
    overall = summary["out_of_fold"][summary["metric"]] if task == "modules" else scores[0]
    return {"score": float(overall), "folds": scores, "seconds": summary["seconds"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", nargs="+", required=True, help="pretraining text files (WikiText-2's, say)")
    p.add_argument("--commonlit", required=True, help="CommonLit Readability's train.csv")
    p.add_argument("--arch", choices=list(ARCHES), default="modernbert")
    p.add_argument("--minutes", type=float, default=15.0, help="pretraining wall-clock budget of each run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--work", default=str(ROOT / "runs/bench-rtd-vs-mlm"))
    args = p.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    work = Path(args.work) / args.arch
    work.mkdir(parents=True, exist_ok=True)
    tok, shards = prepare(args, work)
    modules = work / "modules.csv"
    if not modules.exists():
        write_demo_task(modules)
    data = {"modules": modules, "commonlit": Path(args.commonlit)}
    texts = [row["text"] for row in csv.DictReader(modules.open())][:256]
    results = {}
    for seed in args.seeds:
        for objective in OBJECTIVES:
            run = pretrain(objective, seed, args, tok, shards, work)
            done = json.loads((run / "done.json").read_text())
            results[f"{objective}-{seed}"] = {
                "objective": objective,
                "seed": seed,
                "pretrain": done,
                "spread": feature_spread(run, texts, TASKS["modules"][2]),
                **{task: finetune(run, task, data[task], work) for task in TASKS},
            }
            (work / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    report(results, args)


def report(results: dict, args: argparse.Namespace) -> None:
    from report import save

    lines = ["| objective | pretraining seed | steps | feature spread | modules: accuracy (5 folds) | "
             "CommonLit fold 0: RMSE |", "|---|---|---|---|---|---|"]  # fmt: skip
    rows, bars = [], []
    for r in results.values():
        lines.append(f"| {r['objective']} | {r['seed']} | {r['pretrain']['steps']} | {r['spread']:.4f} | "
                     f"{r['modules']['score']:.4f} | {r['commonlit']['score']:.4f} |")  # fmt: skip
        rows.append({"objective": r["objective"], "seed": r["seed"], "steps": r["pretrain"]["steps"],
                     "feature_spread": r["spread"],
                     "modules_accuracy": r["modules"]["score"], "commonlit_rmse": r["commonlit"]["score"],
                     "pretrain_wall_s": r["pretrain"]["wall_s"]})  # fmt: skip
    for objective in OBJECTIVES:
        mine = [r for r in results.values() if r["objective"] == objective]
        if not mine:
            continue
        acc = [r["modules"]["score"] for r in mine]
        rmse = [r["commonlit"]["score"] for r in mine]
        lines.append(f"| **{objective}, mean ± std** | {len(mine)} seeds | | | {np.mean(acc):.4f} ± "
                     f"{np.std(acc):.4f} | {np.mean(rmse):.4f} ± {np.std(rmse):.4f} |")  # fmt: skip
        colour = {"none": "C1", "mlm": "C7", "rtd": "C0"}[objective]
        bars += [(f"{objective}: modules accuracy", float(np.mean(acc)), colour),
                 (f"{objective}: CommonLit RMSE", float(np.mean(rmse)), colour)]  # fmt: skip
    cpu = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"], capture_output=True, text=True)
    title = (f"Masked LM against replaced-token detection, {args.minutes:g} minutes of pretraining each ({args.arch} "
             f"4 x 256, batch {args.batch} x {args.seq_len}), then fine-tuned alike; {os.cpu_count()} cores of "
             f"{cpu.stdout.strip() or 'this CPU'}")  # fmt: skip
    xlabel = "mean over seeds: modules accuracy (higher is better), CommonLit RMSE (lower is better)"
    save(f"rtd_vs_mlm_{args.arch}", title, "\n".join(lines), rows, bars, xlabel)
    print(f"python {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
