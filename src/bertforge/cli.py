"""The `bertforge` command: one subcommand per stage. A stage's flags come from its config dataclass (flags.py); a
subcommand parses them into the config and calls the stage; nothing more."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Collection, Sequence
from typing import Any

from bertforge import stage_runs
from bertforge.errors import UserError, report
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
        stage_runs.run_tokenizer_train,
        aliases={"--type": "kind", "--max-length": "model_max_length"},
    ),
    "preprocess": Command(
        "tokenize a corpus into fixed-length shards with a manifest",
        "bertforge.tasks.preprocess:PreprocessConfig",
        stage_runs.run_preprocess,
    ),
    "pretrain": Command(
        "masked-LM or replaced-token detection pretraining; the same command again resumes",
        "bertforge.tasks.pretrain:PretrainConfig",
        stage_runs.run_pretrain,
        "Overrides such as --train.max_steps=1000 --optim.lr=1e-3 follow the flags.",
        aliases={"--data": "data.shards", "--sources": "data.sources", "--tokenizer": "data.tokenizer"},
        options=options("config", "out", "resume"),
        yaml=True,
    ),
    "export": Command(
        "a run's weights as a Hugging Face folder",
        "bertforge.tasks.export:ExportConfig",
        stage_runs.run_export,
        positional={"run": "RUN"},
    ),
    "plot": Command(
        "curves of a pretraining or fine-tuning run, as a PNG",
        "bertforge.tasks.plot:PlotConfig",
        stage_runs.run_plot,
        positional={"run": "RUN"},
    ),
    "init": Command(
        "a freshly initialised model as a Hugging Face folder",
        "bertforge.tasks.init:InitConfig",
        stage_runs.run_init,
        "Overrides such as --model.preset=mini --model.num_layers=2 follow the flags.",
        options=options("tokenizer", "out", "config", out={"help": "Hugging Face folder to write"}),
        yaml=True,
    ),
    "fill-mask": Command(
        "top tokens for each [MASK] in a text",
        "bertforge.tasks.infer:FillMaskConfig",
        stage_runs.run_fill_mask,
        positional={"texts": "TEXT"},
        options=options("json"),
    ),
    "predict": Command(
        "predictions of a fine-tuned model: a row per text, each text's entities, each question's answer or choice",
        "bertforge.tasks.infer:PredictConfig",
        stage_runs.run_predict,
        aliases={"--data-format": "format"},
    ),
    "embed": Command(
        "a vector per text, by an embedding model or any encoder",
        "bertforge.tasks.embed:EmbedConfig",
        stage_runs.run_embed,
    ),
    "mine": Command(
        "hard negatives for each query of a table of pairs, found by an embedding model",
        "bertforge.tasks.mine:MineConfig",
        stage_runs.run_mine,
    ),
    "evaluate-retrieval": Command(
        "nDCG@10, MRR@10 and Recall@k of an embedding model on a BEIR folder or a pairs table",
        "bertforge.tasks.retrieve:RetrievalConfig",
        stage_runs.run_evaluate_retrieval,
    ),
    "evaluate": Command(
        "metrics of a fine-tuned model on labelled data, as fine-tuning reports them on its validation data",
        "bertforge.tasks.evaluate:EvaluateConfig",
        stage_runs.run_evaluate,
        aliases={"--data-format": "format", "--target-column": Alias("target_columns", sep=",")},
    ),
    "finetune": Command(
        "fine-tune a sequence, token, span, choice or embedding model with k folds; the same command again resumes",
        "bertforge.tasks.finetune:FinetuneConfig",
        stage_runs.run_finetune,
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
        stage_runs.run_suite,
        "Fine-tuning's overrides such as --train.epochs=1 --head.pooling=mean follow the flags, for every task.",
        passes=True,
    ),
    "plan": Command(
        "memory per device of a pretraining config on a mesh, before running it",
        "bertforge.tasks.plan:PlanConfig",
        stage_runs.run_plan,
        "Overrides such as --mesh.fsdp=4 --train.global_batch=256 --model.remat=true follow the flags.",
        aliases={"--data": "shards"},
        options=options("config"),
        yaml=True,
    ),
    "launch": Command(
        "run a command as several processes on this machine, as the hosts of a cluster would",
        "bertforge.tasks.launch:LaunchConfig",
        stage_runs.run_launch,
        "bertforge launch --num-processes 2 --devices-per-process 4 -- pretrain --config ... --out RUN",
        positional={"command": "COMMAND"},
        remainder=True,
    ),
    "demo": Command(
        "the whole pipeline on a built-in corpus (no download)", "bertforge.tasks.demo:DemoConfig", stage_runs.run_demo
    ),
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
    named = _named(argv)
    argv = data_as_sources(argv) if "pretrain" in named else argv
    parser = build_parser(named)
    args, extra = parser.parse_known_args(argv)
    if args.stage.remainder:
        extra = []  # everything after the command's own flags belongs to the command it runs
    args.passed, extra = passed_overrides(extra) if args.stage.passes else ([], extra)
    cfg, args.config_data = build_config(args, extra)
    return cfg, args


def data_as_sources(argv: Sequence[str]) -> list[str]:
    """pretrain's `--data A=0.7 --data B=0.3` (a mixture, as fairseq users give one) as `--sources A=0.7 B=0.3`;
    one `--data PATH` stays one folder."""
    values, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--data" and i + 1 < len(argv):
            values.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--data="):
            values.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    if len(values) < 2 and not any(_weighted(v) for v in values):
        return list(argv)
    if "--sources" in rest:
        raise UserError("pretrain: give a mixture as --data PATH=WEIGHT (once per folder) or as --sources, not both")
    return [*rest, "--sources", *values]


def _weighted(value: str) -> bool:
    """Whether a --data value is PATH=WEIGHT (a shard folder's own name holds no '=' followed by a number)."""
    weight = value.rpartition("=")[2]
    try:
        return "=" in value and float(weight) == float(weight)
    except ValueError:
        return False


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
