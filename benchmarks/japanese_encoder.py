"""A small Japanese encoder pretrained with bertforge, for the benchmarks that need a model of the user's own.

The corpus is the Japanese text of four public sets, as a domain-adaptive pretraining run would gather it: the
paragraphs of JGLUE's JSQuAD (v1.3, validation: 1,145 Wikipedia paragraphs), the sentences of JSTS (v1.3, train and
validation), the questions and choices of JCommonsenseQA (v1.3, train and validation) and the sentences of the
Japanese Wikipedia NER set (Stockmark), one per line, repeated lines dropped: about 1.5 M characters. No label of
any set is read. The pipeline is the user's own, each stage a `bertforge` command:

1. `bertforge tokenizer train --type unigram --vocab-size 8000` (SentencePiece's Unigram, text without spaces);
2. `bertforge preprocess --seq-len 128 --doc-per-line --mode complete --pack` (whole sentences, packed);
3. `bertforge pretrain --config configs/pretrain/wikitext-mini-10min.yaml` (BERT mini, 4 x 256, masked LM) for
   `--minutes` minutes;
4. `bertforge export` to a Hugging Face folder, which `transformers` and `bertforge finetune --model` load.

With `--suite-every N` the pretraining also fine-tunes its model every N steps on a small suite in the background
(`--eval.suite`): JSTS (JGLUE v1.3; a seeded fifth of its train file, its valid file whole; 1 epoch, batches of 32,
lr 3e-4, one seed), whose Pearson and Spearman correlations the run logs beside its loss and `bertforge plot` draws.

    .venv/bin/python benchmarks/japanese_encoder.py --out runs/ja-mini            # data from ../shared/data
    .venv/bin/python benchmarks/japanese_encoder.py --data-root PATH --out runs/ja-mini --minutes 20
    .venv/bin/python benchmarks/japanese_encoder.py --out runs/ja-mini --suite-every 200

The exported folder is `OUT-hf` (runs/ja-mini-hf); each command and what it printed go to `OUT/pipeline.log`.
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
DATA_ROOT = ROOT.parent / "shared/data"
BIN = ROOT / ".venv/bin/bertforge"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def corpus_lines(root: Path) -> list[str]:
    """Every Japanese text of the four sets, in a fixed order, repeated lines dropped."""
    squad = json.loads((root / "jglue/jsquad-v1.3/valid-v1.3.json").read_text(encoding="utf-8"))
    lines = [p["context"] for article in squad["data"] for p in article["paragraphs"]]
    for split in ("train", "valid"):
        for row in _jsonl(root / f"jglue/jsts-v1.3/{split}-v1.3.json"):
            lines += [row["sentence1"], row["sentence2"]]
        for row in _jsonl(root / f"jglue/jcommonsenseqa-v1.3/{split}-v1.3.json"):
            lines += [row["question"]] + [row[f"choice{i}"] for i in range(5)]
    ner = json.loads((root / "ner-wikipedia-ja/ner.json").read_text(encoding="utf-8"))
    lines += [record["text"] for record in ner]
    seen: dict[str, None] = {}
    for line in lines:
        text = " ".join(line.split())
        if text:
            seen.setdefault(text, None)
    return list(seen)


def _run(command: list[str], log) -> None:
    """Runs one stage, echoing it and its output to the log; a failed stage stops the pipeline."""
    log.write("$ " + " ".join(command) + "\n")
    log.flush()
    start = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    log.write(done.stdout + f"# {time.perf_counter() - start:.0f} s, exit {done.returncode}\n")
    log.flush()
    print(done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "", flush=True)
    if done.returncode:
        sys.exit(f"{command[1]} failed: see {log.name}")


SUITE = """name: jsts-small
source: https://github.com/yahoojapan/JGLUE
seeds: 1
max_length: 128
epochs: 1
batch_size: 32
lrs: [3.0e-4]
tasks:
  jsts:
    name: JSTS
    task: regression
    train: jsts-v1.3/train-v1.3.json
    valid: jsts-v1.3/valid-v1.3.json
    text: sentence1
    pair: sentence2
    target: label
    metrics: [pearson, spearman]
"""


def suite_flags(root: Path, out: Path, every: int) -> list[str]:
    """The pretraining's flags for a JSTS suite every `every` steps, its files and suite file written under `out`."""
    from jglue_suite import prepare

    data = out / "suite-data"
    prepare(root, data, 0.2)
    (out / "suite.yaml").write_text(SUITE, encoding="utf-8")
    return [f"--eval.suite={out / 'suite.yaml'}", f"--eval.suite_data={data}", f"--eval.suite_every={every}",
            f"--checkpoint.every={every}"]  # fmt: skip


def build(root: Path, out: Path, minutes: float, vocab: int, suite_every: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    exported = out.parent / f"{out.name}-hf"
    text = out / "corpus.txt"
    lines = corpus_lines(root)
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{len(lines):,} lines, {sum(map(len, lines)):,} characters -> {text}", flush=True)
    config = ROOT / "configs/pretrain/wikitext-mini-10min.yaml"
    tok, shards, run = out / "tokenizer", out / "shards", out / "run"
    stages = [
        [
            "tokenizer",
            "train",
            "--files",
            str(text),
            "--type",
            "unigram",
            "--vocab-size",
            str(vocab),
            "--out",
            str(tok),
        ],  # fmt: skip
        [
            "preprocess",
            "--tokenizer",
            str(tok),
            "--files",
            str(text),
            "--out",
            str(shards),
            "--seq-len",
            "128",
            "--doc-per-line",
            "--mode",
            "complete",
            "--pack",
        ],  # fmt: skip
        [
            "pretrain",
            "--config",
            str(config),
            "--data",
            str(shards),
            "--out",
            str(run),
            f"--train.time_budget_minutes={minutes}",
            *(suite_flags(root, out, suite_every) if suite_every else []),
        ],  # fmt: skip
        ["export", str(run), "--out", str(exported)],
    ]
    with (out / "pipeline.log").open("a", encoding="utf-8") as log:
        for stage in stages:
            _run([str(BIN), *stage], log)
    return exported


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-root", type=Path, default=DATA_ROOT, help="folder holding jglue/ and ner-wikipedia-ja/")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=15.0, help="pretraining time budget (default: 15)")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--suite-every", type=int, default=0, help="steps between JSTS fine-tunings (0: none)")
    args = parser.parse_args()
    exported = build(args.data_root, args.out, args.minutes, args.vocab_size, args.suite_every)
    print(f"exported -> {exported}")


if __name__ == "__main__":
    main()
