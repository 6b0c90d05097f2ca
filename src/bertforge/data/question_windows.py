"""Extractive question answering's rows: the question, then a window of its context, as run_qa cuts them (the
tokenizer's overflowing tokens with a stride): the question whole (or its first --max-question-length tokens) in
every window, the context in windows of what room is left overlapping by --doc-stride tokens. Each row knows the
characters of its context tokens and where the answer lies in it (the first token when it does not)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from bertforge.data.questions import Question
from bertforge.data.windows import overflow_ranges
from bertforge.errors import UserError
from bertforge.tokenizer.load import Encoded, Tokenizer, truncate

NO_CHARS = -1  # a row token's characters when it is not of the context


@dataclasses.dataclass(frozen=True)
class QuestionWindow:
    question: int  # the question's index
    encoded: Encoded
    offsets: np.ndarray  # (limit, 2) int32: each context token's characters in the context, NO_CHARS elsewhere
    targets: np.ndarray  # (2,) int32: the answer's first and last token in the row; (0, 0) when not inside


def question_windows(
    tok: Tokenizer,
    questions: Sequence[Question],
    limit: int,
    doc_stride: int,
    max_question: int,
) -> list[QuestionWindow]:
    """Every question's rows, in order. A question's first answer gives the rows' targets (a training row's)."""
    q_ids = [truncate(ids, max_question) for ids in tok.tokenize_ids([q.question for q in questions])]
    contexts = tok.tok.encode_batch([q.context for q in questions], add_special_tokens=False)
    before = len(tok.template.prefix) + len(tok.template.middle)
    out = []
    for i, (q, ids, ctx) in enumerate(zip(questions, q_ids, contexts, strict=True)):
        capacity = limit - tok.num_special(pair=True) - len(ids)
        if capacity < 1:
            raise UserError(f"question {q.id}: its {len(ids)} tokens leave no room for its context in max_length "
                            f"{limit}; lower --max-question-length or raise --max-length")  # fmt: skip
        chars = np.array(ctx.offsets, np.int32).reshape(-1, 2)
        for start, end in overflow_ranges(len(ctx.ids), capacity, min(doc_stride, capacity - 1)):
            encoded = tok.assemble(ids, ctx.ids[start:end])
            offsets = np.full((limit, 2), NO_CHARS, np.int32)
            first = before + len(ids)
            offsets[first : first + end - start] = chars[start:end]
            out.append(QuestionWindow(i, encoded, offsets, _targets(q, offsets)))
    return out


def _targets(q: Question, offsets: np.ndarray) -> np.ndarray:
    """The first answer's first and last token in a row: the last context token starting at or before its first
    character and the first ending at or after its end, when the row's context holds it whole; else (0, 0)."""
    if not q.answers:
        return np.zeros(2, np.int32)
    a = q.answers[0]
    begin, finish = a.start, a.start + len(a.text)
    inside = np.flatnonzero(offsets[:, 0] >= 0)
    if inside.size == 0 or offsets[inside[0], 0] > begin or offsets[inside[-1], 1] < finish:
        return np.zeros(2, np.int32)
    first = inside[offsets[inside, 0] <= begin][-1]
    last = inside[offsets[inside, 1] >= finish][0]
    return np.array([first, last], np.int32)
