"""Extractive question answering: a question and its context cut into windows (run_qa's), each window a row whose
span head gives every token a start and an end logit; trained with cross-entropy on the answer's first and last
token (the first token when the window does not hold it), and scored on each question's best span over its windows
by exact match and F1 (SQuAD's; over characters for text without spaces), chosen by F1."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from bertforge.data.labelled import Table, TableConfig
from bertforge.data.question_windows import QuestionWindow, question_windows
from bertforge.data.questions import Question, read_questions
from bertforge.errors import UserError
from bertforge.finetuning.spans import Span, answers_of
from bertforge.tokenizer.load import Tokenizer
from bertforge.train.answers import answer_scores, best_scores, without_spaces

NAME = "question-answering"
HEAD = "span"
PIPELINE_TAG = "question-answering"
AUTO_CLASS = "AutoModelForQuestionAnswering"
DESCRIPTION = "extractive question-answering model"
DEFAULT_LOSS = "span_cross_entropy"
LOSSES = ("span_cross_entropy",)
DEFAULT_METRIC = "f1"
NAMES = ["start", "end"]


@dataclasses.dataclass(frozen=True)
class Asked:
    """A question-answering file as read."""

    path: str
    questions: list[Question]


def read(path: str, cfg: TableConfig, known: Sequence[str] | None) -> Asked:
    return Asked(path, read_questions(path, labelled=True))


def output_names(data: Asked, cfg: TableConfig) -> list[str]:
    return list(NAMES)


@dataclasses.dataclass(frozen=True)
class Rows:
    """What a question-answering Table's rows (windows) came from: Table.source."""

    questions: list[Question]
    windows: list[QuestionWindow]
    max_answer: int  # tokens
    null_threshold: float | None  # None: every question has an answer (SQuAD v1.1)


def settings(questions: Sequence[Question], cfg: TableConfig) -> tuple[int, float | None]:
    """The longest answer in tokens, and the null answer's threshold: 0 when some question has no answer (v2.0)."""
    null = cfg.null_threshold if any(q.impossible for q in questions) else None
    return cfg.max_answer_length, null


def rows(data: Asked, tokenizer: Tokenizer, cfg: TableConfig, limit: int) -> Table:
    """One row per window of each question; targets (R, 4) int32: the answer's first and last token in the row
    (0, 0 when it is not inside), the row's index and its number of tokens."""
    made = question_windows(tokenizer, data.questions, limit, cfg.stride, cfg.max_question_length)
    qs = data.questions
    targets = np.array([[*w.targets, i, len(w.encoded.ids)] for i, w in enumerate(made)], np.int32).reshape(-1, 4)
    return Table(
        path=data.path,
        texts=[qs[w.question].question for w in made],
        pairs=[qs[w.question].context for w in made],
        targets=targets,
        labels=None,
        weights=np.ones(len(made), np.float32),
        ids=[qs[w.question].id for w in made],
        groups=[qs[w.question].group or qs[w.question].id for w in made],  # an article's questions: one fold
        encs=[w.encoded for w in made],
        source=Rows(qs, made, *settings(qs, cfg)),
    )


def run_info(table: Table, cfg: TableConfig) -> dict[str, Any]:
    """What `predict` cuts and answers with: the question's tokens kept, the longest answer, and the null answer's
    threshold (None: the training data had an answer to every question)."""
    source: Rows = table.source
    return {"max_question_length": cfg.max_question_length, "max_answer_length": source.max_answer,
            "null_threshold": source.null_threshold}  # fmt: skip


def strata(table: Table, bins: int) -> np.ndarray | None:
    return None


def spans_of(source: Rows, rows: np.ndarray, outputs: np.ndarray) -> tuple[list[int], list[list[Span]]]:
    """The questions of the table's `rows` (ascending) and each one's n-best spans, from the rows' (R, T, 2)
    outputs."""
    question_of = np.array([source.windows[int(r)].question for r in rows], np.int64)
    questions = np.unique(question_of)
    offsets = np.stack([source.windows[int(r)].offsets for r in rows])  # (R, limit, 2)
    contexts = [source.questions[q].context for q in questions]
    found = answers_of(contexts, np.searchsorted(questions, question_of), outputs[:, : offsets.shape[1]], offsets,
                       source.max_answer, null_threshold=source.null_threshold)  # fmt: skip
    return questions.tolist(), found


def scores(outputs: np.ndarray, targets: np.ndarray, names: Sequence[str], source: Any = None) -> dict[str, float]:
    """Exact match and F1 in percent of each question's best span against its answers."""
    if not isinstance(source, Rows):
        raise UserError("question-answering scores need the windows the outputs are of")
    order, spans = spans_of(source, targets[:, 2], outputs)
    qs = [source.questions[q] for q in order]
    chars = without_spaces([q.context for q in qs])
    return answer_scores([s[0].text for s in spans], [[a.text for a in q.answers] for q in qs], chars)


def column_names(labels: list[str], run: dict[str, Any]) -> list[str]:
    return list(NAMES)


def prediction_columns(
    names: Sequence[str], outputs: np.ndarray, beside_truth: bool
) -> tuple[list[str], list[list[Any]]]:
    raise UserError("question-answering predictions are answers: see predict_questions")


def out_of_fold(table: Table, cfg: TableConfig, names: Sequence[str], rows: np.ndarray, outputs: np.ndarray,
                keys: Sequence[tuple[str, Sequence[Any]]]) -> tuple[list[str], list[list[Any]]]:  # fmt: skip
    """A row per question: its keys (of its first window), its true answers as JSON, the predicted answer, its
    character start in the context (-1: no answer), its probability among the n-best, and its F1 in percent
    against the best true answer (as `scores` counts it)."""
    source: Rows = table.source
    order, spans = spans_of(source, rows, outputs)
    first = {}
    for i, r in enumerate(rows):
        first.setdefault(source.windows[int(r)].question, i)
    chars = without_spaces([source.questions[q].context for q in order])
    header = [name for name, _ in keys] + ["answers", "prediction", "start", "score", "f1"]
    body = []
    for q, found in zip(order, spans, strict=True):
        answers = [a.text for a in source.questions[q].answers]
        best = found[0]
        key_values = [column[first[q]] for _, column in keys]
        f1 = 100 * best_scores(best.text, answers, chars)[1]
        truth = json.dumps(answers, ensure_ascii=False)
        body.append([*key_values, truth, best.text, best.start, f"{best.probability:.6g}", f"{f1:.6g}"])
    return header, body
