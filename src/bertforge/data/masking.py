"""Masked-LM corruption as a pure function of (key, token ids), run on the device inside the train step.

BERT's recipe (Devlin et al. 2019): select `rate` of the maskable tokens (15%; MosaicBERT uses 30%); of those,
80% become [MASK], 10% a random token, 10% stay. Special tokens and padding are never selected. Labels are the
original ids at selected positions and -100 elsewhere. The key of step s is fold_in(key, s), so every epoch
masks anew and a resumed run draws exactly the masks the uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

IGNORE = -100


@dataclasses.dataclass(frozen=True)
class MaskingSpec:
    """What the masking function needs to know of the tokenizer; built once from a shard manifest."""

    mask_id: int
    vocab_size: int
    special_ids: tuple[int, ...]
    rate: float = 0.15
    mask_fraction: float = 0.8
    random_fraction: float = 0.1
    # For whole-word masking: True for ids that continue a word (WordPiece '##' pieces); empty disables it.
    continues_word: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 < self.rate < 1.0:
            raise ValueError(f"masking rate must be in (0, 1), got {self.rate}")
        if self.mask_fraction < 0 or self.random_fraction < 0 or self.mask_fraction + self.random_fraction > 1:
            raise ValueError("mask_fraction and random_fraction must be >= 0 and sum to at most 1")


def continuation_table(
    vocab: dict[str, int], vocab_size: int, prefix: str = "##", word_start: str = "", special: Sequence[int] = ()
) -> tuple[bool, ...]:
    """Per id: does this token continue the previous word? (for whole-word masking)

    WordPiece marks a piece that continues a word (`prefix` '##'); SentencePiece and byte-level BPE mark the piece
    that starts one (`word_start` '▁' or 'Ġ': every other piece continues); a word-level vocabulary marks neither
    (both empty: every token is a word)."""
    table = np.zeros(vocab_size, bool)
    skip = set(special)
    for token, i in vocab.items():
        if i >= vocab_size or i in skip:
            continue
        if word_start:
            table[i] = not token.startswith(word_start)
        elif prefix:
            table[i] = token.startswith(prefix)
    return tuple(bool(x) for x in table)


def _random_ids(key: jax.Array, shape: Sequence[int], vocab_size: int, special_ids: Sequence[int]) -> jax.Array:
    # Uniform over the non-special vocabulary: draw an index into the sorted list of allowed ids.
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(special_ids, np.int64)).astype(np.int32)
    return jnp.asarray(allowed)[jax.random.randint(key, shape, 0, len(allowed))]


def mask_tokens(key: jax.Array, ids: jax.Array, spec: MaskingSpec) -> tuple[jax.Array, jax.Array]:
    """ids (B, T) int -> (inputs (B, T) int32, labels (B, T) int32 with -100 where nothing is predicted)."""
    ids = ids.astype(jnp.int32)
    k_select, k_action, k_random = jax.random.split(key, 3)
    maskable = ~jnp.isin(ids, jnp.asarray(spec.special_ids, jnp.int32))  # (B, T)
    draw = jax.random.uniform(k_select, ids.shape)
    if spec.continues_word:
        # Whole words: every piece of a word takes the draw of the word's first piece.
        continues = jnp.asarray(spec.continues_word)[ids] & maskable
        positions = jnp.arange(ids.shape[1], dtype=jnp.int32)
        word_start = jax.lax.cummax(jnp.where(continues, 0, positions[None, :]), axis=1)  # (B, T)
        draw = jnp.take_along_axis(draw, word_start, axis=1)
    selected = maskable & (draw < spec.rate)
    action = jax.random.uniform(k_action, ids.shape)
    to_mask = selected & (action < spec.mask_fraction)
    to_random = selected & (action >= spec.mask_fraction) & (action < spec.mask_fraction + spec.random_fraction)
    random_ids = _random_ids(k_random, ids.shape, spec.vocab_size, spec.special_ids)
    inputs = jnp.where(to_mask, spec.mask_id, jnp.where(to_random, random_ids, ids))
    labels = jnp.where(selected, ids, IGNORE)
    return inputs, labels


def mask_for_step(key: jax.Array, step: int | jax.Array, ids: jax.Array, spec: MaskingSpec):
    """The masks of training step `step`: a function of the run's key and the step alone."""
    return mask_tokens(jax.random.fold_in(key, step), ids, spec)
