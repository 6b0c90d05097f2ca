"""Preprocessing throughput: `bertforge preprocess` against the Hugging Face `datasets` recipe of run_mlm.py.

Both turn the same text, with the same WordPiece tokenizer, into 128-token blocks: bertforge's concat mode, and
`load_dataset("text")` + `map(tokenize, batched=True, num_proc=N)` + `map(group_texts)`. Each run is a fresh
process, so that its peak memory (with its workers) is its own. Prints a table, saves it (Markdown, JSON) and a
bar chart in benchmarks/results/.

    .venv/bin/python benchmarks/investigations/preprocess_throughput.py \
        [--data-dir ../shared/data/wikitext-2] [--repeat 8]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _path  # noqa: F401 (the benchmarks' folder on the path)
import report


def peak_mb() -> float:
    usage = [resource.getrusage(w).ru_maxrss for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(usage) / 1024


def run_bertforge(corpus: str, tokenizer: str, workers: int, out: str) -> dict:
    from bertforge.tasks import preprocess

    start = time.perf_counter()
    cfg = preprocess.PreprocessConfig(
        tokenizer=tokenizer,
        files=(corpus,),
        out=out,
        seq_len=128,
        workers=workers,
        valid_fraction=0.0,
        doc_per_line=True,
    )
    m = preprocess.main(cfg, progress=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": m["text_tokens"], "blocks": m["splits"]["train"]["sequences"]}


def run_hf(corpus: str, tokenizer: str, workers: int, out: str) -> dict:
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    from itertools import chain

    from datasets import load_dataset
    from transformers import AutoTokenizer

    start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(tokenizer)
    raw = load_dataset("text", data_files={"train": corpus}, cache_dir=out)["train"]
    raw = raw.filter(
        lambda b: [bool(t.strip()) for t in b["text"]], batched=True, num_proc=workers if workers > 1 else None
    )

    def tokenize(batch):
        return tok(batch["text"], return_special_tokens_mask=True)

    tokenized = raw.map(tokenize, batched=True, num_proc=workers if workers > 1 else None, remove_columns=["text"])

    def group_texts(examples):
        joined = {k: list(chain(*examples[k])) for k in examples}
        total = (len(joined["input_ids"]) // 128) * 128
        return {k: [t[i : i + 128] for i in range(0, total, 128)] for k, t in joined.items()}

    grouped = tokenized.map(group_texts, batched=True, num_proc=workers if workers > 1 else None)
    seconds = time.perf_counter() - start
    tokens = sum(len(ids) for ids in tokenized["input_ids"])
    return {"seconds": seconds, "tokens": tokens, "blocks": len(grouped)}


def child(args: argparse.Namespace) -> None:
    fn = run_bertforge if args.impl == "bertforge" else run_hf
    with tempfile.TemporaryDirectory() as out:
        result = fn(args.corpus, args.tokenizer, args.child_workers, str(Path(out) / "o"))
    result["peak_mb"] = peak_mb()
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default="../shared/data/wikitext-2")
    ap.add_argument("--repeat", type=int, default=8, help="copies of the corpus, for a run long enough to time")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--impl", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", help=argparse.SUPPRESS)
    ap.add_argument("--child-workers", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.impl:
        child(args)
        return

    from bertforge.tokenizer.train import train_tokenizer

    work = Path(tempfile.mkdtemp(prefix="bf-bench-"))
    text = "".join(Path(args.data_dir, f).read_text(encoding="utf-8") for f in ("valid.txt", "test.txt"))
    corpus = work / "corpus.txt"
    corpus.write_text(text * args.repeat, encoding="utf-8")
    tok_dir = work / "tok"
    train_tokenizer([str(Path(args.data_dir) / "valid.txt")], "wordpiece", 16000, tok_dir, lowercase=True)
    size_mb = corpus.stat().st_size / 1e6

    rows = []
    for workers in args.workers:
        for impl in ("bertforge", "hf"):
            cmd = [sys.executable, __file__, "--impl", impl, "--corpus", str(corpus), "--tokenizer", str(tok_dir)]
            proc = subprocess.run([*cmd, "--child-workers", str(workers)], capture_output=True, text=True, check=False)
            if proc.returncode:
                sys.exit(proc.stderr[-3000:])
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            name = "bertforge preprocess (concat)" if impl == "bertforge" else "datasets map + group_texts"
            rows.append({"implementation": name, "workers": workers, **result})
            print(rows[-1], flush=True)

    title = (
        f"WikiText-2 valid+test x{args.repeat} ({size_mb:.0f} MB), WordPiece 16k, 128-token blocks, "
        f"{os.cpu_count()} cores"
    )
    lines = [
        "| implementation | workers | seconds | text tokens | tokens/s | peak memory (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['implementation']} | {r['workers']} | {r['seconds']:.1f} | {r['tokens']:,} | "
            f"{r['tokens'] / r['seconds']:,.0f} | {r['peak_mb']:.0f} |"
        )
    bars = [
        (
            f"{r['implementation']}, {r['workers']} worker(s)",
            r["tokens"] / r["seconds"],
            "C0" if r["implementation"].startswith("bertforge") else "C1",
        )
        for r in rows
    ]
    report.save("preprocess", title, "\n".join(lines), rows, bars, "text tokens / s (higher is better)")


if __name__ == "__main__":
    main()
