"""Hostile and broken input through every entry point: each gets a correct result or one line naming the file,
row or key, and exit 2; never a traceback, never a hang. Property-based where it fits (hypothesis; `make faults`
runs many more examples than CI)."""

from __future__ import annotations

import csv
import json
import resource
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_preprocess import content, rows_of

from bertforge.cli import main as cli
from bertforge.tokenizer.load import Tokenizer

settings.register_profile(
    "ci", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
settings.register_profile(
    "full", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
settings.load_profile("full" if __import__("os").environ.get("BERTFORGE_FAULTS") == "full" else "ci")

# Characters that break naive text handling: BOM, NUL, right-to-left marks and text, combining accents, emoji with
# joiners, line and paragraph separators, quotes and separators of CSV.
NASTY = ["\ufeff", "\x00", "\u202e", "\u200f", "مرحبا بالعالم", "עברית", "e\u0301\u0327", "👩\u200d👩\u200d👧",
         "🇫🇷", "\u2028", "\u2029", "\r", '"', '""', ",", "\t", "\\", "[MASK]", "[CLS]", "ﷺ", "𝔘𝔫𝔦"]  # fmt: skip
nasty_text = st.lists(st.one_of(st.sampled_from(NASTY), st.text(max_size=30)), max_size=12).map("".join)


def outcome(argv: list[str], capsys) -> tuple[int, str]:
    """Run the CLI in this process: exit 0, or 2 with exactly one line, which starts with 'error: '."""
    capsys.readouterr()
    started = time.perf_counter()
    code = cli(argv)
    err = capsys.readouterr().err
    assert time.perf_counter() - started < 60, "too slow for a small input"
    assert "Traceback" not in err, err
    assert code in (0, 2), (code, err)
    if code == 2:
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    return code, err


def scratch() -> Path:
    return Path(tempfile.mkdtemp(prefix="hostile-"))


# ------------------------------------------------------------------------------------------------------ corpora
# WordPiece (tokenizers' trainer), and Unigram from a sample (SentencePiece's trainer), on any bytes.
@pytest.mark.parametrize("trainer", [[], ["--type", "unigram", "--sample-lines", "7"]])
@given(data=st.binary(max_size=3000))
@example(data=b"\xff\xfe\x00\x00not utf-8\n")
@example(data=b"\xef\xbb\xbfBOM first\n\nsecond doc\x00with NUL\n")
@example(data="日本語の文です。\n".encode() * 40 + b"\x1f\x8b\x08 gzip magic inside\n")
def test_tokenizer_training_on_any_bytes(trainer, data, capsys, tally):
    tally("hostile")
    tmp = scratch()
    (tmp / "corpus.txt").write_bytes(data)
    argv = ["tokenizer", "train", "--files", str(tmp / "corpus.txt"), "--vocab-size", "120", "--out", str(tmp / "t"),
            *trainer]  # fmt: skip
    code, err = outcome(argv, capsys)
    if code == 0:
        tok = Tokenizer.load(tmp / "t")
        assert tok.tokenize_ids([data.decode("utf-8", "replace")])
    else:
        assert str(tmp / "corpus.txt") in err and not (tmp / "t" / "tokenizer.json").exists()
    shutil.rmtree(tmp)


@pytest.mark.parametrize("cut", [0.0, 0.5, 0.95])
def test_a_damaged_compressed_corpus_is_one_line(cut, capsys, tally):
    tally("hostile")
    import gzip

    tmp = scratch()
    whole = gzip.compress("".join(f"line {i} of a corpus, {i * 7919 % 1000}\n" for i in range(5000)).encode())
    (tmp / "corpus.txt.gz").write_bytes(b"not gzip at all\n" if cut == 0 else whole[: int(len(whole) * cut)])
    for kind in ("wordpiece", "unigram"):
        argv = ["tokenizer", "train", "--files", str(tmp / "corpus.txt.gz"), "--type", kind, "--vocab-size", "120",
                "--out", str(tmp / "t")]  # fmt: skip
        code, err = outcome(argv, capsys)
        assert code == 2 and f"{tmp / 'corpus.txt.gz'}: cannot be read" in err, err
        assert not (tmp / "t").exists()
    shutil.rmtree(tmp)


@given(docs=st.lists(nasty_text, max_size=20))
@example(docs=["[PAD]"])
@example(docs=["[CLS] a [SEP] b [MASK]"])
def test_preprocessing_any_text_keeps_every_token(docs, wordpiece_dir, capsys, tally):
    """JSONL keeps document boundaries exact, so the shards must hold exactly the tokenizer's tokens of each one."""
    tally("hostile")
    tmp = scratch()
    corpus = tmp / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    argv = ["preprocess", "--tokenizer", str(wordpiece_dir), "--files", str(corpus), "--out", str(tmp / "out"),
            "--seq-len", "16", "--valid-fraction", "0"]  # fmt: skip
    code, err = outcome(argv, capsys)
    kept = [d.strip() for d in docs if d.strip()]
    tok = Tokenizer.load(wordpiece_dir)
    read = tok.tokenize_ids(kept, literal_specials=True)
    expected = [t for ids in read for t in [*ids, tok.sep_id]] if kept else []
    if code == 0:
        rows, _ = rows_of(tmp / "out")
        assert [t for row in rows for t in content(row, tok)] == expected
        specials = {tok.cls_id, tok.sep_id, tok.pad_id, tok.mask_id}
        assert not specials & {t for ids in read for t in ids}  # a written "[PAD]" stays text
    else:
        assert not expected and str(corpus) in err, err  # nothing to tokenize, and the file is named
        assert not (tmp / "out" / "manifest.json").exists()
    shutil.rmtree(tmp)


@given(data=st.binary(max_size=3000))
@example(data=b"line one\n\xc3\x28 invalid\n")
@example(data=b"\x00" * 100)
def test_preprocessing_any_bytes(data, wordpiece_dir, capsys, tally):
    tally("hostile")
    tmp = scratch()
    (tmp / "corpus.txt").write_bytes(data)
    argv = ["preprocess", "--tokenizer", str(wordpiece_dir), "--files", str(tmp / "corpus.txt"), "--out",
            str(tmp / "out"), "--seq-len", "16", "--valid-fraction", "0"]  # fmt: skip
    code, err = outcome(argv, capsys)
    if code == 2:
        assert str(tmp / "corpus.txt") in err and not (tmp / "out" / "manifest.json").exists()
    shutil.rmtree(tmp)


# ------------------------------------------------------------------------------------------------------ tables
cell = st.one_of(nasty_text, st.sampled_from(["", " ", "\n", "a,b", 'say "hi"', "line\nbreak", "1e309", "nan"]))


@given(rows=st.lists(st.tuples(cell, cell), min_size=1, max_size=15), bom=st.booleans())
def test_tables_with_quotes_newlines_and_bom_read_back_exactly(rows, bom, tally):
    import csv
    import io

    from bertforge.data.tabular import read_table

    tally("hostile")
    tmp = scratch()
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\r\n")
    writer.writerow(["id", "text"])
    writer.writerows(rows)
    (tmp / "t.csv").write_bytes(("\ufeff" if bom else "").encode() + buf.getvalue().encode("utf-8"))
    columns, got = read_table(str(tmp / "t.csv"))
    assert columns == ["id", "text"]
    assert [(r["id"], r["text"]) for r in got] == rows
    shutil.rmtree(tmp)


@pytest.fixture(scope="module")
def classifier(model_dir, tmp_path_factory) -> Path:
    """A sequence-classification folder (fresh head) to predict with."""
    from bertforge.model.hf import load_pretrained, save_pretrained

    pre = load_pretrained(model_dir, head="sequence", num_labels=1)
    return save_pretrained(pre.model, tmp_path_factory.mktemp("cls") / "model", pre.tokenizer)


@given(texts=st.lists(cell, min_size=1, max_size=8), bom=st.booleans())
def test_predict_keeps_every_row_and_its_id(texts, bom, classifier, capsys, tally):
    import csv

    tally("hostile")
    tmp = scratch()
    with open(tmp / "in.csv", "w", newline="", encoding="utf-8-sig" if bom else "utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["id", "text"])
        writer.writerows([[f'id "{i}",\n{t[:5]}', t] for i, t in enumerate(texts)])
    code, err = outcome(["predict", "--model", str(classifier), "--data", str(tmp / "in.csv"), "--out",
                         str(tmp / "out.csv")], capsys)  # fmt: skip
    if code == 0:
        with open(tmp / "out.csv", newline="", encoding="utf-8") as fh:
            out = list(csv.DictReader(fh))
        assert [r["id"] for r in out] == [f'id "{i}",\n{t[:5]}' for i, t in enumerate(texts)]
        assert all(np.isfinite(float(r["prediction"])) for r in out)
    else:
        assert "empty text" in err and any(not t.strip() for t in texts), err
    shutil.rmtree(tmp)


@pytest.fixture(scope="module")
def tagger(model_dir, tmp_path_factory) -> Path:
    """A token-classification folder (fresh head) to predict with."""
    from bertforge.model.hf import load_pretrained, save_pretrained

    pre = load_pretrained(model_dir, head="token", num_labels=3)
    return save_pretrained(pre.model, tmp_path_factory.mktemp("tok") / "model", pre.tokenizer,
                           {0: "O", 1: "B-X", 2: "I-X"})  # fmt: skip


@settings(max_examples=4)  # each example compiles the programs of its lengths
@given(texts=st.lists(nasty_text, min_size=1, max_size=4))
@example(texts=["", " \u2028\x85", "a " * 400])
def test_token_predict_keeps_every_text_and_slices_its_entities_exactly(texts, tagger, capsys, tally):
    tally("hostile")
    tmp = scratch()
    lines = [json.dumps({"id": f"t{i}", "text": t}) for i, t in enumerate(texts)]
    (tmp / "in.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    code, err = outcome(["predict", "--model", str(tagger), "--data", str(tmp / "in.jsonl"), "--out",
                         str(tmp / "out.jsonl"), "--max-length", "16"], capsys)  # fmt: skip
    assert code == 0, err
    out = [json.loads(line) for line in (tmp / "out.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [o["id"] for o in out] == [f"t{i}" for i in range(len(texts))]
    for o, text in zip(out, texts, strict=True):
        assert all(text[e["start"] : e["end"]] == e["text"] and e["text"].strip() for e in o["entities"])
    shutil.rmtree(tmp)


@given(data=st.binary(max_size=2000))
@example(data=b'"unclosed quote,\n' * 3)
@example(data=b'\xef\xbb\xbftext,target\n"a\nb",1.5\n')
def test_any_bytes_as_a_training_table(data, model_dir, capsys, tally):
    tally("hostile")
    tmp = scratch()
    (tmp / "train.csv").write_bytes(data)
    argv = ["finetune", "--model", str(model_dir), "--data", str(tmp / "train.csv"), "--out", str(tmp / "run"),
            "--folds", "2", "--train.epochs=0.1", "--log.progress=false"]  # fmt: skip
    code, err = outcome(argv, capsys)
    if code == 2:
        assert str(tmp / "train.csv") in err or "fewer rows" in err, err
        assert not (tmp / "run" / "summary.json").exists()
    shutil.rmtree(tmp)


@pytest.fixture(scope="module")
def finished_run(model_dir, tmp_path_factory) -> tuple[Path, list[str]]:
    """A fine-tuning run whose one fold is finished, and the command that made it."""
    tmp = tmp_path_factory.mktemp("finished")
    rows = [(f"river {'city ' * (i % 5)}walk {i}", f"{i % 3}.5") for i in range(24)]
    with open(tmp / "train.csv", "w", newline="", encoding="utf-8") as fh:
        csv.writer(fh).writerows([("text", "target"), *rows])
    argv = ["finetune", "--model", str(model_dir), "--data", str(tmp / "train.csv"), "--out", str(tmp / "run"),
            "--folds", "2", "--fold", "0", "--train.epochs=0.1", "--log.progress=false"]  # fmt: skip
    assert cli(argv) == 0
    return tmp / "run", argv


@given(text=st.one_of(nasty_text, st.dictionaries(st.sampled_from(["train", "optim", "head", "log", "x"]),
                                                  st.dictionaries(st.sampled_from(["epochs", "lr", "every"]),
                                                                  st.one_of(st.integers(), st.text(max_size=5)))
                                                  ).map(yaml.safe_dump)))  # fmt: skip
@example(text="train: {epochs: 5}\n")
@example(text="- a list\n")
@example(text="train: [\n")
def test_a_damaged_run_config_when_the_command_is_repeated(text, finished_run, capsys, tally):
    # The repeated command compares its settings with the run's config.yaml: whatever that file holds, the fold
    # already finished is reported as it is, or the command is one line naming the file or the key that differs.
    tally("hostile")
    tmp = scratch()
    run = shutil.copytree(finished_run[0], tmp / "run")
    (run / "config.yaml").write_text(text, encoding="utf-8")
    argv = [str(run) if a == str(finished_run[0]) else a for a in finished_run[1]]
    code, err = outcome(argv, capsys)
    if code == 2:
        assert str(run / "config.yaml") in err or ("this run has" in err and str(run) in err), err
    try:
        train = (yaml.safe_load(text) or {}).get("train")
    except (yaml.YAMLError, AttributeError):
        train = None
    if isinstance(train, dict) and train.get("epochs", 0.1) != 0.1:  # the run's own epochs: 0.1
        assert code == 2 and "this run has train.epochs" in err, err
    assert (run / "fold-0" / "result.json").read_bytes() == (finished_run[0] / "fold-0" / "result.json").read_bytes()
    shutil.rmtree(tmp)


@settings(max_examples=6)  # an example that reads compiles its lengths
@given(data=st.binary(max_size=2000), tags=st.booleans())
@example(data=b"text,target\n,1.5\nabc,nan\n", tags=False)
@example(data=b"text,target\nriver city,1.5\n", tags=False)
@example(data=b"text,target\nriver city,1.5\ncity,0.5\ncity,0.5\n", tags=False)
@example(data=b'{"tokens": ["a", "b"], "tags": ["B-X", "O"]}\n', tags=True)
@example(data=b'{"tokens": ["a", "b"], "tags": ["B-X", "I-Y"]}\n{"tokens": []', tags=True)
def test_any_bytes_as_evaluation_data(data, tags, classifier, tagger, capsys, tally):
    tally("hostile")
    tmp = scratch()
    path = tmp / ("test.jsonl" if tags else "test.csv")
    path.write_bytes(data)
    model = tagger if tags else classifier
    code, err = outcome(["evaluate", "--model", str(model), "--data", str(path), "--max-length", "16",
                         "--out", str(tmp / "metrics.json")], capsys)  # fmt: skip
    if code == 2:
        assert str(path) in err, err
        assert not (tmp / "metrics.json").exists()
    else:  # strict JSON: an undefined correlation (one record, or outputs that do not vary) is null, not NaN
        found = json.loads((tmp / "metrics.json").read_text(), parse_constant=lambda c: pytest.fail(c))
        assert all(v is None or np.isfinite(v) for v in found.values()), found
    shutil.rmtree(tmp)


@given(data=st.binary(max_size=2000), scored=st.booleans(), named=st.booleans())
@example(data=b"query,passage,score\nq,p,nan\n", scored=True, named=True)
@example(data=b'query,passage,score\n"a\nb",\xc3\x28,1\n', scored=False, named=True)
@example(data=b"anchor,positive,negative_1,score_positive,score_negative_1\nq,p,n,1,inf\n", scored=False, named=False)
@example(data=b"id,anchor,positive,score_positive\n1,q,p,2\n", scored=False, named=False)
@example(data=b"sentence1,sentence2,label\na,b,\n", scored=True, named=False)
def test_any_bytes_as_a_pair_table(data, scored, named, tally):
    """Named columns, or sentence-transformers' columns by position, with a teacher's score_* columns."""
    from bertforge.data.labelled import TableConfig
    from bertforge.errors import UserError
    from bertforge.finetuning import pairs

    tally("hostile")
    tmp = scratch()
    (tmp / "pairs.csv").write_bytes(data)
    cfg = TableConfig(text_column="query", text_pair_column="passage", target_columns=("score",)) if named else (
        TableConfig())  # fmt: skip
    try:
        table = pairs.read(str(tmp / "pairs.csv"), cfg, scored)
        assert len(table) and all(t.strip() for row in table.source.texts for t in row)
        assert np.all(np.isfinite(table.targets))
        pairs.check_teacher(table, "kl")
        assert table.targets.shape[1] == 3 + len(table.source.columns)  # a teacher's score of every candidate
    except UserError as e:
        assert str(e).startswith(f"{tmp / 'pairs.csv'}: ") and "\n" not in str(e), str(e)
    shutil.rmtree(tmp)


@given(texts=st.lists(cell, min_size=1, max_size=6))
def test_embed_keeps_every_row(texts, model_dir, capsys, tally):
    tally("hostile")
    tmp = scratch()
    with open(tmp / "t.csv", "w", newline="", encoding="utf-8") as fh:
        csv.writer(fh).writerows([["id", "text"], *([f"t{i}", t] for i, t in enumerate(texts))])
    code, err = outcome(["embed", "--model", str(model_dir), "--data", str(tmp / "t.csv"), "--out",
                         str(tmp / "v.npy")], capsys)  # fmt: skip
    if code == 0:
        assert np.load(tmp / "v.npy").shape == (len(texts), 32)
    else:
        assert "empty text" in err and str(tmp / "t.csv") in err and not (tmp / "v.npy").exists(), err
    shutil.rmtree(tmp)


# ------------------------------------------------------------------------------------------------------ configs
yaml_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), nasty_text),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(nasty_text, inner, max_size=3)),
    max_leaves=8,
)
section = st.sampled_from(["model", "train", "optim", "data", "eval", "checkpoint", "log", "mesh", "mlm", "typo"])
field = st.sampled_from(["preset", "global_batch", "lr", "max_steps", "every", "hidden_size", "vocab_size", "bogus"])


@given(config=st.dictionaries(section, st.dictionaries(field, yaml_value, max_size=3), max_size=4) | yaml_value)
@example(config={"model": {"vocab_size": 10**12}})
@example(config={"train": {"global_batch": "sixteen"}})
@example(config={"optim": {"lr": [1, 2]}})
def test_pretrain_configs_with_unknown_keys_and_wrong_types(config, capsys, tally):
    tally("hostile")
    tmp = scratch()
    (tmp / "c.yaml").write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    # `plan` reads a config exactly as pretrain does, without training on the ones that turn out valid.
    code, err = outcome(["plan", "--config", str(tmp / "c.yaml"), "--devices", "8", "--seq-len", "32"], capsys)
    if code == 2:
        assert str(tmp / "c.yaml") in err or "config" in err, err
    shutil.rmtree(tmp)


@pytest.mark.parametrize(
    ("yaml_text", "argv", "key"),
    [
        ("", ["finetune", "--model", "some-folder", "--model.attention=xla", "--data", "t.csv"], "model"),
        ("model: some-folder\n", ["finetune", "--model.attention=xla", "--data", "t.csv"], "model"),
        ("model:\n  num_layers: 2\n", ["plan", "--model=mini", "--devices", "8", "--seq-len", "32"], "model"),
        (
            "train:\n  dtype: {x: 1}\n",
            ["plan", "--train.dtype=float32", "--devices", "8", "--seq-len", "32"],
            "train.dtype",
        ),
    ],
)
def test_a_key_given_as_a_value_and_as_a_section(yaml_text, argv, key, capsys, tally):
    # A section's key beside the same name's value (`--model DIR --model.attention=xla`) used to be dropped.
    tally("hostile")
    tmp = scratch()
    (tmp / "c.yaml").write_text(yaml_text, encoding="utf-8")
    config = ["--config", str(tmp / "c.yaml")] if yaml_text else []
    code, err = outcome([*argv, *config, "--out", str(tmp / "out")] if argv[0] == "finetune" else [*argv, *config],
                        capsys)  # fmt: skip
    assert code == 2 and f"'{key}' is given both as a value and as a section" in err, err
    assert not (tmp / "out").exists()
    shutil.rmtree(tmp)


@pytest.mark.parametrize(
    ("command", "key", "name", "needs"),
    [
        ("finetune", "train.attention", "splash", "a TPU"),
        ("finetune", "train.attention", "pallas", "an NVIDIA GPU"),
        ("pretrain", "model.attention", "splash", "a TPU"),
    ],
)
def test_an_attention_this_machine_cannot_run_is_one_line_before_anything_is_written(
    command, key, name, needs, model_dir, shards, capsys, tally
):
    tally("hostile")
    tmp = scratch()
    (tmp / "t.csv").write_text("text,label\na,1\nb,0\n", encoding="utf-8")
    data = ["--model", str(model_dir), "--data", str(tmp / "t.csv")] if command == "finetune" else [
        "--data", str(shards), "--model.preset=test"]  # fmt: skip
    code, err = outcome([command, *data, f"--{key}={name}", "--out", str(tmp / "out")], capsys)
    assert code == 2 and f"{key}={name}: attention '{name}' needs {needs}; this program runs on cpu" in err, err
    written = sorted(p.name for p in (tmp / "out").iterdir()) if (tmp / "out").exists() else []
    assert written in ([], [".lock"]), written  # pretrain's run lock is all
    shutil.rmtree(tmp)


@given(text=nasty_text)
@example(text="model: {preset: test\n")
@example(text="\t- a\n b: [")
def test_pretrain_config_files_that_are_not_yaml(text, capsys, tally):
    tally("hostile")
    tmp = scratch()
    (tmp / "c.yaml").write_text(text, encoding="utf-8")
    code, err = outcome(["plan", "--config", str(tmp / "c.yaml"), "--devices", "8", "--seq-len", "32"], capsys)
    shutil.rmtree(tmp)


# ------------------------------------------------------------------------------------------------------ suites
SUITE = "name: s\nsource: here\ntasks:\n  cola: {name: CoLA, task: classification, train: t.tsv, valid: v.tsv, "


@given(text=nasty_text)
@example(text=SUITE + "columns: [a, b], text: b, target: a, metrics: []}\n")
@example(text=SUITE + "text: b, target: a, metrics: [rmse]}\nlrs: [0]\n")
@example(text=SUITE + "text: b, target: a, metrics: [accuracy], epochs: nan}\nseeds: 2.5\n")
@example(text="tasks: [1, 2]\n")
def test_any_text_as_a_suite_file(text, tally):
    from bertforge.data.suites import load_suite
    from bertforge.errors import UserError

    tally("hostile")
    tmp = scratch()
    (tmp / "s.yaml").write_text(text, encoding="utf-8")
    try:
        assert load_suite(str(tmp / "s.yaml")).tasks
    except UserError as e:
        assert str(e).startswith(str(tmp / "s.yaml")), str(e)
    shutil.rmtree(tmp)


@given(data=st.binary(max_size=1500))
@example(data=b"gj04\t1\t\tA sentence.\r\ngj04\t0\t*\tAnother\u2028one.\n")
@example(data="gj04\t1\t\tLine\u2028separator inside.\n".encode())
@example(data=b"\xef\xbb\xbfgj04\t1\t\tBOM first.\n\n\n")
def test_any_bytes_as_a_headerless_glue_table(data, tally):
    from bertforge.data.suites import load_suite
    from bertforge.errors import UserError
    from bertforge.tasks.suite import prepared_files

    tally("hostile")
    tmp = scratch()
    for name in ("CoLA/train.tsv", "CoLA/dev.tsv"):
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
    glue = load_suite("glue")
    try:
        files = prepared_files(glue, "cola", str(tmp), tmp / "out")
        rows = [json.loads(line) for line in files["train"].read_text(encoding="utf-8").split("\n") if line]
        # Every record kept whole: as many rows as non-empty lines, each with CoLA's 4 fields as written.
        lines = [x.removesuffix("\r") for x in data.decode("utf-8-sig").split("\n") if x.removesuffix("\r")]
        assert [list(r.values()) for r in rows] == [x.split("\t") for x in lines]
    except UserError as e:
        assert str(e).startswith(str(tmp / "CoLA")), str(e)
    shutil.rmtree(tmp)


# ------------------------------------------------------------------------------------------------------ model folders
size = st.one_of(st.integers(-(10**3), 10**13), st.sampled_from([10**12, 2**31, 0, -1, 1.5, "768", None, True, []]))
SIZES = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
         "max_position_embeddings", "type_vocab_size"]  # fmt: skip


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@given(changes=st.dictionaries(st.sampled_from(SIZES), size, min_size=1, max_size=3))
@example(changes={"vocab_size": 10**12})
@example(changes={"hidden_size": 10**9, "intermediate_size": 10**9})
@example(changes={"num_hidden_layers": 10**6})
def test_config_json_with_absurd_sizes_is_refused_before_any_allocation(changes, model_dir, capsys, tally):
    tally("hostile")
    tmp = scratch()
    folder = shutil.copytree(model_dir, tmp / "m")
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    before = peak_rss_mib()
    code, err = outcome(["fill-mask", "--model", str(folder), "the [MASK] river"], capsys)
    assert peak_rss_mib() - before < 512, "allocated for the absurd config"
    if code == 2:
        assert str(folder / "config.json") in err or str(folder) in err, err
    shutil.rmtree(tmp)


@given(data=st.binary(max_size=500))
@example(data=b'{"version": "1.0", "model": null}')
@example(data=b"[]")
def test_tokenizer_json_that_is_not_a_tokenizer(data, model_dir, capsys, tally):
    tally("hostile")
    tmp = scratch()
    folder = shutil.copytree(model_dir, tmp / "m")
    (folder / "tokenizer.json").write_bytes(data)
    code, err = outcome(["fill-mask", "--model", str(folder), "the [MASK] river"], capsys)
    assert code == 2 and str(folder / "tokenizer.json") in err, err
    shutil.rmtree(tmp)


@given(text=nasty_text)
@example(text="\x00" * 5000)
@example(text="مرحبا 👩\u200d👩\u200d👧 e\u0301 " * 200)
def test_fill_mask_on_any_text(text, model_dir, capsys, tally):
    tally("hostile")
    code, err = outcome(["fill-mask", "--model", str(model_dir), "--json", text + " [MASK]"], capsys)
    assert code == 0 or "tokens; the model holds 128" in err, err


# ------------------------------------------------------------------------------------------------------ tagged data
def check_tagged(docs: list, path: str) -> None:
    """What every reader promises of its documents, whatever the file held."""
    from bertforge.data.tags import tag_problem

    assert docs and len({d.id for d in docs}) == len(docs)
    for d in docs:
        if d.words is not None:
            words = [d.text[a:b] for a, b in d.words]
            assert " ".join(words) == d.text and all(w and w.split() == [w] for w in words), (path, d)
            assert d.tags is None or (len(d.tags) == len(words) and not any(map(tag_problem, d.tags))), (path, d)
        if d.entities is not None:
            bounds = [(e.start, e.end) for e in d.entities]
            assert all(0 <= a < b <= len(d.text) for a, b in bounds) and all(e.type.strip() for e in d.entities)
            assert all(b <= c for (_, b), (c, _) in zip(bounds, bounds[1:], strict=False)), (path, d)


def read_tagged_or_named_error(path: Path, labelled: bool) -> None:
    from bertforge.data.tagged import read_documents
    from bertforge.errors import UserError

    try:
        docs = read_documents(str(path), labelled=labelled)
    except UserError as e:
        assert str(e).startswith(f"{path}: ") and "\n" not in str(e), str(e)
        return
    check_tagged(docs, str(path))


@given(data=st.binary(max_size=2000), name=st.sampled_from(["a.conll", "a.jsonl", "a.json"]), labelled=st.booleans())
@example(data=b"-DOCSTART- -X- O\n\n\nEU\tB-ORG \r\nx\xc2\xa0y O\n", name="a.conll", labelled=True)
@example(data=b'[{"tokens": ["a b"], "tags": ["O"]}]', name="a.json", labelled=True)
@example(data=b'{"text": "ab", "entities": [{"span": [1, 2], "type": " "}]}', name="a.jsonl", labelled=False)
def test_any_bytes_as_token_classification_data(data, name, labelled, tally):
    tally("hostile")
    tmp = scratch()
    (tmp / name).write_bytes(data)
    read_tagged_or_named_error(tmp / name, labelled)
    shutil.rmtree(tmp)


json_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 30), nasty_text, st.sampled_from(["O", "B-PER", "I-", "B"])),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(nasty_text, inner, max_size=3)),
    max_leaves=10,
)
tagged_key = st.sampled_from(["tokens", "tags", "ner_tags", "text", "entities", "id", "curid"])
entity = st.fixed_dictionaries(
    {}, optional=dict.fromkeys(["span", "start", "end", "type", "label", "name"], json_value)
)
tagged_record = st.dictionaries(tagged_key, json_value | st.lists(entity, max_size=3), max_size=5)


@given(records=st.lists(tagged_record | json_value, max_size=6), jsonl=st.booleans(), labelled=st.booleans())
@example(records=[{"tokens": ["x"], "tags": ["S-A"]}, {"tokens": ["y"], "ner_tags": [True]}], jsonl=True, labelled=True)
@example(records=[{"text": "abc", "entities": [{"start": 0, "end": 2, "label": "A"}, {"span": [1, 3]}]}],
         jsonl=False, labelled=True)  # fmt: skip
def test_json_records_of_any_shape_as_token_classification_data(records, jsonl, labelled, tally):
    tally("hostile")
    path = records_file(records, jsonl)
    read_tagged_or_named_error(path, labelled)
    shutil.rmtree(path.parent)


def records_file(records: list, jsonl: bool) -> Path:
    """The records as a JSONL file or a JSON list in a scratch folder."""
    path = scratch() / ("a.jsonl" if jsonl else "a.json")
    text = "".join(json.dumps(r) + "\n" for r in records) if jsonl else json.dumps(records)
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------------ questions
def read_questions_or_named_error(path: Path, labelled: bool) -> None:
    """Questions whose every answer slices out of its context, or one line naming the file."""
    from bertforge.data.choices import read_choices
    from bertforge.data.questions import read_questions
    from bertforge.errors import UserError

    try:
        questions = read_questions(str(path), labelled=labelled)
        assert questions and len({q.id for q in questions}) == len(questions)
        for q in questions:
            assert q.question.strip() and q.context.strip()
            assert all(a.text and q.context[a.start : a.start + len(a.text)] == a.text for a in q.answers), q
    except UserError as e:
        assert str(e).startswith(f"{path}: ") and "\n" not in str(e), str(e)
    try:
        records = read_choices(str(path), labelled=labelled)
        assert records and len({len(r.choices) for r in records}) == 1
        for r in records:
            assert len(r.choices) >= 2 and all(c.strip() for c in r.choices) and r.question.strip()
            assert r.label is None or 0 <= r.label < len(r.choices)
    except UserError as e:
        assert str(e).startswith(f"{path}: ") and "\n" not in str(e), str(e)


@given(data=st.binary(max_size=2000), name=st.sampled_from(["a.json", "a.jsonl", "a.csv"]), labelled=st.booleans())
@example(data=b'{"data": [{"paragraphs": [{"context": "ab", "qas": [{"question": "q", "answers": 3}]}]}]}',
         name="a.json", labelled=True)  # fmt: skip
@example(data=b"question,choice0,choice1,label\nq,a,b,1.0\n", name="a.csv", labelled=True)
def test_any_bytes_as_question_answering_and_multiple_choice_data(data, name, labelled, tally):
    tally("hostile")
    tmp = scratch()
    (tmp / name).write_bytes(data)
    read_questions_or_named_error(tmp / name, labelled)
    shutil.rmtree(tmp)


question_key = st.sampled_from(["id", "question", "context", "answer_text", "answer_start", "answers", "choices",
                                "choice0", "choice1", "label", "is_impossible", "title"])  # fmt: skip
question_record = st.dictionaries(question_key, json_value, max_size=7)


@given(records=st.lists(question_record | json_value, max_size=5), jsonl=st.booleans(), labelled=st.booleans())
@example(records=[{"question": "q", "context": "abc", "answer_text": "b", "answer_start": 1.5}], jsonl=True,
         labelled=True)  # fmt: skip
@example(records=[{"question": "q", "context": "abc", "answers": {"text": ["b"], "answer_start": [True]}}],
         jsonl=False, labelled=True)  # fmt: skip
def test_json_records_of_any_shape_as_questions_and_choices(records, jsonl, labelled, tally):
    tally("hostile")
    path = records_file(records, jsonl)
    read_questions_or_named_error(path, labelled)
    shutil.rmtree(path.parent)


# ------------------------------------------------------------------------------------------------------ sizes
@pytest.mark.slow
def test_a_50_mb_line_and_a_million_tiny_documents(wordpiece_dir, tmp_path, capsys, tally):
    tally("hostile", 3)
    line = tmp_path / "line.txt"
    words = ("river city music " * 3_000_000)[: 50 * 2**20]
    line.write_text(words + "\n")
    code, err = outcome(["tokenizer", "train", "--files", str(line), "--vocab-size", "200", "--out",
                         str(tmp_path / "t")], capsys)  # fmt: skip
    assert code == 0
    code, err = outcome(["preprocess", "--tokenizer", str(wordpiece_dir), "--files", str(line), "--out",
                         str(tmp_path / "o1"), "--seq-len", "128", "--valid-fraction", "0"], capsys)  # fmt: skip
    assert code == 0
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("word\n" * 1_000_000)
    argv = ["preprocess", "--tokenizer", str(wordpiece_dir), "--files", str(tiny), "--doc-per-line", "--out",
            str(tmp_path / "o2"), "--seq-len", "32", "--valid-fraction", "0"]  # fmt: skip
    code, err = outcome(argv, capsys)
    assert code == 0
    rows, _ = rows_of(tmp_path / "o2")
    tok = Tokenizer.load(wordpiece_dir)
    per_doc = len(tok.tokenize_ids(["word"])[0]) + 1  # its pieces and the [SEP] that joins documents
    assert sum(len(content(r, tok)) for r in rows) == per_doc * 1_000_000
