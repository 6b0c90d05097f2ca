"""Token classification's rows: each document's tokens aligned to its units (the words given, or the tokenizer's
own tokens for text with character spans), cut into windows of at most a model's length with an overlap, and each
token's window of most context, whose prediction it takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from bertforge.tokenizer.load import Encoded, Tokenizer

IGNORE = -100  # the label of a token the loss and the metrics skip, as transformers spells it


@dataclasses.dataclass(frozen=True)
class Units:
    """A document's units and its tokens (no special tokens)."""

    spans: tuple[tuple[int, int], ...]  # each unit's characters in the text, end exclusive
    ids: tuple[int, ...]  # the tokens
    unit_of: tuple[int, ...]  # each token's unit, -1 for a token that covers no character of one

    def first_tokens(self) -> np.ndarray:
        """(U,) the first token of each unit, -1 for a unit no token starts (a word the tokenizer drops)."""
        first = np.full(len(self.spans), -1, np.int64)
        for t in range(len(self.unit_of) - 1, -1, -1):
            if self.unit_of[t] >= 0:
                first[self.unit_of[t]] = t
        return first


def word_units(tok: Tokenizer, texts: Sequence[str], words: Sequence[Sequence[tuple[int, int]]]) -> list[Units]:
    """Units of texts whose words are given as character spans: each token belongs to the word holding its last
    character. The text is tokenized whole, so a byte-level BPE sees each word with its space as in running text."""
    out = []
    for enc, spans in zip(tok.tok.encode_batch(list(texts), add_special_tokens=False), words, strict=True):
        ends = np.array([end for _, end in spans], np.int64)
        unit_of = []
        for start, end in enc.offsets:
            w = int(np.searchsorted(ends, end - 1, side="right")) if end > start else -1
            inside = 0 <= w < len(spans) and spans[w][0] <= end - 1
            unit_of.append(w if inside else -1)
        out.append(Units(tuple(map(tuple, spans)), tuple(enc.ids), tuple(unit_of)))
    return out


def token_units(tok: Tokenizer, texts: Sequence[str]) -> list[Units]:
    """Units of raw texts: the tokenizer's tokens themselves, less their surrounding spaces; a token that covers
    only spaces or nothing (SentencePiece's lone word mark) belongs to no unit."""
    out = []
    for text, enc in zip(texts, tok.tok.encode_batch(list(texts), add_special_tokens=False), strict=True):
        spans: list[tuple[int, int]] = []
        unit_of = []
        for start, end in enc.offsets:
            piece = text[start:end]
            lead = len(piece) - len(piece.lstrip())
            trail = len(piece) - len(piece.rstrip())
            if end - trail <= start + lead:
                unit_of.append(-1)
                continue
            unit_of.append(len(spans))
            spans.append((start + lead, end - trail))
        out.append(Units(tuple(spans), tuple(enc.ids), tuple(unit_of)))
    return out


def window_ranges(n: int, capacity: int, stride: int) -> list[tuple[int, int]]:
    """(start, end) token ranges of a document of `n` tokens: windows of `capacity` tokens, each starting
    capacity - stride after the one before (an overlap of `stride`), the last ending at the document's end."""
    if capacity < 1 or not 0 <= stride < capacity:
        raise ValueError(f"a window of {capacity} tokens cannot overlap the next by {stride}")
    starts = [0]
    while starts[-1] + capacity < n:
        starts.append(min(starts[-1] + capacity - stride, n - capacity))
    return [(s, min(s + capacity, n)) for s in starts]


def overflow_ranges(n: int, capacity: int, stride: int) -> list[tuple[int, int]]:
    """(start, end) token ranges as `tokenizers` cuts overflowing tokens: windows of `capacity` tokens, each starting
    capacity - stride after the one before, the last holding what remains (extractive QA's windows, as run_qa
    makes them)."""
    if capacity < 1 or not 0 <= stride < capacity:
        raise ValueError(f"a window of {capacity} tokens cannot overlap the next by {stride}")
    ranges = [(0, min(capacity, n))]
    while ranges[-1][1] < n:
        start = ranges[-1][0] + capacity - stride
        ranges.append((start, min(start + capacity, n)))
    return ranges


def owners(ranges: Sequence[tuple[int, int]], n: int) -> np.ndarray:
    """(n,) for each token, the window where it has the most context on both sides (the larger of its distances
    to the window's two ends, the nearer one counted); the first such window on a tie."""
    best = np.full(n, -1, np.int64)
    margin = np.full(n, -1, np.int64)
    for w, (start, end) in enumerate(ranges):
        p = np.arange(start, end)
        m = np.minimum(p - start, end - 1 - p)
        better = m > margin[start:end]
        best[start:end][better] = w
        margin[start:end][better] = m[better]
    return best


@dataclasses.dataclass(frozen=True)
class Window:
    """One row: a window of a document, with its special tokens."""

    doc: int  # the document's index
    start: int  # its first token's index among the document's tokens
    length: int  # its tokens, less the special ones
    encoded: Encoded
    targets: np.ndarray  # (limit, 2) int32: [..., 0] each token's label for the loss (IGNORE: none), [..., 1] the
    # document's index where the token is the first of a unit and this window its owner, -1 elsewhere


def document_windows(
    tok: Tokenizer, units: Units, labels: np.ndarray | None, doc: int, limit: int, stride: int, all_tokens: bool
) -> list[Window]:
    """The rows of one document. `labels` (U,) are the units' label ids (None: no labels); the loss takes each
    unit's first token, or with `all_tokens` every token of it."""
    capacity = limit - tok.num_special()
    n = len(units.ids)
    ranges = window_ranges(n, capacity, min(stride, capacity - 1))
    owner = owners(ranges, n)
    unit_of = np.array(units.unit_of, np.int64).reshape(n)
    first = np.zeros(n, bool)
    starts = units.first_tokens()
    first[starts[starts >= 0]] = True
    token_label = np.full(n, IGNORE, np.int64)
    if labels is not None:
        token_label[first] = labels[unit_of[first]]
        if all_tokens:
            token_label[unit_of >= 0] = labels[unit_of[unit_of >= 0]]
    offset = len(tok.template.prefix)
    out = []
    for w, (start, end) in enumerate(ranges):
        encoded = tok.assemble(list(units.ids[start:end]))
        targets = np.full((limit, 2), (IGNORE, -1), np.int32)
        rows = np.arange(start, end) + offset - start
        targets[rows, 0] = token_label[start:end]
        targets[rows, 1] = np.where(first[start:end] & (owner[start:end] == w), doc, -1)
        out.append(Window(doc, start, end - start, encoded, targets))
    return out


def unit_outputs(windows: Sequence[Window], outputs: np.ndarray, units: Units, offset: int) -> np.ndarray:
    """(U, L) each unit's outputs, read at its first token in the window that owns that token (zeros for a unit
    no token starts). `windows` are one document's, in order, `outputs` (W, limit, L) theirs, and `offset` the
    special tokens before a window's first token."""
    owner = owners([(w.start, w.start + w.length) for w in windows], len(units.ids))
    out = np.zeros((len(units.spans), outputs.shape[-1]), np.float32)
    for u, t in enumerate(units.first_tokens()):
        if t >= 0:
            w = owner[t]
            out[u] = outputs[w, t - windows[w].start + offset]
    return out
