"""Packed rows (preprocess --pack): several sequences share a row and attend within themselves. Each sequence's
loss equals its loss in a row of its own; packing keeps every block and leaves less padding; pretraining runs on
packed shards, and architectures that cannot attend within segments refuse them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_preprocess import make_documents, rows_of, run
from test_pretrain import MODERNBERT, config, losses

from bertforge.data.masking import IGNORE, MaskingSpec
from bertforge.data.packing import BlockPacker, segment_ids
from bertforge.errors import UserError
from bertforge.model.architectures import build
from bertforge.model.config import preset
from bertforge.tasks import pretrain
from bertforge.tasks.preprocess import PreprocessConfig
from bertforge.train.step import StepConfig, mlm_sums

PAD, CLS, SEP, MASK = 0, 2, 3, 4
T = 40  # packed row length; every sequence's own row is padded to it too
FAMILIES = {
    "bert": {},
    "roberta": {"family": "roberta", "pad_token_id": 1},
    "electra": {"family": "electra", "embedding_size": 16},
    "distilbert": {"family": "distilbert", "type_vocab_size": 0, "layer_norm_eps": 1e-12, "hidden_act": "gelu"},
    "modernbert": {k: v for k, v in MODERNBERT.items() if k != "preset"},
}


def sequences(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """[CLS] ... [SEP] sequences of 4 to 24 tokens; a local window of 8 sees only part of the longer ones."""
    return [
        np.concatenate([[CLS], rng.integers(5, 100, rng.integers(2, 23)), [SEP]]).astype(np.int32) for _ in range(n)
    ]


def own_rows(seqs: list[np.ndarray], pad: int) -> np.ndarray:
    rows = np.full((len(seqs), T), pad, np.int32)
    for i, s in enumerate(seqs):
        rows[i, : len(s)] = s
    return rows


def packed_rows(seqs: list[np.ndarray], pad: int) -> np.ndarray:
    packer = BlockPacker(T, pad)
    return np.stack([row for s in seqs for row in packer.add(s)] + packer.finish())


def where_each(rows: np.ndarray, pad: int) -> list[tuple[int, np.ndarray]]:
    """(row, token mask) of each sequence the rows hold."""
    segs = np.asarray(segment_ids(rows, CLS, pad))
    return [(r, segs[r] == k) for r in range(len(rows)) for k in range(1, segs[r].max() + 1)]


def labels_for(rows: np.ndarray, pad: int, labels_of: dict[bytes, np.ndarray]) -> np.ndarray:
    """Each sequence's own labels placed where the rows hold it (IGNORE elsewhere)."""
    out = np.full(rows.shape, IGNORE, np.int32)
    for r, at in where_each(rows, pad):
        out[r, at] = labels_of[rows[r][at].tobytes()]
    return out


def loss_by_sequence(logits: jax.Array, rows: np.ndarray, pad: int, labels: np.ndarray) -> dict[bytes, float]:
    """Mean cross-entropy over each sequence's labelled tokens, by the sequence's ids."""
    ce = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(np.maximum(labels, 0))))
    return {rows[r][at].tobytes(): float(ce[r][at & (labels[r] != IGNORE)].mean()) for r, at in where_each(rows, pad)}


def model_and_data(family: str) -> tuple:
    extra = {"initializer_range": 0.2, "hidden_dropout": 0.0, "attention_dropout": 0.0, **FAMILIES[family]}
    cfg = preset("test", vocab_size=100, **extra)
    model = build(cfg, "mlm", seed=1)
    model.eval()
    rng = np.random.default_rng(0)
    seqs = sequences(rng, 12)
    # Labels on a third of each sequence's tokens (never its [CLS]), as masking would leave them.
    labels_of = {}
    for s in seqs:
        chosen = (rng.random(len(s)) < 0.35) & (np.arange(len(s)) > 0)
        labels_of[s.tobytes()] = np.where(chosen, rng.integers(5, 100, len(s)), IGNORE)
    return model, cfg.pad_token_id, seqs, labels_of


@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_sequence_has_the_loss_it_has_in_a_row_of_its_own(family):
    model, pad, seqs, labels_of = model_and_data(family)
    alone, packed = own_rows(seqs, pad), packed_rows(seqs, pad)
    assert len(packed) < len(seqs) and (np.asarray(segment_ids(packed, CLS, pad)).max(axis=1) > 1).all()
    want = loss_by_sequence(
        model(jnp.asarray(alone), jnp.asarray(alone != pad)), alone, pad, labels_for(alone, pad, labels_of)
    )
    hidden = model.encoder(jnp.asarray(packed), segment_ids=segment_ids(jnp.asarray(packed), CLS, pad))
    got = loss_by_sequence(model.logits_at(hidden), packed, pad, labels_for(packed, pad, labels_of))
    assert got.keys() == want.keys()
    np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-5, atol=1e-5)
    # The same rows with a padding mask only let sequences see each other: the check above can tell.
    leaky = model(jnp.asarray(packed), jnp.asarray(packed != pad))
    leaked = loss_by_sequence(leaky, packed, pad, labels_for(packed, pad, labels_of))
    assert max(abs(leaked[k] - want[k]) for k in want) > 1e-3


@pytest.mark.parametrize("sparse_head", [True, False], ids=["sparse", "dense"])
def test_the_pretraining_loss_of_packed_rows_is_that_of_the_rows_they_pack(sparse_head):
    model, pad, seqs, labels_of = model_and_data("modernbert")
    masking = MaskingSpec(mask_id=MASK, vocab_size=100, special_ids=(PAD, 1, CLS, SEP, MASK))
    sums = {}
    for name, rows, cls in (("alone", own_rows(seqs, pad), None), ("packed", packed_rows(seqs, pad), CLS)):
        cfg = StepConfig(masking, pad, sparse_head=sparse_head, capacity=rows.size, packed_cls=cls)
        labels = labels_for(rows, pad, labels_of)
        sums[name] = np.asarray(mlm_sums(model, jnp.asarray(rows), jnp.asarray(labels), cfg))
    np.testing.assert_allclose(sums["packed"], sums["alone"], rtol=1e-5)


# ---------------------------------------------------------------------------------------------- preprocess --pack
def blocks(rows: np.ndarray, pad: int) -> list[tuple[int, ...]]:
    return sorted(tuple(rows[r][at]) for r, at in where_each(rows, pad))


@pytest.mark.parametrize("mode", ["complete", "doc"])
def test_packing_keeps_every_block_and_leaves_less_padding(mode, tmp_path, wordpiece_dir):
    docs = make_documents(n_docs=200, seed=3)
    common = dict(mode=mode, seq_len=64, valid_fraction=0.0)
    plain = run(tmp_path, wordpiece_dir, docs, name="plain", **common)
    packed = run(tmp_path, wordpiece_dir, docs, name="packed", pack=True, **common)
    (rows, shards), (packed_rows_, packed_shards) = rows_of(tmp_path / "plain"), rows_of(tmp_path / "packed")
    assert (shards.packed, packed_shards.packed) == (False, True)
    assert blocks(packed_rows_, shards.pad_id) == blocks(rows, shards.pad_id)  # the same blocks, each whole
    padding = {name: m["splits"]["train"]["padding"] for name, m in (("plain", plain), ("packed", packed))}
    assert padding == {
        name: np.mean(r == shards.pad_id).round(4) for name, r in (("plain", rows), ("packed", packed_rows_))
    }
    # What is left is within sentences' granularity: a row's last sentence that did not fit, never cut.
    assert padding["packed"] < 0.75 * padding["plain"] and len(packed_rows_) < len(rows), padding


def test_concat_rows_are_not_packed(tmp_path):
    with pytest.raises(ValueError, match="pack"):
        PreprocessConfig(tokenizer="t", files=("a.txt",), out=str(tmp_path), pack=True)


# ---------------------------------------------------------------------------------------------- pretraining
@pytest.fixture(scope="module")
def packed_shards(tmp_path_factory, wordpiece_dir):
    tmp = tmp_path_factory.mktemp("packed")
    run(tmp, wordpiece_dir, make_documents(n_docs=400, seed=7), mode="doc", pack=True, seq_len=32, valid_fraction=0.05)
    return tmp / "out"


def test_a_modernbert_pretrains_on_packed_shards(packed_shards, tmp_path):
    cfg = config(packed_shards, model=MODERNBERT, train={"max_steps": 60}, eval={"every": 20}, checkpoint={"every": 20})
    pretrain.main(cfg, str(tmp_path / "run"))
    train, valid = losses(tmp_path / "run"), losses(tmp_path / "run", "valid_loss")
    assert np.mean([train[s] for s in range(51, 61)]) < train[1] - 1.0 and valid[60] < valid[20]


def test_an_architecture_without_segments_refuses_packed_shards(packed_shards, tmp_path, capsys):
    cfg = config(packed_shards, model={"family": "deberta-v2"})
    with pytest.raises(UserError, match="packed shards need an architecture"):
        pretrain.main(cfg, str(tmp_path / "run"))
