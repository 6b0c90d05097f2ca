"""The `bertforge` command: one subcommand per stage. A stage's flags come from its config dataclass (flags.py); a
subcommand parses them into the config and calls the stage; nothing more."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Collection, Sequence
from typing import Any

from bertforge.errors import report
from bertforge.flags import (
    Alias,
    Command,
    Formatter,
    Parser,
    Version,
    add_flags,
    build_config,
    options,
    passed_overrides,
)
from bertforge.runtime.allocator import NOTE as ALLOCATOR_NOTE


def _model_keys(args: argparse.Namespace) -> list[str]:
    """The model section's keys the config gave (without vocab_size the model takes the tokenizer's)."""
    return list(args.config_data.get("model") or {})


def _tokenizer_train(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import tokenizer

    tok = tokenizer.main(cfg, show_progress=sys.stderr.isatty())
    print(f"trained a {cfg.kind} tokenizer with {tok.vocab_size} tokens -> {cfg.out}")
    return 0


def _preprocess(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import preprocess

    if cfg.valid_files:  # held-out files take the place of a held-out share
        cfg = dataclasses.replace(cfg, valid_fraction=0.0)
    print(preprocess.describe(preprocess.main(cfg), cfg.out))
    return 0


def _init(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import init

    out = init.main(cfg, args.tokenizer, args.out, vocab_given="vocab_size" in _model_keys(args))
    print(f"initialised a {cfg.model.num_layers}-layer model with a {cfg.head} head -> {out}")
    return 0


def _pretrain(cfg: Any, args: argparse.Namespace) -> int:
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


def _export(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import export

    out, url, what = export.main(cfg)
    done = [f"exported {cfg.run} ({what}) -> {out}"] if out else []
    print("\n".join(done + ([f"pushed {cfg.run} ({what}) to the Hugging Face Hub: {url}"] if url else [])))
    return 0


def _plot(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import plot

    print(f"wrote {plot.main(cfg)}")
    return 0


def _fill_mask(cfg: Any, args: argparse.Namespace) -> int:
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


def _predict(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks.infer import predict_main

    print(f"wrote {len(predict_main(cfg))} predictions -> {cfg.out}")
    return 0


def _embed(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import embed

    vectors = embed.main(cfg)
    print(f"wrote {vectors.shape[0]} vectors of {vectors.shape[1]} values -> {cfg.out}")
    return 0


def _evaluate_retrieval(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import retrieve

    found = retrieve.main(cfg)
    print(" ".join(f"{k} {v:.4f}" for k, v in found.items() if isinstance(v, float)) + f" ({found['queries']} queries, "
          f"{found['documents']} documents)")  # fmt: skip
    return 0


def _evaluate(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import evaluate

    found = evaluate.main(cfg)
    shown = (f"{k} {'undefined' if v is None else f'{v:.4f}'}" for k, v in found.items() if k != "records")
    print(" ".join(shown) + f" ({found['records']} records)")
    return 0


def _finetune(cfg: Any, args: argparse.Namespace) -> int:
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


def _suite(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import scoreboard, suite

    try:
        board = suite.main(cfg, overrides=args.passed)
    except suite.Stopped as e:
        print(f"{e}; run the same command to continue", file=sys.stderr)
        return 143
    print(scoreboard.markdown(board), end="")
    print(f"-> {cfg.out} (scoreboard.json, scoreboard.md, scoreboard.png, units/)")
    return 0


def _plan(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import plan

    estimate, measured = plan.main(cfg)
    print(plan.describe(cfg, estimate))
    print(estimate.table())
    if measured is not None:
        error = 100 * (estimate.peak / measured - 1)
        print(f"compiled on this machine: {measured / plan.MiB:,.1f} MiB per device (estimate {error:+.1f}%)")
    return 0


def _launch(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import launch

    return launch.main(cfg)


def _demo(cfg: Any, args: argparse.Namespace) -> int:
    from bertforge.tasks import demo

    if cfg.compare == "none":
        cfg = dataclasses.replace(cfg, compare=None)
    demo.main(cfg)
    return 0


# The data section's keys that fine-tuning takes as --key-name flags too.
_DATA_FLAGS = ("text_column", "text_pair_column", "id_column", "group_column", "error_column", "max_length",
               "truncation", "quoted_tsv", "tag_scheme", "label_all_tokens", "stride", "long_text",
               "window_pool", "max_question_length", "max_answer_length", "context_column")  # fmt: skip
_DATA_LISTS = ("target_columns", "negative_columns")  # flags of a comma-separated list, named in the singular

GROUPS = {"tokenizer": "train a tokenizer"}
COMMANDS: dict[str, Command] = {
    "tokenizer train": Command(
        "train a WordPiece, Unigram or BPE tokenizer from text files",
        "bertforge.tasks.tokenizer:TokenizerTrainConfig",
        _tokenizer_train,
        aliases={"--type": "kind", "--max-length": "model_max_length"},
    ),
    "preprocess": Command(
        "tokenize a corpus into fixed-length shards with a manifest",
        "bertforge.tasks.preprocess:PreprocessConfig",
        _preprocess,
    ),
    "pretrain": Command(
        "masked-LM or replaced-token detection pretraining; the same command again resumes",
        "bertforge.tasks.pretrain:PretrainConfig",
        _pretrain,
        "Overrides such as --train.max_steps=1000 --optim.lr=1e-3 follow the flags.",
        aliases={"--data": "data.shards", "--tokenizer": "data.tokenizer"},
        options=options("config", "out", "resume"),
        yaml=True,
    ),
    "export": Command(
        "a run's weights as a Hugging Face folder",
        "bertforge.tasks.export:ExportConfig",
        _export,
        positional={"run": "RUN"},
    ),
    "plot": Command(
        "curves of a pretraining or fine-tuning run, as a PNG",
        "bertforge.tasks.plot:PlotConfig",
        _plot,
        positional={"run": "RUN"},
    ),
    "init": Command(
        "a freshly initialised model as a Hugging Face folder",
        "bertforge.tasks.init:InitConfig",
        _init,
        "Overrides such as --model.preset=mini --model.num_layers=2 follow the flags.",
        options=options("tokenizer", "out", "config", out={"help": "Hugging Face folder to write"}),
        yaml=True,
    ),
    "fill-mask": Command(
        "top tokens for each [MASK] in a text",
        "bertforge.tasks.infer:FillMaskConfig",
        _fill_mask,
        positional={"texts": "TEXT"},
        options=options("json"),
    ),
    "predict": Command(
        "predictions of a fine-tuned model: a row per text, each text's entities, each question's answer or choice",
        "bertforge.tasks.infer:PredictConfig",
        _predict,
        aliases={"--data-format": "format"},
    ),
    "embed": Command(
        "a vector per text, by an embedding model or any encoder", "bertforge.tasks.embed:EmbedConfig", _embed
    ),
    "evaluate-retrieval": Command(
        "nDCG@10, MRR@10 and Recall@k of an embedding model on a BEIR folder or a pairs table",
        "bertforge.tasks.retrieve:RetrievalConfig",
        _evaluate_retrieval,
    ),
    "evaluate": Command(
        "metrics of a fine-tuned model on labelled data, as fine-tuning reports them on its validation data",
        "bertforge.tasks.evaluate:EvaluateConfig",
        _evaluate,
        aliases={"--data-format": "format", "--target-column": Alias("target_columns", sep=",")},
    ),
    "finetune": Command(
        "fine-tune a sequence, token, span, choice or embedding model with k folds; the same command again resumes",
        "bertforge.tasks.finetune:FinetuneConfig",
        _finetune,
        "Overrides such as --optim.lr=3e-5 --train.epochs=5 --head.pooling=mean follow the flags.",
        aliases={
            "--data": "data.train",
            "--valid-data": "data.valid",
            **{f"--{key[:-1].replace('_', '-')}": Alias(f"data.{key}", sep=",") for key in _DATA_LISTS},
            "--task": "head.task",
            "--folds": "folds.k",
            "--fold": "folds.run",
            "--data-format": "data.format",
            **{f"--{key.replace('_', '-')}": f"data.{key}" for key in _DATA_FLAGS},
        },
        options=options(
            "config",
            "out",
            "resume",
            out={"help": "run folder"},
            resume={"choices": ("auto", "never"), "help": "auto (default) or never"},
        ),
        yaml=True,
    ),
    "suite": Command(
        "fine-tune one encoder on every task of a suite (GLUE, JGLUE, a YAML file), seeds and learning rates, and "
        "score it; the same command again skips what is done",
        "bertforge.tasks.suite:SuiteConfig",
        _suite,
        "Fine-tuning's overrides such as --train.epochs=1 --head.pooling=mean follow the flags, for every task.",
        passes=True,
    ),
    "plan": Command(
        "memory per device of a pretraining config on a mesh, before running it",
        "bertforge.tasks.plan:PlanConfig",
        _plan,
        "Overrides such as --mesh.fsdp=4 --train.global_batch=256 --model.remat=true follow the flags.",
        aliases={"--data": "shards"},
        options=options("config"),
        yaml=True,
    ),
    "launch": Command(
        "run a command as several processes on this machine, as the hosts of a cluster would",
        "bertforge.tasks.launch:LaunchConfig",
        _launch,
        "bertforge launch --num-processes 2 --devices-per-process 4 -- pretrain --config ... --out RUN",
        positional={"command": "COMMAND"},
        remainder=True,
    ),
    "demo": Command("the whole pipeline on a built-in corpus (no download)", "bertforge.tasks.demo:DemoConfig", _demo),
}


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The command line. Only `commands` (all when None) get their flags: that imports their stage's module."""
    parser = Parser(
        prog="bertforge",
        description="Pretrain and fine-tune BERT-family models with JAX on TPU, GPU or CPU.",
        epilog=ALLOCATOR_NOTE,
    )
    parser.add_argument("--version", action=Version)
    sub = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, Any] = {}
    for name, command in COMMANDS.items():
        where, leaf = sub, name
        if " " in name:
            group, leaf = name.split(" ", 1)
            if group not in groups:
                groups[group] = sub.add_parser(group, help=GROUPS[group]).add_subparsers(dest="action", required=True)
            where = groups[group]
        p = where.add_parser(leaf, help=command.help, description=command.description, formatter_class=Formatter)
        if commands is None or name in commands:
            add_flags(p, command)
    return parser


def command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each command's parser in `parser` (build_parser's) by its full name, `tokenizer train` included."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                inner = command_parsers(sub)
                found.update({f"{name} {k}": v for k, v in inner.items()} if inner else {name: sub})
    return found


def parse(argv: Sequence[str]) -> tuple[Any, argparse.Namespace]:
    """The stage's config and the parsed arguments (`args.stage` is the Command); a mistake is a UserError."""
    parser = build_parser(_named(argv))
    args, extra = parser.parse_known_args(argv)
    if args.stage.remainder:
        extra = []  # everything after the command's own flags belongs to the command it runs
    args.passed, extra = passed_overrides(extra) if args.stage.passes else ([], extra)
    cfg, args.config_data = build_config(args, extra)
    return cfg, args


def _named(argv: Sequence[str]) -> set[str]:
    """The commands argv names: the top level has no option that takes a value, so its first word is the command."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return {name for name in COMMANDS if name.split(" ", 1)[0] == first}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Lines show as they come when stdout is a file or a pipe.
    getattr(sys.stdout, "reconfigure", lambda **_: None)(line_buffering=True)
    if _named(argv):
        _compile_once()  # before the stage's module imports JAX: the processes it starts inherit the settings
    try:
        cfg, args = parse(argv)
        code, leave_at_once = args.stage.run(cfg, args), False
    except BaseException as e:  # noqa: BLE001 (report re-raises what it does not turn into a line)
        code, leave_at_once = report(e, _in_multiprocess_run())
    if leave_at_once or (code not in (0, 143) and _in_multiprocess_run()):
        # Leave at once: a normal exit waits at JAX's shutdown barrier for processes that, stuck in a collective
        # with this one, never come. Gone, this process stops sending heartbeats and the others stop too. After a
        # refused write, orbax's background writers are failing too and would only add their tracebacks.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _compile_once() -> None:
    """JAX's persistent compilation cache for the command (and the processes it starts), before anything compiles."""
    from bertforge.runtime import compile_cache

    folder = compile_cache.enable()
    if folder is not None:
        compile_cache.say_cache_errors_once(folder)


def _in_multiprocess_run() -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized()


def entry() -> None:
    """The installed `bertforge` command and `python -m bertforge.cli`: the process-wide settings, then main."""
    from bertforge.runtime import allocator, collector, xla_options

    command = sys.argv[1] if len(sys.argv) > 1 else None
    allocator.rerun_with_tuned_allocator(command)
    xla_options.set_xla_flags(command)  # after the re-run: the settings of the process that goes on
    collector.for_command()
    code = main()
    collector.freeze_for_exit()
    sys.exit(code)


if __name__ == "__main__":
    entry()
