"""Uniform-length batching: batches of texts of similar length, padded to one of a few lengths.

XLA compiles one program per input shape. Padding every batch to one of a few lengths keeps the shapes few, so each
is compiled once, while a batch of short texts is not padded to the longest text of the set. The lengths are either
every multiple of `bucket`, or a ladder of at most `shapes` of those multiples chosen from the data (`ladder`): the
ones that leave the fewest padding tokens in an epoch's batches. Every batch has the same number of rows; a short
final batch is filled with rows of weight 0.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import numpy as np

from bertforge.tokenizer.load import Encoded

BUCKET = 32
POOL = 16  # batches per pool of rows sorted by length


def bucket_length(n: int, limit: int, bucket: int = BUCKET) -> int:
    """The padded length of a batch whose longest text has n tokens; bucket 0 pads everything to `limit`."""
    if bucket <= 0:
        return limit
    return min(limit, -(-n // bucket) * bucket)


def ladder(maxima: np.ndarray, limit: int, bucket: int, shapes: int) -> tuple[int, ...]:
    """At most `shapes` padded lengths, multiples of `bucket` (or `limit`), for batches whose longest texts have
    `maxima` tokens: those that minimise the batches' total padded length, the longest always among them.

    Each batch is padded to the shortest length of the ladder that holds it; an exact dynamic programme over the
    distinct rounded maxima (at most limit / bucket of them).
    """
    rounded = np.array([bucket_length(int(n), limit, bucket) for n in np.asarray(maxima)])
    values, counts = np.unique(rounded, return_counts=True)  # ascending
    n, k = len(values), min(shapes, len(values))
    if n == 0 or k <= 0:
        return ()
    below = np.concatenate([[0], np.cumsum(counts)])  # below[j]: batches with a value under values[j]
    inf = float("inf")
    # cost[r][j]: least total length of the batches up to values[j] with r + 1 rungs, the top one at values[j].
    cost = np.full((k, n), inf)
    back = np.zeros((k, n), int)
    cost[0] = values * below[1:]
    for r in range(1, k):
        for j in range(r, n):
            for i in range(r - 1, j):  # the rung below is at values[i]
                c = cost[r - 1][i] + values[j] * (below[j + 1] - below[i + 1])
                if c < cost[r][j]:
                    cost[r][j], back[r][j] = c, i
    r = int(np.argmin(cost[:, n - 1]))
    rungs, j = [], n - 1
    while True:
        rungs.append(int(values[j]))
        if r == 0:
            break
        j, r = back[r][j], r - 1
    return tuple(sorted(rungs))


def padded_length(n: int, limit: int, bucket: int = BUCKET, rungs: tuple[int, ...] = ()) -> int:
    """The length a batch whose longest text has n tokens is padded to: the shortest rung that holds it, else
    bucket_length (a text longer than every rung, or no ladder)."""
    for rung in rungs:
        if rung >= n:
            return rung
    return bucket_length(n, limit, bucket)


@dataclasses.dataclass(frozen=True)
class EncodedChoices:
    """A multiple-choice row: the encoding of each of its (question, choice) pairs, batched as (B, N, T)."""

    options: tuple[Encoded, ...]


Row = Encoded | EncodedChoices


def tokens_of(row: Row) -> int:
    """The tokens a row needs: its text's, or its longest choice's."""
    if isinstance(row, EncodedChoices):
        return max(len(e.ids) for e in row.options)
    return len(row.ids)


def packed_tokens(row: Row) -> int:
    """The tokens a row's texts take in packed rows: its text's, or all its choices' (or texts')."""
    if isinstance(row, EncodedChoices):
        return sum(len(e.ids) for e in row.options)
    return len(row.ids)


def choices_of(rows: Sequence[Row]) -> int:
    """The number of choices of multiple-choice rows (each has the same); 0 for texts."""
    return len(rows[0].options) if rows and isinstance(rows[0], EncodedChoices) else 0


def pad_batch(
    encs: Sequence[Row], pad_id: int, length: int, rows: int | None = None, choices: int = 0
) -> dict[str, np.ndarray]:
    """Right-pad encodings to `length`: input_ids, attention_mask, token_type_ids, each (B, T) int32, or
    (B, N, T) for multiple-choice rows (`choices` N, which `encs` give when there are any).

    With `rows`, the batch has that many rows; the extra ones are all padding (attention_mask 0).
    """
    b, n = rows or len(encs), choices_of(encs) or choices
    flat = [o for e in encs for o in e.options] if n else encs
    shape = (b * n, length) if n else (b, length)
    ids = np.full(shape, pad_id, np.int32)
    mask = np.zeros(shape, np.int32)
    types = np.zeros(shape, np.int32)
    for i, e in enumerate(flat):
        k = len(e.ids)
        ids[i, :k], mask[i, :k], types[i, :k] = e.ids, 1, e.type_ids
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    return {k: v.reshape(b, n, length) for k, v in batch.items()} if n else batch


def by_length(lengths: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Inference batches: indices sorted longest first (a memory error shows at once), cut into batches."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def epoch_batches(
    lengths: np.ndarray, batch_size: int, bucket: int, seed: int, epoch: int, pool: int = POOL
) -> list[np.ndarray]:
    """Training batches for one epoch, a pure function of (seed, epoch).

    With bucket > 0: the rows shuffled and cut into pools of `pool` batches, each pool sorted by length and cut
    into batches, the batches shuffled, the longest first. A batch holds rows of similar length that are otherwise
    drawn at random, different in every epoch; sorting the whole set instead pads about as little but puts the
    same neighbours together every epoch, and the noise that would vary them costs padding. With bucket 0: plain
    random batches.
    """
    lengths = np.asarray(lengths)
    n = len(lengths)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(n)
    if bucket <= 0:
        return [order[i : i + batch_size] for i in range(0, n, batch_size)]
    rows = batch_size * pool
    batches = []
    for i in range(0, n, rows):
        chunk = order[i : i + rows]
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]  # longest first
        batches += [chunk[j : j + batch_size] for j in range(0, len(chunk), batch_size)]
    longest = max(range(len(batches)), key=lambda b: (lengths[batches[b]].max(), -b))
    rest = [batches[b] for b in rng.permutation(len(batches)) if b != longest]
    return [batches[longest], *rest]


def balanced_batches(sizes: np.ndarray, batch_size: int, seed: int, epoch: int, pool: int = POOL) -> list[np.ndarray]:
    """Training batches for one epoch whose rows hold about the same tokens, a pure function of (seed, epoch), for
    packed steps (text_packing), whose one shape must hold the fullest step's texts.

    The rows are shuffled as for epoch_batches and cut into pools of `pool` batches; in each pool the rows, the
    most tokens first, each join the batch with the fewest tokens that has room (greedy balancing), and the pool's
    batches are shuffled. A batch is still a random draw of its pool's rows, the long and the short mixed, but no
    batch is much fuller than the pool's mean. Every batch has batch_size rows but the epoch's last, as in
    epoch_batches. `sizes`: each row's tokens (all its texts')."""
    sizes = np.asarray(sizes)
    n = len(sizes)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(n)
    batches: list[np.ndarray] = []
    for i in range(0, n, batch_size * pool):
        chunk = order[i : i + batch_size * pool]
        count = -(-len(chunk) // batch_size)
        room = [batch_size] * (count - 1) + [len(chunk) - batch_size * (count - 1)]
        members: list[list[int]] = [[] for _ in range(count)]
        open_ = [(0, b) for b in range(count)]  # (tokens so far, batch): a heap of the batches with room
        for row in chunk[np.argsort(-sizes[chunk], kind="stable")]:
            tokens, b = heapq.heappop(open_)
            members[b].append(int(row))
            if len(members[b]) < room[b]:
                heapq.heappush(open_, (tokens + int(sizes[row]), b))
        full = [np.array(members[b]) for b in rng.permutation(count - 1)]
        batches += [*full, np.array(members[-1])]  # the epoch's short batch, if any, stays last
    return batches
