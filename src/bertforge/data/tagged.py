"""Token-classification data (named entities): CoNLL columns, or JSONL and JSON lists of records that hold either
tokens with one tag each or a text with character spans, read into Documents and checked record by record.

Every mistake is named by file and line (CoNLL, JSONL) or by 1-based record (a JSON list).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Iterator
from typing import Any

import fsspec

from bertforge.data.documents import iter_jsonl
from bertforge.data.tags import tag_problem
from bertforge.errors import UserError


@dataclasses.dataclass(frozen=True)
class Entity:
    start: int  # character offsets into Document.text, end exclusive
    end: int
    type: str


@dataclasses.dataclass(frozen=True)
class Document:
    id: str  # the record's id when it has one, else its 0-based index as a string
    text: str
    words: tuple[tuple[int, int], ...] | None  # word formats: each word's (start, end) in text; None for spans
    tags: tuple[str, ...] | None  # word formats: one tag per word; None when the input has none
    entities: tuple[Entity, ...] | None  # span format: the entities by start; None when the record gives none
    group: str | None = None  # a record's 'curid' or 'group' (its article): a group's texts stay in one fold


FORMATS = ("conll", "jsonl", "json")
# File name endings read as CoNLL columns (CoNLL-U is not among them: its last column is not a tag).
_CONLL_SUFFIXES = (".conll", ".conll03", ".txt", ".tsv", ".bio", ".iob", ".iob2", ".bioes")
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
_WHITESPACE = re.compile(r"\s")
_COLUMNS = re.compile(r"[ \t]+")


def data_format(path: str, given: str = "") -> str:
    """'conll', 'jsonl' or 'json': `given` when set, else told by the file name (a compression suffix aside)."""
    if given:
        if given not in FORMATS:
            raise UserError(f"unknown --data-format {given!r} (conll, jsonl or json)")
        return given
    name = path.lower()
    for suffix in _COMPRESSIONS:
        name = name.removesuffix(suffix)
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith(".json"):
        return "json"
    if name.endswith(_CONLL_SUFFIXES):
        return "conll"
    raise UserError(f"{path}: cannot tell the format from the file name; give --data-format conll, jsonl or json")


def read_documents(path: str, fmt: str = "", labelled: bool = True) -> list[Document]:
    """The documents of a file, checked; `labelled=False` lets documents come without tags or entities."""
    fmt = data_format(path, fmt)
    if fmt == "conll":
        docs = _conll_documents(path, labelled)
    else:
        records = _json_records(path) if fmt == "json" else _jsonl_records(path)
        docs = _record_documents(path, records, labelled)
    if not docs:
        raise UserError(f"{path}: no records")
    return docs


# ----------------------------------------------------------------------------------------------------- reading
def read_text(path: str) -> str:
    """The whole file as text (a leading BOM dropped); unreadable or non-UTF-8 bytes are named by line."""
    try:
        with fsspec.open(path, "rb", compression="infer") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot be read ({e})") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(f"{path}: line {line} is not UTF-8 text") from None


def _jsonl_records(path: str) -> Iterator[tuple[str, dict]]:
    for lineno, row in iter_jsonl(path):
        yield f"line {lineno}", row


def _json_records(path: str) -> Iterator[tuple[str, Any]]:
    text = read_text(path)
    if not text.strip():
        return
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(
            f"{path}: line {e.lineno} is not valid JSON ({e.msg}); a file of one object per line is read with "
            "--data-format jsonl"
        ) from None
    except RecursionError:
        raise UserError(f"{path}: its JSON nests too deeply to read") from None
    if not isinstance(data, list):
        held = "an object" if isinstance(data, dict) else json.dumps(data)[:20]
        raise UserError(f"{path}: a JSON file must hold a list of records, this one holds {held}")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise UserError(f"{path}: record {i + 1} is not a JSON object")
        yield f"record {i + 1}", row


def _word_spans(tokens: Iterable[str]) -> tuple[tuple[int, int], ...]:
    """Each token's (start, end) in the tokens joined by single spaces."""
    spans, at = [], 0
    for token in tokens:
        spans.append((at, at + len(token)))
        at += len(token) + 1
    return tuple(spans)


def _word_document(id_: str, tokens: list[str], tags: list[str] | None) -> Document:
    tags_ = None if tags is None else tuple(tags)
    return Document(id=id_, text=" ".join(tokens), words=_word_spans(tokens), tags=tags_, entities=None)


def _show(value: Any) -> str:
    """A value from the file for an error message: on one line, and not too long."""
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


# ------------------------------------------------------------------------------------------------------ CoNLL
def _conll_sentences(path: str) -> Iterator[list[tuple[int, list[str]]]]:
    """(line number, columns) of each sentence's lines: runs of lines between blank and -DOCSTART- lines."""
    sentence: list[tuple[int, list[str]]] = []
    for lineno, line in enumerate(read_text(path).split("\n"), 1):
        columns = _COLUMNS.split(line.strip(" \t\r"))
        if not line.strip() or columns[0] == "-DOCSTART-":
            if sentence:
                yield sentence
            sentence = []
            continue
        if any(_WHITESPACE.search(c) for c in columns):
            raise UserError(
                f"{path}: line {lineno}: {_show(line.strip())} holds a whitespace character other than space or tab"
            )
        sentence.append((lineno, columns))
    if sentence:
        yield sentence


def _conll_documents(path: str, labelled: bool) -> list[Document]:
    """One document per sentence: the first column is the token, the last the tag, any between are ignored."""
    docs = []
    for sentence in _conll_sentences(path):
        first_line, first_columns = sentence[0]
        tagged = len(first_columns) > 1
        for lineno, columns in sentence:
            where = f"{path}: line {lineno}"
            if len(columns) == 1 and labelled:
                raise UserError(f"{where}: {_show(columns[0])} has no tag column (the token first, the tag last)")
            if (len(columns) > 1) != tagged:
                has, other = ("a", "has none") if len(columns) > 1 else ("no", "has one")
                raise UserError(f"{where} has {has} tag column, line {first_line} of the same sentence {other}")
            problem = tag_problem(columns[-1]) if tagged else None
            if problem:
                raise UserError(f"{where}: {problem}")
        tokens = [columns[0] for _, columns in sentence]
        docs.append(_word_document(str(len(docs)), tokens, [c[-1] for _, c in sentence] if tagged else None))
    return docs


# ------------------------------------------------------------------------------------------------ JSON records
def _record_documents(path: str, records: Iterable[tuple[str, dict]], labelled: bool) -> list[Document]:
    """Documents of word records ('tokens', 'tags') or span records ('text', 'entities'), the kind fixed by the first
    record."""
    docs: list[Document] = []
    kind = ""
    ids: dict[str, str] = {}
    for index, (where, row) in enumerate(records):
        here = f"{path}: {where}"
        row_kind = "tokens" if "tokens" in row else "text" if "text" in row else ""
        if not kind and not row_kind:
            raise UserError(f"{here} has neither 'tokens' (with 'tags') nor 'text' (with 'entities')")
        if kind and row_kind and row_kind != kind:
            raise UserError(f"{here} holds '{row_kind}' where the file's first record holds '{kind}'")
        kind = kind or row_kind
        id_ = _record_id(here, row, index)
        if id_ in ids:
            raise UserError(f"{here} repeats the id {_show(id_)} of {ids[id_]}")
        ids[id_] = where
        doc = _word_record(here, row, id_, labelled) if kind == "tokens" else _span_record(here, row, id_, labelled)
        docs.append(dataclasses.replace(doc, group=_record_group(here, row)))
    return docs


def _record_key(here: str, row: dict, key: str) -> str | None:
    """The record's `key` as a string, None when it has none."""
    if key not in row:
        return None
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise UserError(f"{here}: '{key}' is not a string or an integer ({_show(value)})")
    return str(value)


def _record_id(here: str, row: dict, index: int) -> str:
    found = _record_key(here, row, "id")
    return str(index) if found is None else found


def _record_group(here: str, row: dict) -> str | None:
    """An article id ('curid', as Wikipedia sets have it) or a 'group': several records may share it."""
    found = _record_key(here, row, "group")
    return _record_key(here, row, "curid") if found is None else found


def _word_record(here: str, row: dict, id_: str, labelled: bool) -> Document:
    tokens = row.get("tokens")
    if not isinstance(tokens, list):
        raise UserError(f"{here}: 'tokens' is not a list" if "tokens" in row else f"{here} has no 'tokens'")
    for j, token in enumerate(tokens):
        if not isinstance(token, str) or not token:
            problem = "is empty" if token == "" else f"is not a string ({_show(token)})"
            raise UserError(f"{here}: token {j + 1} {problem}")
        if _WHITESPACE.search(token):
            raise UserError(f"{here}: token {j + 1} {_show(token)} holds whitespace (one word per token)")
    key = "tags" if "tags" in row else "ner_tags"
    tags = row.get(key)
    if tags is None:
        if labelled:
            raise UserError(f"{here} has no 'tags'")
        return _word_document(id_, tokens, None)
    if not isinstance(tags, list):
        raise UserError(f"{here}: '{key}' is not a list")
    if len(tags) != len(tokens):
        raise UserError(f"{here} has {len(tokens)} tokens and {len(tags)} '{key}'")
    for j, tag in enumerate(tags):
        if isinstance(tag, int) and not isinstance(tag, bool):
            raise UserError(f"{here}: '{key}' holds numbers ({tag} at {j + 1}); give the tags' names, e.g. B-PER")
        problem = tag_problem(tag)
        if problem:
            raise UserError(f"{here}: tag {j + 1}: {problem}")
    return _word_document(id_, tokens, tags)


def _span_record(here: str, row: dict, id_: str, labelled: bool) -> Document:
    text = row.get("text")
    if not isinstance(text, str):
        raise UserError(f"{here}: 'text' is not a string" if "text" in row else f"{here} has no 'text'")
    given = row.get("entities")
    if given is None:
        if labelled:
            raise UserError(f"{here} has no 'entities'")
        return Document(id=id_, text=text, words=None, tags=None, entities=None)
    if not isinstance(given, list):
        raise UserError(f"{here}: 'entities' is not a list")
    found = sorted((*_entity(f"{here}: entity {j + 1}", e, len(text)), j + 1) for j, e in enumerate(given))
    for (start, end, _, j), (next_start, next_end, _, k) in zip(found, found[1:], strict=False):
        if next_start < end:
            raise UserError(f"{here}: entity {j} [{start}, {end}) and entity {k} [{next_start}, {next_end}) overlap")
    entities = tuple(Entity(start, end, kind) for start, end, kind, _ in found)
    return Document(id=id_, text=text, words=None, tags=None, entities=entities)


def _entity(where: str, given: Any, length: int) -> tuple[int, int, str]:
    """(start, end, type) of one entity of a span record, its span checked against the text's length."""
    if not isinstance(given, dict):
        raise UserError(f"{where} is not a JSON object")
    if "span" in given:
        span = given["span"]
    elif "start" in given and "end" in given:
        span = [given["start"], given["end"]]
    else:
        raise UserError(f"{where} has no 'span' (or 'start' and 'end')")
    if not isinstance(span, list) or len(span) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in span):
        raise UserError(f"{where}: the span {_show(span)} is not two integers [start, end]")
    start, end = span
    if not 0 <= start < end <= length:
        raise UserError(f"{where}: the span [{start}, {end}] is not within the text (0 <= start < end <= {length})")
    key = "type" if "type" in given else "label"
    if key not in given:
        raise UserError(f"{where} has no 'type'")
    kind = given[key]
    if not isinstance(kind, str):
        raise UserError(f"{where}: the type {_show(kind)} is not a string")
    if not kind.strip():
        raise UserError(f"{where}: the type is empty")
    return start, end, kind
