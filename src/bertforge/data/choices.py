"""Multiple-choice data: a question (and an optional context) with N choices and the index of the right one, as a
table (CSV, TSV, Parquet, JSONL, or a JSON list) with columns `choice0` .. `choice{N-1}` and `label`, as
JCommonsenseQA writes it, or records with a `choices` list. Every record must offer the same number of choices;
anything malformed is one line naming the file and the record."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any

from bertforge.data import tabular
from bertforge.data.questions import json_content
from bertforge.errors import UserError

_NUMBERED = re.compile(r"^(choice|ending)(\d+)$")


@dataclasses.dataclass(frozen=True)
class Choices:
    id: str  # the record's id (`id`, else `q_id`), else its 0-based index as a string
    question: str
    context: str | None  # read before the question when the data has a context column
    choices: tuple[str, ...]
    label: int | None  # the right choice's index; None when the data is not labelled
    group: str | None = None


def read_choices(path: str, labelled: bool = True, context: str | None = None) -> list[Choices]:
    """The records of a file; `context` names a column read as each record's context, `labelled=False` lets records
    come without a label (what `predict` reads)."""
    name = path.lower()
    if name.endswith(".json"):
        content = json_content(path)
        if isinstance(content, dict):
            raise UserError(f"{path}: holds SQuAD JSON, not multiple-choice records (a list, or one per line)")
        records = content
    elif name.endswith((".jsonl", ".csv", ".tsv", ".parquet")):
        _, rows = tabular.read_table(path)
        kind = "line" if name.endswith(".jsonl") else "row"
        records = [(f"{kind} {i + 1}", row) for i, row in enumerate(rows)]
    else:
        raise UserError(f"{path}: unknown multiple-choice format (use .csv, .tsv, .parquet, .jsonl or .json)")
    if not records:
        raise UserError(f"{path}: no records")
    found = [_record(path, where, row, i, labelled, context) for i, (where, row) in enumerate(records)]
    counts = {len(r.choices) for r in found}
    if len(counts) > 1:
        first = found[0]
        odd = next(i for i, r in enumerate(found) if len(r.choices) != len(first.choices))
        raise UserError(f"{path}: {records[odd][0]} has {len(found[odd].choices)} choices where the first record "
                        f"has {len(first.choices)}; every record must offer the same number")  # fmt: skip
    return found


def _record(path: str, where: str, row: dict, index: int, labelled: bool, context: str | None) -> Choices:
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        raise UserError(f"{path}: {where}: 'question' is missing or empty")
    options = _options(path, where, row)
    given = labelled or row.get("label") not in (None, "")
    label = _label(path, where, row.get("label"), len(options)) if given else None
    text = None
    if context is not None:
        text = row.get(context)
        if not isinstance(text, str):
            raise UserError(f"{path}: {where}: the context column '{context}' is missing or not text")
    rid = next((row[k] for k in ("id", "q_id") if row.get(k) not in (None, "")), index)
    group = row.get("group")
    return Choices(str(rid), question, text, options, label, str(group) if group not in (None, "") else None)


def _options(path: str, where: str, row: dict) -> tuple[str, ...]:
    if "choices" in row:
        given: Any = row["choices"]
        if isinstance(given, str):  # a table cell holding a JSON list
            try:
                given = json.loads(given)
            except json.JSONDecodeError:
                given = None
        if not isinstance(given, list):
            raise UserError(f"{path}: {where}: 'choices' must be a list of texts")
    else:
        numbered = sorted((int(m.group(2)), k) for k in row if (m := _NUMBERED.match(k)))
        if [n for n, _ in numbered] != list(range(len(numbered))):
            raise UserError(f"{path}: {where}: no choices: give columns choice0, choice1, ... (numbered from 0 "
                            "without a gap) or a 'choices' list")  # fmt: skip
        given = [row[k] for _, k in numbered]
    if len(given) < 2:
        raise UserError(f"{path}: {where}: {len(given)} choice(s); a multiple-choice question needs at least 2")
    for i, option in enumerate(given):
        if not isinstance(option, str) or not option.strip():
            raise UserError(f"{path}: {where}: choice {i} is empty or not text ({json.dumps(option)[:40]})")
    return tuple(given)


def _label(path: str, where: str, value: Any, n: int) -> int:
    try:
        label = int(value)
        if isinstance(value, float) and value != label or isinstance(value, bool):
            raise ValueError
        if isinstance(value, str) and value.strip() != str(label):
            raise ValueError
    except (TypeError, ValueError):
        raise UserError(f"{path}: {where}: 'label' must be a choice's index from 0 to {n - 1}, got "
                        f"{json.dumps(value)}") from None  # fmt: skip
    if not 0 <= label < n:
        raise UserError(f"{path}: {where}: 'label' is {label}, outside the {n} choices (0 to {n - 1})")
    return label


def choice_texts(records: Sequence[Choices]) -> tuple[list[str], list[str]]:
    """The (first, second) texts of every (record, choice) pair, record by record: the question, then the choice;
    with a context, the context, then the question and the choice (run_swag's sent1, then sent2 and the ending)."""
    firsts, seconds = [], []
    for r in records:
        firsts += [r.question if r.context is None else r.context] * len(r.choices)
        seconds += list(r.choices) if r.context is None else [f"{r.question} {c}" for c in r.choices]
    return firsts, seconds
