"""Tables of texts and targets: CSV, TSV, JSONL and Parquet, local or fsspec URLs, read with named errors.

Rows are numbered from 1, the header not counted, in every error message.

CSV is RFC 4180: fields may be quoted, and a quoted field may hold commas, quotes ("") and line breaks. TSV is
IANA's text/tab-separated-values: no quoting at all, a record per line, fields split on tabs, so a `"` is text like
any other character (GLUE's tables are written so, and STS-B has a sentence that starts with an unmatched quote).
TSV written with CSV-style quoting is read with `quoted_tsv=True`.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from typing import Any

import fsspec
import numpy as np

from bertforge.data.documents import iter_jsonl
from bertforge.errors import UserError

FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


def _format(path: str) -> str:
    for suffix, fmt in FORMATS.items():
        if path.lower().endswith(suffix):
            return fmt
    raise UserError(f"{path}: unknown table format (use .csv, .tsv, .jsonl or .parquet)")


def _read_parquet(path: str) -> tuple[list[str], list[dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with fsspec.open(path, "rb") as fh:
            table = pq.read_table(fh)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0] if str(e) else e})") from None
    return list(table.column_names), table.to_pylist()


def read_table(
    path: str, quoted_tsv: bool = False, columns: Sequence[str] = ()
) -> tuple[list[str], list[dict[str, Any]]]:
    """-> (column names, rows as dicts). `quoted_tsv` reads a .tsv with CSV quoting (and a tab between fields);
    `columns` names a .tsv's columns, in order, where it has no header (GLUE's CoLA)."""
    fmt = _format(path)
    if fmt == "parquet":
        return _read_parquet(path)
    if fmt == "jsonl":
        rows = [row for _, row in iter_jsonl(path)]
        if not rows:
            raise UserError(f"{path}: the file is empty")
        return list(dict.fromkeys(k for row in rows for k in row)), rows
    try:
        with fsspec.open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(f"{path}: line {line} is not UTF-8 text") from None
    if not text.strip():
        raise UserError(f"{path}: the file is empty")
    if fmt == "tsv" and not quoted_tsv:
        return _split_tsv(path, text, columns)
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""), delimiter="\t" if fmt == "tsv" else ",")
        columns = list(reader.fieldnames or [])
        rows = list(reader)
    except csv.Error as e:
        raise UserError(f"{path}: not a valid {fmt.upper()} file ({e})") from None
    return columns, rows


def _split_tsv(path: str, text: str, given: Sequence[str] = ()) -> tuple[list[str], list[dict[str, Any]]]:
    """TSV as IANA defines it: records split on line feeds (a carriage return before one dropped), fields on tabs,
    nothing quoted. Empty lines are skipped, as the CSV reader skips them. A record whose fields do not match the
    header's (or the `given` columns of a table without one) is an error: it is how a tab or a line break inside a
    field shows."""
    records = (line.removesuffix("\r") for line in text.split("\n"))
    records = (line for line in records if line)
    columns = list(given) or next(records).split("\t")
    expected = f"the header {len(columns)}"
    if given:
        expected = f"its {len(columns)} columns ({', '.join(columns)}; no header)"
    rows = []
    for i, line in enumerate(records):
        fields = line.split("\t")
        if len(fields) != len(columns):
            raise UserError(
                f"{path}: row {i + 1} has {len(fields)} tab-separated field(s), {expected} "
                "(a tab or a line break inside a field? TSV has no quoting; --quoted-tsv reads quoted fields)"
            )
        rows.append(dict(zip(columns, fields, strict=True)))
    return columns, rows


def text_column(path: str, columns: Sequence[str], rows: list[dict[str, Any]], column: str) -> list[str]:
    """The values of a text column; a missing column or an empty text is an error naming it."""
    _require(path, columns, column)
    out = []
    for i, row in enumerate(rows):
        value = row.get(column)
        if not isinstance(value, str) or not value.strip():
            raise UserError(f"{path}: row {i + 1} has an empty text in column '{column}'")
        out.append(value)
    return out


def _require(path: str, columns: Sequence[str], column: str) -> None:
    if column not in columns:
        raise UserError(f"{path}: no column '{column}' (columns: {', '.join(columns)})")


def numeric_column(path: str, columns: Sequence[str], rows: list[dict[str, Any]], column: str) -> np.ndarray:
    """(N,) float64 values of a column; a missing column, an empty cell, text or NaN is an error naming the row."""
    _require(path, columns, column)
    out = np.empty(len(rows), np.float64)
    for i, row in enumerate(rows):
        value = row.get(column)
        try:
            x = float(value.strip() if isinstance(value, str) else value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise UserError(f"{path}: row {i + 1}: column '{column}' holds {value!r}, not a number") from None
        if not np.isfinite(x):
            raise UserError(f"{path}: row {i + 1}: column '{column}' is {value!r}; every row needs a finite value")
        out[i] = x
    return out


def label_column(path: str, columns: Sequence[str], rows: list[dict[str, Any]], column: str) -> list[str]:
    """Class labels as strings (1 and '1' are one class); an empty cell is an error naming the row."""
    _require(path, columns, column)
    out = []
    for i, row in enumerate(rows):
        value = row.get(column)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        label = "" if value is None else str(value).strip()
        if not label or label.lower() == "nan":
            raise UserError(f"{path}: row {i + 1}: column '{column}' has no label")
        out.append(label)
    return out


def plain_column(path: str, columns: Sequence[str], rows: list[dict[str, Any]], column: str) -> list[str]:
    """A column's values as strings, empty cells as ''."""
    _require(path, columns, column)
    return ["" if row.get(column) is None else str(row.get(column)) for row in rows]


def write_csv(path: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Write a CSV whole or not at all (local paths atomically; fsspec URLs in one put)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows(rows)
    if "://" in path:
        with fsspec.open(path, "w", encoding="utf-8") as fh:
            fh.write(buf.getvalue())
        return
    from pathlib import Path

    from bertforge.fileio import write_atomic

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, buf.getvalue())
