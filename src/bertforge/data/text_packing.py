"""Padding-free fine-tuning batches: a step's texts packed into a fixed number of rows of a fixed length.

Each row holds several whole texts one after another; the model attends within each text (segment ids) and counts
its positions from the text's start, and the head reads each text's own tokens, so every text's outputs are the
ones it would have alone. Every batch of a run has the same shape, so the run compiles one training program and
one evaluation program, whatever its texts' lengths.

A packed batch holds, besides the targets and weights of its N texts:
- input_ids, token_type_ids (R, L) int32: the texts' tokens, [PAD] after the last text of a row;
- segment_ids (R, L) int32: k on the k-th text of its row (from 1), 0 on padding;
- texts (R, L) int32: the index of each token's text in the batch (0..N-1), N on padding;
- starts (N,) int32: each text's first token, as an index into the R * L tokens (0 for a filler text).
A training step packs its texts into as many micro-batches of one shape as they need (micro_batches), each
indexing its own texts and rows; train/packed_step.py adds up their gradients.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from bertforge.tokenizer.load import Encoded

PACKED_INPUTS = ("input_ids", "token_type_ids", "segment_ids", "texts", "starts")  # what a packed forward takes


@dataclasses.dataclass(frozen=True)
class PackShape:
    """The one shape of a run's packed batches: micro-batches of `rows` rows of `length` tokens holding at most
    `texts` texts, as many a training step as its texts need (`mean_rows` rows a step on average over the run);
    for evaluation, `eval_rows` rows holding at most `eval_texts` texts."""

    length: int
    rows: int
    texts: int
    eval_rows: int
    eval_texts: int
    mean_rows: float = 0.0


def first_room(free: list[int], n: int) -> int:
    """The first of the rows with `free` tokens left that holds n more, or len(free) for a new row: where first fit
    puts a text, for first_fit and eval_batches alike."""
    return next((r for r, room in enumerate(free) if room >= n), len(free))


def first_fit(lengths: Sequence[int], length: int) -> list[list[int]]:
    """Texts of `lengths` tokens (each at most `length`) placed in rows of `length` tokens, longest first, each
    in the first row with room for it (first-fit decreasing); each row's texts as indices into `lengths`."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        n = lengths[i]
        if n > length:
            raise ValueError(f"a text of {n} tokens does not fit a row of {length}")
        row = first_room(free, n)
        if row == len(rows):
            rows.append([])
            free.append(length)
        rows[row].append(i)
        free[row] -= n
    return rows


def fill(encs: Sequence[Encoded], placed: list[list[int]], length: int, rows: int, texts: int,
         pad_id: int) -> dict[str, np.ndarray]:  # fmt: skip
    """The packed batch of `encs` placed in rows as `placed` says (each row's texts, indices into encs), with
    `rows` rows and room for `texts` texts (the ones past len(encs) are fillers: no token, start 0)."""
    if len(encs) > texts:
        raise ValueError(f"{len(encs)} texts for a batch of {texts}")
    if len(placed) > rows:
        raise ValueError(f"{len(encs)} texts need {len(placed)} rows of {length} tokens, the batch has {rows}")
    ids = np.full((rows, length), pad_id, np.int32)
    types = np.zeros((rows, length), np.int32)
    segments = np.zeros((rows, length), np.int32)
    owner = np.full((rows, length), texts, np.int32)
    starts = np.zeros(texts, np.int32)
    for r, members in enumerate(placed):
        at = 0
        for k, i in enumerate(members, start=1):
            n = len(encs[i].ids)
            ids[r, at : at + n], types[r, at : at + n] = encs[i].ids, encs[i].type_ids
            segments[r, at : at + n], owner[r, at : at + n] = k, i
            starts[i] = r * length + at
            at += n
    return {"input_ids": ids, "token_type_ids": types, "segment_ids": segments, "texts": owner, "starts": starts}


def pack(encs: Sequence[Encoded], length: int, rows: int, texts: int, pad_id: int) -> dict[str, np.ndarray]:
    """`encs` packed by first_fit into `rows` rows of `length` tokens, with room for `texts` texts."""
    return fill(encs, first_fit([len(e.ids) for e in encs], length), length, rows, texts, pad_id)


Micro = tuple[dict[str, np.ndarray], list[int]]  # a packed micro-batch, and which texts it holds


def micro_batches(encs: Sequence[Encoded], shape: PackShape, pad_id: int) -> list[Micro]:
    """A training step's texts packed by first_fit and cut into micro-batches of shape.rows rows, as few as they
    need: each micro-batch's packed batch, and which of `encs` it holds (in the order of its text slots)."""
    placed = first_fit([len(e.ids) for e in encs], shape.length)
    chunks = [placed[at : at + shape.rows] for at in range(0, len(placed), shape.rows)]
    return [fill_rows(encs, chunk, shape.length, shape.rows, shape.texts, pad_id) for chunk in chunks]


def fill_rows(encs: Sequence[Encoded], placed: list[list[int]], length: int, rows: int, texts: int,
              pad_id: int) -> Micro:  # fmt: skip
    """The packed batch of the texts that `placed` puts in its rows (indices into all of `encs`), and which texts
    it holds, in the order of its text slots."""
    held = [i for row in placed for i in row]
    slot = {i: k for k, i in enumerate(held)}
    local = [[slot[i] for i in row] for row in placed]
    return fill([encs[i] for i in held], local, length, rows, texts, pad_id), held


def eval_batches(lengths: np.ndarray, length: int, rows: int, texts: int) -> list[list[list[int]]]:
    """Evaluation batches of at most `rows` rows and `texts` texts, each as its rows' texts (indices into lengths):
    the longest texts left first, by first fit, then the gaps they leave filled with the shortest left. Longest
    first alone would give the first batches one long text a row and the last ones the short texts; filling the
    gaps from the short end takes fewer batches of the one compiled shape."""
    order = np.argsort(-np.asarray(lengths), kind="stable").tolist()
    head, tail, batches = 0, len(order), []
    while head < tail:
        free: list[int] = []
        placed: list[list[int]] = []
        for _ in range(min(texts, tail - head)):
            n = int(lengths[order[head]])
            row = first_room(free, n)
            if row == len(free):
                if len(free) == rows:
                    break
                free.append(length)
                placed.append([])
            free[row] -= n
            placed[row].append(order[head])
            head += 1
        room = texts - sum(map(len, placed))
        while head < tail and room > 0:
            n = int(lengths[order[tail - 1]])  # the shortest text left
            row = first_room(free, n)
            if row == len(free):
                break  # no gap holds it, nor any text left
            free[row] -= n
            placed[row].append(order[tail - 1])
            tail, room = tail - 1, room - 1
        batches.append(placed)
    return batches


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
