"""Padding-free fine-tuning: texts packed into rows give each text the outputs, losses and gradients it has alone,
and a packed k-fold run compiles one training program."""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_architectures import init_model
from test_compile_cache import COUNTING, _env, _total
from test_embedding import pair_rows, write_rows
from test_finetune import _refused, river_rows, write_table
from test_multiple_choice import choice_records
from test_multiple_choice import write_csv as write_choices
from test_question_answering import _squad
from test_token_classification import tagged_sentences, write_jsonl

from bertforge.data.batching import EncodedChoices, balanced_batches, pad_batch
from bertforge.data.text_packing import PACKED_INPUTS, PackShape, eval_batches, first_fit, micro_batches, pack
from bertforge.finetuning.pairs import distinct_texts
from bertforge.model import attention as attn
from bertforge.model import config as model_config
from bertforge.model.architectures import FAMILIES, SEGMENT_FAMILIES, build
from bertforge.model.config import ModelConfig, preset
from bertforge.runtime.devices import global_array, make_mesh
from bertforge.tasks import packed_batches
from bertforge.tasks.model_outputs import INPUTS
from bertforge.tasks.packed_batches import packed_outputs, step_batch
from bertforge.tokenizer.load import Encoded
from bertforge.train.contrastive import ContrastiveConfig
from bertforge.train.optim import OptimConfig, make_optimizer
from bertforge.train.packed_step import compile_packed_step
from bertforge.train.sequence_step import (
    SequenceStepConfig,
    compile_train_step,
    gradients,
    predict_step,
    summed_gradients,
)
from bertforge.train.step import new_train_state

# Every family that packs, BERT's and ModernBERT's attention in every run of the suite; RoBERTa's offset positions,
# ELECTRA's embedding projection and DistilBERT's missing token types with the slow marker (`make slow`), since their
# packed attention is BERT's.
FAMILY_CASES = [f if f in ("bert", "modernbert") else pytest.param(f, marks=pytest.mark.slow) for f in SEGMENT_FAMILIES]
LENGTHS = [3, 17, 9, 30, 5, 12, 2, 21, 7, 16]  # mixed lengths, one of them the row's whole length


def texts(lengths: list[int], seed: int = 0, vocab: int = 120) -> list[Encoded]:
    rng = np.random.default_rng(seed)
    return [Encoded(rng.integers(5, vocab, n).tolist(), (np.arange(n) > n // 2).astype(int).tolist()) for n in lengths]


# ------------------------------------------------------------------------------------------------ placing texts
def test_first_fit_places_every_text_once_in_rows_that_hold_it():
    rng = np.random.default_rng(1)
    for _ in range(50):
        lengths = rng.integers(1, 33, rng.integers(1, 40)).tolist()
        rows = first_fit(lengths, 32)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in row) <= 32 for row in rows)
        # First fit leaves no two rows that could have been one (at most one row is half empty or less).
        assert sum(sum(lengths[i] for i in row) <= 16 for row in rows) <= 1
    with pytest.raises(ValueError, match="does not fit"):
        first_fit([33], 32)


def test_pack_puts_each_text_at_its_start_with_its_segment_and_fillers_empty():
    encs = texts(LENGTHS)
    batch = pack(encs, 32, 6, 12, pad_id=0)
    flat = {k: batch[k].reshape(-1) for k in ("input_ids", "token_type_ids", "segment_ids", "texts")}
    for i, e in enumerate(encs):
        at, n = batch["starts"][i], len(e.ids)
        assert flat["input_ids"][at : at + n].tolist() == e.ids
        assert flat["token_type_ids"][at : at + n].tolist() == e.type_ids
        assert (flat["texts"][at : at + n] == i).all() and (flat["texts"] == i).sum() == n
        assert len(set(flat["segment_ids"][at : at + n])) == 1 and flat["segment_ids"][at] > 0
        assert at // 32 == (at + n - 1) // 32  # within one row
    assert (flat["texts"] >= len(encs)).sum() == (flat["segment_ids"] == 0).sum() == 6 * 32 - sum(LENGTHS)
    assert ((flat["input_ids"] == 0) == (flat["segment_ids"] == 0)).all()
    assert batch["starts"][len(encs) :].tolist() == [0, 0]
    with pytest.raises(ValueError, match="need 2 rows"):
        pack(texts([30, 30]), 32, 1, 2, pad_id=0)


def test_eval_batches_take_every_text_once_within_the_shape():
    lengths = np.random.default_rng(2).integers(2, 33, 200)
    batches = eval_batches(lengths, 32, rows=4, texts=9)
    assert sorted(i for b in batches for row in b for i in row) == list(range(200))
    for b in batches:
        assert len(b) <= 4 and sum(map(len, b)) <= 9
        assert all(lengths[row].sum() <= 32 for row in b)


def test_eval_batches_fill_the_long_texts_gaps_with_the_short_ones():
    # 8 texts of 40 tokens and 16 of 10 in rows of 64: 480 tokens, so at least two batches of 4 rows (256 tokens);
    # longest first alone takes three (two of the long texts, one a row, then the short ones).
    lengths = np.array([10, 40] * 8 + [10] * 8)
    batches = eval_batches(lengths, 64, rows=4, texts=100)
    assert len(batches) == 2
    for b in batches:
        assert sorted(lengths[row].tolist() for row in b) == [[40, 10, 10]] * 4


def test_packed_outputs_are_each_texts_own_in_input_order():
    # forward returns each text slot's first token id, 200 + the text's index: each must come back at its index.
    plain = texts([30, 5, 12, 30, 3, 20, 7, 30, 9, 2])
    encs = [Encoded([200 + k, *e.ids[1:]], e.type_ids) for k, e in enumerate(plain)]
    shape = PackShape(length=32, rows=3, texts=8, eval_rows=3, eval_texts=8)

    def forward(batch):
        return batch["input_ids"].reshape(-1)[batch["starts"]][:, None].astype(np.float32)

    out = packed_outputs(forward, encs, shape, pad_id=0)
    assert out[:, 0].tolist() == [200 + k for k in range(len(encs))]


# ------------------------------------------------------------------------------------------------ every family
def family_config(family: str, pooling: str) -> ModelConfig:
    # A wide initialiser makes outputs far from zero, so that a wrong token in a text shows in its outputs.
    base = preset("test", vocab_size=120, hidden_dropout=0.0, attention_dropout=0.0, initializer_range=0.2)
    fields = FAMILIES[family].apply(dataclasses.asdict(base))
    # ModernBERT's local layers see 8 tokens, fewer than the longer texts: the window must stay within each text.
    extra = {"local_attention": 8, "global_attn_every_n_layers": 2} if family == "modernbert" else {}
    return ModelConfig(**{**fields, "family": family, "pooling": pooling, **extra})


def padded_and_packed(cfg: ModelConfig, targets: np.ndarray) -> tuple[dict, dict]:
    """One batch of LENGTHS' texts with a filler, padded to 32 and packed into 6 rows of 32."""
    encs = texts(LENGTHS)
    if not cfg.type_vocab_size:
        encs = [Encoded(e.ids, [0] * len(e.ids)) for e in encs]
    b = len(encs) + 2  # two fillers
    weight = np.r_[np.ones(len(encs)), np.zeros(2)].astype(np.float32)
    rest = {"targets": targets[:b], "weight": weight}
    return {**pad_batch(encs, cfg.pad_token_id, 32, b), **rest}, {**pack(encs, 32, 6, b, cfg.pad_token_id), **rest}


@pytest.mark.parametrize("family", FAMILY_CASES)
@pytest.mark.parametrize("pooling", packed_batches.POOLINGS)
def test_packed_texts_have_the_outputs_they_have_alone(family, pooling):
    cfg = family_config(family, pooling)
    graphdef, params, rest = nnx.split(build(cfg, "sequence", num_labels=3, seed=0), nnx.Param, ...)
    padded, packed = padded_and_packed(cfg, np.zeros(12, np.int32))
    alone = predict_step(graphdef, rest, params, {k: jnp.asarray(v) for k, v in padded.items()})
    together = predict_step(graphdef, rest, params, {k: jnp.asarray(packed[k]) for k in PACKED_INPUTS})
    n = len(LENGTHS)
    np.testing.assert_allclose(np.asarray(together)[:n], np.asarray(alone)[:n], atol=1e-5, rtol=0)
    assert np.abs(np.asarray(alone)[:n]).max() > 0.05  # outputs far enough from zero to tell texts apart


def same_gradients(graphdef, rest, params, padded: dict, packed: dict, step: SequenceStepConfig,
                   packed_step: SequenceStepConfig | None = None) -> float:  # fmt: skip
    """Assert that the padded and the packed batch give the same loss and gradients (1e-5), gradients large
    enough to tell a wrong one; returns the loss. `packed_step`: the packed batch's step, where it differs."""
    g1, l1, _ = gradients(graphdef, rest, params, None, {k: jnp.asarray(v) for k, v in padded.items()}, step)
    g2, l2, _ = gradients(graphdef, rest, params, None, {k: jnp.asarray(v) for k, v in packed.items()},
                          packed_step or step)  # fmt: skip
    assert float(l2) == pytest.approx(float(l1), abs=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g1)) > 1e-3
    return float(l1)


@pytest.mark.parametrize("family", FAMILY_CASES)
@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_packed_losses_and_gradients_equal_the_padded_ones(family, loss):
    cfg = family_config(family, "mean" if loss == "mse" else "cls")
    labels = 1 if loss == "mse" else 3
    graphdef, params, rest = nnx.split(build(cfg, "sequence", num_labels=labels, seed=0), nnx.Param, ...)
    rng = np.random.default_rng(3)
    targets = rng.normal(size=(12, 1)).astype(np.float32) if loss == "mse" else rng.integers(0, 3, 12).astype(np.int32)
    padded, packed = padded_and_packed(cfg, targets)
    same_gradients(graphdef, rest, params, padded, packed, SequenceStepConfig(loss, dropout=False))


# ------------------------------------------------------------------------------------------------ embedding models
def _pairs(cfg: ModelConfig, real: int = 5) -> tuple[list[EncodedChoices], np.ndarray, np.ndarray]:
    """`real` rows of (anchor, positive, negative) texts of mixed lengths, one of them a whole row of 32, and
    multiple-negatives targets in which row 3's positive is row 0's passage."""
    lengths = np.random.default_rng(6).integers(2, 31, (real, 3))
    lengths[0, 1] = 32  # one text fills its row
    encs = texts(lengths.ravel().tolist(), seed=7)
    if not cfg.type_vocab_size:
        encs = [Encoded(e.ids, [0] * len(e.ids)) for e in encs]
    pairs = [EncodedChoices(tuple(encs[3 * r : 3 * r + 3])) for r in range(real)]
    targets = np.stack([np.ones(real), np.ones(real), np.arange(real), np.arange(real)], 1).astype(np.float32)
    targets[3, 3] = 0  # row 3's positive is row 0's passage: not its negative
    return pairs, targets, np.ones(real, np.float32)


def pair_batch(cfg: ModelConfig, rows: int = 6, real: int = 5, targets: np.ndarray | None = None) -> tuple[dict, dict]:
    """`real` rows of (anchor, positive, negative) texts of mixed lengths (or 3 choices of a question, with
    `targets`), and fillers up to `rows`: padded to 32 as (B, 3, T), and packed whole (whole_batch) into 12 rows
    of 32."""
    pairs, default_targets, weight = _pairs(cfg, real)
    targets = default_targets if targets is None else targets
    shape = PackShape(length=32, rows=12, texts=3 * rows, eval_rows=1, eval_texts=1)
    packed = packed_batches.whole_batch(pairs, targets, weight, shape, cfg.pad_token_id, rows)
    padded = pad_batch(pairs, cfg.pad_token_id, 32, rows)
    return {**padded, "targets": packed["targets"], "weight": packed["weight"]}, packed


@pytest.mark.parametrize("family", FAMILY_CASES)
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_packed_embedding_losses_and_gradients_equal_the_padded_ones(family, pooling):
    """Multiple-negatives ranking over a batch packed whole: the same embeddings, loss and gradients as the
    padded (B, N, T) batch, filler rows and a shared passage included."""
    cfg = dataclasses.replace(family_config(family, pooling), normalize=True)
    graphdef, params, rest = nnx.split(build(cfg, "embedding", seed=0), nnx.Param, ...)
    padded, packed = pair_batch(cfg)
    alone = predict_step(graphdef, rest, params, {k: jnp.asarray(padded[k]) for k in INPUTS})  # (B, 3, D)
    together = predict_step(graphdef, rest, params, {k: jnp.asarray(packed[k]) for k in PACKED_INPUTS})
    np.testing.assert_allclose(np.asarray(together).reshape(alone.shape)[:5], np.asarray(alone)[:5], atol=1e-5)
    step = SequenceStepConfig("mnrl", dropout=False, contrastive=ContrastiveConfig())
    assert same_gradients(graphdef, rest, params, padded, packed, step) > 0.1


@pytest.mark.parametrize(("family", "parts"), [(f, 2) for f in SEGMENT_FAMILIES] + [("bert", 3)])
def test_the_cached_loss_on_packed_mini_batches_has_the_padded_batchs_loss_and_gradients(family, parts):
    """The cached loss (GradCache) over `parts` mini-batches each packed on its own (rows i * A + k in mini-batch
    k): the loss and gradients of the whole padded (B, N, T) batch taken at once, filler rows and a shared
    passage included."""
    cfg = dataclasses.replace(family_config(family, "mean"), normalize=True)
    graphdef, params, rest = nnx.split(build(cfg, "embedding", seed=0), nnx.Param, ...)
    padded, _ = pair_batch(cfg)
    pairs, targets, weight = _pairs(cfg)
    shape = PackShape(length=32, rows=12, texts=3 * 6 // parts, eval_rows=1, eval_texts=1)
    packed = packed_batches.whole_batch(pairs, targets, weight, shape, cfg.pad_token_id, 6, parts)
    assert packed["input_ids"].shape == (12 * parts, 32) and packed["starts"].shape == (18,)
    step = SequenceStepConfig("mnrl", dropout=False, contrastive=ContrastiveConfig())
    cached = dataclasses.replace(step, grad_accum=parts)
    assert same_gradients(graphdef, rest, params, padded, packed, step, cached) > 0.1


@pytest.mark.parametrize("family", FAMILY_CASES)
def test_packed_choices_have_the_scores_losses_and_gradients_of_padded_ones(family):
    """A step of questions with 3 choices each, packed whole: each choice's score, the cross-entropy over each
    question's choices and its gradients as the padded (B, N, T) batch gives them."""
    cfg = family_config(family, "cls")
    graphdef, params, rest = nnx.split(build(cfg, "choice", seed=0), nnx.Param, ...)
    padded, packed = pair_batch(cfg, targets=np.array([2, 0, 1, 1, 0], np.int32))
    alone = predict_step(graphdef, rest, params, {k: jnp.asarray(padded[k]) for k in INPUTS})  # (B, 3)
    together = predict_step(graphdef, rest, params, {k: jnp.asarray(packed[k]) for k in PACKED_INPUTS})  # (3B, 1)
    np.testing.assert_allclose(np.asarray(together).reshape(alone.shape)[:5], np.asarray(alone)[:5], atol=1e-5)
    assert np.ptp(np.asarray(alone)[:5], axis=1).min() > 1e-3  # the choices' scores differ
    same_gradients(graphdef, rest, params, padded, packed, SequenceStepConfig("cross_entropy", dropout=False))


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_packed_first_tokens_attend_to_their_own_text_on_cudnn(family, monkeypatch):
    """cuDNN's path takes a row's padding as its length; a packed text's first token must attend to its own span
    of the row instead. The cuDNN calls run here on XLA's implementation of jax.nn.dot_product_attention, which
    takes the same arguments (lengths and masks) and means the same by them."""
    real = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, implementation=None, **k: real(*a, **k))
    monkeypatch.setattr(attn, "choose_attention", lambda requested, *_: requested)
    monkeypatch.setattr(model_config, "cudnn_takes", lambda *_: True)  # float32 here, for a 1e-5 comparison
    outputs = {}
    for name in ("cudnn", "explicit"):
        cfg = dataclasses.replace(family_config(family, "cls"), attention=name)
        graphdef, params, rest = nnx.split(build(cfg, "sequence", num_labels=3, seed=0), nnx.Param, ...)
        _, packed = padded_and_packed(cfg, np.zeros(12, np.int32))
        outputs[name] = np.asarray(
            predict_step(graphdef, rest, params, {k: jnp.asarray(packed[k]) for k in PACKED_INPUTS})
        )
    n = len(LENGTHS)
    np.testing.assert_allclose(outputs["cudnn"][:n], outputs["explicit"][:n], atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------ token heads
def token_targets(head: str, lengths: list[int], seed: int = 5) -> np.ndarray:
    """Targets of texts of `lengths` and two fillers: for 'token' (B, 32, 2), a label at about two tokens in three
    (-100 elsewhere and past the text) and the text's index where it owns the token (-1 elsewhere); for 'span'
    (B, 4), an answer's first and last token inside the text, the row and the text's tokens."""
    rng = np.random.default_rng(seed)
    b = len(lengths) + 2
    if head == "span":
        first = np.array([rng.integers(0, n) for n in lengths])
        last = np.array([rng.integers(f, n) for f, n in zip(first, lengths, strict=True)])
        spans = np.stack([first, last, np.arange(len(lengths)), lengths], 1)
        return np.r_[spans, np.zeros((2, 4), np.int64)].astype(np.int32)
    out = np.full((b, 32, 2), -100, np.int32)
    out[..., 1] = -1
    for i, n in enumerate(lengths):
        labelled = rng.random(n) < 0.67
        out[i, :n, 0] = np.where(labelled, rng.integers(0, 5, n), -100)
        out[i, :n, 1] = np.where(labelled, i, -1)
    return out


@pytest.mark.parametrize("family", FAMILY_CASES)
@pytest.mark.parametrize("head", packed_batches.TOKEN_HEADS)
def test_packed_token_heads_have_the_outputs_losses_and_gradients_of_padded_ones(family, head):
    """Texts of mixed lengths and two fillers packed into rows: each text's token logits (entities' labels, or an
    answer's start and end) read from its own first token, its loss (over the labelled tokens, or the texts) and
    its gradients, as the padded batch gives them; zeros past each text's last token."""
    cfg = family_config(family, "cls")
    graphdef, params, rest = nnx.split(build(cfg, head, num_labels=5, seed=0), nnx.Param, ...)
    padded, packed = padded_and_packed(cfg, token_targets(head, LENGTHS))
    alone = np.asarray(predict_step(graphdef, rest, params, {k: jnp.asarray(padded[k]) for k in INPUTS}))
    together = np.asarray(predict_step(graphdef, rest, params, {k: jnp.asarray(packed[k]) for k in PACKED_INPUTS}))
    assert together.shape == alone.shape
    for i, n in enumerate(LENGTHS):
        np.testing.assert_allclose(together[i, :n], alone[i, :n], atol=1e-5, rtol=0)
        assert not together[i, n:].any()
    assert np.abs(alone[: len(LENGTHS)]).max() > 0.05
    loss = "token_cross_entropy" if head == "token" else "span_cross_entropy"
    assert same_gradients(graphdef, rest, params, padded, packed, SequenceStepConfig(loss, dropout=False)) > 0.1


@pytest.mark.parametrize("rows", [1, 2, 6])
def test_a_packed_token_step_averages_over_the_step_s_labelled_tokens(rows):
    """In micro-batches of `rows` rows, each micro-batch's token loss is over the whole step's labelled tokens:
    the step's loss and gradients are the padded step's."""
    cfg = family_config("bert", "cls")
    graphdef, params, rest = nnx.split(build(cfg, "token", num_labels=5, seed=0), nnx.Param, ...)
    targets = token_targets("token", LENGTHS)
    padded, _ = padded_and_packed(cfg, targets)
    shape = PackShape(length=32, rows=rows, texts=12, eval_rows=1, eval_texts=1)
    n = len(LENGTHS)
    packed = step_batch(texts(LENGTHS), targets[:n], np.ones(n, np.float32), shape, cfg.pad_token_id, jnp.asarray,
                        loss="token_cross_entropy")  # fmt: skip
    assert packed.count == (targets[:n, :, 0] >= 0).sum()
    step = SequenceStepConfig("token_cross_entropy", dropout=False)
    g1, l1, _ = gradients(graphdef, rest, params, None, {k: jnp.asarray(v) for k, v in padded.items()}, step)
    total = None
    for micro in packed.micro:
        g, part = summed_gradients(graphdef, rest, params, None, micro, step, None, count=jnp.float32(packed.count))
        total = (g, part) if total is None else (jax.tree.map(jnp.add, total[0], g), total[1] + part)
    assert float(total[1]) == pytest.approx(float(l1), abs=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(total[0]), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)


def test_a_whole_plan_holds_the_fullest_step_and_evaluation_dedups_texts():
    lengths = np.random.default_rng(8).integers(3, 60, (50, 2))
    settings = dict(batch_size=8, grad_accum=1, epochs=2, seed=0, eval_batch_size=16, bucket=8, pool=16)
    folds = [np.arange(50), np.arange(0, 50, 2)]
    shape = packed_batches.whole_plan(lengths, lengths[:0], folds, 64, settings, shards=2)
    assert shape.length == 64 and shape.texts == 16 and shape.rows % 2 == 0
    needs = [len(first_fit(lengths[fold][b].ravel().tolist(), 64)) for fold in folds
             for epoch in range(2) for b in balanced_batches(lengths[fold].sum(axis=1), 8, 0, epoch)]  # fmt: skip
    assert max(needs) <= shape.rows < max(needs) + 2
    a, b = texts([4, 6, 5]), texts([7], seed=1)
    rows = [EncodedChoices((a[0], a[1])), EncodedChoices((a[2], a[1])), EncodedChoices((b[0], a[0]))]
    distinct, index = distinct_texts(rows)
    assert [e.ids for e in distinct] == [a[0].ids, a[1].ids, a[2].ids, b[0].ids]
    assert index.tolist() == [[0, 1], [2, 1], [3, 0]]


def test_micro_batches_hold_every_text_once_and_no_more_than_needed():
    encs = texts(LENGTHS + [11, 4, 25, 8])
    shape = PackShape(length=32, rows=2, texts=8, eval_rows=1, eval_texts=1)
    micro = micro_batches(encs, shape, pad_id=0)
    assert sorted(i for _, held in micro for i in held) == list(range(len(encs)))
    assert len(micro) == -(-len(first_fit([len(e.ids) for e in encs], 32)) // 2)
    for batch, held in micro:
        for j, i in enumerate(held):  # slot j holds text i
            at = batch["starts"][j]
            assert batch["input_ids"].reshape(-1)[at : at + len(encs[i].ids)].tolist() == encs[i].ids


@pytest.mark.parametrize("rows", [1, 2, 6])
def test_a_packed_step_makes_the_update_of_the_padded_step(rows):
    """The update of a batch of mixed lengths (and two fillers), as micro-batches of `rows` rows (6: all in one),
    equals the padded step's: same loss, gradient norm and parameters after AdamW with clipping."""
    cfg = family_config("bert", "cls")
    graphdef, params, rest = nnx.split(build(cfg, "sequence", num_labels=3, seed=0), nnx.Param, ...)
    # AdamW's first update is about lr * sign(gradient): lr 1e-3 keeps a gradient's last-digit difference (from
    # summing in another order) within the tolerance, while any wrong gradient sign moves a parameter by 2e-3.
    tx = make_optimizer(OptimConfig(lr=1e-3, clip_norm=0.5), params, cfg.num_layers)
    mesh = make_mesh(devices=jax.devices()[:1])
    targets = np.random.default_rng(4).integers(0, 3, 12).astype(np.int32)
    padded, _ = padded_and_packed(cfg, targets)
    shape = PackShape(length=32, rows=rows, texts=12, eval_rows=1, eval_texts=1)
    encs = texts(LENGTHS)
    put = functools.partial(global_array, mesh=mesh)
    packed = step_batch(encs, targets[: len(encs)], np.ones(len(encs), np.float32), shape, cfg.pad_token_id, put)
    assert len(packed.micro) == -(-len(first_fit(LENGTHS, 32)) // rows)
    step_cfg = SequenceStepConfig("cross_entropy", dropout=False)
    results = []
    for compile_step, batch in ((compile_train_step, padded), (compile_packed_step, packed)):
        state = new_train_state(jax.tree.map(jnp.copy, params), tx, mesh)  # the step donates it
        step = compile_step(graphdef, rest, tx, step_cfg, jax.tree.map(lambda x: x.sharding, state))
        batch = batch if compile_step is compile_packed_step else {k: put(v) for k, v in batch.items()}
        state, found = step(state, batch, jnp.float32(1e-3), jax.random.key(0))
        results.append((found, jax.tree.leaves(state.params)))
    (m1, p1), (m2, p2) = results
    assert float(m2["loss"]) == pytest.approx(float(m1["loss"]), abs=1e-5)
    assert float(m2["grad_norm"]) == pytest.approx(float(m1["grad_norm"]), abs=1e-5)
    for a, b in zip(p1, p2, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)


def test_auto_packs_where_packed_steps_compute_less_than_the_ladder():
    model = preset("test", pooling="cls")  # 2 layers, the last of which padded batches compute for [CLS] only
    settings = dict(batch_size=16, grad_accum=1, epochs=1, seed=0, eval_batch_size=16, bucket=8, pool=16)
    short = np.random.default_rng(5).integers(2, 17, 64)
    # A ladder of one rung pads every text to 64 tokens; packed rows of 16 hold several texts each. Texts of 36
    # tokens and one of 64: rows of 64 hold one text each, where the ladder pads all but one batch to 40.
    for lengths, rungs, packs in ((short, (64,), True), (np.r_[np.full(63, 36), 64], (40, 64), False)):
        shape = packed_batches.plan(lengths, lengths[:0], [np.arange(64)], 64, settings, shards=1)
        packed = packed_batches.packed_work(shape, 64, 16, model)
        padded = packed_batches.ladder_work(lengths, 16, 64, 8, rungs, 0, model)
        assert (packed <= packed_batches.margin("cpu") * padded) == packs, (packed, padded, shape)
        # On an accelerator, where each length the ladder adds costs a compilation of seconds, auto packs both.
        assert packed <= packed_batches.margin("gpu") * padded and packed <= packed_batches.margin("tpu") * padded


def test_auto_packs_pairs_of_a_short_query_and_a_long_passage():
    model = preset("test", pooling="mean")
    settings = dict(batch_size=8, grad_accum=1, epochs=1, seed=0, eval_batch_size=8, bucket=8, pool=16)
    queries = np.random.default_rng(9).integers(4, 13, 64)
    # Queries of 4-12 tokens fill the room that passages of 56 leave in rows of 64, where padding gives each query
    # the passage's length. Texts of 36 tokens and one of 64: rows of 64 hold one text each, where the ladder pads
    # all but one batch to 40.
    long = np.c_[np.full(64, 36), np.r_[np.full(63, 36), 64]]
    for lengths, packs in ((np.c_[queries, np.full(64, 56)], True), (long, False)):
        shape = packed_batches.whole_plan(lengths, lengths[:0, 0], [np.arange(64)], 64, settings, shards=1)
        packed = packed_batches.packed_work(shape, 64, 8, model, per_row=2)
        padded = packed_batches.ladder_work(lengths.max(1), 8, 64, 8, (40, 64), 0, model, per_row=2)
        assert (packed <= packed_batches.MARGIN * padded) == packs, (packed, padded, shape)


def test_packing_is_offered_only_where_it_is_exact():
    assert packed_batches.why_not("sequence", "bert", "cls") == ""
    assert "deberta-v2" not in SEGMENT_FAMILIES
    assert "no attention within packed texts" in packed_batches.why_not("sequence", "deberta-v2", "cls")
    assert "no packed form" in packed_batches.why_not("sequence", "bert", "attention")
    assert packed_batches.why_not("token", "bert", "attention") == packed_batches.why_not("span", "roberta", "x") == ""
    assert "no attention within packed texts" in packed_batches.why_not("token", "deberta-v2", "cls")
    assert "has no packed form" in packed_batches.why_not("mlm", "bert", "cls")
    assert packed_batches.why_not("embedding", "modernbert", "mean") == ""
    assert packed_batches.why_not("choice", "electra", "cls") == ""


# ------------------------------------------------------------------------------------------------ one program
def _compiles(tmp_path, name: str, model_dir, data, *extra: str) -> tuple[dict, str]:
    script = tmp_path / "counting.py"
    script.write_text(COUNTING)
    out = tmp_path / f"{name}.json"
    argv = ["finetune", "--model", model_dir, "--data", data, "--out", tmp_path / name, "--folds", "2",
            "--train.epochs=2", "--train.batch_size=8", "--mesh.num_devices=1", "--data.max_length=64",
            "--log.progress=false", "--train.evals_per_epoch=2", *extra]  # fmt: skip
    env = _env(BERTFORGE_COMPILE_CACHE=str(tmp_path / f"cache-{name}"))
    proc = subprocess.run([sys.executable, str(script), str(out), *map(str, argv)], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())["counts"], proc.stderr


def test_a_packed_k_fold_run_compiles_one_training_and_one_evaluation_program(model_dir, tmp_path):
    data = write_table(tmp_path / "train.csv", river_rows(64, seed=7))
    counts, log = _compiles(tmp_path, "packed", model_dir, data, "--data.pack=true")
    assert "texts packed" in log, log
    # Two folds, two epochs, four evaluations each: one program for every micro-batch of every step, one for
    # every evaluation.
    assert _total(counts, "compile_requests_use_cache", "jit(add_gradients)") == 1, counts
    assert _total(counts, "compile_requests_use_cache", "jit(gradients)") == 0, counts
    assert _total(counts, "compile_requests_use_cache", "jit(predict_step)") == 1, counts
    result = json.loads((tmp_path / "packed" / "summary.json").read_text())
    assert len(result["folds"]) == 2
    # The same run padded to the length ladder compiles one program per padded length.
    counts, log = _compiles(tmp_path, "padded", model_dir, data, "--data.pack=false")
    assert "texts padded to" in log, log
    assert _total(counts, "compile_requests_use_cache", "jit(gradients)") > 1, counts


@pytest.mark.parametrize("accum", [1, 2])
def test_a_packed_embedding_run_compiles_one_training_and_one_evaluation_program(accum, model_dir, tmp_path):
    """Packed whole, or with the cached loss in 2 mini-batches each packed on its own."""
    data = write_rows(tmp_path / "pairs.csv", pair_rows(48, seed=3))
    pairs = ["--task", "embedding", "--text-column", "query", "--text-pair-column", "passage", "--negative-column",
             "negative", f"--train.grad_accum={accum}"]  # fmt: skip
    counts, log = _compiles(tmp_path, "packed-pairs", model_dir, data, *pairs, "--data.pack=true")
    into = "one batch" if accum == 1 else "2 mini-batches"
    assert f"each step's texts packed into {into} of" in log, log
    assert _total(counts, "compile_requests_use_cache", "jit(gradients)") == 1, counts
    assert _total(counts, "compile_requests_use_cache", "jit(predict_step)") == 1, counts
    summary = json.loads((tmp_path / "packed-pairs" / "summary.json").read_text())
    assert len(summary["folds"]) == 2 and all(0 < f["score"] <= 1 for f in summary["folds"]), summary


# A task's data, what its log says of its batches, and its training program: one for a step packed whole (WHOLE),
# or one that adds each micro-batch's gradients.
PACKED_RUNS = {
    "multiple-choice": (lambda d: write_choices(d / "choices.csv", choice_records(48, seed=4)),
                        "each step's texts packed into one batch of", "jit(gradients)"),
    "token-classification": (lambda d: write_jsonl(d / "tagged.jsonl", tagged_sentences(48, seed=2)),
                             "texts packed into micro-batches of", "jit(add_gradients)"),
}  # fmt: skip


@pytest.mark.parametrize("task", PACKED_RUNS)
def test_a_packed_k_fold_run_of_a_task_compiles_one_training_and_one_evaluation_program(task, model_dir, tmp_path):
    write, line, program = PACKED_RUNS[task]
    counts, log = _compiles(tmp_path, task, model_dir, write(tmp_path), "--task", task, "--data.pack=true")
    assert line in log, log
    other = ({"jit(gradients)", "jit(add_gradients)"} - {program}).pop()
    assert _total(counts, "compile_requests_use_cache", program) == 1, counts
    assert _total(counts, "compile_requests_use_cache", other) == 0, counts
    assert _total(counts, "compile_requests_use_cache", "jit(predict_step)") == 1, counts
    summary = json.loads((tmp_path / task / "summary.json").read_text())
    assert len(summary["folds"]) == 2 and all(0 <= f["score"] <= 1 for f in summary["folds"]), summary


def test_a_packed_question_answering_run_compiles_one_program_and_answers_from_the_context(model_dir, tmp_path):
    data = _squad(tmp_path / "squad.json", 24, seed=3)
    counts, log = _compiles(tmp_path, "packed-qa", model_dir, data, "--task", "question-answering", "--stride", "8",
                            "--data.pack=true")  # fmt: skip
    assert "texts packed into micro-batches of" in log, log
    assert _total(counts, "compile_requests_use_cache", "jit(add_gradients)") == 1, counts
    assert _total(counts, "compile_requests_use_cache", "jit(predict_step)") == 1, counts
    contexts = {qa["id"]: p["context"] for a in json.loads(data.read_text())["data"] for p in a["paragraphs"]
                for qa in p["qas"]}  # fmt: skip
    with open(tmp_path / "packed-qa" / "oof.csv", newline="", encoding="utf-8") as fh:
        oof = list(csv.DictReader(fh))
    assert len(oof) == 24
    for r in oof:
        start = int(r["start"])
        assert contexts[r["id"]][start : start + len(r["prediction"])] == r["prediction"] and r["prediction"]


def test_packing_asked_where_it_is_not_exact_is_one_line(wordpiece_dir, tmp_path, capsys):
    deberta = init_model("deberta-v2", wordpiece_dir, tmp_path / "deberta")
    data = write_table(tmp_path / "train.csv", river_rows(32, seed=8))
    line = _refused(deberta, data, tmp_path / "run", capsys, "--data.pack=true")
    assert line == (
        "error: data.pack=true: deberta-v2 has no attention within packed texts; leave data.pack unset (packed "
        "where it is exact) or false"
    )
