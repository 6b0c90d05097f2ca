"""Extractive question-answering data: SQuAD v1.1 and v2.0 JSON (`data[].paragraphs[].qas[]`), or flat records
(JSONL, a JSON list, CSV, TSV or Parquet) of `question`, `context` and either `answer_text` and `answer_start` or
SQuAD's `answers` ({"text": [...], "answer_start": [...]}, as Hugging Face datasets write it), read into Questions
and checked record by record: an answer whose text is not at its start in the context is named with its record.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from bertforge.data import tabular
from bertforge.data.documents import iter_jsonl
from bertforge.data.tagged import read_text
from bertforge.errors import UserError


@dataclasses.dataclass(frozen=True)
class Answer:
    text: str
    start: int  # its first character in the context


@dataclasses.dataclass(frozen=True)
class Question:
    id: str  # the record's id, else its 0-based index as a string
    question: str
    context: str
    answers: tuple[Answer, ...]  # () for a question with no answer (v2.0), or when the data is not labelled
    group: str | None = None  # the article's title: an article's questions stay in one fold
    impossible: bool = False  # marked as having no answer in the context (v2.0's is_impossible)


_TABLES = (".csv", ".tsv", ".parquet")


def read_questions(path: str, labelled: bool = True) -> list[Question]:
    """The questions of a file, every answer checked against its context; `labelled=False` lets them come without
    answers (what `predict` reads)."""
    name = path.lower()
    if name.endswith(_TABLES):
        _, rows = tabular.read_table(path)
        found = [_flat(path, f"row {i + 1}", row, i, labelled) for i, row in enumerate(rows)]
    elif name.endswith(".jsonl"):
        found = [_flat(path, f"line {n}", row, i, labelled) for i, (n, row) in enumerate(iter_jsonl(path))]
    elif name.endswith(".json"):
        found = _json(path, labelled)
    else:
        raise UserError(f"{path}: unknown question-answering format (use .json, .jsonl, .csv, .tsv or .parquet)")
    if not found:
        raise UserError(f"{path}: no questions")
    ids = [q.id for q in found]
    if len(set(ids)) < len(ids):
        twice = next(i for i in ids if ids.count(i) > 1)
        raise UserError(f"{path}: the id '{twice}' is given to more than one question")
    return found


def json_content(path: str) -> dict | list[tuple[str, dict]]:
    """A .json file's SQuAD object (one with 'data'), or its records as (where, record): a JSON list's, or the
    lines' of a file of one JSON object per line (JSONL under a .json name, as JGLUE ships JCommonsenseQA)."""
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        if e.msg != "Extra data":
            raise UserError(f"{path}: line {e.lineno} is not valid JSON ({e.msg})") from None
        return [(f"line {n}", row) for n, row in iter_jsonl(path)]
    except RecursionError:
        raise UserError(f"{path}: its JSON nests too deeply to read") from None
    if isinstance(data, list):
        return [(f"record {i + 1}", _object(path, f"record {i + 1}", r)) for i, r in enumerate(data)]
    if isinstance(data, dict):  # SQuAD's object, or the one record of a one-line JSONL file
        return data if "data" in data else [("line 1", data)]
    raise UserError(f"{path}: holds {json.dumps(data)[:20]}, not records")


def _json(path: str, labelled: bool) -> list[Question]:
    data = json_content(path)
    if isinstance(data, list):
        return [_flat(path, where, r, i, labelled) for i, (where, r) in enumerate(data)]
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise UserError(f"{path}: neither SQuAD JSON (an object with a 'data' list) nor a JSON list of records")
    out: list[Question] = []
    for a, article in enumerate(data["data"]):
        article = _object(path, f"data[{a}]", article)
        title = article.get("title")
        for p, paragraph in enumerate(_list(path, f"data[{a}]", article, "paragraphs")):
            where = f"data[{a}].paragraphs[{p}]"
            paragraph = _object(path, where, paragraph)
            context = _string(path, where, paragraph, "context")
            for q, qa in enumerate(_list(path, where, paragraph, "qas")):
                at = f"{where}.qas[{q}]"
                qa = _object(path, at, qa)
                out.append(_question(path, at, qa, context, str(title) if title else None, len(out), labelled))
    return out


def _flat(path: str, where: str, row: dict, index: int, labelled: bool) -> Question:
    context = _string(path, where, row, "context")
    group = row.get("title") or row.get("group")
    return _question(path, where, row, context, str(group) if group else None, index, labelled)


def _question(path: str, where: str, qa: dict, context: str, group: str | None, index: int, labelled: bool
              ) -> Question:  # fmt: skip
    question = _string(path, where, qa, "question")
    qid = qa.get("id")
    qid = str(index) if qid is None or qid == "" else str(qid)
    impossible = _flag(path, where, qa.get("is_impossible", False))
    answers = () if impossible else _answers(path, f"{where} (id {qid})", qa, context)
    if labelled and not answers and not impossible:
        raise UserError(f"{path}: {where} (id {qid}): no answer given (answers, or answer_text and answer_start; "
                        "is_impossible: true for a question without one)")  # fmt: skip
    return Question(qid, question, context, answers, group, impossible)


def _answers(path: str, where: str, qa: dict, context: str) -> tuple[Answer, ...]:
    """The record's answers, each found at its start in the context."""
    if "answer_text" in qa or "answer_start" in qa:
        pairs = [(qa.get("answer_text"), qa.get("answer_start"))]
        if pairs[0] == ("", "") or pairs[0] == (None, None):
            return ()
    elif isinstance(qa.get("answers"), dict):  # Hugging Face datasets: lists of texts and starts
        given = qa["answers"]
        texts, starts = given.get("text", []), given.get("answer_start", [])
        if not isinstance(texts, list) or not isinstance(starts, list) or len(texts) != len(starts):
            raise UserError(f"{path}: {where}: answers must hold lists 'text' and 'answer_start' of one length")
        pairs = list(zip(texts, starts, strict=True))
    else:
        items = qa.get("answers") or []
        if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
            raise UserError(f"{path}: {where}: answers must be a list of objects with 'text' and 'answer_start'")
        pairs = [(x.get("text"), x.get("answer_start")) for x in items]
    return tuple(_answer(path, where, text, start, context) for text, start in pairs)


def _answer(path: str, where: str, text: Any, start: Any, context: str) -> Answer:
    if not isinstance(text, str) or not text:
        raise UserError(f"{path}: {where}: an answer's text must be a non-empty string, got {json.dumps(text)}")
    try:
        if isinstance(start, bool):
            raise ValueError
        at = int(start)
        if str(start).strip() != str(at) and start != at:
            raise ValueError
    except (TypeError, ValueError):
        raise UserError(f"{path}: {where}: answer_start must be a whole number, got {json.dumps(start)}") from None
    if context[at : at + len(text)] != text or at < 0:
        seen = context[max(at, 0) : max(at, 0) + len(text)]
        raise UserError(f"{path}: {where}: the answer {text!r} is not at answer_start {at} in the context "
                        f"(which reads {seen!r} there)")  # fmt: skip
    return Answer(text, at)


def _object(path: str, where: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise UserError(f"{path}: {where} is not a JSON object")
    return value


def _list(path: str, where: str, record: dict, key: str) -> list:
    value = record.get(key)
    if not isinstance(value, list):
        raise UserError(f"{path}: {where}: '{key}' must be a list")
    return value


def _string(path: str, where: str, record: dict, key: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        shown = "missing" if key not in record else f"not a non-empty string ({json.dumps(value)[:40]})"
        raise UserError(f"{path}: {where}: '{key}' is {shown}")
    return value


def _flag(path: str, where: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).strip().lower() in ("true", "1"):
        return True
    if str(value).strip().lower() in ("false", "0", ""):
        return False
    raise UserError(f"{path}: {where}: is_impossible must be true or false, got {json.dumps(value)}")
