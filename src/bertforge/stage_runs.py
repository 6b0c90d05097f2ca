"""What each subcommand does once its flags are parsed: call its stage's main with the config and say, in a line or
a table, what it did. cli.py maps the subcommands to these."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any


def _model_keys(args: argparse.Namespace) -> list[str]:
    """The model section's keys the config gave (without vocab_size the model takes the tokenizer's)."""
    return list(args.config_data.get("model") or {})


def run_tokenizer_train(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import tokenizer

    tok = tokenizer.main(cfg, show_progress=sys.stderr.isatty())
    print(f"trained a {cfg.kind} tokenizer with {tok.vocab_size} tokens -> {cfg.out}")
    return 0


def run_preprocess(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import preprocess

    if cfg.valid_files:  # held-out files take the place of a held-out share
        cfg = dataclasses.replace(cfg, valid_fraction=0.0)
    print(preprocess.describe(preprocess.main(cfg), cfg.out))
    return 0


def run_init(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import init

    out = init.main(cfg, args.tokenizer, args.out, vocab_given="vocab_size" in _model_keys(args))
    print(f"initialised a {cfg.model.num_layers}-layer model with a {cfg.head} head -> {out}")
    return 0


def run_pretrain(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.runtime.devices import initialize_distributed
    from bertforge.tasks import pretrain
    from bertforge.train.loop import Preempted

    initialize_distributed()
    try:
        last = pretrain.main(cfg, args.out, resume=args.resume, model_keys=_model_keys(args))
    except Preempted as e:
        print(f"{e}; checkpoint saved; run the same command to continue", file=sys.stderr)
        return 143
    keys = ("loss", "valid_loss", "valid_accuracy", "valid_gen_loss", "valid_disc_accuracy", "valid_disc_auc")
    shown = ", ".join(f"{k} {last[k]:.4g}" for k in keys if k in last)
    print(f"pretrained {last['step']} steps ({shown}) -> {args.out}")
    return 0


def run_export(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import export

    out, url, what = export.main(cfg)
    done = [f"exported {cfg.run} ({what}) -> {out}"] if out else []
    print("\n".join(done + ([f"pushed {cfg.run} ({what}) to the Hugging Face Hub: {url}"] if url else [])))
    return 0


def run_plot(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import plot

    print(f"wrote {plot.main(cfg)}")
    return 0


def run_fill_mask(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks.infer import fill_mask_main

    results = fill_mask_main(cfg)
    if args.json:
        print(json.dumps([{"text": t, "masks": r} for t, r in zip(cfg.texts, results, strict=True)], indent=2))
        return 0
    for text, masks in zip(cfg.texts, results, strict=True):
        print(text)
        for m, top in enumerate(masks):
            if len(masks) > 1:
                print(f"  mask {m + 1}:")
            for option in top:
                print(f"  {option['score']:8.4f}  {option['token_str']:<16} {option['sequence']}")
    return 0


def run_predict(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks.infer import predict_main

    print(f"wrote {len(predict_main(cfg))} predictions -> {cfg.out}")
    return 0


def run_embed(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import embed

    vectors = embed.main(cfg)
    print(f"wrote {vectors.shape[0]} vectors of {vectors.shape[1]} values -> {cfg.out}")
    return 0


def run_mine(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import mine

    found = mine.main(cfg)
    dropped = f"; {found.dropped} dropped, their queries short of candidates" if found.dropped else ""
    print(f"wrote {len(found.rows)} rows with {cfg.negatives} negatives each{dropped} -> {cfg.out}")
    return 0


def run_evaluate_retrieval(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import retrieve

    found = retrieve.main(cfg)
    print(" ".join(f"{k} {v:.4f}" for k, v in found.items() if isinstance(v, float)) + f" ({found['queries']} queries, "
          f"{found['documents']} documents)")  # fmt: skip
    return 0


def run_evaluate(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import evaluate

    found = evaluate.main(cfg)
    shown = (f"{k} {'undefined' if v is None else f'{v:.4f}'}" for k, v in found.items() if k != "records")
    print(" ".join(shown) + f" ({found['records']} records)")
    return 0


def run_finetune(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.runtime.devices import initialize_distributed
    from bertforge.tasks import finetune
    from bertforge.train.loop import Preempted

    initialize_distributed()
    try:
        summary = finetune.main(cfg, args.out, resume=args.resume)
    except Preempted as e:
        print(f"{e}; checkpoint saved; run the same command to continue", file=sys.stderr)
        return 143
    print(finetune.format_summary(summary))
    print(f"-> {args.out} (summary.json, oof.csv, fold-*/model)")
    return 0


def run_suite(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import scoreboard, suite

    try:
        board = suite.main(cfg, overrides=args.passed)
    except suite.Stopped as e:
        print(f"{e}; run the same command to continue", file=sys.stderr)
        return 143
    print(scoreboard.markdown(board), end="")
    print(f"-> {cfg.out} (scoreboard.json, scoreboard.md, scoreboard.png, units/)")
    return 0


def run_plan(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import plan

    estimate, measured = plan.main(cfg)
    print(plan.describe(cfg, estimate))
    print(estimate.table())
    if measured is not None:
        error = 100 * (estimate.peak / measured - 1)
        print(f"compiled on this machine: {measured / plan.MiB:,.1f} MiB per device (estimate {error:+.1f}%)")
    return 0


def run_launch(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import launch

    return launch.main(cfg)


def run_demo(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import demo

    if cfg.compare == "none":
        cfg = dataclasses.replace(cfg, compare=None)
    demo.main(cfg)
    return 0
