"""Uniform-length batching: batches of texts of similar length, padded to one of a few bucket lengths.

XLA compiles one program per input shape. Padding every batch to a multiple of `bucket` (32 by default) keeps the
shapes few, so each is compiled once, while a batch of short texts is not padded to the longest text of the set.
Every batch has the same number of rows; a short final batch is filled with rows of weight 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bertforge.tokenizer import Encoded

BUCKET = 32
POOL = 16  # batches per pool of rows sorted by length


def bucket_length(n: int, limit: int, bucket: int = BUCKET) -> int:
    """The padded length of a batch whose longest text has n tokens; bucket 0 pads everything to `limit`."""
    if bucket <= 0:
        return limit
    return min(limit, -(-n // bucket) * bucket)


def pad_batch(encs: Sequence[Encoded], pad_id: int, length: int, rows: int | None = None) -> dict[str, np.ndarray]:
    """Right-pad encodings to `length`: input_ids, attention_mask, token_type_ids, each (B, T) int32.

    With `rows`, the batch has that many rows; the extra ones are all padding (attention_mask 0).
    """
    b = rows or len(encs)
    ids = np.full((b, length), pad_id, np.int32)
    mask = np.zeros((b, length), np.int32)
    types = np.zeros((b, length), np.int32)
    for i, e in enumerate(encs):
        n = len(e.ids)
        ids[i, :n], mask[i, :n], types[i, :n] = e.ids, 1, e.type_ids
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


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
