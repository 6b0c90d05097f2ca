"""The `bertforge` command: one subcommand per stage. It parses arguments and calls the stage; nothing more."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from bertforge.errors import StorageError, UserError, failed_collective, storage_problem


def _make(cls: Any, **kwargs: Any) -> Any:
    """A stage's frozen config from CLI flags; its validation errors are the user's."""
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise UserError(str(e)) from None


def _tokenizer_train(args: argparse.Namespace) -> int:
    from bertforge import tokenizer

    tok = tokenizer.train(
        args.files,
        args.type,
        args.vocab_size,
        args.out,
        lowercase=args.lowercase,
        style=args.style,
        min_frequency=args.min_frequency,
        model_max_length=args.max_length,
        show_progress=sys.stderr.isatty(),
    )
    print(f"trained a {args.type} tokenizer with {tok.vocab_size} tokens -> {args.out}")
    return 0


def _preprocess(args: argparse.Namespace) -> int:
    from bertforge.data import preprocess

    cfg = _make(
        preprocess.PreprocessConfig,
        tokenizer=args.tokenizer,
        files=tuple(args.files),
        out=args.out,
        seq_len=args.seq_len,
        mode=args.mode,
        workers=args.workers,
        valid_fraction=0.0 if args.valid_files else args.valid_fraction,
        valid_files=tuple(args.valid_files or ()),
        shard_size=args.shard_size,
        input_format=args.input_format,
        doc_per_line=args.doc_per_line,
        text_field=args.text_field,
        seed=args.seed,
    )
    m = preprocess.main(cfg)
    train, valid = m["splits"]["train"], m["splits"]["valid"]
    stats = m["stats"]
    rate = m["text_tokens"] / max(stats["seconds"], 1e-9)
    print(
        f"{train['sequences']:,} train sequences in {len(train['shards'])} shard(s), "
        f"{valid['sequences']:,} valid sequences, {m['seq_len']} tokens each ({m['mode']}); "
        f"{m['text_tokens']:,} text tokens in {stats['seconds']:.1f} s "
        f"({rate:,.0f} tokens/s), peak memory {stats['peak_memory_mb']:.0f} MB "
        f"-> {args.out}/manifest.json"
    )
    return 0


def _init(args: argparse.Namespace, extra: Sequence[str]) -> int:
    from bertforge.config import load_config_and_data
    from bertforge.tasks import init

    cfg, data = load_config_and_data(init.InitConfig, args.config, extra)
    vocab_given = "vocab_size" in (data.get("model") or {})
    out = init.main(cfg, args.tokenizer, args.out, vocab_given=vocab_given)
    print(f"initialised a {cfg.model.num_layers}-layer model with a {cfg.head} head -> {out}")
    return 0


def _pretrain(args: argparse.Namespace, extra: Sequence[str]) -> int:
    from bertforge.config import load_config_and_data
    from bertforge.tasks import pretrain
    from bertforge.train.loop import Preempted

    flags = {k: v for k, v in (("shards", args.data), ("tokenizer", args.tokenizer)) if v}
    cfg, data = load_config_and_data(pretrain.PretrainConfig, args.config, extra, {"data": flags})
    vocab_given = "vocab_size" in (data.get("model") or {})
    from bertforge.parallel import initialize_distributed

    initialize_distributed()
    try:
        last = pretrain.main(cfg, args.out, resume=args.resume, vocab_given=vocab_given)
    except Preempted as e:
        print(f"{e}; checkpoint saved; run the same command to continue", file=sys.stderr)
        return 143
    shown = ", ".join(f"{k} {last[k]:.4g}" for k in ("loss", "valid_loss", "valid_accuracy") if k in last)
    print(f"pretrained {last['step']} steps ({shown}) -> {args.out}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from bertforge.tasks import export

    out = export.main(args.run_dir, args.out, args.step)
    print(f"exported {args.run_dir} ({args.step}) -> {out}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from bertforge.plot import plot_run

    print(f"wrote {plot_run(args.run_dir, args.out)}")
    return 0


def _fill_mask(args: argparse.Namespace) -> int:
    from bertforge.tasks.infer import FillMaskConfig, fill_mask_main

    results = fill_mask_main(FillMaskConfig(model=args.model, texts=tuple(args.texts), top_k=args.top_k))
    if args.json:
        print(json.dumps([{"text": t, "masks": r} for t, r in zip(args.texts, results, strict=True)], indent=2))
        return 0
    for text, masks in zip(args.texts, results, strict=True):
        print(text)
        for m, options in enumerate(masks):
            if len(masks) > 1:
                print(f"  mask {m + 1}:")
            for option in options:
                print(f"  {option['score']:8.4f}  {option['token_str']:<16} {option['sequence']}")
    return 0


def _predict(args: argparse.Namespace) -> int:
    from bertforge.tasks.infer import PredictConfig, predict_main

    cfg = _make(
        PredictConfig,
        model=args.model,
        data=args.data,
        out=args.out,
        text_column=args.text_column,
        text_pair_column=args.text_pair_column,
        id_column=args.id_column,
        batch_size=args.batch_size,
        max_length=args.max_length,
        truncation=args.truncation,
        quoted_tsv=args.quoted_tsv,
    )
    outputs = predict_main(cfg)
    print(f"wrote {len(outputs)} predictions -> {args.out}")
    return 0


def _finetune(args: argparse.Namespace, extra: Sequence[str]) -> int:
    from bertforge.config import load_config_and_data
    from bertforge.tasks import finetune
    from bertforge.train.loop import Preempted

    data = {
        "train": args.data,
        "valid": args.valid_data,
        "text_column": args.text_column,
        "text_pair_column": args.text_pair_column,
        "target_columns": args.target_column.split(",") if args.target_column else None,
        "id_column": args.id_column,
        "group_column": args.group_column,
        "error_column": args.error_column,
        "max_length": args.max_length,
        "truncation": args.truncation,
        "quoted_tsv": args.quoted_tsv,
    }
    flags: dict[str, Any] = {"data": {k: v for k, v in data.items() if v is not None}}
    if args.model:
        flags["model"] = args.model
    if args.task:
        flags["head"] = {"task": args.task}
    folds = {k: v for k, v in (("k", args.folds), ("run", args.fold)) if v is not None}
    if folds:
        flags["folds"] = folds
    cfg, _ = load_config_and_data(finetune.FinetuneConfig, args.config, extra, flags)
    from bertforge.parallel import initialize_distributed

    initialize_distributed()
    try:
        summary = finetune.main(cfg, args.out, resume=args.resume)
    except Preempted as e:
        print(f"{e}; checkpoint saved; run the same command to continue", file=sys.stderr)
        return 143
    print(finetune.format_summary(summary))
    print(f"-> {args.out} (summary.json, oof.csv, fold-*/model)")
    return 0


def _plan(args: argparse.Namespace, extra: Sequence[str]) -> int:
    from bertforge.config import load_config_and_data
    from bertforge.tasks import plan, pretrain

    cfg, _ = load_config_and_data(pretrain.PretrainConfig, args.config, extra)
    seq_len = args.seq_len
    if seq_len is None and args.data:
        from bertforge.data.shards import Shards

        seq_len = Shards(args.data, "train").seq_len
    seq_len = seq_len or 128
    if args.devices is None:
        import jax

        devices = cfg.mesh.num_devices or jax.device_count()
    else:
        devices = args.devices
    estimate, measured = plan.main(cfg, devices, seq_len, compile=args.compile)
    print(plan.describe(cfg, estimate))
    print(estimate.table())
    if measured is not None:
        error = 100 * (estimate.peak / measured - 1)
        print(f"compiled on this machine: {measured / plan.MiB:,.1f} MiB per device (estimate {error:+.1f}%)")
    return 0


def _launch(args: argparse.Namespace) -> int:
    from bertforge.tasks import launch

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    cfg = _make(
        launch.LaunchConfig,
        command=tuple(command),
        num_processes=args.num_processes,
        devices_per_process=args.devices_per_process,
        port=args.port,
        log_dir=args.log_dir or "",
    )
    return launch.main(cfg)


def _demo(args: argparse.Namespace) -> int:
    from bertforge.tasks import demo

    # Every DemoConfig field that has a flag and was given; the rest keep the dataclass defaults.
    fields = (f.name for f in dataclasses.fields(demo.DemoConfig))
    given = {name: getattr(args, name) for name in fields if getattr(args, name, None) is not None}
    if given.get("compare") == "none":
        given["compare"] = None
    demo.main(demo.DemoConfig(**given))
    return 0


QUOTED_TSV_HELP = 'the .tsv table is written with CSV quoting (default: TSV has no quoting, so a " is text)'


class _Version(argparse.Action):
    """--version: prints `bertforge X.Y.Z` and exits; the version is looked up only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        from bertforge import version

        print(f"bertforge {version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bertforge", description="Pretrain and fine-tune BERT-family models with JAX on TPU, GPU or CPU."
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)

    tok = sub.add_parser("tokenizer", help="train a tokenizer").add_subparsers(dest="action", required=True)
    train = tok.add_parser("train", help="train a WordPiece, Unigram or BPE tokenizer from text files")
    train.add_argument("--files", nargs="+", required=True, help="text files: paths, globs or fsspec URLs")
    train.add_argument("--type", choices=["wordpiece", "unigram", "bpe"], default="wordpiece")
    train.add_argument("--vocab-size", type=int, default=30522)
    train.add_argument("--out", required=True, help="folder to write tokenizer.json and tokenizer_config.json")
    train.add_argument("--lowercase", action="store_true")
    train.add_argument(
        "--style", choices=["bert", "roberta"], default=None, help="special tokens (default: roberta for bpe)"
    )
    train.add_argument("--min-frequency", type=int, default=2)
    train.add_argument("--max-length", type=int, default=512, help="model_max_length written for transformers")
    train.set_defaults(run=_tokenizer_train)

    pp = sub.add_parser("preprocess", help="tokenize a corpus into fixed-length shards with a manifest")
    pp.add_argument("--tokenizer", required=True, help="tokenizer folder")
    pp.add_argument("--files", nargs="+", required=True, help="text, JSONL or Parquet: paths, globs, fsspec URLs")
    pp.add_argument("--out", required=True, help="folder or fsspec URL for the shards and manifest.json")
    pp.add_argument("--seq-len", type=int, default=128)
    pp.add_argument(
        "--mode",
        choices=["concat", "complete", "doc"],
        default="concat",
        help="concat: cut the joined text; complete: whole sentences; doc: whole sentences of one document",
    )
    pp.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    pp.add_argument("--valid-fraction", type=float, default=0.01, help="share of documents held out")
    pp.add_argument("--valid-files", nargs="+", help="held-out files instead of --valid-fraction")
    pp.add_argument("--shard-size", type=int, default=65536, help="sequences per shard")
    pp.add_argument("--input-format", choices=["auto", "text", "jsonl", "parquet"], default="auto")
    pp.add_argument("--doc-per-line", action="store_true", help="text: one document per line, not per blank-line block")
    pp.add_argument("--text-field", default="text", help="JSONL field or Parquet column holding the text")
    pp.add_argument("--seed", type=int, default=0, help="decides which documents are held out")
    pp.set_defaults(run=_preprocess)

    pt = sub.add_parser(
        "pretrain",
        help="masked-LM pretraining from scratch; the same command again resumes",
        description="Overrides such as --train.max_steps=1000 --optim.lr=1e-3 follow the flags.",
    )
    pt.add_argument("--config", help="YAML (configs/pretrain/*.yaml)")
    pt.add_argument("--data", help="shard folder made by `bertforge preprocess`")
    pt.add_argument("--tokenizer", help="tokenizer folder (default: the one the shards were made with)")
    pt.add_argument("--out", required=True, help="run folder: checkpoints, metrics, logs")
    pt.add_argument("--resume", default="auto", help="auto (default), never, or a checkpoint folder")
    pt.set_defaults(run=_pretrain, takes_overrides=True)

    ex = sub.add_parser("export", help="a run's weights as a Hugging Face folder")
    ex.add_argument("run_dir", metavar="RUN", help="run folder")
    ex.add_argument("--out", required=True)
    ex.add_argument("--step", default="latest", help="latest (default), best, or a step number")
    ex.set_defaults(run=_export)

    pl = sub.add_parser("plot", help="curves of a pretraining or fine-tuning run, as a PNG")
    pl.add_argument("run_dir", metavar="RUN", help="run folder")
    pl.add_argument("--out", help="PNG to write (default: RUN/curves.png)")
    pl.set_defaults(run=_plot)

    init = sub.add_parser(
        "init",
        help="a freshly initialised model as a Hugging Face folder",
        description="Overrides such as --model.preset=mini --model.num_layers=2 follow the flags.",
    )
    init.add_argument("--tokenizer", required=True, help="tokenizer folder (its vocabulary sizes the model)")
    init.add_argument("--out", required=True)
    init.add_argument("--config", help="YAML with a 'model:' section (preset and fields), 'head', 'num_labels'")
    init.set_defaults(run=_init, takes_overrides=True)

    fm = sub.add_parser("fill-mask", help="top tokens for each [MASK] in a text")
    fm.add_argument("--model", required=True, help="Hugging Face folder or hub id of a masked-LM model")
    fm.add_argument("--top-k", type=int, default=5)
    fm.add_argument("--json", action="store_true", help="print JSON instead of a table")
    fm.add_argument("texts", nargs="+", metavar="TEXT")
    fm.set_defaults(run=_fill_mask)

    pr = sub.add_parser("predict", help="predictions of a sequence-classification model for a table of texts")
    pr.add_argument("--model", required=True, help="a fine-tuning run (its folds averaged) or a model folder")
    pr.add_argument("--data", required=True, help="CSV, TSV or JSONL")
    pr.add_argument("--out", required=True, help="CSV to write")
    pr.add_argument("--text-column", default=None, help="default: the fine-tuning run's, else text")
    pr.add_argument("--text-pair-column", default=None)
    pr.add_argument("--id-column", default=None, help="column copied to the output (default: 'id' if present)")
    pr.add_argument("--batch-size", type=int, default=32)
    pr.add_argument("--max-length", type=int, default=None)
    pr.add_argument("--truncation", choices=["head", "tail", "head+tail"], default=None)
    pr.add_argument("--quoted-tsv", action="store_true", help=QUOTED_TSV_HELP)
    pr.set_defaults(run=_predict)

    ft = sub.add_parser(
        "finetune",
        help="fine-tune a sequence head with k-fold cross-validation; the same command again resumes",
        description="Overrides such as --optim.lr=3e-5 --train.epochs=5 --head.pooling=mean follow the flags.",
    )
    ft.add_argument("--model", help="Hugging Face folder or hub id, or a bertforge pretraining run")
    ft.add_argument("--data", help="training table: CSV, TSV, JSONL or Parquet, local or fsspec URL")
    ft.add_argument("--valid-data", help="a validation table instead of folds")
    ft.add_argument("--text-column", help="default: text")
    ft.add_argument("--text-pair-column")
    ft.add_argument("--target-column", help="default: target; several for multilabel, comma-separated")
    ft.add_argument("--id-column", help="copied to oof.csv (default: 'id' when present)")
    ft.add_argument("--group-column", help="rows sharing a value stay in one fold")
    ft.add_argument("--error-column", help="standard error of the target: rows weighted by 1/error^2")
    ft.add_argument("--task", choices=["regression", "classification", "multilabel"])
    ft.add_argument("--folds", type=int, help="number of folds (default 5)")
    ft.add_argument("--fold", help="'all' (default) or fold numbers such as 0 or 0,2")
    ft.add_argument("--max-length", type=int, help="tokens per text (default 256)")
    ft.add_argument("--truncation", choices=["head", "tail", "head+tail"])
    ft.add_argument("--quoted-tsv", action="store_true", default=None, help=QUOTED_TSV_HELP)
    ft.add_argument("--config", help="YAML (configs/finetune/*.yaml)")
    ft.add_argument("--out", required=True, help="run folder")
    ft.add_argument("--resume", default="auto", choices=["auto", "never"])
    ft.set_defaults(run=_finetune, takes_overrides=True)

    pn = sub.add_parser(
        "plan",
        help="memory per device of a pretraining config on a mesh, before running it",
        description="Overrides such as --mesh.fsdp=4 --train.global_batch=256 --model.remat=true follow the flags.",
    )
    pn.add_argument("--config", help="YAML (configs/pretrain/*.yaml)")
    pn.add_argument("--devices", type=int, help="devices of the mesh (default: this machine's)")
    pn.add_argument("--seq-len", type=int, help="tokens per sequence (default: the shards' of --data, else 128)")
    pn.add_argument("--data", help="shard folder, for its sequence length")
    pn.add_argument("--compile", action="store_true", help="also compile the step here and show JAX's figure")
    pn.set_defaults(run=_plan, takes_overrides=True)

    la = sub.add_parser(
        "launch",
        help="run a command as several processes on this machine, as the hosts of a cluster would",
        description="bertforge launch --num-processes 2 --devices-per-process 4 -- pretrain --config ... --out RUN",
    )
    la.add_argument("--num-processes", type=int, default=2)
    la.add_argument("--devices-per-process", type=int, default=4, help="simulated CPU devices of each process")
    la.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
    la.add_argument("--log-dir", help="logs of processes 1.. (default: RUN/logs)")
    la.add_argument("command", nargs=argparse.REMAINDER, help="-- then a bertforge command and its arguments")
    la.set_defaults(run=_launch)

    dm = sub.add_parser("demo", help="the whole pipeline on a built-in corpus (no download)")
    dm.add_argument("--out", help="folder for everything the demo writes (default: demo-output)")
    dm.add_argument("--preset", help="model size (default: mini)")
    dm.add_argument("--steps", type=int, help="pretraining steps, the part of the demo that scales (default: 600)")
    dm.add_argument("--minutes", type=float, help="a pretraining time budget instead of --steps")
    dm.add_argument("--folds", type=int, help="folds of the fine-tuning task (default: 3)")
    dm.add_argument("--compare-folds", type=int, help="folds the compared models run (default: 1)")
    dm.add_argument("--max-length", type=int, help="tokens per pretraining block and per docstring (default: 64)")
    dm.add_argument("--epochs", type=float, help="fine-tuning epochs (default: 3)")
    dm.add_argument("--per-class", type=int, help="docstrings per module in the fine-tuning task (default: 150)")
    dm.add_argument(
        "--compare",
        help="a model folder or hub id fine-tuned alongside the pretrained one (default: the shipped "
        "all-MiniLM-L6-v2 weights; 'none' for none)",
    )
    dm.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(line_buffering=True)  # lines show as they come when stdout is a file or a pipe
    if args.command == "launch":
        extra = []  # everything after `launch` belongs to the launched command
    _compile_once()
    leave_at_once = False
    try:
        if extra and not getattr(args, "takes_overrides", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        code = args.run(args, extra) if getattr(args, "takes_overrides", False) else args.run(args)
    except UserError as e:
        # One line, whatever the message quotes from the input (a column name may hold a newline or U+2028).
        text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in str(e))
        print(f"error: {text}", file=sys.stderr)
        code = 2
        leave_at_once = isinstance(e, StorageError)
    except OSError as e:
        refused = storage_problem(e)
        if refused is None:
            raise
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{refused[0]}; {refused[1]} and run the same command again", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except BaseException as e:
        if not _in_multiprocess_run():
            raise
        lost = failed_collective(e)
        if lost is None:
            traceback.print_exc()
        else:
            import jax

            print(
                f"error: process {jax.process_index()} of {jax.process_count()}: a collective with the other "
                f"processes failed ({lost}); another process has probably stopped, its log says why. Run the same "
                "command again on every process to continue from the last checkpoint",
                file=sys.stderr,
            )
        code = 1
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
    from bertforge import compile_cache

    folder = compile_cache.enable()
    if folder is not None:
        compile_cache.say_cache_errors_once(folder)


def _in_multiprocess_run() -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized()


def entry() -> None:
    """The installed `bertforge` command and `python -m bertforge.cli`: the process-wide settings, then main."""
    from bertforge.allocator import rerun_with_tuned_allocator

    rerun_with_tuned_allocator()
    sys.exit(main())


if __name__ == "__main__":
    entry()
