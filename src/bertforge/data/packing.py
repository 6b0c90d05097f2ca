"""Token-id arrays -> fixed-length rows for the shards: one block [CLS] content [SEP] per row, padded, or with
`pack`, several blocks sharing a row (ModernBERT's unpadding, done once at preprocessing time).

A packed row is [CLS] a [SEP] [CLS] b [SEP] ... [PAD]...: every block starts with [CLS], which no masking ever
replaces, so a model recovers the blocks from the ids alone (segment_ids) and attends within each; the shards stay
plain token arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

OPEN_ROWS = 64  # rows a block may still be placed in; the fullest is written out when one more is needed


def segment_ids(ids: Any, cls_id: int, pad_id: int) -> Any:
    """(B, T) ids of packed rows, a NumPy or JAX array -> (B, T) int32: k for the tokens of a row's k-th block
    (from 1), 0 for padding. Array methods only, so that the preprocessing workers never import JAX."""
    return ((ids == cls_id).cumsum(axis=1) * (ids != pad_id)).astype("int32")


def padded(content: np.ndarray, seq_len: int, pad_id: int) -> np.ndarray:
    """content (n,) -> (seq_len,) int32 with [PAD] after it."""
    row = np.full(seq_len, pad_id, np.int32)
    row[: len(content)] = content
    return row


class BlockPacker:
    """Places blocks into rows of `seq_len` tokens, each into the open row it fills best (best fit), so that
    almost no padding is left; the output depends on the blocks' order only."""

    def __init__(self, seq_len: int, pad_id: int, open_rows: int = OPEN_ROWS):
        self.seq_len, self.pad_id, self.open_rows = seq_len, pad_id, open_rows
        self.rows: list[list[np.ndarray]] = []
        self.free: list[int] = []

    def _take(self, i: int) -> np.ndarray:
        self.free.pop(i)
        return padded(np.concatenate(self.rows.pop(i)), self.seq_len, self.pad_id)

    def add(self, block: np.ndarray) -> list[np.ndarray]:
        """Rows completed by this block: a row left with no room, or the fullest when too many are open."""
        n = len(block)
        fits = [i for i, free in enumerate(self.free) if free >= n]
        out: list[np.ndarray] = []
        if fits:
            i = min(fits, key=lambda j: self.free[j])  # the first of the tightest
        else:
            if len(self.rows) == self.open_rows:
                out.append(self._take(min(range(len(self.free)), key=lambda j: self.free[j])))
            self.rows.append([])
            self.free.append(self.seq_len)
            i = len(self.rows) - 1
        self.rows[i].append(block)
        self.free[i] -= n
        if self.free[i] == 0:
            out.append(self._take(i))
        return out

    def finish(self) -> list[np.ndarray]:
        return [self._take(0) for _ in range(len(self.rows))]


class Packer:
    """Turns token-id arrays into rows of exactly seq_len tokens: blocks [CLS] content [SEP], padded one per row,
    or several to a row with `pack`."""

    def __init__(self, seq_len: int, mode: str, cls_id: int, sep_id: int, pad_id: int, pack: bool = False):
        self.width = seq_len - 2  # content tokens per block
        self.seq_len, self.mode = seq_len, mode
        self.cls_id, self.sep_id, self.pad_id = cls_id, sep_id, pad_id
        self.packer = BlockPacker(seq_len, pad_id) if pack else None
        self.buffer: list[np.ndarray] = []
        self.buffered = 0
        self.split_sentences = 0  # sentences longer than a row, which had to be cut

    def _rows(self, content: np.ndarray) -> list[np.ndarray]:
        block = np.concatenate([[self.cls_id], content, [self.sep_id]]).astype(np.int32)
        if self.packer is not None:
            return self.packer.add(block)
        return [padded(block, self.seq_len, self.pad_id)]

    def _emit(self) -> list[np.ndarray]:
        if not self.buffered:
            return []
        content = np.concatenate(self.buffer)
        self.buffer, self.buffered = [], 0
        return self._rows(content)

    def add_document(self, pieces: list[np.ndarray]) -> list[np.ndarray]:
        """Rows completed by this document (a document's pieces are sentences, or the whole text)."""
        if not pieces:
            return []
        if self.mode == "concat":
            return self._add_concat(np.concatenate([*pieces, [self.sep_id]]).astype(np.int32))
        rows: list[np.ndarray] = []
        if self.mode == "doc":
            rows += self._emit()
        new_document = True  # complete: a document that continues a row starts after a [SEP]
        for sentence in pieces:
            if len(sentence) > self.width:
                self.split_sentences += 1
                rows += self._emit()
                for start in range(0, len(sentence), self.width):
                    part = sentence[start : start + self.width]
                    if len(part) == self.width:
                        rows += self._rows(part)
                    else:
                        self.buffer, self.buffered = [part], len(part)
                new_document = False
                continue
            sep = [np.array([self.sep_id], np.int32)] if new_document and self.buffered else []
            if self.buffered + len(sep) + len(sentence) > self.width:
                rows += self._emit()
                sep = []
            self.buffer.extend([*sep, sentence])
            self.buffered += len(sep) + len(sentence)
            new_document = False
        if self.mode == "doc":
            rows += self._emit()
        return rows

    def _add_concat(self, ids: np.ndarray) -> list[np.ndarray]:
        self.buffer.append(ids)
        self.buffered += len(ids)
        if self.buffered < self.width:
            return []
        stream = np.concatenate(self.buffer)
        n_full = len(stream) // self.width
        rows = [r for i in range(n_full) for r in self._rows(stream[i * self.width : (i + 1) * self.width])]
        rest = stream[n_full * self.width :]
        self.buffer, self.buffered = ([rest], len(rest)) if len(rest) else ([], 0)
        return rows

    def finish(self) -> list[np.ndarray]:
        return self._emit() + (self.packer.finish() if self.packer is not None else [])
