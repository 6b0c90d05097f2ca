"""What the task benchmarks (token_classification.py, questions_and_choices.py) share: bertforge's command and its
times, the Trainer's arguments, run and logging (the same work as bertforge's: same_work.py), the worker process in
bertforge's environment, the loop over seeds in alternating order that saves rows, and their lines in the results
index."""

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
from typing import Any

import results_index
import same_work

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


def add_options(p: argparse.ArgumentParser) -> None:
    """The options every task benchmark takes: its references and a first run's compile cache."""
    same_work.reference_options(p)
    p.add_argument("--cold-cache", action="store_true",
                   help="bertforge with an empty compile cache each run (a first run)")  # fmt: skip


def run_bertforge(cmd: list[str], out: Path, cold: bool = False) -> tuple[dict, dict]:
    """Run `cmd` (`cold`: with an empty compile cache of its own); its summary.json and its times: wall, training
    steps (every logged window's mean step time, evaluations excluded, times its steps) and evaluations, with fold
    0's steps and rows."""
    print(" ".join(cmd), flush=True)
    env = same_work.environment()
    if cold:
        cache = out.parent / f"{out.name}-compile-cache"
        shutil.rmtree(cache, ignore_errors=True)
        env["BERTFORGE_COMPILE_CACHE"] = str(cache)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env)
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
             "valid_rows": fold["valid_rows"], "evaluations": [r["step"] for r in records if "eval_seconds" in r],
             "variant": "bf16" if "--train.dtype=bfloat16" in cmd else "float32"}  # fmt: skip
    return summary, times


def run_worker(cmd: list[str], out: Path) -> dict:
    """Run a Trainer worker `cmd` in the environment bertforge's process gets; its result.json with the process's
    wall time."""
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=same_work.environment())
    wall = time.perf_counter() - start
    return {**json.loads((out / "result.json").read_text()), "wall_s": wall}


def training_args(args: argparse.Namespace, work: dict[str, Any], grouped: bool = True, **extra: Any):
    """The Trainer's arguments of the shared recipe, with bertforge's steps, evaluations and checkpoints (`work`,
    from same_work.plan) and no others; args.reference "tuned" groups batches by length, where `grouped`."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(args.hf_out),
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=EVAL_BATCH,
        learning_rate=args.lr,
        weight_decay=WEIGHT_DECAY,
        warmup_steps=WARMUP,  # below 1: a fraction of the total steps
        lr_scheduler_type="linear",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        train_sampling_strategy="group_by_length" if grouped and args.reference == "tuned" else "random",
        logging_steps=10,
        report_to="none",
        use_cpu=args.device == "cpu",
        bf16=args.bf16,
        seed=args.seed,
        dataloader_num_workers=0,
        **same_work.trainer_arguments(work),
        **extra,
    )


def train_reference(args: argparse.Namespace, make_trainer: Callable[..., Any], train_rows: int, metric: str,
                    grouped: bool = True) -> dict[str, Any]:  # fmt: skip
    """Build the Trainer with `make_trainer(training_arguments, callbacks)` for `train_rows` training rows (one
    evaluation an epoch, as bertforge's command here), train it, and write its best model once (same_work.finish);
    -> the result's common fields, with `evaluation`: the best logged evaluation. `grouped`: the tuned reference
    groups its batches by length."""
    import torch

    work = same_work.plan(train_rows, args.batch_size, args.epochs, 1)
    callback, eval_s = progress()
    same = same_work.trainer_callback(work)
    trainer = make_trainer(training_args(args, work, grouped), [callback, same])
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    best = same_work.finish(trainer, metric, True, Path(args.hf_out) / "model")
    return {"score": best["score"], "evaluation": best["evaluation"], "steps_s": train_s - eval_s[0],
            "eval_s": eval_s[0], "best_step": best["best_step"], "steps": trainer.state.global_step,
            "evaluations": same.evaluated, "saves": same.saved, "torch_threads": torch.get_num_threads()}  # fmt: skip


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
    """Each system of `systems` ((name, run(args, work, out))) once per seed of args.seeds into fresh folders, the
    order rotated from seed to seed (same_work.order); the rows, with the saved ones of other seeds first when
    args.keep."""
    from report import RESULTS

    rows = []
    if args.keep:
        rows = [r for r in json.loads((RESULTS / f"{name}.json").read_text())["rows"] if r["seed"] not in args.seeds]
    for index, seed in enumerate(args.seeds):
        args.seed = seed
        first = len(rows)
        for system, run in same_work.order(systems, index):
            folder = work / f"{_slug(system)}-seed{seed}"
            shutil.rmtree(folder, ignore_errors=True)
            rows.append(_row(system, run(args, work, folder), seed=seed, counts=counts))
        print(json.dumps(rows[first:]), flush=True)
    return rows


def reference_systems(run: Callable[..., dict], variants: list[str], names: dict[str, str] | None = None
                      ) -> list[tuple[str, Callable[..., dict]]]:  # fmt: skip
    """The Trainer's systems, one per variant ("shipped", "tuned"): run(args, work, out, reference=variant);
    `names` replaces a variant's row name where its tuning is not same_work's."""
    names = {**same_work.REFERENCES, **(names or {})}
    return [(names[v], functools.partial(run, reference=v)) for v in variants]


def index(args: argparse.Namespace, benchmark: str, recipe: str, metric: str, rows: list[dict]) -> None:
    """The run's lines in the results index, one per system, over the seeds run now."""
    machine = results_index.gpu_machine() if args.device == "gpu" else None
    cache = "cold" if args.cold_cache else "warm"
    results_index.append(results_index.run_lines(benchmark, recipe, metric, rows, args.seeds, cache, machine,
                                                 name=same_work.index_name))  # fmt: skip


def _slug(system: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in system.lower()).strip("-")


def _row(system: str, result: dict, seed: int, counts: dict) -> dict:
    return {"system": system, "seed": seed, **counts, **result}
