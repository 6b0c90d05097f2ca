"""Token classification (named entities): a label per word, or per token for text with character spans, trained
with cross-entropy over each word's first sub-token and chosen by entity-level F1 (exact span and type, as seqeval
and conlleval count). A text longer than the model's length is cut into overlapping windows, each a row; each word
takes its prediction from the window where it has the most context."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from bertforge.data import windows
from bertforge.data.labelled import Table, TableConfig
from bertforge.data.tagged import Document, read_documents
from bertforge.data.tags import convert, labels_of, scheme_of, spans_of, tags_of
from bertforge.errors import UserError
from bertforge.tokenizer.load import Tokenizer
from bertforge.train.entities import entity_scores
from bertforge.train.metrics import softmax

NAME = "token-classification"
HEAD = "token"
PIPELINE_TAG = "token-classification"
AUTO_CLASS = "AutoModelForTokenClassification"
DESCRIPTION = "token-classification model"
DEFAULT_LOSS = "token_cross_entropy"
LOSSES = ("token_cross_entropy",)
DEFAULT_METRIC = "f1"
SHOWN = 3  # entities named in the line about those no token boundary matches


@dataclasses.dataclass(frozen=True)
class Tagged:
    """A token-classification file as read: its documents, the tag scheme trained and the labels."""

    path: str
    documents: list[Document]
    scheme: str
    names: list[str]  # the head's labels, "O" first


def _types(docs: Sequence[Document]) -> set[str]:
    if docs[0].words is None:
        return {e.type for d in docs for e in d.entities or ()}
    return {t for d in docs for t, _, _ in spans_of(d.tags or ())}


def read(path: str, cfg: TableConfig, known: Sequence[str] | None) -> Tagged:
    """The documents of a CoNLL, JSONL or JSON file; a validation file (`known`: the training labels) may hold no
    entity type the training file lacks."""
    docs = read_documents(path, cfg.format, labelled=True)
    if known is not None:
        names = list(known)
        allowed = {n.split("-", 1)[1] for n in names if "-" in n}
        for i, d in enumerate(docs):
            extra = sorted(_types([d]) - allowed)
            if extra:
                raise UserError(f"{path}: record {i + 1} (id {d.id}): entity type '{extra[0]}' never occurs in the "
                                f"training data ({', '.join(sorted(allowed))})")  # fmt: skip
        return Tagged(path, docs, scheme_of(names), names)
    spans = docs[0].words is None
    scheme = cfg.tag_scheme or ("bio" if spans else scheme_of(t for d in docs for t in d.tags or ()))
    return Tagged(path, docs, scheme, labels_of(_types(docs), scheme))


def output_names(data: Tagged, cfg: TableConfig) -> list[str]:
    return data.names


def units_of(docs: Sequence[Document], tokenizer: Tokenizer) -> list[windows.Units]:
    """Each document's units: its words, or the tokenizer's tokens where the text came with character spans."""
    if docs and docs[0].words is not None:
        return windows.word_units(tokenizer, [d.text for d in docs], [d.words or () for d in docs])
    return windows.token_units(tokenizer, [d.text for d in docs])


def unit_spans(doc: Document, units: windows.Units) -> tuple[list[tuple[str, int, int]], list[str]]:
    """A span-format document's entities as (type, first unit, last unit), and the text of each entity whose ends
    fall inside a unit (no token boundary matches it), which is left out."""
    starts = {s: u for u, (s, _) in enumerate(units.spans)}
    ends = {e: u for u, (_, e) in enumerate(units.spans)}
    found, missed = [], []
    for e in doc.entities or ():
        piece = doc.text[e.start : e.end]
        start = e.start + len(piece) - len(piece.lstrip())
        end = e.end - len(piece) + len(piece.rstrip())
        first, last = starts.get(start), ends.get(end)
        if first is None or last is None or last < first:
            missed.append(f"{doc.text[e.start : e.end]!r} ({e.type})")
        else:
            found.append((e.type, first, last))
    return found, missed


def unit_tags(data: Tagged, units: Sequence[windows.Units]) -> list[list[str]]:
    """Each document's unit tags in the data's scheme; a line on stderr counts the entities no token boundary
    matches and names the first few."""
    if data.documents[0].words is not None:
        return [convert(d.tags or (), data.scheme) for d in data.documents]
    tags, missed, total = [], [], 0
    for i, (doc, u) in enumerate(zip(data.documents, units, strict=True)):
        found, lost = unit_spans(doc, u)
        tags.append(tags_of(found, len(u.spans), data.scheme))
        missed += [f"record {i + 1} {m}" for m in lost]
        total += len(doc.entities or ())
    if missed:
        print(f"warning: {data.path}: {len(missed)} of {total} entities match no token boundary and are left out: "
              + "; ".join(missed[:SHOWN]) + ("; ..." if len(missed) > SHOWN else ""), file=sys.stderr)  # fmt: skip
    return tags


@dataclasses.dataclass(frozen=True)
class Rows:
    """What a token task's Table rows (windows) came from: Table.source."""

    data: Tagged
    units: list[windows.Units]
    tags: list[list[str]]  # each document's unit tags
    windows: list[windows.Window]
    offset: int  # special tokens before a window's first token


def rows(data: Tagged, tokenizer: Tokenizer, cfg: TableConfig, limit: int) -> Table:
    """One row per window of each document, targets (R, limit, 2) as data.windows.Window's."""
    units = units_of(data.documents, tokenizer)
    tags = unit_tags(data, units)
    index = {n: i for i, n in enumerate(data.names)}
    made: list[windows.Window] = []
    for d, (u, t) in enumerate(zip(units, tags, strict=True)):
        labels = np.array([index[x] for x in t], np.int64)
        made += windows.document_windows(tokenizer, u, labels, d, limit, cfg.stride, cfg.label_all_tokens)
    docs = data.documents
    return Table(
        path=data.path,
        texts=[docs[w.doc].text for w in made],
        pairs=None,
        targets=np.stack([w.targets for w in made]),
        labels=None,
        weights=np.ones(len(made), np.float32),
        ids=[docs[w.doc].id for w in made],
        groups=[docs[w.doc].group or f"#{w.doc}" for w in made],  # a document's (a group's) windows: one fold
        encs=[w.encoded for w in made],
        source=Rows(data, units, tags, made, len(tokenizer.template.prefix)),
    )


def run_info(table: Table, cfg: TableConfig) -> dict[str, Any]:
    return {}


def strata(table: Table, bins: int) -> np.ndarray | None:
    return None


def _sequences(outputs: np.ndarray, targets: np.ndarray, names: Sequence[str]) -> tuple[list, list]:
    """The true and predicted tags of each document's units, read where a window owns a unit's first token."""
    owned = targets[..., 1] >= 0  # (R, T)
    docs = targets[..., 1][owned]
    true = np.asarray(names)[targets[..., 0][owned]]
    pred = np.asarray(names)[np.argmax(outputs[owned], axis=-1)]
    cuts = np.flatnonzero(np.diff(docs)) + 1
    return [list(x) for x in np.split(true, cuts)], [list(x) for x in np.split(pred, cuts)]


def scores(outputs: np.ndarray, targets: np.ndarray, names: Sequence[str], source: Any = None) -> dict[str, float]:
    """Entity-level precision, recall and F1 (micro and per type) and token accuracy, over the documents' units."""
    if not np.any(targets[..., 1] >= 0):  # no word to score (texts the tokenizer makes no tokens of)
        return {"f1": 0.0, "precision": 0.0, "recall": 0.0, "accuracy": 0.0}
    return entity_scores(*_sequences(outputs, targets, names))


def column_names(labels: list[str], run: dict[str, Any]) -> list[str]:
    return labels


def prediction_columns(
    names: Sequence[str], outputs: np.ndarray, beside_truth: bool
) -> tuple[list[str], list[list[Any]]]:
    """Each unit's tag and its probability."""
    probs = softmax(outputs, axis=-1)
    best = np.argmax(outputs, axis=-1)
    return ["tag", "score"], [[names[b], f"{p[b]:.7g}"] for b, p in zip(best, probs, strict=True)]


def entities(text: str, units: windows.Units, outputs: np.ndarray, names: Sequence[str]) -> list[dict[str, Any]]:
    """The entities a document's (U, L) unit outputs predict: character start and end, type, text, and score (the
    mean probability of its units' tags). A unit no token starts is predicted 'O'."""
    probs = softmax(outputs, axis=-1)
    best = np.argmax(outputs, axis=-1)
    covered = units.first_tokens() >= 0
    tags = [names[b] if c else "O" for b, c in zip(best, covered, strict=True)]
    return [_entity(text, units, kind, first, last, probs[np.arange(first, last + 1), best[first : last + 1]])
            for kind, first, last in spans_of(tags)]  # fmt: skip


def _entity(text: str, units: windows.Units, kind: str, first: int, last: int, probs: np.ndarray) -> dict[str, Any]:
    return {**_span(text, units, kind, first, last), "score": round(float(probs.mean()), 6)}


def _span(text: str, units: windows.Units, kind: str, first: int, last: int) -> dict[str, Any]:
    """An entity over units first..last: its characters, type and text."""
    start, end = units.spans[first][0], units.spans[last][1]
    return {"start": start, "end": end, "type": kind, "text": text[start:end]}


def true_entities(text: str, units: windows.Units, tags: Sequence[str]) -> list[dict[str, Any]]:
    """The entities of a document's unit tags, as `entities` writes them (without a score)."""
    return [_span(text, units, kind, first, last) for kind, first, last in spans_of(tags)]


def document_outputs(
    wins: Sequence[windows.Window], units: Sequence[windows.Units], offset: int, outputs: np.ndarray
) -> dict[int, np.ndarray]:
    """Each document's (U, L) unit outputs from the (W, limit, L) `outputs` of windows `wins` (in document order;
    all of a document's), `offset` special tokens before each window's first token."""
    by_doc: dict[int, list[int]] = {}
    for i, w in enumerate(wins):
        by_doc.setdefault(w.doc, []).append(i)
    return {
        d: windows.unit_outputs([wins[i] for i in idx], outputs[idx], units[d], offset) for d, idx in by_doc.items()
    }


def out_of_fold(table: Table, cfg: TableConfig, names: Sequence[str], rows: np.ndarray, outputs: np.ndarray,
                keys: Sequence[tuple[str, Sequence[Any]]]) -> tuple[list[str], list[list[Any]]]:  # fmt: skip
    """A row per document: its keys (of its first window), its true entities and the predicted ones, as JSON."""
    source: Rows = table.source
    first = {}
    for i, r in enumerate(rows):
        first.setdefault(source.windows[int(r)].doc, i)
    by_doc = document_outputs([source.windows[int(r)] for r in rows], source.units, source.offset, outputs)
    header = [name for name, _ in keys] + ["entities", "predicted"]
    body = []
    for d, i in first.items():
        text, u = source.data.documents[d].text, source.units[d]
        truth = true_entities(text, u, source.tags[d])
        found = entities(text, u, by_doc[d], names)
        body.append([*(column[i] for _, column in keys), _json(truth), _json(found)])
    return header, body


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
