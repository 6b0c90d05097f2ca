"""Tokenizer training at corpus scale: `bertforge tokenizer train` against the SentencePiece library's trainer and
the `tokenizers` trainers, on Japanese (no spaces) and English, for Unigram and WordPiece.

The corpora are built from public data: Japanese from the JSQuAD contexts and the Japanese Wikipedia NER sentences
(each line one to four sentences drawn at random), English from WikiText-2's lines (drawn at random), to 10, 100
and 1,000 MB. Every run is a fresh process, timed from its start (imports included) to its end, and its peak
resident memory read from the kernel (wait4). bertforge runs as a user types it (`bertforge tokenizer train`);
SentencePiece as its Python users call it (`SentencePieceTrainer.train(input=...)`, its defaults otherwise, but for
`hard_vocab_limit=False` as bertforge sets it: WikiText-2's text gives only about 10,000 Unigram pieces);
`tokenizers` as its documentation trains (`Tokenizer.train(files, trainer)`). SentencePiece runs twice: as shipped
(its default of 16 threads) and tuned, with one thread per core (`num_threads`, as bertforge gives it). Above
`--sample-above` MB, bertforge trains on `--sample-lines` lines and SentencePiece on as many (its
`input_sentence_size`, which samples as it reads); `tokenizers` has no sampling and reads everything.
`tokenizers`' Unigram is run only where it fits in memory (HF_UNIGRAM_MAX_MB): on text without spaces it holds
every substring of every line.

For each Unigram tokenizer, `tokens/kchar` is the number of pieces per 1,000 characters of 2,000 lines of the
corpus: the two SentencePiece-trained tokenizers should cut text alike.

    .venv/bin/python benchmarks/tokenizer_training.py --data ../shared/data [--sizes 10 100 1000]

Each run adds a line per corpus, type and implementation to the results index (results_index.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import report
import results_index

VENV_BIN = Path(sys.executable).parent
HF_UNIGRAM_MAX_MB = {"ja": 10, "en": 10}  # the largest corpus `tokenizers`' Unigram trainer runs on


def japanese_sentences(data: Path) -> list[str]:
    squad = json.loads((data / "jglue/jsquad-v1.3/valid-v1.3.json").read_text("utf-8"))
    texts = {p["context"].split("[SEP]")[-1].strip() for a in squad["data"] for p in a["paragraphs"]}
    texts |= {x["text"] for x in json.loads((data / "ner-wikipedia-ja/ner.json").read_text("utf-8"))}
    return sorted({s.strip() + "。" for t in texts for s in t.split("。") if s.strip()})


def english_lines(data: Path) -> list[str]:
    text = "".join((data / "wikitext-2" / f).read_text("utf-8") for f in ("valid.txt", "test.txt"))
    return sorted({line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("=")})


def build_corpus(units: list[str], per_line: int, mb: int, path: Path, seed: int = 0) -> Path:
    """`mb` MB of lines, each 1..per_line units drawn at random (joined without spaces for Japanese)."""
    if path.exists() and path.stat().st_size >= mb << 20:
        return path
    rng, size, joiner = random.Random(seed), 0, "" if per_line > 1 else " "
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        while size < mb << 20:
            line = joiner.join(rng.choice(units) for _ in range(rng.randint(1, per_line))) + "\n"
            fh.write(line)
            size += len(line.encode("utf-8"))
    tmp.rename(path)
    return path


# ------------------------------------------------------------------------------------------------ the workers
def run_sentencepiece(corpus: str, kind: str, vocab: int, coverage: float, sample: int, out: Path,
                      tuned: bool = False) -> None:  # fmt: skip
    import sentencepiece as spm

    extra = {"input_sentence_size": sample, "shuffle_input_sentence": True} if sample else {}
    extra |= {"num_threads": os.cpu_count() or 1} if tuned else {}  # tuned: a thread per core
    spm.SentencePieceTrainer.train(
        input=corpus, model_prefix=str(out / "sp"), model_type=kind, vocab_size=vocab,
        character_coverage=coverage, hard_vocab_limit=False, minloglevel=2, **extra,
    )  # fmt: skip


def run_tokenizers(corpus: str, kind: str, vocab: int, out: Path) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    if kind == "unigram":
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=vocab, special_tokens=specials, unk_token="[UNK]")
    else:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=False)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=specials)
    tok.train([corpus], trainer)
    tok.save(str(out / "tokenizer.json"))


def tokens_per_kchar(out: Path, corpus: str) -> float | None:
    """Pieces per 1,000 characters on the corpus's first 2,000 lines, for the tokenizer in `out`."""
    with open(corpus, encoding="utf-8") as fh:
        lines = [line.strip() for line in itertools.islice(fh, 2000)]
    chars = sum(len(line) for line in lines)
    if (out / "sp.model").exists():
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(out / "sp.model"))
        return 1000 * sum(len(ids) for ids in sp.encode(lines)) / chars
    if (out / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        return 1000 * sum(len(e.ids) for e in tok.encode_batch(lines, add_special_tokens=False)) / chars
    return None


def child(args: argparse.Namespace) -> None:
    out = Path(args.out)
    if args.impl.startswith("sentencepiece"):
        tuned = args.impl == SP_TUNED
        run_sentencepiece(args.corpus, args.kind, args.vocab, args.coverage, args.sample, out, tuned)
    else:
        run_tokenizers(args.corpus, args.kind, args.vocab, out)


def timed(cmd: list[str], limit: float) -> dict:
    """Wall seconds and peak resident memory of one fresh process, or why it has none."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"seconds": None, "peak_mb": None, "note": f"stopped after {limit:.0f} s"}
    seconds = time.perf_counter() - start
    peak = _peak_from(err)  # the wrapper's children's high-water mark: the command's own
    if proc.returncode:
        said = [line for line in err.strip().splitlines() if not line.startswith("PEAK_KB ")] or ["?"]
        return {"seconds": None, "peak_mb": None, "note": "failed: " + said[-1][:200]}
    return {"seconds": seconds, "peak_mb": peak, "note": ""}


PEAK_WRAPPER = (
    "import resource, subprocess, sys\n"
    "code = subprocess.call(sys.argv[1:])\n"
    "print(f'PEAK_KB {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}', file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def _peak_from(err: str) -> float | None:
    marks = [line for line in err.splitlines() if line.startswith("PEAK_KB ")]
    return int(marks[-1].split()[1]) / 1024 if marks else None


# ---------------------------------------------------------------------------------------------------- the parent
SP_TUNED = "sentencepiece-threads"  # SentencePiece with a thread per core
# implementation -> (system, variant) as the results index names them
SYSTEMS = {"bertforge": ("bertforge", "float32"), "sentencepiece": ("SentencePiece", "shipped"),
           SP_TUNED: ("SentencePiece", "tuned"), "tokenizers": ("tokenizers (Hugging Face)", "shipped")}  # fmt: skip


def index(rows: list[dict], vocab: int) -> None:
    """A line per corpus, type and implementation in the results index: its wall seconds."""
    lines = []
    for r in rows:
        if r["seconds"]:
            system, variant = SYSTEMS[r["implementation"]]
            per_seed = [{"seed": 0, "wall_s": r["seconds"], "value": r["seconds"]}]
            recipe = f"{r['type']}-{r['language']}-{r['mb']}mb-{vocab // 1000}k"
            lines.append(results_index.line("tokenizer_training", recipe, system, variant, "warm", "seconds",
                                            per_seed, peak_mb=r["peak_mb"]))  # fmt: skip
    results_index.append(lines)


def plan(lang: str, mb: int) -> list[tuple[str, str]]:
    """(implementation, type) pairs to run on one corpus."""
    runs = [("bertforge", "unigram"), ("sentencepiece", "unigram"), (SP_TUNED, "unigram")]
    if mb <= HF_UNIGRAM_MAX_MB[lang]:
        runs.append(("tokenizers", "unigram"))
    return runs + [("bertforge", "wordpiece"), ("tokenizers", "wordpiece")]


def command(impl: str, kind: str, corpus: Path, lang: str, sample: int, args: argparse.Namespace, out: Path):
    coverage = 0.9995 if lang == "ja" else 1.0
    if impl == "bertforge":
        cmd = [str(VENV_BIN / "bertforge"), "tokenizer", "train", "--files", str(corpus), "--type", kind,
               "--vocab-size", str(args.vocab), "--out", str(out)]  # fmt: skip
        return cmd + (["--sample-lines", str(sample)] if sample else [])
    return [sys.executable, __file__, "--impl", impl, "--kind", kind, "--corpus", str(corpus), "--vocab",
            str(args.vocab), "--coverage", str(coverage), "--sample", str(sample), "--out", str(out)]  # fmt: skip


def run_all(args: argparse.Namespace) -> list[dict]:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    units = {"ja": (japanese_sentences(Path(args.data)), 4), "en": (english_lines(Path(args.data)), 1)}
    rows = []
    for lang in args.languages:
        for mb in args.sizes:
            corpus = build_corpus(*units[lang], mb, work / f"{lang}{mb}.txt")
            sample = args.sample_lines if mb > args.sample_above else 0
            for impl, kind in plan(lang, mb):
                out = work / f"out-{lang}{mb}-{impl}-{kind}"
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir()
                cmd = command(impl, kind, corpus, lang, sample if impl != "tokenizers" else 0, args, out)
                result = timed([sys.executable, "-c", PEAK_WRAPPER, *cmd], args.limit)
                density = tokens_per_kchar(out, str(corpus)) if result["seconds"] and kind == "unigram" else None
                rows.append({"language": lang, "mb": mb, "type": kind, "implementation": impl,
                             "sampled_lines": sample if impl != "tokenizers" else 0, **result,
                             "tokens_per_kchar": density})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| text | MB | type | implementation | lines sampled | seconds | peak memory (MB) | tokens/kchar | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        secs = f"{r['seconds']:.1f}" if r["seconds"] else "-"
        peak = f"{r['peak_mb']:,.0f}" if r["peak_mb"] else "-"
        dens = f"{r['tokens_per_kchar']:.0f}" if r["tokens_per_kchar"] else ""
        sampled = f"{r['sampled_lines']:,}" if r["sampled_lines"] else "all"
        lines.append(f"| {r['language']} | {r['mb']} | {r['type']} | {r['implementation']} | {sampled} | {secs} | "
                     f"{peak} | {dens} | {r['note']} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--work", default="/tmp/bertforge-tokenizer-bench")
    ap.add_argument("--languages", nargs="+", default=["ja", "en"])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--sample-above", type=int, default=100, help="MB above which the SentencePiece runs sample")
    ap.add_argument("--sample-lines", type=int, default=300_000)
    ap.add_argument("--limit", type=float, default=1800, help="seconds before a run is stopped")
    ap.add_argument("--name", default="tokenizer_training")
    for flag in ("--impl", "--kind", "--corpus", "--out"):
        ap.add_argument(flag, help=argparse.SUPPRESS)
    ap.add_argument("--coverage", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--sample", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.impl:
        child(args)
        return
    rows = run_all(args)
    title = (
        f"Tokenizer training, vocabulary {args.vocab:,}, {os.cpu_count()} cores: wall seconds and peak memory of "
        f"each command (SentencePiece-trained runs above {args.sample_above} MB on {args.sample_lines:,} lines)"
    )
    index(rows, args.vocab)
    colour = {"bertforge": "C0", "sentencepiece": "C1", SP_TUNED: "C3", "tokenizers": "C2"}
    bars = [(f"{r['language']} {r['mb']} MB {r['type']} {r['implementation']}", r["seconds"] or 0,
             colour[r["implementation"]]) for r in rows]  # fmt: skip
    report.save(args.name, title, table(rows), rows, bars, "seconds (lower is better)")


if __name__ == "__main__":
    main()
