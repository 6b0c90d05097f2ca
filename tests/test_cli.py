"""The command line, end to end: fill-mask and predict against transformers, init, and one-line errors."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import re
import subprocess
import sys
import typing

import numpy as np
import pytest
import torch
from hf_models import save_hf_model
from transformers import (
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertForMaskedLM,
    BertForSequenceClassification,
    RobertaForMaskedLM,
    pipeline,
)

import bertforge
from bertforge.cli import COMMANDS, build_parser, command_parsers, main, parse
from bertforge.flags import OPTIONS


def run_cli(capsys, *argv):
    capsys.readouterr()  # drop what the test's own setup printed
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "family,model_cls,tok_fixture",
    [("bert", BertForMaskedLM, "wordpiece_dir"), ("roberta", RobertaForMaskedLM, "bpe_dir")],
)
def test_fill_mask_matches_the_transformers_pipeline(family, model_cls, tok_fixture, request, tmp_path, capsys):
    folder = save_hf_model(model_cls, family, request.getfixturevalue(tok_fixture), tmp_path / "hf")
    reference = pipeline("fill-mask", model=str(folder), top_k=5)
    mask = reference.tokenizer.mask_token
    texts = [f"The river city had a {mask} school.", f"A {mask} of the league and the {mask} season!"]
    code, out, err = run_cli(capsys, "fill-mask", "--model", folder, "--json", "--top-k", 5, *texts)
    assert code == 0, err
    ours = json.loads(out)
    for text, result in zip(texts, ours, strict=True):
        theirs = reference(text)
        theirs = theirs if isinstance(theirs[0], list) else [theirs]  # one mask: a flat list
        assert len(result["masks"]) == len(theirs) == text.count(mask)
        for our_mask, their_mask in zip(result["masks"], theirs, strict=True):
            assert [o["token"] for o in our_mask] == [t["token"] for t in their_mask]
            assert [o["token_str"].strip() for o in our_mask] == [t["token_str"].strip() for t in their_mask]
            np.testing.assert_allclose([o["score"] for o in our_mask], [t["score"] for t in their_mask], atol=1e-4)
            # far above uniform (1 / vocabulary size), so the comparison has teeth
            assert our_mask[0]["score"] > 5 / reference.tokenizer.vocab_size


def test_fill_mask_table_accepts_bracket_mask_for_any_model(bpe_dir, tmp_path, capsys):
    folder = save_hf_model(RobertaForMaskedLM, "roberta", bpe_dir, tmp_path / "hf")
    code, out, err = run_cli(capsys, "fill-mask", "--model", folder, "--top-k", 3, "The [MASK] of the city.")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "The [MASK] of the city."
    assert len(lines) == 4
    scores = [float(line.split()[0]) for line in lines[1:]]
    assert scores == sorted(scores, reverse=True) and all(0 < s <= 1 for s in scores)


def _write_table(path, rows):
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["id", "excerpt"])
        writer.writerows(rows)


@pytest.mark.parametrize("num_labels", [1, 3])
def test_predict_equals_transformers_logits(num_labels, wordpiece_dir, tmp_path, capsys):
    folder = save_hf_model(BertForSequenceClassification, "bert", wordpiece_dir, tmp_path / "hf", num_labels=num_labels)
    texts = [
        "The river city had a music school.",
        'A text with "quotes", commas,\nand a newline in the field.',
        " ".join(["a very long text about the army"] * 40),  # longer than the model's 64 positions: truncated
        "Short!",
    ]
    data = tmp_path / "test.csv"
    _write_table(data, [(f"row{i}", t) for i, t in enumerate(texts)])
    out = tmp_path / "preds.csv"
    code, stdout, err = run_cli(
        capsys,
        "predict",
        "--model",
        folder,
        "--data",
        data,
        "--text-column",
        "excerpt",
        "--out",
        out,
        "--batch-size",
        2,
    )
    assert code == 0, err
    with open(out, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["id"] for r in rows] == [f"row{i}" for i in range(len(texts))]

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    for row, text in zip(rows, texts, strict=True):
        enc = tok(text, truncation=True, max_length=64, return_tensors="pt")
        with torch.no_grad():
            logits = model(**enc).logits[0].numpy()
        if num_labels == 1:
            assert float(row["prediction"]) == pytest.approx(float(logits[0]), abs=1e-4)
        else:
            ours = np.array([float(row[f"logit_LABEL_{j}"]) for j in range(num_labels)])
            np.testing.assert_allclose(ours, logits, atol=1e-4)
            assert row["label"] == f"LABEL_{int(np.argmax(logits))}"


def test_init_then_fill_mask_and_transformers_load(wordpiece_dir, tmp_path, capsys):
    out = tmp_path / "model"
    code, _, err = run_cli(
        capsys, "init", "--tokenizer", wordpiece_dir, "--out", out, "--model.preset=test", "--model.num_layers=1"
    )
    assert code == 0, err
    hf = AutoModelForMaskedLM.from_pretrained(out)
    assert hf.config.num_hidden_layers == 1 and hf.config.vocab_size == 700
    code, stdout, err = run_cli(capsys, "fill-mask", "--model", out, "--json", "the [MASK] city")
    assert code == 0, err
    assert len(json.loads(stdout)[0]["masks"][0]) == 5


# ---------------------------------------------------------------------------------------------------- bad input
def assert_one_line_error(code, out, err, *fragments):
    assert code == 2
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_bad_inputs_get_one_line_errors(wordpiece_dir, corpus, tmp_path, capsys):
    folder = save_hf_model(BertForMaskedLM, "bert", wordpiece_dir, tmp_path / "hf")

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((folder / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04never unpickled")
    assert_one_line_error(*run_cli(capsys, "fill-mask", "--model", pickled, "a [MASK]"), "pytorch_model.bin", "convert")

    gpt = tmp_path / "gpt"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    assert_one_line_error(*run_cli(capsys, "fill-mask", "--model", gpt, "a [MASK]"), "config.json", "gpt2")

    small = tmp_path / "small-vocab"
    small.mkdir()
    for f in folder.iterdir():
        (small / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((small / "config.json").read_text())
    cfg["vocab_size"] = 10
    (small / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(*run_cli(capsys, "fill-mask", "--model", small, "a [MASK]"), "700 tokens", "10 rows")

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    args = ["tokenizer", "train", "--files", empty, "--vocab-size", 100, "--out", tmp_path / "t1"]
    assert_one_line_error(*run_cli(capsys, *args), "empty.txt", "no text")

    latin = tmp_path / "latin.txt"
    latin.write_bytes("na\xefve\n".encode("latin-1"))
    args = ["tokenizer", "train", "--files", latin, "--vocab-size", 100, "--out", tmp_path / "t2"]
    assert_one_line_error(*run_cli(capsys, *args), "latin.txt", "line 1", "UTF-8")

    args = ["init", "--tokenizer", wordpiece_dir, "--out", tmp_path / "m1", "--model.preset=gigantic"]
    assert_one_line_error(*run_cli(capsys, *args), "unknown preset 'gigantic'", "model.preset")

    args = ["init", "--tokenizer", wordpiece_dir, "--out", tmp_path / "m2", "--model.hiden_size=64"]
    assert_one_line_error(*run_cli(capsys, *args), "unknown config key 'model.hiden_size'")

    args = ["init", "--tokenizer", wordpiece_dir, "--out", tmp_path / "m3", "--model.vocab_size=100"]
    assert_one_line_error(*run_cli(capsys, *args), "model.vocab_size", "700")

    assert_one_line_error(*run_cli(capsys, "fill-mask", "--model", folder, "no mask here"), "no [MASK] in")
    assert not any((tmp_path / n).exists() for n in ("t1", "t2", "m1", "m2", "m3"))


def test_predict_names_a_missing_column(tmp_path, wordpiece_dir, capsys):
    folder = save_hf_model(BertForSequenceClassification, "bert", wordpiece_dir, tmp_path / "hf", num_labels=1)
    data = tmp_path / "d.csv"
    _write_table(data, [("a", "text")])
    args = ["predict", "--model", folder, "--data", data, "--text-column", "text", "--out", tmp_path / "p.csv"]
    assert_one_line_error(*run_cli(capsys, *args), "d.csv", "no column 'text'", "excerpt")
    assert not (tmp_path / "p.csv").exists()


def test_console_script_reports_errors_without_traceback(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "bertforge")
    proc = subprocess.run(
        [exe, "tokenizer", "train", "--files", str(tmp_path / "absent.txt"), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, "absent.txt: no such file")


def test_version_is_the_installed_package_version(monkeypatch):
    import importlib.metadata

    exe = os.path.join(os.path.dirname(sys.executable), "bertforge")
    proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    assert proc.stdout == f"bertforge {importlib.metadata.version('bertforge')}\n"
    assert bertforge.version() == bertforge.__version__ == importlib.metadata.version("bertforge")

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert bertforge.version() == "unknown"


def test_python_api_returns_what_the_cli_writes(wordpiece_dir, tmp_path, capsys):
    folder = save_hf_model(BertForSequenceClassification, "bert", wordpiece_dir, tmp_path / "hf", num_labels=1)
    texts = ["The river city had a music school.", "Short!"]
    data = tmp_path / "d.csv"
    _write_table(data, list(enumerate(texts)))
    code, _, err = run_cli(
        capsys, "predict", "--model", folder, "--data", data, "--text-column", "excerpt", "--out", tmp_path / "p.csv"
    )
    assert code == 0, err
    with open(tmp_path / "p.csv", newline="") as fh:
        written = [float(r["prediction"]) for r in csv.DictReader(fh)]
    api = bertforge.predict(str(folder), texts)
    assert api.shape == (2, 1)
    assert bertforge.labels(str(folder)) == ["LABEL_0"]
    np.testing.assert_allclose(api[:, 0], written, rtol=1e-6)
    mlm = save_hf_model(BertForMaskedLM, "bert", wordpiece_dir, tmp_path / "mlm")
    assert len(bertforge.fill_mask(str(mlm), "the [MASK] city", top_k=2)[0][0]) == 2


# A long run: `make demo` runs the demo itself, and this shortened one is in the slow set.
@pytest.mark.slow
def test_shortened_demo_runs_end_to_end(wordpiece_dir, tmp_path, capsys):
    compare = save_hf_model(BertForMaskedLM, "bert", wordpiece_dir, tmp_path / "compare")
    out_dir = tmp_path / "demo"
    code, out, err = run_cli(
        capsys, "demo", "--out", out_dir, "--preset", "test", "--steps", 6, "--folds", 2, "--epochs", 1,
        "--per-class", 20, "--compare", compare,
    )  # fmt: skip
    assert code == 0, err
    assert "== summary" in out
    for name in ("tokenizer/tokenizer.json", "shards/manifest.json", "run/metrics.jsonl", "task/train.csv"):
        assert (out_dir / name).exists(), name
    assert AutoModelForMaskedLM.from_pretrained(out_dir / "model").config.num_hidden_layers == 2
    with open(out_dir / "task" / "test.csv", newline="") as fh:
        test = list(csv.DictReader(fh))
    corpus = set((out_dir / "corpus.txt").read_text().splitlines())
    assert len(test) == 16 and not corpus & {r["text"] for r in test}  # held out of pretraining too

    for run, name, folds in (
        (out_dir / "finetune-pretrained", "BERT test pretrained above", [0, 1]),
        (out_dir / "finetune-random", "BERT test, random weights", [0]),  # the comparisons run fewer folds
        (out_dir / "finetune-compare", "compare", [0]),
    ):
        summary = json.loads((run / "summary.json").read_text())
        assert [f["fold"] for f in summary["folds"]] == folds
        model = run / f"fold-{folds[-1]}" / "model"
        assert AutoModelForSequenceClassification.from_pretrained(model).config.num_labels == 8
        with open(run / "predictions.csv", newline="") as fh:
            written = list(csv.DictReader(fh))
        assert [r["id"] for r in written] == [r["id"] for r in test]
        logits = bertforge.predict(str(run), [r["text"] for r in test])
        labels = bertforge.labels(run)
        assert labels == json.loads((run / "run.json").read_text())["labels"] == sorted(set(r["module"] for r in test))
        assert [r["prediction"] for r in written] == [labels[i] for i in logits.argmax(axis=1)]
        accuracy = np.mean([r["prediction"] == r["module"] for r in written])
        row = next(line for line in out.splitlines() if line.startswith(f"| {name} |"))
        assert row.split(" | ")[4] == f"{accuracy:.3f}", row


# ---------------------------------------------------------------------------------------------------- flags
def _leaf_defaults(cls, default=dataclasses.MISSING, prefix=""):
    """{dotted path: default} of every leaf field, a section's fields taking the section's default."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if default is not dataclasses.MISSING:
            value = getattr(default, f.name)
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = f.default
        tp = hints[f.name]
        listed = typing.get_origin(tp) in (tuple, list)  # a list of sections (phases) is one value
        section = None if listed else next((t for t in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(t)), None)
        if section is not None:
            out.update(_leaf_defaults(section, value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    return out


def test_every_flag_default_is_its_config_fields_default():
    parsers = command_parsers(build_parser())
    assert set(parsers) == set(COMMANDS)
    for name, sub in parsers.items():
        command = COMMANDS[name]
        defaults = _leaf_defaults(command.config_class())
        reached = set()
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = action.option_strings[0].lstrip("-") if action.option_strings else action.dest
            if flag in command.options:  # the command's own options, from one shared table, are no config field
                assert flag in OPTIONS and flag not in defaults, (name, flag)
                continue
            path = getattr(action, "path", None)
            assert path in defaults, f"{name}: {action.option_strings} is no flag made from a config field"
            reached.add(path)
            if defaults[path] is dataclasses.MISSING:
                assert action.required or not action.option_strings, (name, path)
            else:
                assert action.default == defaults[path], (name, action.option_strings, action.default, defaults[path])
                assert not action.required, (name, path)
        assert reached == set(defaults), f"{name}: fields without a flag: {set(defaults) - reached}"


def test_aliases_set_their_fields():
    cfg, args = parse(["finetune", "--out", "o", "--model", "m", "--data", "t.csv", "--valid-data", "v.csv",
                       "--text-column", "a", "--text-pair-column", "b", "--target-column", "y1,y2", "--id-column", "i",
                       "--group-column", "g", "--error-column", "e", "--task", "multilabel", "--folds", "3",
                       "--fold", "0,2", "--max-length", "64", "--truncation", "tail", "--quoted-tsv"])  # fmt: skip
    assert cfg.model == "m" and args.out == "o" and args.resume == "auto"
    assert (
        dataclasses.replace(
            cfg.data,
            train="t.csv",
            valid="v.csv",
            text_column="a",
            text_pair_column="b",
            target_columns=("y1", "y2"),
            id_column="i",
            group_column="g",
            error_column="e",
            max_length=64,
            truncation="tail",
            quoted_tsv=True,
        )
        == cfg.data
    )
    assert (cfg.head.task, cfg.folds.k, cfg.folds.run) == ("multilabel", 3, "0,2")
    cfg, _ = parse(["pretrain", "--out", "r", "--data", "sh", "--tokenizer", "tok", "--train.max_steps=null"])
    assert (cfg.data.shards, cfg.data.tokenizer, cfg.train.max_steps) == ("sh", "tok", None)
    cfg, _ = parse(["plan", "--data", "sh", "--devices", "8", "--compile", "--mesh.fsdp=4"])
    assert (cfg.shards, cfg.devices, cfg.compile, cfg.mesh.fsdp, cfg.data.shards) == ("sh", 8, True, 4, "")
    cfg, _ = parse(["tokenizer", "train", "--files", "a", "b", "--out", "t", "--type", "bpe", "--max-length", "128"])
    assert (cfg.files, cfg.kind, cfg.model_max_length, cfg.style) == (("a", "b"), "bpe", 128, None)


def test_only_given_flags_override_the_yaml(tmp_path):
    path = tmp_path / "ft.yaml"
    path.write_text("data:\n  max_length: 128\n  text_column: excerpt\nfolds:\n  k: 3\n")
    cfg, _ = parse(["finetune", "--config", str(path), "--out", "o", "--folds", "4"])
    assert (cfg.data.max_length, cfg.data.text_column, cfg.folds.k) == (128, "excerpt", 4)
    cfg, args = parse(["init", "--tokenizer", "t", "--out", "m", "--num_labels", "3", "--model.vocab_size=100"])
    assert cfg.num_labels == 3 and args.config_data["model"] == {"vocab_size": 100}
    cfg, _ = parse(["launch", "--num-processes", "3", "--", "pretrain", "--out", "r", "--train.max_steps=2"])
    assert cfg.command == ("pretrain", "--out", "r", "--train.max_steps=2") and cfg.num_processes == 3


def test_held_out_files_replace_the_held_out_share(monkeypatch, capsys):
    from bertforge.tasks import preprocess

    seen = []

    def fake_main(cfg):
        seen.append(cfg)
        split = {"sequences": 0, "shards": []}
        stats = {"seconds": 1.0, "peak_memory_mb": 1.0}
        return {"splits": {"train": split, "valid": split}, "stats": stats, "text_tokens": 0, "seq_len": 16, "mode": ""}

    monkeypatch.setattr(preprocess, "main", fake_main)
    base = ["preprocess", "--tokenizer", "t", "--files", "a", "--out", "o"]
    assert run_cli(capsys, *base, "--valid-fraction", "0.2")[0] == 0
    assert run_cli(capsys, *base, "--valid-files", "v1", "v2")[0] == 0
    assert [(c.valid_fraction, c.valid_files) for c in seen] == [(0.2, ()), (0.0, ("v1", "v2"))]


def test_flag_mistakes_get_one_line_errors(capsys):
    assert_one_line_error(*run_cli(capsys, "preprocess", "--tokenizer", "t", "--files", "a", "--out", "o", "--bogus"),
                          "unrecognized arguments: --bogus")  # fmt: skip
    assert_one_line_error(*run_cli(capsys, "pretrain", "--out", "r", "--bogus=1"), "unknown config key 'bogus'")
    assert_one_line_error(*run_cli(capsys, "pretrain", "--out", "r", "--train.max_step=1"),
                          "unknown config key 'train.max_step' (did you mean 'train.max_steps'?)")  # fmt: skip
    assert_one_line_error(*run_cli(capsys, "finetune", "--out", "r", "--task", "lm"), "--task", "invalid choice")
    assert_one_line_error(*run_cli(capsys, "export", "--step", "best"), "bertforge export", "RUN")
    assert_one_line_error(*run_cli(capsys, "predict", "--model", "m", "--data", "d", "--out", "o", "--batch-size", "x"),
                          "--batch-size", "invalid int value")  # fmt: skip
    assert_one_line_error(*run_cli(capsys, "nonsense"), "invalid choice: 'nonsense'")


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_flag_says_what_it_does(name):
    """Each flag's help is its own field's comment, not only its default: a comment above a run of fields names
    the first field alone, so a field that shares one shows a bare flag or another field's description."""
    sub = command_parsers(build_parser({name}))[name]
    bare = []
    for action in sub._actions:
        flag = action.option_strings[0] if action.option_strings else ""
        if not flag.startswith("--") or "." in flag or flag == "--help":
            continue  # positionals and --section.key overrides (those list every config field)
        if not re.sub(r"\(?default: [^)]*\)?", "", action.help or "").strip():
            bare.append(flag)
    assert not bare, (name, bare)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_lists_every_flag_with_its_default(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*name.split(), "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    sub = command_parsers(build_parser({name}))[name]
    for action in sub._actions:
        shown = action.option_strings[0] if action.option_strings else action.metavar
        assert shown in out, (name, shown)
        default = action.default
        if getattr(action, "path", None) and not (default is None or default is False or default in ("", ())):
            assert "default" in action.help, (name, shown, action.help)
