"""MLM masking: BERT's 15% with 80/10/10, never special tokens, dynamic per step, whole words."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertforge.data.masking import IGNORE, MaskingSpec, continuation_table, mask_for_step, mask_tokens

VOCAB = 1000
CLS, SEP, PAD, MASK, UNK = 2, 3, 0, 4, 1
SPECIALS = (PAD, UNK, CLS, SEP, MASK)


def corpus(rows=1000, cols=1000, seed=0):
    """10^6 token ids with [CLS] ... [SEP] and padding, as shards hold them."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, VOCAB, size=(rows, cols), dtype=np.int32)
    lengths = rng.integers(cols // 2, cols + 1, size=rows)
    for i, n in enumerate(lengths):
        ids[i, 0], ids[i, n - 1], ids[i, n:] = CLS, SEP, PAD
    return jnp.asarray(ids)


@pytest.mark.parametrize("rate", [0.15, 0.30])
def test_masking_statistics_on_a_million_tokens(rate):
    ids = corpus()
    assert ids.size == 10**6
    spec = MaskingSpec(mask_id=MASK, vocab_size=VOCAB, special_ids=SPECIALS, rate=rate)
    inputs, labels = jax.jit(mask_tokens, static_argnums=2)(jax.random.key(0), ids, spec)
    ids, inputs, labels = np.asarray(ids), np.asarray(inputs), np.asarray(labels)
    special = np.isin(ids, SPECIALS)
    selected = labels != IGNORE
    # Never a special token or padding: not selected, and left as it was.
    assert not np.any(selected & special)
    assert np.array_equal(inputs[special], ids[special])
    assert np.array_equal(labels[selected], ids[selected])
    assert abs(selected.sum() / (~special).sum() - rate) < 0.005
    n = selected.sum()
    masked = (inputs == MASK) & selected
    unchanged = (inputs == ids) & selected
    replaced = selected & ~masked & ~unchanged
    assert abs(masked.sum() / n - 0.8) < 0.005
    assert abs(replaced.sum() / n - 0.1) < 0.005
    assert abs(unchanged.sum() / n - 0.1) < 0.005
    assert not np.any(np.isin(inputs[replaced], SPECIALS))  # random tokens are never special ones
    assert np.array_equal(inputs[~selected], ids[~selected])


def test_masks_are_a_function_of_key_and_step():
    ids = corpus(rows=8, cols=64)
    spec = MaskingSpec(mask_id=MASK, vocab_size=VOCAB, special_ids=SPECIALS)
    key = jax.random.key(7)
    a = mask_for_step(key, 3, ids, spec)
    b = mask_for_step(key, 3, ids, spec)
    c = mask_for_step(key, 4, ids, spec)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(a[1], c[1])  # each step (and so each epoch) masks anew
    assert np.array_equal(a[1], mask_tokens(jax.random.fold_in(key, 3), ids, spec)[1])


def test_whole_word_masking_takes_all_pieces_of_a_word_or_none():
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}
    vocab.update({f"w{i}": 5 + i for i in range(50)})
    vocab.update({f"##p{i}": 55 + i for i in range(45)})
    table = continuation_table(vocab, 100)
    spec = MaskingSpec(mask_id=MASK, vocab_size=100, special_ids=SPECIALS, continues_word=table, rate=0.3)
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(64):
        row = [CLS]
        while len(row) < 127:
            row += [int(rng.integers(5, 55))] + [int(x) for x in rng.integers(55, 100, rng.integers(0, 4))]
        rows.append(row[:127] + [SEP])
    ids = np.array(rows, np.int32)
    _, labels = mask_tokens(jax.random.key(1), jnp.asarray(ids), spec)
    labels = np.asarray(labels)
    cont = np.asarray(table)[ids]
    words_seen = partial = 0
    for r in range(ids.shape[0]):
        start = None
        for t in range(ids.shape[1] + 1):
            if t == ids.shape[1] or not cont[r, t]:
                if start is not None and ids[r, start] not in SPECIALS:
                    flags = labels[r, start:t] != IGNORE
                    words_seen += 1
                    partial += flags.any() and not flags.all()
                start = t
    assert words_seen > 1000 and partial == 0
    selected_words = np.mean(labels[~cont & ~np.isin(ids, SPECIALS)] != IGNORE)
    assert abs(selected_words - 0.3) < 0.05
