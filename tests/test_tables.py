"""Tables as users write them: TSV without quoting (GLUE's), TSV with quoting on request, and a fine-tuning and
predictions from a TSV whose texts hold unbalanced quotes."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from test_finetune import finetune, river_rows

import bertforge
from bertforge.cli import main as cli
from bertforge.data.tabular import read_table
from bertforge.errors import UserError

# Texts a CSV reader would take for quoting: a quote that opens and never closes (as in STS-B), quotes inside,
# a field that is only quotes, and one that looks quoted whole. In a TSV each is text, quotes included.
QUOTED_TEXTS = ['"He said so', 'plain "x" y', '"""', 'ends with "', '"quoted whole"', "it's", '""']


def write_tsv(path: Path, columns: list[str], rows: list[list[str]], newline: str = "\n") -> Path:
    """TSV as GLUE writes it: fields joined by tabs, nothing quoted."""
    lines = ["\t".join(columns), *("\t".join(map(str, row)) for row in rows)]
    path.write_bytes(newline.join(lines).encode("utf-8") + newline.encode())
    return path


def test_tsv_fields_that_start_with_or_hold_unbalanced_quotes_are_read_as_text(tmp_path):
    rows = [[str(i), text, f"{i / 2}"] for i, text in enumerate(QUOTED_TEXTS * 30)]
    for newline in ("\n", "\r\n"):
        path = write_tsv(tmp_path / "t.tsv", ["id", "sentence", "score"], rows, newline)
        columns, got = read_table(str(path))
        assert columns == ["id", "sentence", "score"]
        assert [[r["id"], r["sentence"], r["score"]] for r in got] == rows


def test_a_tab_or_a_line_break_inside_a_tsv_field_is_an_error_naming_the_row(model_dir, tmp_path, capsys):
    good = [[str(i), f"text {i}", "1.0"] for i in range(6)]
    tab = write_tsv(tmp_path / "tab.tsv", ["id", "text", "target"], [*good[:2], ["2", "a\tb", "1.0"], *good[3:]])
    with pytest.raises(UserError, match=r"tab\.tsv: row 3 has 4 tab-separated field\(s\), the header 3"):
        read_table(str(tab))
    broken = write_tsv(tmp_path / "break.tsv", ["id", "text", "target"], [*good[:4], ["4", "a\nb", "1.0"]])
    with pytest.raises(UserError, match=r"break\.tsv: row 5 has 2 tab-separated field\(s\), the header 3"):
        read_table(str(broken))
    capsys.readouterr()
    code = finetune(model_dir, tab, tmp_path / "run")
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "tab.tsv: row 3 has 4" in err, err
    assert not (tmp_path / "run").exists()


def write_quoted_tsv(path: Path, columns: list[str], rows: list[list[str]]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh, delimiter="\t", lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(rows)
    return path


def test_quoted_tsv_is_read_with_its_quoting_when_asked(tmp_path):
    from bertforge.data.labelled import TableConfig
    from bertforge.data.labelled import read_table as read_training_table
    from bertforge.finetuning import regression

    rows = [["0", "a\tb", "1"], ["1", 'say "hi"', "2"], ["2", "two\nlines", "3"], ["3", '"', "4"]]
    path = write_quoted_tsv(tmp_path / "q.tsv", ["id", "text", "target"], rows)
    columns, got = read_table(str(path), quoted_tsv=True)
    assert columns == ["id", "text", "target"] and [list(r.values()) for r in got] == rows
    with pytest.raises(UserError, match=r"q\.tsv: row 1 has 4 tab-separated field\(s\)"):
        read_table(str(path))  # without the option the quotes are text and the tab splits the field
    table = read_training_table(str(path), TableConfig(quoted_tsv=True), regression.read_targets)
    assert table.texts == [r[1] for r in rows] and table.targets[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]


def _predictions(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_finetune_and_predict_from_a_glue_style_tsv_with_unbalanced_quotes(model_dir, tmp_path):
    rows = river_rows(48, seed=6)
    for i, row in enumerate(rows):
        row["text"] = QUOTED_TEXTS[i % len(QUOTED_TEXTS)] + " " + row["text"]  # most texts start with a quote
    table = [[r["id"], r["text"], f"{r['target']:.6g}"] for r in rows]
    data = write_tsv(tmp_path / "train.tsv", ["id", "text", "target"], table)
    out = tmp_path / "run"
    assert finetune(model_dir, data, out, "--folds", "2", "--train.epochs=1") == 0
    with open(out / "oof.csv", newline="") as fh:
        assert sorted(r["id"] for r in csv.DictReader(fh)) == sorted(r["id"] for r in rows)
    assert json.loads((out / "run.json").read_text())["bertforge_version"] == bertforge.version()

    pred = tmp_path / "pred.csv"
    assert cli(["predict", "--model", str(out), "--data", str(data), "--out", str(pred)]) == 0
    predicted = _predictions(pred)
    assert [r["id"] for r in predicted] == [r["id"] for r in rows]
    assert all(r["prediction"] for r in predicted)
    # The same table written with quoting, read with --quoted-tsv: the same texts, so the same predictions.
    quoted = write_quoted_tsv(tmp_path / "quoted.tsv", ["id", "text", "target"], table)
    again = tmp_path / "again.csv"
    assert cli(["predict", "--model", str(out), "--data", str(quoted), "--out", str(again), "--quoted-tsv"]) == 0
    assert _predictions(again) == predicted
