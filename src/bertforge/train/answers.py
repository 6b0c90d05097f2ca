"""Extractive question answering's metrics: exact match and F1 as the official SQuAD evaluation computes them (v1.1,
and v2.0's split into questions with and without an answer), with F1 over characters for text written without
spaces (JSQuAD's evaluation), where SQuAD's counts words."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize(text: str) -> str:
    """SQuAD's normalisation: lower case, ASCII punctuation removed, English articles removed, spaces collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def answer_tokens(text: str, chars: bool) -> list[str]:
    """What F1 counts: the normalised words, or its characters other than spaces."""
    norm = normalize(text)
    return [c for c in norm if not c.isspace()] if chars else norm.split()


def exact_match(prediction: str, truth: str) -> float:
    return float(normalize(prediction) == normalize(truth))


def f1(prediction: str, truth: str, chars: bool = False) -> float:
    """Token F1 of two answers; an empty one (no answer) scores 1 against an empty one and 0 otherwise (v2.0)."""
    pred, gold = answer_tokens(prediction, chars), answer_tokens(truth, chars)
    if not pred or not gold:
        return float(pred == gold)
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def without_spaces(texts: Sequence[str]) -> bool:
    """Whether text is written without spaces between words (Japanese, Chinese, Thai): F1 then counts characters.
    Taken from the share of the texts' characters that are spaces (under 1 in 40; English has about 1 in 6)."""
    total = sum(len(t) for t in texts)
    return total > 0 and sum(t.count(" ") for t in texts) < total / 40


def best_scores(prediction: str, truths: Sequence[str], chars: bool) -> tuple[float, float]:
    """Exact match and F1 (0 to 1) of one question's answer against the best of its true answers (none: '')."""
    golds = list(truths) or [""]
    return max(exact_match(prediction, g) for g in golds), max(f1(prediction, g, chars) for g in golds)


def answer_scores(predictions: Sequence[str], truths: Sequence[Sequence[str]], chars: bool) -> dict[str, float]:
    """Exact match and F1 in percent, each question scored against its best true answer (an empty list: the
    question has no answer, scored against ''), with v2.0's split when some questions have no answer."""
    if len(predictions) != len(truths):
        raise ValueError(f"{len(predictions)} predictions for {len(truths)} questions")
    em, fs, has = [], [], []
    for pred, golds in zip(predictions, truths, strict=True):
        e, f = best_scores(pred, golds, chars)
        em.append(e)
        fs.append(f)
        has.append(any(golds))
    out = {"exact_match": _percent(em), "f1": _percent(fs)}
    if not all(has):
        for name, keep in (("has_answer", True), ("no_answer", False)):
            out[f"{name}_exact_match"] = _percent([e for e, h in zip(em, has, strict=True) if h == keep])
            out[f"{name}_f1"] = _percent([f for f, h in zip(fs, has, strict=True) if h == keep])
    return out


def _percent(values: Sequence[float]) -> float:
    return 100.0 * sum(values) / len(values) if values else 0.0
