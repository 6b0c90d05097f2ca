"""DeBERTa-v2/v3 against transformers: hidden states, MLM and sequence logits, gradients, round trips, refusals."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from flax.traverse_util import flatten_dict
from transformers import (
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    DebertaV2Config,
    DebertaV2ForMaskedLM,
    DebertaV2ForSequenceClassification,
    DebertaV2Model,
)
from transformers.models.deberta_v2.modeling_deberta_v2 import make_log_bucket_position

from bertforge.errors import UserError
from bertforge.model import relative
from bertforge.model.architectures import build, config_from_hf, key_table
from bertforge.model.hf import load_pretrained, save_pretrained

VOCAB = 97
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    layer_norm_eps=1e-7,
    initializer_range=0.2,  # outputs far from uniform: a wrong weight cannot hide in tiny logits
    relative_attention=True,
)
# Each switches on what a family of public checkpoints uses, and the options around it.
VARIANTS = {
    # deberta-v3-xsmall/small/base/large: 256 log buckets (here 8, so that a 20-token batch reaches the logarithmic
    # ones), shared keys, no absolute positions, no token types, the relative table's LayerNorm, the hub's string
    # spelling of pos_att_type; and the non-legacy MLM head of the original checkpoints. Its max_position_embeddings
    # is shorter than the batch: without absolute positions any length goes, distances past it clamp.
    "v3": dict(
        max_position_embeddings=16,
        position_buckets=8,
        pos_att_type="p2c|c2p",
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        position_biased_input=False,
        type_vocab_size=0,
        legacy=False,
    ),
    # deberta-v2-xlarge: as v3 plus the convolution layer (grouped here) and an explicit attention_head_size.
    "v2-conv": dict(
        position_buckets=8,
        max_relative_positions=24,
        pos_att_type=["p2c", "c2p"],
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        position_biased_input=False,
        type_vocab_size=0,
        conv_kernel_size=3,
        conv_groups=2,
        conv_act="gelu",
        attention_head_size=8,
    ),
    # Separate position projections, no buckets with a short clamp, a narrower embedding table and its projection,
    # absolute positions and token types, other activations.
    "own-keys": dict(
        max_relative_positions=6,
        pos_att_type=["c2p", "p2c"],
        share_att_key=False,
        position_biased_input=True,
        type_vocab_size=2,
        embedding_size=24,
        hidden_act="gelu_new",
        pooler_hidden_act="tanh",
    ),
}


def hf_config(variant: str, **extra) -> DebertaV2Config:
    return DebertaV2Config(**{**SMALL, **VARIANTS[variant], **extra})


def save_reference(model_cls, variant: str, out, seed: int = 0, **extra):
    """A randomly initialised transformers model of `variant`, biases and norms randomised, saved to `out`."""
    torch.manual_seed(seed)
    model = model_cls(hf_config(variant, **extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(out)
    if isinstance(VARIANTS[variant].get("pos_att_type"), str):  # as the hub's config.json files spell it
        data = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**data, "pos_att_type": VARIANTS[variant]["pos_att_type"]}))
    return model


def pair_batch(segments=((6, 11), (4, 5), (2, 1)), seed: int = 0) -> dict[str, np.ndarray]:
    """Right-padded [CLS] a [SEP] b [SEP] pairs of random ids; token types 0 then 1."""
    rng = np.random.default_rng(seed)
    t = max(a + b + 3 for a, b in segments)
    batch = {k: np.zeros((len(segments), t), np.int32) for k in ("input_ids", "attention_mask", "token_type_ids")}
    for row, (a, b) in enumerate(segments):
        ids = [1, *rng.integers(4, VOCAB, a), 2, *rng.integers(4, VOCAB, b), 2]
        batch["input_ids"][row, : len(ids)] = ids
        batch["attention_mask"][row, : len(ids)] = 1
        batch["token_type_ids"][row, a + 2 : len(ids)] = 1
    return batch


def load(folder, **kw):
    """load_pretrained without a tokenizer, in eval mode (no dropout)."""
    pre = load_pretrained(folder, need_tokenizer=False, **kw)
    pre.model.eval()
    return pre


def ours(fn, batch):
    return np.asarray(fn(*(jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "token_type_ids"))))


def theirs(model, batch):
    with torch.no_grad():
        out = model(**{k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()})
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).numpy()


def max_diff(a, b) -> float:
    assert a.shape == b.shape
    return float(np.max(np.abs(a - b)))


def test_log_buckets_match_transformers():
    rel = np.arange(-3000, 3001)
    for buckets, reach in ((256, 512), (8, 64), (8, 24), (32, 1024)):
        want = make_log_bucket_position(torch.tensor(rel), buckets, reach).long().numpy()
        np.testing.assert_array_equal(relative.log_buckets(rel, buckets, reach), want, err_msg=f"{buckets}, {reach}")


@pytest.mark.parametrize("t", [7, 90])  # fewer distances than table rows; distances past max_position 64
def test_shifted_relative_scores_equal_the_definition(t):
    n, h, span = 2, 4, 8
    plan = relative.relative_plan(t, span, span, 64)
    rng = np.random.default_rng(t)
    rows = plan.hi - plan.lo
    q, k = (rng.standard_normal((2, t, n, h), np.float32) for _ in range(2))
    pos_q, pos_k = (rng.standard_normal((rows, n, h), np.float32) for _ in range(2))
    a = jax.jit(lambda *x: relative.relative_scores(*x, plan))(q, k, pos_q, pos_k)
    # The definition: c2p[i, j] = q_i . pos_k[row(i - j)], p2c[i, j] = k_j . pos_q[row(i - j)].
    i = np.arange(t)
    row = plan.by_distance[i[:, None] - i[None, :] + t - 1]  # (T, T)
    want = np.einsum("bqnh,qknh->bnqk", q, pos_k[row]) + np.einsum("bknh,qknh->bnqk", k, pos_q[row])
    np.testing.assert_allclose(np.asarray(a), want, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_outputs_match_transformers(variant, tmp_path):
    batch = pair_batch()
    assert batch["attention_mask"].min() == 0 and batch["token_type_ids"].max() == 1
    assert batch["input_ids"].shape[1] > VARIANTS["v3"]["max_position_embeddings"]
    # A bare DebertaV2Model (as the v3 RTD discriminators are published) loads as an encoder.
    ref = save_reference(DebertaV2Model, variant, tmp_path / "model")
    pre = load(tmp_path / "model")
    assert pre.model.config.family == "deberta-v2"
    got, want = ours(pre.model.encoder, batch), theirs(ref, batch)
    assert max_diff(got, want) <= 1e-4  # every position, padding too: transformers' masking is reproduced
    ref = save_reference(DebertaV2ForMaskedLM, variant, tmp_path / "mlm", seed=1)
    pre = load(tmp_path / "mlm", require_head=True)
    assert pre.head == "mlm"
    assert max_diff(ours(pre.model, batch), theirs(ref, batch)) <= 1e-4
    for labels in (1, 3):
        folder = tmp_path / f"seq{labels}"
        ref = save_reference(DebertaV2ForSequenceClassification, variant, folder, seed=labels, num_labels=labels)
        pre = load(folder, require_head=True)
        assert pre.head == "sequence" and pre.model.num_labels == labels
        assert max_diff(ours(pre.model, batch), theirs(ref, batch)) <= 1e-4


@pytest.mark.parametrize("variant", VARIANTS)
def test_regression_gradients_match_torch(variant, tmp_path):
    batch = pair_batch()
    target = np.array([0.5, -1.0, 2.0], np.float32)
    ref = save_reference(DebertaV2ForSequenceClassification, variant, tmp_path / "seq", num_labels=1)
    # One variant keeps only each layer's input for the backward pass: the same gradients.
    pre = load(tmp_path / "seq", require_head=True, overrides={"remat": variant == "v2-conv"})
    model = pre.model
    model.eval()
    inputs = [jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "token_type_ids")]
    grads = nnx.jit(nnx.grad(lambda m: jnp.mean((m(*inputs)[:, 0] - target) ** 2)))(model)
    flat = flatten_dict(nnx.to_pure_dict(grads))
    tensors = {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}
    torch.nn.functional.mse_loss(ref(**tensors).logits[:, 0], torch.tensor(target)).backward()
    params = dict(ref.named_parameters())
    rows = key_table(model.config, "sequence")
    assert {r.hf for r in rows} == set(params)  # every parameter of transformers' model is compared
    largest = max(float(p.grad.abs().max()) for p in params.values())
    for row in rows:
        want = params[row.hf].grad.numpy()
        got = np.asarray(flat[row.path])
        got = got.T if row.transpose else got
        scale = np.abs(want).max()
        if scale < 1e-6 * largest:
            # A bias added to every key of a query's row (key_proj's in the content term, pos_key_proj's) shifts
            # all its scores alike, which the softmax ignores: a gradient of zero, rounding noise on both sides.
            assert np.abs(got).max() < 1e-6 * largest, row.hf
            continue
        assert max_diff(got, want) <= 1e-4 * scale, row.hf


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head", ["mlm", "sequence"])
def test_round_trip_through_transformers(variant, head, tmp_path):
    data = {**hf_config(variant).to_dict(), "model_type": "deberta-v2"}
    cfg, _ = config_from_hf(data, "test")
    model = build(cfg, head, num_labels=2, seed=3)
    # Fresh biases are zero and LayerNorms identity: perturb every parameter so that each one is checked.
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.default_rng(1)
    nnx.update(model, jax.tree.unflatten(treedef, [x + 0.1 * rng.standard_normal(x.shape, np.float32) for x in leaves]))
    out = save_pretrained(model, tmp_path / "export")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "deberta-v2" and written["architectures"][0].startswith("DebertaV2For")
    batch = pair_batch()
    model.eval()
    encoder = AutoModel.from_pretrained(out).eval()
    assert type(encoder).__name__ == "DebertaV2Model"
    assert max_diff(ours(model.encoder, batch), theirs(encoder, batch)) <= 1e-4
    auto = AutoModelForMaskedLM if head == "mlm" else AutoModelForSequenceClassification
    ref = auto.from_pretrained(out).eval()
    assert max_diff(ours(model, batch), theirs(ref, batch)) <= 1e-4
    back = load(out, require_head=True)
    assert back.model.config == cfg
    before = flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    after = flatten_dict(nnx.to_pure_dict(nnx.state(back.model, nnx.Param)))
    assert before.keys() == after.keys()
    for path, value in before.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(after[path]), err_msg=str(path))


@pytest.mark.parametrize(
    "key,value",
    [
        ("attention_head_size", 16),
        ("pos_att_type", ["c2p", "p2p"]),
        ("pos_att_type", "c2p|p2p"),
        ("hidden_act", "gelu_fast"),
        ("pooler_hidden_act", "mish"),
        ("conv_act", "mish"),
        ("pooler_hidden_size", 48),
        ("conv_kernel_size", 4),
        ("legacy", False),  # with embedding_size 24 != hidden_size 32: transformers cannot run that head
        ("tie_word_embeddings", False),  # the legacy MLM head would have its own decoder
        ("position_buckets", 10),  # with max_relative_positions 6: log(5 / 5) = 0 divides
    ],
)
def test_unsupported_options_are_refused_in_one_line(key, value, tmp_path):
    save_reference(DebertaV2ForMaskedLM, "own-keys", tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    data = json.loads(path.read_text())
    data[key] = value
    path.write_text(json.dumps(data))
    with pytest.raises(UserError) as err:
        load_pretrained(tmp_path / "m", need_tokenizer=False)
    message = str(err.value)
    assert "\n" not in message and key in message
    shown = "p2p" if key == "pos_att_type" else repr(value)
    assert shown in message
