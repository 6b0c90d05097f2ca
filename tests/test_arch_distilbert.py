"""DistilBERT against transformers: hidden states, masked-LM and classification logits, fine-tuning gradients, and
weights that round-trip exactly. DistilBERT has no token types: ours get them and must ignore them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from test_arch_electra import (
    assert_gradients_match,
    family_config,
    hidden_ours,
    pair_batch,
    perturbed,
    run_ours,
    save_reference,
)
from test_model_hf import max_diff_on_tokens
from transformers import (
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    DistilBertConfig,
    DistilBertForMaskedLM,
    DistilBertForSequenceClassification,
    DistilBertModel,
)

from bertforge.errors import UserError
from bertforge.model.architectures import build
from bertforge.model.hf import load_pretrained, save_pretrained
from bertforge.tokenizer.load import Tokenizer

SIZES = dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64, activation="gelu")


def reference(model_cls, tokenizer_dir: Path, out: Path, seed: int = 0, **extra) -> Path:
    """A randomly initialised transformers DistilBERT `model_cls` with a wide initialiser, saved to `out`."""
    tok = Tokenizer.load(tokenizer_dir)
    torch.manual_seed(seed)
    fields = {**SIZES, **extra}
    config = DistilBertConfig(vocab_size=tok.vocab_size, pad_token_id=tok.pad_id, initializer_range=0.2, **fields)
    return save_reference(model_cls(config), tokenizer_dir, out)


def torch_inputs(batch) -> dict[str, torch.Tensor]:
    """What DistilBERT takes: no token types."""
    return {k: torch.tensor(batch[k], dtype=torch.long) for k in ("input_ids", "attention_mask")}


# ------------------------------------------------------------------------------------------------------- outputs
def test_hidden_states_match_transformers(wordpiece_dir, tmp_path):
    folder = reference(DistilBertModel, wordpiece_dir, tmp_path / "hf")
    pre = load_pretrained(folder)
    cfg = pre.model.config
    assert (cfg.type_vocab_size, cfg.layer_norm_eps, cfg.hidden_size, cfg.intermediate_size) == (0, 1e-12, 32, 64)
    batch = pair_batch(pre.tokenizer)  # token types 0 and 1, which DistilBERT ignores
    ref = AutoModel.from_pretrained(folder).eval()
    with torch.no_grad():
        theirs = ref(**torch_inputs(batch)).last_hidden_state.numpy()
    assert max_diff_on_tokens(hidden_ours(pre.model, batch), theirs, batch["attention_mask"]) <= 1e-4


def test_mlm_logits_match_transformers(wordpiece_dir, tmp_path):
    folder = reference(DistilBertForMaskedLM, wordpiece_dir, tmp_path / "hf", activation="relu")
    pre = load_pretrained(folder, require_head=True)
    assert pre.head == "mlm" and pre.model.config.hidden_act == "relu"  # the head's activation too
    batch = pair_batch(pre.tokenizer)
    ref = DistilBertForMaskedLM.from_pretrained(folder).eval()
    with torch.no_grad():
        theirs = ref(**torch_inputs(batch)).logits.numpy()
    assert max_diff_on_tokens(run_ours(pre.model, batch), theirs, batch["attention_mask"]) <= 1e-4


@pytest.mark.parametrize("num_labels", [1, 3])
def test_sequence_logits_match_transformers(num_labels, wordpiece_dir, tmp_path):
    folder = reference(DistilBertForSequenceClassification, wordpiece_dir, tmp_path / "hf", num_labels=num_labels)
    pre = load_pretrained(folder, require_head=True)
    assert pre.head == "sequence" and pre.model.num_labels == num_labels
    assert pre.model.config.classifier_act == "relu" and pre.model.config.classifier_dropout == 0.2
    batch = pair_batch(pre.tokenizer)
    ref = DistilBertForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        theirs = ref(**torch_inputs(batch)).logits.numpy()
    assert np.max(np.abs(run_ours(pre.model, batch) - theirs)) <= 1e-4


def test_fine_tuning_gradients_match_torch(wordpiece_dir, tmp_path):
    folder = reference(DistilBertForSequenceClassification, wordpiece_dir, tmp_path / "hf", num_labels=1)
    pre = load_pretrained(folder, require_head=True)
    batch = pair_batch(pre.tokenizer)
    ref = DistilBertForSequenceClassification.from_pretrained(folder).eval()
    assert assert_gradients_match(pre.model, ref, batch, torch_inputs(batch)) <= 1e-4


# ------------------------------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("head", ["mlm", "sequence"])
def test_round_trip_through_transformers(head, wordpiece_dir, tmp_path):
    tok = Tokenizer.load(wordpiece_dir)
    model = perturbed(build(family_config("distilbert", tok), head, num_labels=2, seed=3))
    out = save_pretrained(model, tmp_path / "export", tok)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "distilbert" and config["architectures"][0].startswith("DistilBert")
    batch = pair_batch(tok)

    encoder = AutoModel.from_pretrained(out).eval()
    auto = AutoModelForMaskedLM if head == "mlm" else AutoModelForSequenceClassification
    ref = auto.from_pretrained(out).eval()
    with torch.no_grad():
        hidden = encoder(**torch_inputs(batch)).last_hidden_state.numpy()
        theirs = ref(**torch_inputs(batch)).logits.numpy()
    mask = batch["attention_mask"]
    assert type(encoder) is DistilBertModel
    assert max_diff_on_tokens(hidden_ours(model, batch), hidden, mask) <= 1e-4
    if head == "mlm":
        assert type(ref) is DistilBertForMaskedLM
        assert max_diff_on_tokens(run_ours(model, batch), theirs, mask) <= 1e-4
    else:
        assert type(ref) is DistilBertForSequenceClassification
        assert np.max(np.abs(run_ours(model, batch) - theirs)) <= 1e-4

    back = load_pretrained(out, require_head=True)
    # seq_classif_dropout must be a number in transformers: "as the hidden dropout" (None) is written as its value.
    assert back.model.config == dataclasses.replace(model.config, classifier_dropout=model.config.hidden_dropout)
    before = jax.tree.leaves(nnx.state(model, nnx.Param))
    after = jax.tree.leaves(nnx.state(back.model, nnx.Param))
    assert len(before) == len(after)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_attention_output_has_no_dropout(wordpiece_dir):
    # transformers' DistilBERT drops out the feed-forward output, not the attention output as BERT does.
    tok = Tokenizer.load(wordpiece_dir)
    layers = build(family_config("distilbert", tok), "mlm").encoder.layers
    assert all(not layer.attn_out_dropout and layer.dropout.rate == 0.1 for layer in layers)
    bert_layers = build(family_config("bert", tok), "mlm").encoder.layers
    assert all(layer.attn_out_dropout for layer in bert_layers)


# ---------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "key,value",
    [("sinusoidal_pos_embds", True), ("tie_weights_", False), ("tie_word_embeddings", False)],
)
def test_unsupported_option_is_refused_in_one_line(key, value, wordpiece_dir, tmp_path):
    folder = reference(DistilBertForMaskedLM, wordpiece_dir, tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as e:
        load_pretrained(folder)
    message = str(e.value)
    assert f"{key}={value!r}" in message and "config.json" in message and "\n" not in message


def test_untied_decoder_weight_is_refused(wordpiece_dir, tmp_path):
    folder = reference(DistilBertForMaskedLM, wordpiece_dir, tmp_path / "hf")
    tensors = load_file(folder / "model.safetensors")
    word = tensors["distilbert.embeddings.word_embeddings.weight"]
    save_file({**tensors, "vocab_projector.weight": word}, folder / "model.safetensors")
    load_pretrained(folder, require_head=True)  # stored, but equal: tied
    save_file({**tensors, "vocab_projector.weight": word + 1}, folder / "model.safetensors")
    with pytest.raises(UserError, match=r"^vocab_projector.weight differs from distilbert.embeddings"):
        load_pretrained(folder)


def test_config_other_than_transformers_builds_is_refused(wordpiece_dir):
    tok = Tokenizer.load(wordpiece_dir)
    with pytest.raises(UserError, match="type_vocab_size=2"):
        build(family_config("distilbert", tok, type_vocab_size=2))
    with pytest.raises(UserError, match="layer_norm_eps=1e-05"):
        build(family_config("distilbert", tok, layer_norm_eps=1e-5))
    with pytest.raises(UserError, match="classifier_act='gelu'"):
        build(family_config("distilbert", tok, classifier_act="gelu"), "sequence")
