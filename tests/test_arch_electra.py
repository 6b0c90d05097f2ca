"""ELECTRA against transformers: hidden states, generator (masked-LM) and classification logits, fine-tuning
gradients, the discriminator checkpoint as an encoder, and weights that round-trip exactly."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from flax.traverse_util import flatten_dict
from test_model_hf import batch_for, max_diff_on_tokens, torch_inputs
from transformers import (
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    ElectraConfig,
    ElectraForMaskedLM,
    ElectraForPreTraining,
    ElectraForSequenceClassification,
    ElectraModel,
)

from bertforge.errors import UserError
from bertforge.model.architectures import FAMILIES, build, key_table
from bertforge.model.config import ModelConfig, preset
from bertforge.model.hf import load_pretrained, save_pretrained
from bertforge.tokenizer.load import Tokenizer

TEXTS = [
    "The river city had a music school.",
    "A much longer sentence about the army, the church and the league season, which needs many more tokens.",
    "Short one!",
]
PAIRS = ["a second text", "b", "the king of the river"]
# electra-small's shape, smaller: an embedding table narrower than the hidden size, projected up.
SIZES = dict(
    embedding_size=16,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    type_vocab_size=2,
)


# ------------------------------------------------------------------------------------------------------- helpers
def randomise(model: torch.nn.Module) -> None:
    """Biases and norm weights start at 0 / 1: shake them so that a wrong mapping cannot hide."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name or "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))


def save_reference(model: torch.nn.Module, tokenizer_dir: Path, out: Path) -> Path:
    randomise(model)
    model.eval().save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, out / name)
    return out


def reference(model_cls, tokenizer_dir: Path, out: Path, seed: int = 0, **extra) -> Path:
    """A randomly initialised transformers ELECTRA `model_cls` with a wide initialiser, saved to `out`."""
    tok = Tokenizer.load(tokenizer_dir)
    torch.manual_seed(seed)
    fields = {**SIZES, **extra}
    config = ElectraConfig(vocab_size=tok.vocab_size, pad_token_id=tok.pad_id, initializer_range=0.2, **fields)
    return save_reference(model_cls(config), tokenizer_dir, out)


def pair_batch(tokenizer) -> dict[str, np.ndarray]:
    batch = batch_for(tokenizer, TEXTS, pairs=PAIRS)
    assert batch["attention_mask"].min() == 0 and batch["token_type_ids"].max() == 1  # padding and both types
    return batch


def inputs(batch) -> list[jax.Array]:
    return [jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "token_type_ids")]


def run_ours(model, batch) -> np.ndarray:
    model.eval()
    return np.asarray(model(*inputs(batch)))


def hidden_ours(model, batch) -> np.ndarray:
    model.eval()
    return np.asarray(model.encoder(*inputs(batch)))


def perturbed(model):
    """A bertforge model with every parameter moved off its initial value (zero biases, identity norms)."""
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    nnx.update(model, jax.tree.unflatten(treedef, leaves))
    return model


def family_config(family: str, tok: Tokenizer, **extra) -> ModelConfig:
    """The `test` preset with the family's conventions, as `init --model.family=...` builds it."""
    base = dataclasses.asdict(preset("test", vocab_size=tok.vocab_size, pad_token_id=tok.pad_id))
    return ModelConfig(**{**FAMILIES[family].apply(base), "initializer_range": 0.2, "family": family, **extra})


def assert_gradients_match(model, ref: torch.nn.Module, batch, torch_batch) -> float:
    """Gradients of the MSE of the (B, 1) output: every parameter of `ref` against ours through the key table.
    Returns the worst relative error (max abs difference / max abs of torch's gradient)."""
    targets = np.array([0.5, -1.0, 2.0], np.float32)
    model.eval()

    def loss(m):
        return jnp.mean((m(*inputs(batch))[:, 0] - targets) ** 2)

    grads = flatten_dict(nnx.to_pure_dict(nnx.jit(nnx.grad(loss))(model)))
    ((ref(**torch_batch).logits[:, 0] - torch.from_numpy(targets)) ** 2).mean().backward()
    theirs = {name: p.grad.numpy() for name, p in ref.named_parameters()}
    rows = key_table(model.config, "sequence")
    assert sorted(r.hf for r in rows) == sorted(theirs)  # every transformers parameter, and only those
    scale = max(np.abs(g).max() for g in theirs.values())
    worst = 0.0
    for row in rows:
        want = theirs[row.hf]
        got = np.asarray(grads[row.path])
        got = got.T if row.transpose else got
        diff = np.abs(got - want).max()
        if ".k_lin.bias" in row.hf or ".key.bias" in row.hf:
            # Exactly zero in exact arithmetic (softmax ignores a shift shared by all keys): both are rounding noise.
            assert diff <= 1e-6 * scale, row.hf
            continue
        assert np.abs(want).max() > 1e-6 * scale, row.hf  # a real gradient, not zeros on both sides
        rel = diff / np.abs(want).max()
        assert rel <= 1e-4, f"{row.hf}: relative error {rel:.2e}"
        worst = max(worst, rel)
    return worst


# ------------------------------------------------------------------------------------------------------- outputs
@pytest.mark.parametrize("embedding_size", [16, 32])
def test_hidden_states_match_transformers(embedding_size, wordpiece_dir, tmp_path):
    folder = reference(ElectraModel, wordpiece_dir, tmp_path / "hf", embedding_size=embedding_size)
    pre = load_pretrained(folder)
    assert pre.model.config.embed_dim == embedding_size
    assert pre.model.config.embedding_size == (0 if embedding_size == 32 else embedding_size)
    assert (pre.model.encoder.embeddings.project is None) == (embedding_size == 32)
    batch = pair_batch(pre.tokenizer)
    ref = AutoModel.from_pretrained(folder).eval()
    with torch.no_grad():
        theirs = ref(**torch_inputs(batch)).last_hidden_state.numpy()
    assert max_diff_on_tokens(hidden_ours(pre.model, batch), theirs, batch["attention_mask"]) <= 1e-4


def test_discriminator_checkpoint_loads_as_an_encoder(wordpiece_dir, tmp_path):
    folder = reference(ElectraForPreTraining, wordpiece_dir, tmp_path / "hf")
    # Its replaced-token head is no masked-LM head: asked for one, the checkpoint is refused ...
    with pytest.raises(UserError, match="has no masked-LM head weights"):
        load_pretrained(folder, require_head=True)
    # ... and for fine-tuning the encoder loads while a sequence head starts fresh.
    pre = load_pretrained(folder, head="sequence", num_labels=1)
    assert pre.head == "sequence" and set(pre.missing_head) == {
        "classifier.dense.weight",
        "classifier.dense.bias",
        "classifier.out_proj.weight",
        "classifier.out_proj.bias",
    }
    batch = pair_batch(pre.tokenizer)
    ref = ElectraForPreTraining.from_pretrained(folder).eval()
    with torch.no_grad():
        theirs = ref.electra(**torch_inputs(batch)).last_hidden_state.numpy()
    assert max_diff_on_tokens(hidden_ours(pre.model, batch), theirs, batch["attention_mask"]) <= 1e-4


def test_generator_mlm_logits_match_transformers(wordpiece_dir, tmp_path):
    folder = reference(ElectraForMaskedLM, wordpiece_dir, tmp_path / "hf", hidden_act="gelu_new")
    pre = load_pretrained(folder, require_head=True)
    assert pre.head == "mlm" and pre.model.config.hidden_act == "gelu_new"  # the head's GELU stays exact
    batch = pair_batch(pre.tokenizer)
    ref = ElectraForMaskedLM.from_pretrained(folder).eval()
    with torch.no_grad():
        theirs = ref(**torch_inputs(batch)).logits.numpy()
    assert max_diff_on_tokens(run_ours(pre.model, batch), theirs, batch["attention_mask"]) <= 1e-4


@pytest.mark.parametrize("num_labels", [1, 3])
def test_sequence_logits_match_transformers(num_labels, wordpiece_dir, tmp_path):
    folder = reference(ElectraForSequenceClassification, wordpiece_dir, tmp_path / "hf", num_labels=num_labels)
    pre = load_pretrained(folder, require_head=True)
    assert pre.head == "sequence" and pre.model.num_labels == num_labels
    assert pre.model.config.classifier_act == "gelu"
    batch = pair_batch(pre.tokenizer)
    ref = ElectraForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        theirs = ref(**torch_inputs(batch)).logits.numpy()
    assert np.max(np.abs(run_ours(pre.model, batch) - theirs)) <= 1e-4


def test_fine_tuning_gradients_match_torch(wordpiece_dir, tmp_path):
    folder = reference(ElectraForSequenceClassification, wordpiece_dir, tmp_path / "hf", num_labels=1)
    pre = load_pretrained(folder, require_head=True)
    batch = pair_batch(pre.tokenizer)
    ref = ElectraForSequenceClassification.from_pretrained(folder).eval()
    assert assert_gradients_match(pre.model, ref, batch, torch_inputs(batch)) <= 1e-4


# ------------------------------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("head", ["mlm", "sequence"])
def test_round_trip_through_transformers(head, wordpiece_dir, tmp_path):
    tok = Tokenizer.load(wordpiece_dir)
    cfg = family_config("electra", tok, embedding_size=16)
    model = perturbed(build(cfg, head, num_labels=2, seed=3))
    out = save_pretrained(model, tmp_path / "export", tok)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "electra" and config["architectures"][0].startswith("Electra")
    batch = pair_batch(tok)

    encoder = AutoModel.from_pretrained(out).eval()
    auto = AutoModelForMaskedLM if head == "mlm" else AutoModelForSequenceClassification
    ref = auto.from_pretrained(out).eval()
    with torch.no_grad():
        hidden = encoder(**torch_inputs(batch)).last_hidden_state.numpy()
        theirs = ref(**torch_inputs(batch)).logits.numpy()
    mask = batch["attention_mask"]
    assert type(encoder) is ElectraModel
    assert max_diff_on_tokens(hidden_ours(model, batch), hidden, mask) <= 1e-4
    if head == "mlm":
        assert type(ref) is ElectraForMaskedLM
        assert max_diff_on_tokens(run_ours(model, batch), theirs, mask) <= 1e-4
    else:
        assert type(ref) is ElectraForSequenceClassification
        assert np.max(np.abs(run_ours(model, batch) - theirs)) <= 1e-4

    back = load_pretrained(out, require_head=True)
    assert back.model.config == model.config
    before = jax.tree.leaves(nnx.state(model, nnx.Param))
    after = jax.tree.leaves(nnx.state(back.model, nnx.Param))
    assert len(before) == len(after)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "key,value",
    [
        ("summary_type", "mean"),
        ("summary_use_proj", False),
        ("summary_activation", "tanh"),
        ("summary_proj_to_labels", True),
        ("position_embedding_type", "relative_key"),
        ("is_decoder", True),
        ("tie_word_embeddings", False),
    ],
)
def test_unsupported_option_is_refused_in_one_line(key, value, wordpiece_dir, tmp_path):
    folder = reference(ElectraForMaskedLM, wordpiece_dir, tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as e:
        load_pretrained(folder)
    message = str(e.value)
    assert f"{key}={value!r}" in message and "config.json" in message and "\n" not in message


def test_classification_activation_other_than_gelu_is_refused(wordpiece_dir):
    tok = Tokenizer.load(wordpiece_dir)
    with pytest.raises(UserError, match="classifier_act='tanh'"):
        build(family_config("electra", tok, classifier_act="tanh"), "sequence")
