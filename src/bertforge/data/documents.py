"""Reading a corpus as a stream of documents: plain text, JSONL or Parquet, local or fsspec, gzip or not.

Plain text holds one document per blank-line-separated block (default) or one per line. Nothing is read
whole: memory stays flat however large the files.
"""

from __future__ import annotations

import json
import lzma
import re
import zlib
from collections.abc import Iterator, Sequence
from typing import Literal, get_args

import fsspec

from bertforge.errors import UserError

InputFormat = Literal["auto", "text", "jsonl", "parquet"]
INPUT_FORMATS: tuple[str, ...] = get_args(InputFormat)

# A sentence ends at . ! or ? followed by space and an upper-case letter, digit or opening quote/bracket.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(document: str) -> list[str]:
    """Lines, then sentences within each line: the units that `complete` and `doc` blocks never cut."""
    out = []
    for line in document.split("\n"):
        out.extend(s for s in (p.strip() for p in _SENTENCE_END.split(line)) if s)
    return out


def expand_files(paths: Sequence[str]) -> list[str]:
    """Local paths, globs or fsspec URLs -> concrete file URLs; a missing file or empty pattern is an error."""
    out: list[str] = []
    for p in paths:
        if any(ch in p for ch in "*?["):
            fs, _, matches = fsspec.get_fs_token_paths(p)
            if not matches:
                raise UserError(f"{p}: no file matches this pattern")
            out.extend(fs.unstrip_protocol(m) if "://" in p else m for m in sorted(matches))
        else:
            fs, _, (one,) = fsspec.get_fs_token_paths(p)
            if not fs.exists(one):
                raise UserError(f"{p}: no such file")
            if fs.isdir(one):
                raise UserError(f"{p}: is a folder, not a file")
            out.append(p)
    return out


def detect_format(path: str, fmt: str = "auto") -> str:
    if fmt != "auto":
        return fmt
    name = path.lower().removesuffix(".gz").removesuffix(".bz2").removesuffix(".xz").removesuffix(".zst")
    if name.endswith((".jsonl", ".json")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def _lines(path: str) -> Iterator[tuple[int, str]]:
    try:
        fh = fsspec.open(path, "rb", compression="infer").open()
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot be read ({e})") from None
    lineno = 0
    with fh:
        try:
            for lineno, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise UserError(f"{path}: line {lineno} is not UTF-8 text (byte {e.start} of the line)") from None
                if lineno == 1:
                    line = line.removeprefix("\ufeff")
                yield lineno, line.rstrip("\r\n")
        except (OSError, EOFError, zlib.error, lzma.LZMAError) as e:  # a damaged or truncated compressed file
            where = f" past line {lineno}" if lineno else ""
            raise UserError(f"{path}: cannot be read{where} ({e})") from None


def _text_documents(path: str, doc_per_line: bool) -> Iterator[str]:
    block: list[str] = []
    for _, line in _lines(path):
        if "\x00" in line:
            line = line.replace("\x00", " ")
        stripped = line.strip()
        if doc_per_line:
            if stripped:
                yield stripped
            continue
        if stripped:
            block.append(stripped)
        elif block:
            yield "\n".join(block)
            block = []
    if block:
        yield "\n".join(block)


def iter_jsonl(path: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line of a JSONL file; anything but an object is named."""
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path}: line {lineno} is not valid JSON") from None
        except RecursionError:
            raise UserError(f"{path}: line {lineno} nests too deeply to read") from None
        if not isinstance(row, dict):
            raise UserError(f"{path}: line {lineno} is not a JSON object")
        yield lineno, row


def _jsonl_documents(path: str, field: str) -> Iterator[str]:
    for lineno, row in iter_jsonl(path):
        if field not in row:
            raise UserError(f"{path}: line {lineno} has no field '{field}' (set --text-field)")
        text = row[field]
        if not isinstance(text, str):
            raise UserError(f"{path}: line {lineno}: field '{field}' is not a string")
        if text.strip():
            yield text.strip()


def _parquet_documents(path: str, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        with fsspec.open(path, "rb") as fh:
            pf = pq.ParquetFile(fh)
            if field not in pf.schema_arrow.names:
                names = ", ".join(pf.schema_arrow.names)
                raise UserError(f"{path}: no column '{field}' (columns: {names}; set --text-field)")
            for batch in pf.iter_batches(columns=[field], batch_size=1024):
                for text in batch.column(0).to_pylist():
                    if isinstance(text, str) and text.strip():
                        yield text.strip()
    except UserError:
        raise
    except Exception as e:  # pyarrow's errors for a damaged file
        raise UserError(f"{path}: not a readable Parquet file ({e})") from None


def iter_documents(path: str, fmt: str = "auto", doc_per_line: bool = False, text_field: str = "text") -> Iterator[str]:
    """The non-empty documents of one file; a file with none is an error naming it."""
    kind = detect_format(path, fmt)
    if kind == "text":
        docs = _text_documents(path, doc_per_line)
    elif kind == "jsonl":
        docs = _jsonl_documents(path, text_field)
    elif kind == "parquet":
        docs = _parquet_documents(path, text_field)
    else:
        raise UserError(f"unknown input format '{fmt}' (choose from {', '.join(INPUT_FORMATS)})")
    empty = True
    for doc in docs:
        empty = False
        yield doc
    if empty:
        raise UserError(f"{path}: no text in this file")


def file_size(path: str) -> int:
    """The size in bytes of a local or fsspec file; 0 when unknown."""
    fs, _, (p,) = fsspec.get_fs_token_paths(path)
    try:
        return int(fs.size(p) or 0)
    except (OSError, TypeError):
        return 0  # unknown size: the progress bar shows bytes without a total
