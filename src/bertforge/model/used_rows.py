"""Fine-tuning over the word-embedding rows that a run's data uses.

No fine-tuning head reads the word-embedding table as an output layer, so the row of a token that none of the
run's texts hold gets a zero gradient at every step. AdamW, whose moments for that row then stay zero, only
decays it: each step multiplies it by 1 - lr * weight_decay. Every such row is its starting value times one
factor that all of them share. `shrink` gives the model a table of the rows the data uses (`UsedRows`) and that
factor as a scalar parameter beside it, which the same AdamW decays as it would decay the rows (a zero gradient,
a decayed name); `expand` puts the whole table back, the unused rows scaled by the factor, for the model folder.
AdamW's pass over the table and the table's gradient then cover the rows in use: a few thousand of
all-MiniLM-L6-v2's 30,522 on a small task, where the table is half the model's parameters (DeBERTa-v3's 128,100
rows are 53% of its base model's; XLM-R's 250,002 are 69%). The numbers are the whole table's, to float32's
rounding of the factor (docs/benchmarks.md#the-rows-a-run-uses).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bertforge.model.layers import axes

# Row counts are rounded up to this, so that data of a similar vocabulary compiles the same programs and the
# table divides over the devices it is split across.
ROWS = 512


def rows_for(used: int, vocab: int) -> int:
    """The rows of the table of `used` of a vocabulary of `vocab` tokens: rounded up to ROWS, at most the whole."""
    return min(-(-used // ROWS) * ROWS, max(vocab, used))


class UsedRows(nnx.Module):
    """A word-embedding table of the rows of `ids` (ascending), looked up by token id as nnx.Embed's is.

    `untouched` is the factor by which AdamW's weight decay has scaled every other row (1 at the start). The ids
    are a static attribute, so that the lookup from token id to row is a constant of the compiled programs and not
    a leaf of the model's state, whose leaves' order keys the dropout streams (train/step.py's stream_keys)."""

    def __init__(self, table: np.ndarray, ids: np.ndarray) -> None:
        vocab, width = table.shape
        size = rows_for(len(ids), vocab)
        rows = np.zeros((size, width), table.dtype)  # rows past the ids stay zero: no token reads them
        rows[: len(ids)] = table[ids]
        self.embedding = nnx.Param(jnp.asarray(rows), **axes("vocab", "embed"))
        self.untouched = nnx.Param(jnp.ones((), jnp.float32), **axes())
        self.vocab = vocab
        self.ids = np.asarray(ids, np.int32).tobytes()  # bytes: hashable, as the graph's static attributes are

    def row_of(self) -> np.ndarray:
        """(V,) int32: each token id's row; the table's length (past it) for the ids the data does not hold, which
        jnp.take reads as NaN, so that a stray id is loud."""
        ids = np.frombuffer(self.ids, np.int32)
        rows = np.full(self.vocab, self.embedding[...].shape[0], np.int32)
        rows[ids] = np.arange(len(ids), dtype=np.int32)
        return rows

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], jnp.asarray(self.row_of())[input_ids], axis=0)  # (..., E)


@dataclasses.dataclass(frozen=True)
class Trimmed:
    """What `expand` needs: the used token ids (ascending) and the whole starting table, on the host."""

    ids: np.ndarray  # (N,) int
    table: np.ndarray  # (V, E) float32

    def fingerprint(self) -> str:
        """A short digest of the ids, which a checkpoint's rows are in the order of."""
        return hashlib.sha256(self.ids.astype(np.int64).tobytes()).hexdigest()[:16]


def describe(trimmed: Trimmed) -> str:
    """What the run's log says of the table it trains."""
    return (
        f"training the word-embedding rows of the {len(trimmed.ids):,} tokens its texts use, of {len(trimmed.table):,}"
    )


def used_ids(tokenizer: Any, *tables: Iterable[Any] | None) -> np.ndarray:
    """(N,) int64: the distinct ids of the tokens of every row's text in `tables` (lists of rows, or None: an
    Encoded's `ids`, or those of each of its `options`) and of the tokenizer's special tokens (batching adds
    padding), ascending."""
    specials = (tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id, tokenizer.mask_id, tokenizer.unk_id)
    seen = np.zeros(0, np.int64)
    chunk: list[np.ndarray] = [np.array([i for i in specials if i is not None], np.int64)]
    for row in (row for rows in tables if rows is not None for row in rows):
        chunk += [np.asarray(e.ids, np.int64) for e in getattr(row, "options", (row,))]
        if len(chunk) >= 4096:
            seen, chunk = np.union1d(seen, np.concatenate(chunk)), []
    return np.union1d(seen, np.concatenate(chunk)) if chunk else seen


def shrink(model: nnx.Module, ids: np.ndarray) -> Trimmed | None:
    """Give `model`'s encoder the table of `ids`' rows, in place; None (and nothing changed) when that would not
    make the table at least a tenth smaller."""
    embeddings = model.encoder.embeddings
    vocab = embeddings.word.embedding[...].shape[0]
    if rows_for(len(ids), vocab) > 0.9 * vocab:
        return None
    table = np.asarray(jax.device_get(embeddings.word.embedding[...]))
    embeddings.word = UsedRows(table, ids)
    return Trimmed(np.asarray(ids, np.int64), table)


def expand(model: nnx.Module, trimmed: Trimmed) -> None:
    """Put `model`'s whole word-embedding table back, in place: the starting table times the factor, with the used
    rows as trained."""
    embeddings = model.encoder.embeddings
    used = embeddings.word
    rows = np.asarray(jax.device_get(used.embedding[...]))
    table = trimmed.table * np.float32(jax.device_get(used.untouched[...]))
    table[trimmed.ids] = rows[: len(trimmed.ids)]
    vocab, width = table.shape
    embeddings.word = nnx.Embed(
        vocab,
        width,
        param_dtype=jnp.float32,
        embedding_init=lambda *_: jnp.asarray(table),
        embedding_metadata=axes("vocab", "embed"),
        rngs=_NoDraws(),  # type: ignore[arg-type]
    )


class _NoDraws:
    """In place of nnx.Rngs for a module whose initializer ignores its key: nnx.Rngs(0) would draw one, a program
    of its own to compile at the end of a first run."""

    def params(self) -> None:
        return None
