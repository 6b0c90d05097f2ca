"""A mixture of two corpora (`pretrain --sources`) against each corpus alone: the same model, steps and seed, each
model's masked-LM loss on each corpus's validation split.

The corpora: WikiText-2's validation and test splits (English Wikipedia; `make data` fetches them) and the Japanese
text of japanese_encoder.py (JGLUE v1.3's paragraphs, sentences, questions and choices, the Japanese Wikipedia NER
set's sentences; no label read). One SentencePiece Unigram tokenizer over both (`bertforge tokenizer train --type
unigram`), shards of 128 tokens per corpus (5% held out). Every run reads the two folders as a mixture, so that each
of its evaluations scores both validation splits: alone, the other corpus weighs 1e-9 and gives no row in the run's
steps (a source gives within one row of its share, data/mixture.py); mixed, the English corpus weighs `--weight`.
The BERT mini of configs/pretrain/wikitext-mini-10min.yaml, `--steps` steps of 16 x 128 tokens.

Index lines, per corpus (recipe `english` / `japanese`): bertforge is the mixture, the reference the run on that
corpus alone, the metric its validation loss (lower is better), each with the run's wall time.

    .venv/bin/python benchmarks/pretrain_mixture.py --out runs/mixture --steps 200
    .venv/bin/python benchmarks/pretrain_mixture.py --data-root PATH --out runs/mixture
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
import results_index  # noqa: E402
from japanese_encoder import corpus_lines  # noqa: E402

BIN = ROOT / ".venv/bin/bertforge"
CONFIG = ROOT / "configs/pretrain/wikitext-mini-10min.yaml"
NAMES = {"en": "english", "ja": "japanese"}


def _run(command: list[str], log) -> str:
    log.write("$ " + " ".join(map(str, command)) + "\n")
    start = time.perf_counter()
    done = subprocess.run(list(map(str, command)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.write(done.stdout + f"# {time.perf_counter() - start:.0f} s, exit {done.returncode}\n")
    log.flush()
    if done.returncode:
        sys.exit(f"{command[1]} failed: see {log.name}")
    return done.stdout


def prepare(root: Path, out: Path, log) -> dict[str, Path]:
    """The two corpora as text files, one tokenizer over both, a shard folder per corpus."""
    files = {"en": out / "en.txt", "ja": out / "ja.txt"}
    english = [(root / "wikitext-2" / f"{split}.txt").read_text(encoding="utf-8") for split in ("valid", "test")]
    files["en"].write_text("".join(english), encoding="utf-8")
    files["ja"].write_text("\n".join(corpus_lines(root)) + "\n", encoding="utf-8")
    tok = out / "tok"
    _run([BIN, "tokenizer", "train", "--files", *files.values(), "--type", "unigram", "--vocab-size", "16000",
          "--out", tok], log)  # fmt: skip
    shards = {}
    for name, file in files.items():
        shards[name] = out / f"shards-{name}"
        each_line = ["--doc-per-line"] if name == "ja" else []  # a paragraph, sentence or question per line
        _run([BIN, "preprocess", "--tokenizer", tok, "--files", file, "--out", shards[name], "--seq-len", "128",
              "--valid-fraction", "0.05", *each_line], log)  # fmt: skip
    return shards


def pretrain(shards: dict[str, Path], weights: dict[str, float], out: Path, steps: int, log) -> dict:
    """One run of the mixture `weights`: its wall time and its last evaluation's loss on each corpus."""
    sources = [f"{shards[n]}={w}" for n, w in weights.items()]
    start = time.perf_counter()
    _run([BIN, "pretrain", "--config", CONFIG, "--out", out, "--sources", *sources, f"--train.max_steps={steps}",
          "--train.time_budget_minutes=null", f"--eval.every={steps}", f"--checkpoint.every={steps}",
          "--log.tensorboard=false", "--log.progress=false"], log)  # fmt: skip
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "valid_loss" in r][-1]
    return {"wall_s": wall, **{n: last[f"valid_loss_shards-{n}"] for n in NAMES}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", type=Path, default=ROOT.parent / "shared/data")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--weight", type=float, default=0.5, help="the English corpus's share of the mixture")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "benchmark.log", "a", encoding="utf-8") as log:
        shards = prepare(args.data_root, args.out, log)
        runs = {
            "en": pretrain(shards, {"en": 1.0, "ja": 1e-9}, args.out / "en-alone", args.steps, log),
            "ja": pretrain(shards, {"en": 1e-9, "ja": 1.0}, args.out / "ja-alone", args.steps, log),
            "mix": pretrain(shards, {"en": args.weight, "ja": 1 - args.weight}, args.out / "mixture", args.steps, log),
        }
    print(json.dumps(runs, indent=2))
    recipe = f"{args.steps} steps of 16 x 128, BERT mini"
    lines = []
    for name, corpus in NAMES.items():
        for system, run, variant in (("bertforge", runs["mix"], f"mixture {args.weight:g}:{1 - args.weight:g}"),
                                     (f"{corpus} alone", runs[name], "the same steps")):  # fmt: skip
            per_seed = [{"seed": 0, "wall_s": run["wall_s"], "value": run[name]}]
            lines.append(results_index.line("pretrain_mixture", f"{corpus}: {recipe}", system, variant, "cold",
                                            f"valid_loss {corpus} (lower is better)", per_seed))  # fmt: skip
    results_index.append(lines)


if __name__ == "__main__":
    main()
