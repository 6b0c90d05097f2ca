"""Retrieval evaluation data: BEIR's layout (a folder with corpus.jsonl, queries.jsonl and qrels/SPLIT.tsv), or a
table of pairs where each query's relevant document is its own row's (the documents being the distinct texts of
that column). Anything malformed is one line naming the file and the line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from bertforge.data import tabular
from bertforge.errors import UserError


@dataclasses.dataclass(frozen=True)
class Judged:
    """Queries, documents and which documents are relevant to each query (with their grades)."""

    query_ids: list[str]
    queries: list[str]
    doc_ids: list[str]
    docs: list[str]
    relevant: list[dict[int, float]]  # per query: {document index: grade}


def read_judged(path: str, split: str = "test", query_column: str = "query", doc_column: str = "passage") -> Judged:
    """A BEIR folder (its qrels/`split`.tsv) or a pairs table (`query_column`, `doc_column`)."""
    folder = Path(path)
    if folder.is_dir():
        return _beir(folder, split)
    columns, rows = tabular.read_table(path)
    if not rows:
        raise UserError(f"{path}: no rows")
    queries = tabular.text_column(path, columns, rows, query_column)
    docs = tabular.text_column(path, columns, rows, doc_column)
    unique = list(dict.fromkeys(docs))
    index = {d: i for i, d in enumerate(unique)}
    ids = tabular.plain_column(path, columns, rows, "id") if "id" in columns else [str(i) for i in range(len(rows))]
    return Judged(ids, queries, [str(i) for i in range(len(unique))], unique, [{index[d]: 1.0} for d in docs])


def _records(path: Path) -> list[tuple[int, dict]]:
    if not path.is_file():
        raise UserError(f"{path}: missing (a BEIR folder holds corpus.jsonl, queries.jsonl and qrels/SPLIT.tsv)")
    out = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise UserError(f"{path}: line {n} is not JSON") from None
            if not isinstance(record, dict) or not isinstance(record.get("_id"), (str, int)):
                raise UserError(f"{path}: line {n} has no '_id'")
            if not isinstance(record.get("text"), str):
                raise UserError(f"{path}: line {n} has no 'text'")
            out.append((n, record))
    return out


def _beir(folder: Path, split: str) -> Judged:
    """BEIR's files: a document is its title and its text joined by a space, as BEIR's models encode it."""
    corpus = _records(folder / "corpus.jsonl")
    doc_ids = [str(r["_id"]) for _, r in corpus]
    docs = [f"{r.get('title') or ''} {r['text']}".strip() for _, r in corpus]
    queries = {str(r["_id"]): r["text"] for _, r in _records(folder / "queries.jsonl")}
    where = {d: i for i, d in enumerate(doc_ids)}
    judged: dict[str, dict[int, float]] = {}
    qrels = folder / "qrels" / f"{split}.tsv"
    if not qrels.is_file():
        raise UserError(f"{qrels}: missing (--split names the qrels file)")
    for n, line in enumerate(qrels.read_text(encoding="utf-8").splitlines(), start=1):
        parts = line.split("\t")
        if n == 1 and parts[0] == "query-id" or not line.strip():
            continue
        try:
            query, doc, grade = parts[0], parts[1], float(parts[2])
        except (IndexError, ValueError):
            raise UserError(f"{qrels}: line {n}: expected query-id, corpus-id and a score, tab-separated") from None
        if query not in queries:
            raise UserError(f"{qrels}: line {n}: query {query!r} is not in queries.jsonl")
        if doc not in where:
            raise UserError(f"{qrels}: line {n}: document {doc!r} is not in corpus.jsonl")
        judged.setdefault(query, {})[where[doc]] = grade
    ids = [q for q in queries if q in judged]  # queries without judgements are left out, as BEIR leaves them
    return Judged(ids, [queries[q] for q in ids], doc_ids, docs, [judged[q] for q in ids])
