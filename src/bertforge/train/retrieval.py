"""Retrieval metrics of embeddings: every query's top documents by cosine similarity, found exactly in chunks (a
million passages fit in a few hundred MB), and nDCG@10, MRR@10 and Recall@k of those rankings as BEIR reports them
(pytrec_eval's trec_eval measures, and BEIR's MRR).

Documents with equal scores are ranked as trec_eval ranks them: by their id, the greater (as text) first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

QUERY_CHUNK = 256
DOC_CHUNK = 65536  # with QUERY_CHUNK, 128 MB of int64 keys per step
CUTOFFS = (10, 100)  # Recall@k's


def unit_rows(x: np.ndarray) -> np.ndarray:
    """float32 rows scaled to unit length (a zero row stays zero)."""
    x = np.asarray(x, np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def _keys(scores: np.ndarray, tiebreak: np.ndarray) -> np.ndarray:
    """int64 keys ordered as (score, tiebreak): the float32 score's bits in an order-keeping form, then the tiebreak."""
    bits = np.ascontiguousarray(scores, np.float32).view(np.int32)
    ordered = np.where(bits >= 0, bits, bits ^ np.int32(0x7FFFFFFF)).astype(np.int64)
    return (ordered << 32) + tiebreak[None, :]


def top_documents(queries: np.ndarray, docs: np.ndarray, k: int, tiebreak: np.ndarray) -> np.ndarray:
    """(Q, min(k, C)) indices of each query's best documents by cosine similarity, best first; `tiebreak` (C,)
    distinct ints: among equal scores the greater ranks first."""
    q, d = unit_rows(queries), unit_rows(docs)
    k = min(k, len(d))
    tiebreak = np.asarray(tiebreak, np.int64)
    return np.concatenate([_top(q[a : a + QUERY_CHUNK], d, k, tiebreak) for a in range(0, len(q), QUERY_CHUNK)])


def _top(q: np.ndarray, d: np.ndarray, k: int, tiebreak: np.ndarray) -> np.ndarray:
    """(q, k) best documents of a chunk of queries, merged over chunks of the documents."""
    best_keys = best = np.empty((len(q), 0), np.int64)
    for b in range(0, len(d), DOC_CHUNK):
        keys = _keys(q @ d[b : b + DOC_CHUNK].T, tiebreak[b : b + DOC_CHUNK])  # (q, c)
        index = np.broadcast_to(np.arange(b, b + keys.shape[1]), keys.shape)
        keys, index = np.concatenate([best_keys, keys], 1), np.concatenate([best, index], 1)
        if keys.shape[1] > k:
            keep = np.argpartition(keys, -k, axis=1)[:, -k:]  # keys are distinct: the k greatest, in any order
            keys, index = np.take_along_axis(keys, keep, 1), np.take_along_axis(index, keep, 1)
        best_keys, best = keys, index
    return np.take_along_axis(best, np.argsort(best_keys, axis=1)[:, ::-1], 1)


def id_tiebreak(ids: Sequence[str]) -> np.ndarray:
    """(C,) the rank of each id in text order: trec_eval ranks equal scores by id, the greater first."""
    ranks = np.empty(len(ids), np.int64)
    ranks[np.argsort(np.array(ids, dtype=object), kind="stable")] = np.arange(len(ids))
    return ranks


def ranking_scores(ranked: np.ndarray, relevant: Sequence[Mapping[int, float]]) -> dict[str, float]:
    """nDCG@10, MRR@10 and Recall@k (CUTOFFS) of rankings (Q, K) of document indices, best first, against each
    query's relevance judgements {document: grade}; grades above 0 are relevant. Queries with no judgement are
    left out, as pytrec_eval leaves them."""
    judged = [i for i, r in enumerate(relevant) if r]
    totals = {"ndcg@10": 0.0, "mrr@10": 0.0, **{f"recall@{k}": 0.0 for k in CUTOFFS}}
    discount = 1.0 / np.log2(np.arange(2, 12))
    for i in judged:
        grades = relevant[i]
        found = [float(grades.get(int(doc), 0.0)) for doc in ranked[i]]
        ideal = sorted((g for g in grades.values() if g > 0), reverse=True)[:10]
        gains = np.array([max(g, 0.0) for g in found[:10]])
        idcg = float(np.sum(np.array(ideal) * discount[: len(ideal)]))
        totals["ndcg@10"] += float(np.sum(gains * discount[: len(gains)])) / idcg if idcg > 0 else 0.0
        first = next((r for r, g in enumerate(found[:10]) if g > 0), None)
        totals["mrr@10"] += 0.0 if first is None else 1.0 / (first + 1)
        wanted = sum(1 for g in grades.values() if g > 0)
        for k in CUTOFFS:
            totals[f"recall@{k}"] += sum(1 for g in found[:k] if g > 0) / wanted if wanted else 0.0
    return {name: value / max(len(judged), 1) for name, value in totals.items()}


def retrieval_scores(
    queries: np.ndarray, docs: np.ndarray, relevant: Sequence[Mapping[int, float]], doc_ids: Sequence[str]
) -> dict[str, float]:
    """The ranking scores of retrieving from `docs` (C, D) for each of `queries` (Q, D) by cosine similarity."""
    ranked = top_documents(queries, docs, max(CUTOFFS), id_tiebreak(doc_ids))
    return ranking_scores(ranked, relevant)
