"""Extractive question answering's post-processing: each question's answers from the start and end logits of its
windows, as run_qa's postprocess_qa_predictions picks them (a span's score is its start logit plus its end logit;
spans only inside the context, end not before start, at most --max-answer-length tokens; the best over every
window of the question), searched exhaustively where run_qa looks at the top 20 starts and ends of each window.
With no-answer questions allowed (SQuAD v2.0), the null answer (the first token's start and end) wins when its
lowest score over the windows beats the best span's by more than a threshold."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from bertforge.train.metrics import softmax


@dataclasses.dataclass(frozen=True)
class Span:
    text: str  # '' for no answer
    start: int  # its first character in the context; -1 for no answer
    score: float  # start logit + end logit
    probability: float = 0.0  # softmax of the score over the question's n-best


def window_spans(start: np.ndarray, end: np.ndarray, offsets: np.ndarray, max_answer: int, k: int
                 ) -> list[tuple[float, int, int]]:  # fmt: skip
    """The `k` best (score, first token, last token) of one window's (T,) logits, among spans of context tokens
    (offsets (T, 2), -1 off the context) of at most `max_answer` tokens."""
    context = offsets[:, 0] >= 0
    t = len(start)
    first, last = np.arange(t)[:, None], np.arange(t)[None, :]
    allowed = context[:, None] & context[None, :] & (last >= first) & (last - first < max_answer)
    scores = np.where(allowed, start[:, None] + end[None, :], -np.inf)  # (T, T)
    flat = scores.ravel()
    k = min(k, int(allowed.sum()))
    if k == 0:
        return []
    top = np.argpartition(-flat, k - 1)[:k]
    top = top[np.argsort(-flat[top], kind="stable")]
    return [(float(flat[i]), int(i // t), int(i % t)) for i in top]


def question_spans(
    context: str,
    starts: np.ndarray,
    ends: np.ndarray,
    offsets: np.ndarray,
    max_answer: int = 30,
    n_best: int = 20,
    null_threshold: float | None = None,
) -> list[Span]:
    """One question's n-best answers, best first, from the (W, T) logits and (W, T, 2) offsets of its windows.
    `null_threshold` None: every question has an answer (v1.1); a number: the null answer goes first when its score
    beats the best span's by more than it."""
    found: list[tuple[float, int, int]] = []  # (score, first character, end character)
    for w in range(len(starts)):
        for score, s, e in window_spans(starts[w], ends[w], offsets[w], max_answer, n_best):
            found.append((score, int(offsets[w, s, 0]), int(offsets[w, e, 1])))
    found.sort(key=lambda x: -x[0])
    spans = [Span(context[a:b], a, score) for score, a, b in found[:n_best]]
    if null_threshold is not None:
        null = float(np.min(starts[:, 0] + ends[:, 0]))
        if not spans or null - spans[0].score > null_threshold:
            spans.insert(0, Span("", -1, null))
        else:
            spans.append(Span("", -1, null))
    if not spans:
        return [Span("", -1, 0.0, 1.0)]
    scores = np.array([s.score for s in spans])
    probs = softmax(scores)
    return [dataclasses.replace(s, probability=float(p)) for s, p in zip(spans, probs, strict=True)]


def answers_of(
    contexts: Sequence[str],
    question_of: np.ndarray,
    outputs: np.ndarray,
    offsets: np.ndarray,
    max_answer: int = 30,
    n_best: int = 20,
    null_threshold: float | None = None,
) -> list[list[Span]]:
    """Each question's n-best answers from its windows' (R, T, 2) start and end logits and (R, T, 2) offsets;
    `question_of` (R,) gives each window's question (its index in `contexts`)."""
    out = []
    for q, context in enumerate(contexts):
        rows = np.flatnonzero(question_of == q)
        out.append(question_spans(context, outputs[rows, :, 0], outputs[rows, :, 1], offsets[rows], max_answer,
                                  n_best, null_threshold))  # fmt: skip
    return out
