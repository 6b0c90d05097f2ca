"""Multiple choice: a question (after its context, when the data has one) paired with each of its N choices, each
pair scored by the choice head; trained with cross-entropy over the N scores (softmax over the choices), as
transformers' *ForMultipleChoice models are, and chosen by accuracy."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from bertforge.data.batching import EncodedChoices, choices_of
from bertforge.data.choices import Choices, choice_texts, read_choices
from bertforge.data.labelled import Table, TableConfig
from bertforge.errors import UserError
from bertforge.finetuning import tables
from bertforge.finetuning.columns import numbers
from bertforge.tokenizer.load import Tokenizer
from bertforge.train.metrics import softmax

NAME = "multiple-choice"
HEAD = "choice"
PIPELINE_TAG = "multiple-choice"
AUTO_CLASS = "AutoModelForMultipleChoice"
DESCRIPTION = "multiple-choice model"
DEFAULT_LOSS = "cross_entropy"
LOSSES = ("cross_entropy",)
DEFAULT_METRIC = "accuracy"


@dataclasses.dataclass(frozen=True)
class Offered:
    """A multiple-choice file as read."""

    path: str
    records: list[Choices]


def read(path: str, cfg: TableConfig, known: Sequence[str] | None) -> Offered:
    """The records of `path`; validation records must offer as many choices as the training ones."""
    records = read_choices(path, labelled=True, context=cfg.context_column)
    if known is not None and len(records[0].choices) != len(known):
        raise UserError(f"{path}: offers {len(records[0].choices)} choices per question where the training data "
                        f"offers {len(known)}")  # fmt: skip
    return Offered(path, records)


def output_names(data: Offered, cfg: TableConfig) -> list[str]:
    """A score per choice, by its position."""
    return names_of(len(data.records[0].choices))


def names_of(n: int) -> list[str]:
    return [f"choice{i}" for i in range(n)]


def encode(records: Sequence[Choices], tokenizer: Tokenizer, limit: int, truncation: str) -> list[EncodedChoices]:
    """Each record's (question, choice) pairs, encoded in at most `limit` tokens each."""
    firsts, seconds = choice_texts(records)
    pairs = tokenizer.encode_batch(firsts, seconds, max_length=limit, truncation=truncation)
    n = len(records[0].choices) if records else 0
    return [EncodedChoices(tuple(pairs[i * n : (i + 1) * n])) for i in range(len(records))]


def rows(data: Offered, tokenizer: Tokenizer, cfg: TableConfig, limit: int) -> Table:
    """A row per record: its choices' encodings (Table.encs) and the right one's index (targets, (R,) int32)."""
    records = data.records
    return Table(
        path=data.path,
        texts=[r.question for r in records],
        pairs=None,
        targets=np.array([r.label for r in records], np.int32),
        labels=[str(r.label) for r in records],
        weights=np.ones(len(records), np.float32),
        ids=[r.id for r in records],
        groups=[r.group or r.id for r in records],
        encs=encode(records, tokenizer, limit, cfg.truncation),
    )


def run_info(table: Table, cfg: TableConfig) -> dict[str, Any]:
    """The choices per question, and the column read as each question's context."""
    assert table.encs is not None
    return {"choices": choices_of(table.encs), "context_column": cfg.context_column}


def strata(table: Table, bins: int) -> np.ndarray | None:
    """The right choice's position: folds balanced over it."""
    return table.targets


def scores(outputs: np.ndarray, targets: np.ndarray, names: Sequence[str], source: Any = None) -> dict[str, float]:
    """Accuracy of the highest-scored choice."""
    return {"accuracy": float(np.mean(np.argmax(outputs, axis=1) == targets))}


def column_names(labels: list[str], run: dict[str, Any]) -> list[str]:
    return names_of(int(run.get("choices", 0)))


def prediction_columns(
    names: Sequence[str], outputs: np.ndarray, beside_truth: bool
) -> tuple[list[str], list[list[Any]]]:
    """The chosen choice's index ('label', or 'prediction' beside the true label) and each choice's probability."""
    header = ["prediction" if beside_truth else "label", *(f"probability_{n}" for n in names)]
    values = numbers(softmax(np.asarray(outputs, np.float64), axis=1))
    return header, [[int(np.argmax(o)), *v] for o, v in zip(outputs, values, strict=True)]


def out_of_fold(table: Table, cfg: TableConfig, names: Sequence[str], rows: np.ndarray, outputs: np.ndarray,
                keys: Sequence[tuple[str, Sequence[Any]]]) -> tuple[list[str], list[list[Any]]]:  # fmt: skip
    """oof.csv: the keys, the right choice, the chosen one and each choice's probability."""
    truth = (["label"], [[int(table.targets[r])] for r in rows])
    return tables.prediction_table(prediction_columns, names, outputs, keys, truth)
