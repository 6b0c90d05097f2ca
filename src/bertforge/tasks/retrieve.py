"""`bertforge evaluate-retrieval`: how well an embedding model finds each query's relevant documents, on a BEIR
folder or a table of pairs: nDCG@10, MRR@10, Recall@10 and Recall@100, exactly (train/retrieval.py)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from bertforge.data.beir import read_judged
from bertforge.errors import UserError
from bertforge.fileio import write_atomic
from bertforge.tasks.embed import embed, load_embedder
from bertforge.train.retrieval import retrieval_scores


@dataclasses.dataclass(frozen=True)
class RetrievalConfig:
    model: str  # a sentence-transformers or Hugging Face folder, hub id, embedding fine-tuning run or pretraining run
    data: str  # a BEIR folder (corpus.jsonl, queries.jsonl, qrels/SPLIT.tsv) or a table of (query, document) pairs
    split: str = "test"  # a BEIR folder's qrels file
    query_column: str = "query"  # a table's columns
    document_column: str = "passage"  # a table's column of documents
    batch_size: int = 64  # texts per batch
    max_length: int | None = None  # tokens per text (default: the fine-tuning run's, else the model's)
    dtype: str = "float32"  # bfloat16 computes in bfloat16
    out: str | None = None  # a JSON file for the scores

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")


def main(cfg: RetrievalConfig) -> dict[str, Any]:
    """The scores, also written to cfg.out when given."""
    judged = read_judged(cfg.data, cfg.split, cfg.query_column, cfg.document_column)
    if not judged.queries:
        raise UserError(f"{cfg.data}: no query has a judged document")
    pre, settings = load_embedder(cfg.model, None if cfg.dtype == "float32" else cfg.dtype)
    length = cfg.max_length or settings.get("max_length")
    queries = embed(pre, judged.queries, cfg.batch_size, length, progress=True)
    docs = embed(pre, judged.docs, cfg.batch_size, length, progress=True)
    found = {**retrieval_scores(queries, docs, judged.relevant, judged.doc_ids),
             "queries": len(judged.queries), "documents": len(judged.docs)}  # fmt: skip
    if cfg.out:
        write_atomic(cfg.out, json.dumps(found, indent=2) + "\n")
    return found
