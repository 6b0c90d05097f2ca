"""Retrieval metrics against a direct implementation of trec_eval's measures (as pytrec_eval, which BEIR uses, computes
them) on rankings with many ties: documents of equal score ranked by id, the greater first; nDCG with graded gains
and the ideal ranking from the judgements; MRR@10 and Recall@k."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bertforge.train import retrieval


def exact_vectors(n: int, rng: np.random.Generator) -> np.ndarray:
    """Rows of four +-1 among eight zeros: every cosine is a multiple of 1/4, exactly, so scores tie often."""
    x = np.zeros((n, 8), np.float32)
    for row in x:
        row[rng.choice(8, 4, replace=False)] = rng.choice([-1.0, 1.0], 4)
    return x


def reference_run(q: np.ndarray, d: np.ndarray, ids: list[str]) -> list[list[str]]:
    """Every query's documents by score, ties by id with the greater first (trec_eval's order)."""
    runs = []
    for row in q:
        scores = {ids[j]: float(row @ d[j]) / 4 for j in range(len(d))}
        runs.append(sorted(ids, key=lambda i: (scores[i], i), reverse=True))
    return runs


def reference_measures(ranked: list[str], grades: dict[str, int]) -> dict[str, float]:
    dcg = sum(grades.get(doc, 0) / math.log2(r + 2) for r, doc in enumerate(ranked[:10]) if grades.get(doc, 0) > 0)
    ideal = sorted((g for g in grades.values() if g > 0), reverse=True)[:10]
    idcg = sum(g / math.log2(r + 2) for r, g in enumerate(ideal))
    first = next((r for r, doc in enumerate(ranked[:10]) if grades.get(doc, 0) > 0), None)
    relevant = {doc for doc, g in grades.items() if g > 0}
    return {
        "ndcg@10": dcg / idcg if idcg else 0.0,
        "mrr@10": 0.0 if first is None else 1 / (first + 1),
        "recall@10": len(relevant & set(ranked[:10])) / len(relevant),
        "recall@100": len(relevant & set(ranked[:100])) / len(relevant),
    }


@pytest.mark.parametrize("chunks", [(1000, 1000), (37, 7)])  # one chunk, and many of odd sizes
def test_metrics_equal_trec_eval_measures_on_a_ranking_with_ties(chunks, monkeypatch):
    monkeypatch.setattr(retrieval, "DOC_CHUNK", chunks[0])
    monkeypatch.setattr(retrieval, "QUERY_CHUNK", chunks[1])
    rng = np.random.default_rng(0)
    q, d = exact_vectors(40, rng), exact_vectors(300, rng)
    ids = [f"doc{rng.integers(10**6)}-{j}" for j in range(300)]  # text order is not index order
    judgements = [{int(j): int(rng.integers(1, 4)) for j in rng.choice(300, rng.integers(1, 6), replace=False)}
                  for _ in range(40)]  # fmt: skip
    judgements[3] = {}  # a query without judgements is left out
    got = retrieval.retrieval_scores(q, d, judgements, ids)
    runs = reference_run(q, d, ids)
    expected = [reference_measures(runs[i], {ids[j]: g for j, g in judgements[i].items()})
                for i in range(40) if judgements[i]]  # fmt: skip
    for name in ("ndcg@10", "mrr@10", "recall@10", "recall@100"):
        assert got[name] == pytest.approx(np.mean([e[name] for e in expected]), abs=1e-12), name
    ranked = retrieval.top_documents(q, d, 100, retrieval.id_tiebreak(ids))
    assert [[ids[j] for j in row] for row in ranked] == [r[:100] for r in runs]


def test_top_documents_of_fewer_documents_than_asked_and_zero_vectors():
    q = np.array([[1.0, 0.0], [0.0, 0.0]], np.float32)
    d = np.array([[0.0, 0.0], [1.0, 1.0], [2.0, 0.0]], np.float32)
    ranked = retrieval.top_documents(q, d, 10, retrieval.id_tiebreak(["a", "b", "c"]))
    assert ranked.tolist() == [[2, 1, 0], [2, 1, 0]]  # the zero query ties everywhere: ids decide
