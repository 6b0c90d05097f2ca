"""What each lever of ModernBERT's pretraining recipe gives: bertforge ModernBERT mini with its recipe, then with
one lever at a time put back to the 2018 recipe, each for the same wall-clock budget, evaluated as
pretrain_quality.py evaluates (the same held-out blocks with the same 15% [MASK] positions, every checkpoint placed
at the wall time it was written). Also a larger batch, constant and ramped (Cramming), the architecture alone (BERT's
layers with ModernBERT's recipe) and sequence packing (documents' own blocks, DOC-SENTENCES: padded rows against
packed rows).

    .venv/bin/python benchmarks/investigations/pretrain_levers.py --data data/wikitext-2/*.txt [--minutes 5]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import _path  # noqa: F401 (the benchmarks' folder on the path)
import numpy as np
from pretrain_quality import BERTFORGE, ROOT, bertforge_command, evaluate, prepare, train_rows

# name: (architecture, recipe, shards, extra flags, what differs from the full recipe)
LEVERS = {
    "recipe": ("modernbert", "modernbert", "concat", [], "ModernBERT, its full recipe"),
    "masking-15": ("modernbert", "modernbert", "concat", ["--mlm.rate=0.15"], "15% masking instead of 30%"),
    "dropout": (
        "modernbert",
        "modernbert",
        "concat",
        ["--model.hidden_dropout=0.1", "--model.attention_dropout=0.1"],
        "dropout 0.1 instead of none",
    ),  # fmt: skip
    "linear": ("modernbert", "modernbert", "concat", ["--optim.schedule=linear"], "linear decay instead of WSD"),
    "lr-1e-4": (
        "modernbert",
        "modernbert",
        "concat",
        ["--optim.lr=1e-4"],
        "learning rate 1e-4 (BERT's) instead of 1e-3",
    ),
    "dense-head": (
        "modernbert",
        "modernbert",
        "concat",
        ["--train.sparse_head=false"],
        "vocabulary projection on every token instead of the masked ones",
    ),  # fmt: skip
    "batch-64": (
        "modernbert",
        "modernbert",
        "concat",
        ["--train.global_batch=64", "--train.grad_accum=4"],
        "batch 64 (4 micro-batches of 16) instead of 16",
    ),  # fmt: skip
    "ramp-64": (
        "modernbert",
        "modernbert",
        "concat",
        ["--train.global_batch=64", "--train.grad_accum=4", "--train.batch_ramp=0.5"],
        "batch ramped from 16 to 64 over the first half",
    ),  # fmt: skip
    "bert-layers": ("bert", "modernbert", "concat", [], "BERT's layers (post-norm, GELU, learned positions)"),
    "doc": ("modernbert", "modernbert", "doc", [], "document blocks (DOC-SENTENCES), padded"),
    "doc-packed": ("modernbert", "modernbert", "doc-packed", [], "document blocks, packed (--pack)"),
}


def shards_for(kind: str, args: argparse.Namespace, tok: Path, concat: Path, work: Path) -> Path:
    if kind == "concat":
        return concat
    out = work / f"shards-{kind}"
    if not (out / "manifest.json").exists():
        pack = ["--pack"] if kind.endswith("packed") else []
        subprocess.run([*BERTFORGE, "preprocess", "--tokenizer", str(tok), "--files", *args.data, "--out", str(out),
                        "--seq-len", str(args.seq_len), "--valid-fraction", "0.05", "--mode", "doc", *pack],
                       check=True)  # fmt: skip
    return out


def text_tokens_per_s(out: Path, shards: Path) -> float:
    """Tokens of text (not padding) trained on per second of the run, from its metrics and its shards' padding."""
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in metrics if "elapsed" in m][-1]
    manifest = json.loads((shards / "manifest.json").read_text())
    padding = np.mean(train_rows(shards) == manifest["special_ids"]["pad"])
    return last["tokens"] * (1 - padding) / last["elapsed"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", nargs="+", default=sorted(glob.glob(str(ROOT.parent / "shared/data/wikitext-2/*.txt"))))
    p.add_argument("--minutes", type=float, default=5.0, help="wall-clock training budget of each variant")
    p.add_argument("--levers", nargs="+", choices=list(LEVERS), default=list(LEVERS))
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--work", default=str(ROOT / "runs/bench-pretrain-quality"))
    args = p.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tok, concat = prepare(args, work)
    batch = dict(np.load(work / "eval.npz"))
    saved = work / "levers.json"
    results = json.loads(saved.read_text()) if saved.exists() else {}
    for name in args.levers:
        arch, recipe, kind, extra, _ = LEVERS[name]
        shards = shards_for(kind, args, tok, concat, work)
        out = work / f"lever-{name}"
        shutil.rmtree(out, ignore_errors=True)
        launched = time.time()
        subprocess.run([*bertforge_command(arch, recipe, args, shards, out), *extra], check=True)
        wall = time.time() - launched
        results[name] = {"wall_s": wall, "curve": evaluate("bertforge", out, launched, batch),
                         "text_tokens_per_s": text_tokens_per_s(out, shards)}  # fmt: skip
        saved.write_text(json.dumps(results, indent=2) + "\n")
    report(results, args.minutes)


def report(results: dict, minutes: float) -> None:
    from report import RESULTS, save

    base = results["recipe"]["curve"][-1]["valid_loss"] if "recipe" in results else None
    lines = ["| variant | steps | text tokens/s | final validation loss | change against the full recipe |",
             "|---|---|---|---|---|"]  # fmt: skip
    rows, bars = [], []
    for name, r in results.items():
        final = r["curve"][-1]
        delta = "" if base is None or name == "recipe" else f"{final['valid_loss'] - base:+.3f}"
        lines.append(f"| {LEVERS[name][4]} | {final['step']} | {r['text_tokens_per_s']:,.0f} | "
                     f"{final['valid_loss']:.3f} | {delta} |")  # fmt: skip
        rows.append({"variant": name, "steps": final["step"], "text_tokens_per_s": r["text_tokens_per_s"],
                     "final_valid_loss": final["valid_loss"]})  # fmt: skip
        bars.append((LEVERS[name][4], final["valid_loss"], "C0" if name == "recipe" else "C7"))
    title = (
        f"ModernBERT mini's recipe, one lever at a time: validation MLM loss after {minutes:g} minutes, one run each"
    )
    save("pretrain_levers", title, "\n".join(lines), rows, bars, "final validation MLM loss (lower is better)")

    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, r) in enumerate(results.items()):
        ax.plot([q["wall_s"] / 60 for q in r["curve"]], [q["valid_loss"] for q in r["curve"]], "o-", ms=3,
                color=f"C{i}", label=LEVERS[name][4])  # fmt: skip
    ax.set_xlabel("wall-clock minutes since launch")
    ax.set_ylabel("validation MLM loss (same blocks, same masks)")
    ax.set_ylim(top=min(8.0, ax.get_ylim()[1]))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "pretrain_levers_curves.png", dpi=120)


if __name__ == "__main__":
    main()
