"""Entity-level scores of tag sequences: precision, recall and F1 over exact entities (conlleval's and seqeval's
default way of counting), per type and over all types, and token accuracy.

An entity is right only with the same type, first and last unit; sequences are documents, and no entity crosses
from one to the next. A ratio with nothing to count (no entity predicted, none true) is 0.0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from bertforge.data.tags import spans_of


def _ratio(numerator: int, denominator: int) -> float:
    return numerator / denominator if denominator else 0.0


def _f1(precision: float, recall: float) -> float:
    # From precision and recall, as seqeval computes it, so that the two agree to the last bit.
    return 2 * precision * recall / (precision + recall) if precision + recall else 0.0


def entity_scores(true: Sequence[Sequence[str]], pred: Sequence[Sequence[str]]) -> dict[str, float]:
    """{'precision', 'recall', 'f1', 'accuracy', and for each entity type seen (true or predicted) 'precision_TYPE',
    'recall_TYPE', 'f1_TYPE'}; precision, recall and F1 are micro-averaged over all entities of all documents."""
    if len(true) != len(pred):
        raise ValueError(f"{len(true)} true sequences but {len(pred)} predicted")
    true_n, pred_n, hits = Counter(), Counter(), Counter()  # per type: true entities, predicted, predicted and true
    units = right = 0
    for doc, (t, p) in enumerate(zip(true, pred, strict=True)):
        if len(t) != len(p):
            raise ValueError(f"sequence {doc}: {len(t)} true tags but {len(p)} predicted")
        units += len(t)
        right += sum(a == b for a, b in zip(t, p, strict=True))
        true_spans, pred_spans = set(spans_of(t)), set(spans_of(p))
        true_n.update(kind for kind, _, _ in true_spans)
        pred_n.update(kind for kind, _, _ in pred_spans)
        hits.update(kind for kind, _, _ in true_spans & pred_spans)
    precision = _ratio(sum(hits.values()), sum(pred_n.values()))
    recall = _ratio(sum(hits.values()), sum(true_n.values()))
    scores = {"precision": precision, "recall": recall, "f1": _f1(precision, recall), "accuracy": _ratio(right, units)}
    for kind in sorted(true_n.keys() | pred_n.keys()):
        p, r = _ratio(hits[kind], pred_n[kind]), _ratio(hits[kind], true_n[kind])
        scores.update({f"precision_{kind}": p, f"recall_{kind}": r, f"f1_{kind}": _f1(p, r)})
    return scores
