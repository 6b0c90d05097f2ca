"""What the task benchmarks (token_classification.py, questions_and_choices.py) share: bertforge's command and its
times, the Trainer's arguments and logging, the worker process, and the loop over seeds that saves rows."""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

WARMUP, WEIGHT_DECAY, EVAL_BATCH = 0.1, 0.01, 64


def bertforge_command(args: argparse.Namespace, task: str, train: Path, valid: Path, out: Path) -> list[str]:
    """`bertforge finetune` with the shared recipe: one evaluation per epoch, linear decay after a 0.1 warmup."""
    cmd = [
        sys.executable, "-m", "bertforge.cli", "finetune", "--task", task,
        "--model", args.model, "--data", str(train), "--valid-data", str(valid),
        "--out", str(out), "--max-length", str(args.max_length),
        f"--train.batch_size={args.batch_size}", f"--train.epochs={args.epochs}", "--train.evals_per_epoch=1",
        f"--train.eval_batch_size={EVAL_BATCH}", f"--optim.lr={args.lr}", "--optim.schedule=linear",
        f"--optim.warmup_fraction={WARMUP}", f"--optim.weight_decay={WEIGHT_DECAY}", "--optim.clip_norm=1.0",
        f"--train.seed={args.seed}", "--log.progress=false",
    ]  # fmt: skip
    return cmd + (["--train.dtype=bfloat16"] if args.bf16 else [])


def run_bertforge(cmd: list[str], out: Path) -> tuple[dict, dict]:
    """Run `cmd`; its summary.json and its times: wall, training steps (every logged window's mean step time,
    evaluations excluded, times its steps) and evaluations, with fold 0's steps and rows."""
    print(" ".join(cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - start
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "fold-0" / "metrics.jsonl").read_text().splitlines()]
    steps_s, last = 0.0, 0
    for r in records:
        if "step_time" in r:
            steps_s += (r["step"] - last) * r["step_time"]
            last = r["step"]
    fold = summary["folds"][0]
    times = {"wall_s": wall, "steps_s": steps_s, "eval_s": sum(r.get("eval_seconds", 0.0) for r in records),
             "best_step": fold["best_step"], "steps": fold["steps"], "train_rows": fold["train_rows"],
             "valid_rows": fold["valid_rows"]}  # fmt: skip
    return summary, times


def run_worker(cmd: list[str], out: Path) -> dict:
    """Run a Trainer worker `cmd`; its result.json with the process's wall time."""
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - start
    return {**json.loads((out / "result.json").read_text()), "wall_s": wall}


def training_args(args: argparse.Namespace, metric: str):
    """The Trainer's arguments of the shared recipe: eval and save each epoch, the best model by `metric`."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(args.hf_out),
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=EVAL_BATCH,
        num_train_epochs=args.epochs,
        learning_rate=args.lr,
        weight_decay=WEIGHT_DECAY,
        warmup_steps=WARMUP,  # below 1: a fraction of the total steps
        lr_scheduler_type="linear",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        eval_strategy="epoch",
        save_strategy="epoch",
        save_total_limit=1,
        load_best_model_at_end=True,
        metric_for_best_model=metric,
        greater_is_better=True,
        logging_steps=10,
        report_to="none",
        use_cpu=args.device == "cpu",
        bf16=args.bf16,
        seed=args.seed,
        dataloader_num_workers=0,
    )


def progress() -> tuple[object, list[float]]:
    """A Trainer callback that prints each log and adds up the evaluations' seconds (in the returned list)."""
    from transformers import TrainerCallback

    eval_s = [0.0]

    class Progress(TrainerCallback):
        def on_log(self, _args, state, _control, logs=None, **kw):
            eval_s[0] += (logs or {}).get("eval_runtime", 0.0)
            print(f"step {state.global_step}: {logs}", flush=True)

    return Progress(), eval_s


def run_seeds(args: argparse.Namespace, name: str, work: Path, counts: dict,
              systems: list[tuple[str, Callable[[argparse.Namespace, Path, Path], dict]]]) -> list[dict]:  # fmt: skip
    """Each system of `systems` ((name, run(args, work, out))) once per seed of args.seeds, one after the other, into
    fresh folders; the rows, with the saved ones of other seeds first when args.keep."""
    from report import RESULTS

    rows = []
    if args.keep:
        rows = [r for r in json.loads((RESULTS / f"{name}.json").read_text())["rows"] if r["seed"] not in args.seeds]
    for seed in args.seeds:
        args.seed = seed
        first = len(rows)
        row = functools.partial(_row, seed=seed, counts=counts)
        folders = [work / f"{'bertforge' if i == 0 else 'transformers-trainer'}-seed{seed}" for i in range(2)]
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        for (system, run), folder in zip(systems, folders, strict=True):
            rows.append(row(system, run(args, work, folder)))
        print(json.dumps(rows[first:]), flush=True)
    return rows


def _row(system: str, result: dict, seed: int, counts: dict) -> dict:
    return {"system": system, "seed": seed, **counts, **result}
