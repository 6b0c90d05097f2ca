"""Tables of texts and targets: CSV, TSV and JSONL, local or fsspec URLs, read with named errors."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from typing import Any

import fsspec

from bertforge.data.documents import iter_jsonl
from bertforge.errors import UserError

FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "jsonl"}


def _format(path: str) -> str:
    for suffix, fmt in FORMATS.items():
        if path.lower().endswith(suffix):
            return fmt
    raise UserError(f"{path}: unknown table format (use .csv, .tsv or .jsonl)")


def read_table(path: str) -> tuple[list[str], list[dict[str, Any]]]:
    """-> (column names, rows as dicts). Row numbers in errors count the header as row 1 for CSV/TSV."""
    fmt = _format(path)
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
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""), delimiter="\t" if fmt == "tsv" else ",")
        columns = list(reader.fieldnames or [])
        rows = list(reader)
    except csv.Error as e:
        raise UserError(f"{path}: not a valid {fmt.upper()} file ({e})") from None
    return columns, rows


def text_column(path: str, columns: Sequence[str], rows: list[dict[str, Any]], column: str) -> list[str]:
    """The values of a text column; a missing column or an empty text is an error naming it."""
    if column not in columns:
        raise UserError(f"{path}: no column '{column}' (columns: {', '.join(columns)})")
    out = []
    for i, row in enumerate(rows):
        value = row.get(column)
        if not isinstance(value, str) or not value.strip():
            raise UserError(f"{path}: row {i + 1} has an empty text in column '{column}'")
        out.append(value)
    return out


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
