"""ModernBERT against transformers (eager and sdpa attention): hidden states, masked-LM and classification logits,
fine-tuning gradients, both config.json forms, weights that round-trip exactly, and the options it refuses.

The batch is longer than the local window (local_attention 8, about 20 tokens), layers alternate global and local
(global_attn_every_n_layers 2, 3 layers) and the two RoPE bases differ, so a wrong window, layer pattern or base
changes the numbers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from flax.traverse_util import flatten_dict
from test_model_hf import max_diff_on_tokens
from transformers import (
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    ModernBertConfig,
    ModernBertForMaskedLM,
    ModernBertForSequenceClassification,
    ModernBertModel,
)

from bertforge.data.batching import pad_batch
from bertforge.errors import UserError
from bertforge.model.architectures import FAMILIES, build, config_from_hf, key_table
from bertforge.model.config import ModelConfig
from bertforge.model.hf import load_pretrained, save_pretrained
from bertforge.tokenizer.load import Tokenizer

TEXTS = [
    "The river city had a music school and a church by the station.",
    "A much longer sentence about the army, the church and the league season, which needs many more tokens.",
    "Short one!",
]
PAIRS = ["a second text about the king", "b", "the king of the river"]
WINDOW, EVERY_N, LAYERS = 8, 2, 3
THETAS = dict(global_rope_theta=1000.0, local_rope_theta=20.0)
SIZES = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=2)
# Bias switches: ModernBERT-base's (the decoder's only), all on, all off.
BIASES = {
    "base": dict(attention_bias=False, mlp_bias=False, norm_bias=False, classifier_bias=False, decoder_bias=True),
    "all": dict(attention_bias=True, mlp_bias=True, norm_bias=True, classifier_bias=True, decoder_bias=True),
    "none": dict(attention_bias=False, mlp_bias=False, norm_bias=False, classifier_bias=False, decoder_bias=False),
}
NO_SPECIAL_IDS = dict.fromkeys(("bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id"))


# ------------------------------------------------------------------------------------------------------- helpers
def reference(model_cls, tokenizer_dir: Path, out: Path, biases: str = "base", **extra) -> Path:
    """A random transformers ModernBERT `model_cls` with a wide initialiser and shaken biases and norms, saved."""
    tok = Tokenizer.load(tokenizer_dir)
    torch.manual_seed(0)
    config = ModernBertConfig(
        vocab_size=tok.vocab_size,
        pad_token_id=tok.pad_id,
        max_position_embeddings=64,
        initializer_range=0.2,
        local_attention=WINDOW,
        global_attn_every_n_layers=EVERY_N,
        **THETAS,
        **SIZES,
        **BIASES[biases],
        **NO_SPECIAL_IDS,
        **extra,
    )
    model = model_cls(config)
    with torch.no_grad():  # biases and norm weights start at 0 / 1: shake them so a wrong mapping cannot hide
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.eval().save_pretrained(out)
    return out


def pair_batch(tokenizer_dir: Path) -> dict[str, np.ndarray]:
    """Right-padded text pairs, longer than the window."""
    tok = Tokenizer.load(tokenizer_dir)
    encs = tok.encode_batch(TEXTS, PAIRS)
    batch = pad_batch(encs, tok.pad_id, max(len(e.ids) for e in encs))
    length = batch["attention_mask"].sum(axis=1)
    assert batch["input_ids"].shape[1] > 2 * WINDOW and length.min() < length.max()  # window and padding matter
    return batch


def theirs(model, batch, field="logits") -> np.ndarray:
    inputs = {k: torch.tensor(batch[k], dtype=torch.long) for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        return getattr(model(**inputs), field).numpy()


def ours(model, batch) -> np.ndarray:
    model.eval()
    return np.asarray(model(*(jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "token_type_ids"))))


def hf_load(auto, folder: Path, attn: str = "eager"):
    return auto.from_pretrained(folder, attn_implementation=attn).eval()


def to_original_form(folder: Path) -> None:
    """Rewrite config.json in the form of the public checkpoints: global_attn_every_n_layers, global_rope_theta and
    local_rope_theta, without transformers' layer_types and rope_parameters."""
    data = json.loads((folder / "config.json").read_text())
    del data["layer_types"], data["rope_parameters"]
    data.update(global_attn_every_n_layers=EVERY_N, **THETAS)
    (folder / "config.json").write_text(json.dumps(data))


# ------------------------------------------------------------------------------------------------ against HF
@pytest.mark.parametrize(
    ("biases", "attn", "attention", "form"),
    [
        ("base", "eager", "custom", "transformers"),
        ("all", "sdpa", "xla", "transformers"),
        ("base", "sdpa", "explicit", "original"),
    ],
)
def test_hidden_states_match_transformers(biases, attn, attention, form, bpe_dir, tmp_path):
    # A bare ModernBertModel checkpoint: its names have no "model." prefix.
    folder = reference(ModernBertModel, bpe_dir, tmp_path / "hf", biases)
    if form == "original":
        to_original_form(folder)
    pre = load_pretrained(folder, need_tokenizer=False, overrides={"attention": attention})
    cfg = pre.model.config
    assert (cfg.global_attn_every_n_layers, cfg.local_attention, cfg.global_rope_theta) == (EVERY_N, WINDOW, 1000.0)
    batch = pair_batch(bpe_dir)
    pre.model.eval()
    got = np.asarray(pre.model.encoder(*(jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask"))))
    want = theirs(hf_load(AutoModel, folder, attn), batch, "last_hidden_state")
    assert max_diff_on_tokens(got, want, batch["attention_mask"]) <= 1e-4
    types = jnp.asarray(batch["attention_mask"])  # token types 1: ignored, ModernBERT has none
    with_types = pre.model.encoder(jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"]), types)
    np.testing.assert_array_equal(np.asarray(with_types), got)


@pytest.mark.parametrize(("biases", "attn"), [("base", "eager"), ("all", "sdpa")])
def test_mlm_logits_match_transformers(biases, attn, bpe_dir, tmp_path):
    folder = reference(ModernBertForMaskedLM, bpe_dir, tmp_path / "hf", biases)
    pre = load_pretrained(folder, require_head=True, need_tokenizer=False)
    assert pre.head == "mlm" and pre.model.config.family == "modernbert"
    batch = pair_batch(bpe_dir)
    want = theirs(hf_load(ModernBertForMaskedLM, folder, attn), batch)
    assert max_diff_on_tokens(ours(pre.model, batch), want, batch["attention_mask"]) <= 1e-4


@pytest.mark.parametrize(
    ("biases", "pooling", "num_labels", "attn"),
    [("base", "cls", 1, "eager"), ("base", "mean", 3, "sdpa"), ("all", "mean", 1, "eager"), ("all", "cls", 3, "sdpa")],
)
def test_sequence_logits_match_transformers(biases, pooling, num_labels, attn, bpe_dir, tmp_path):
    folder = reference(
        ModernBertForSequenceClassification,
        bpe_dir,
        tmp_path / "hf",
        biases,
        classifier_pooling=pooling,
        num_labels=num_labels,
    )
    pre = load_pretrained(folder, require_head=True, need_tokenizer=False)
    assert pre.head == "sequence" and pre.model.num_labels == num_labels and pre.model.config.pooling == pooling
    batch = pair_batch(bpe_dir)
    want = theirs(hf_load(ModernBertForSequenceClassification, folder, attn), batch)
    assert np.max(np.abs(ours(pre.model, batch) - want)) <= 1e-4


@pytest.mark.parametrize(("biases", "pooling"), [("all", "cls"), ("base", "mean")])
def test_fine_tuning_gradients_match_torch(biases, pooling, bpe_dir, tmp_path):
    folder = reference(
        ModernBertForSequenceClassification,
        bpe_dir,
        tmp_path / "hf",
        biases,
        classifier_pooling=pooling,
        num_labels=1,
    )
    pre = load_pretrained(folder, require_head=True, need_tokenizer=False)
    pre.model.eval()
    batch = pair_batch(bpe_dir)
    target = np.linspace(-1.0, 1.0, len(TEXTS), dtype=np.float32)[:, None]
    ids, mask = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    grads = nnx.jit(nnx.grad(lambda m: jnp.mean((m(ids, mask) - target) ** 2)))(pre.model)
    flat = flatten_dict(nnx.to_pure_dict(grads))

    ref = hf_load(ModernBertForSequenceClassification, folder)
    inputs = {k: torch.tensor(batch[k], dtype=torch.long) for k in ("input_ids", "attention_mask")}
    torch.mean((ref(**inputs).logits - torch.tensor(target)) ** 2).backward()
    params = dict(ref.named_parameters())
    rows = key_table(pre.model.config, "sequence")
    assert {row.hf for row in rows} == set(params)  # every parameter, and nothing else
    for row in rows:
        want = params[row.hf].grad.numpy()
        got = np.asarray(flat[row.path])
        got = got.T if row.transpose else got
        scale = np.abs(want).max()
        assert scale > 1e-6, row.hf  # a real gradient, not zeros on both sides
        assert np.abs(got - want).max() <= 1e-4 * scale, row.hf


# ------------------------------------------------------------------------------------------------- round trip
@pytest.mark.parametrize(
    ("head", "biases", "pooling"),
    [("mlm", "base", "cls"), ("sequence", "all", "mean"), ("mlm", "none", "cls"), ("sequence", "none", "cls")],
)
def test_round_trip_through_transformers(head, biases, pooling, bpe_dir, tmp_path):
    tok = Tokenizer.load(bpe_dir)
    # The family's conventions (no token types, no dropout, gelu head), then this test's sizes and switches.
    family = FAMILIES["modernbert"].apply(dataclasses.asdict(ModelConfig()))
    sizes = dict(hidden_size=32, intermediate_size=48, num_layers=LAYERS, num_heads=2, max_position_embeddings=64)
    cfg = ModelConfig(
        **{
            **family,
            **sizes,
            **THETAS,
            **BIASES[biases],
            "family": "modernbert",
            "vocab_size": tok.vocab_size,
            "pad_token_id": tok.pad_id,
            "initializer_range": 0.2,
            "local_attention": WINDOW,
            "global_attn_every_n_layers": EVERY_N,
            "pooling": pooling,
        }
    )
    model = build(cfg, head, num_labels=2, seed=3)
    state = nnx.state(model, nnx.Param)  # fresh biases are 0 and norms identity: perturb every parameter
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    nnx.update(model, jax.tree.unflatten(treedef, leaves))
    out = save_pretrained(model, tmp_path / "export", tok)
    batch = pair_batch(bpe_dir)
    valid = batch["attention_mask"]

    hidden = np.asarray(model.encoder(jnp.asarray(batch["input_ids"]), jnp.asarray(valid)))
    assert max_diff_on_tokens(hidden, theirs(hf_load(AutoModel, out), batch, "last_hidden_state"), valid) <= 1e-4
    if head == "mlm":
        assert max_diff_on_tokens(ours(model, batch), theirs(hf_load(AutoModelForMaskedLM, out), batch), valid) <= 1e-4
    else:
        want = theirs(hf_load(AutoModelForSequenceClassification, out, "sdpa"), batch)
        assert np.max(np.abs(ours(model, batch) - want)) <= 1e-4

    back = load_pretrained(out, require_head=True)
    assert back.model.config == dataclasses.replace(cfg, classifier_dropout=0.0)  # written as hidden_dropout's 0
    before, after = (jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (model, back.model))
    assert len(before) == len(after)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------------------------------- config.json
# answerdotai/ModernBERT-base's config.json, as published (the original keys only).
BASE_CONFIG = {
    "architectures": ["ModernBertForMaskedLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 50281,
    "classifier_activation": "gelu",
    "classifier_bias": False,
    "classifier_dropout": 0.0,
    "classifier_pooling": "mean",
    "cls_token_id": 50281,
    "decoder_bias": True,
    "deterministic_flash_attn": False,
    "embedding_dropout": 0.0,
    "eos_token_id": 50282,
    "global_attn_every_n_layers": 3,
    "global_rope_theta": 160000.0,
    "gradient_checkpointing": False,
    "hidden_activation": "gelu",
    "hidden_size": 768,
    "initializer_cutoff_factor": 2.0,
    "initializer_range": 0.02,
    "intermediate_size": 1152,
    "layer_norm_eps": 1e-05,
    "local_attention": 128,
    "local_rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "mlp_dropout": 0.0,
    "model_type": "modernbert",
    "norm_bias": False,
    "norm_eps": 1e-05,
    "num_attention_heads": 12,
    "num_hidden_layers": 22,
    "pad_token_id": 50283,
    "position_embedding_type": "absolute",
    "reference_compile": True,
    "sep_token_id": 50282,
    "sparse_pred_ignore_index": -100,
    "sparse_prediction": False,
    "torch_dtype": "float32",
    "transformers_version": "4.47.0.dev0",
    "vocab_size": 50368,
}


def test_the_public_base_config_reads_as_transformers_reads_it():
    cfg, info = config_from_hf(BASE_CONFIG, "config.json")
    hf = ModernBertConfig.from_dict(BASE_CONFIG)
    assert info.head == "mlm" and cfg.family == "modernbert"
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.intermediate_size) == (768, 22, 12, 1152)
    assert cfg.max_seq_len == 8192 and cfg.type_vocab_size == 0 and cfg.pooling == "mean"
    assert (cfg.local_attention // 2, cfg.layer_norm_eps) == (hf.sliding_window, hf.norm_eps)
    kinds = ["full_attention" if i % cfg.global_attn_every_n_layers == 0 else "sliding_attention" for i in range(22)]
    assert kinds == hf.layer_types
    assert cfg.global_rope_theta == hf.rope_parameters["full_attention"]["rope_theta"] == 160000.0
    assert cfg.local_rope_theta == hf.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    flags = ("attention_bias", "mlp_bias", "norm_bias", "classifier_bias", "decoder_bias")
    assert [getattr(cfg, f) for f in flags] == [getattr(hf, f) for f in flags]
    assert (cfg.hidden_act, cfg.classifier_act, cfg.hidden_dropout, cfg.attention_dropout) == ("gelu", "gelu", 0, 0)
    # The large model: another layer count and pattern, the same keys.
    large = {**BASE_CONFIG, "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16}
    assert config_from_hf(large, "config.json")[0].num_layers == 28


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("hidden_activation", "quick_gelu"),
        ("classifier_activation", "mish"),
        ("classifier_pooling", "max"),
        ("rope_parameters", {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10.0}}),
        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
        ("layer_types", ["full_attention", "full_attention", "sliding_attention"]),
        ("tie_word_embeddings", False),
        ("head_dim", 8),
    ],
)
def test_unsupported_options_are_refused_in_one_line(key, value, bpe_dir, tmp_path):
    folder = reference(ModernBertForMaskedLM, bpe_dir, tmp_path / "hf")
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**data, key: value}))
    with pytest.raises(UserError) as err:
        load_pretrained(folder, need_tokenizer=False)
    message = str(err.value)
    named = value["full_attention"] if key == "rope_parameters" else value  # named as rope_parameters.full_attention
    assert "\n" not in message and key in message and repr(named) in message


def test_runtime_flags_are_accepted(bpe_dir, tmp_path):
    folder = reference(ModernBertForMaskedLM, bpe_dir, tmp_path / "hf")
    data = json.loads((folder / "config.json").read_text())
    flags = dict(
        reference_compile=True, sparse_prediction=True, deterministic_flash_attn=True, gradient_checkpointing=True
    )
    (folder / "config.json").write_text(json.dumps({**data, **flags}))
    assert load_pretrained(folder, need_tokenizer=False).model.config.family == "modernbert"


def tiny_config(**extra) -> ModelConfig:
    return ModelConfig(
        family="modernbert",
        vocab_size=500,
        type_vocab_size=0,
        max_position_embeddings=64,
        num_layers=2,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        local_attention=WINDOW,
        global_attn_every_n_layers=EVERY_N,
        **THETAS,
        **extra,
    )


def tiny_batch(seq_len: int) -> tuple[jax.Array, jax.Array]:
    ids = jnp.asarray(np.random.default_rng(0).integers(5, 500, (3, seq_len)))
    mask = jnp.asarray(np.arange(seq_len)[None, :] < np.array([[seq_len], [13], [5]])).astype(jnp.int32)
    return ids, mask


@pytest.mark.slow  # `make slow`
def test_remat_and_dropout_give_the_plain_numbers():
    # Dropout everywhere (embeddings, attention probabilities and output, MLP, head): the rematerialised layers
    # draw the same keys as the plain ones, so loss and gradients are the same.
    cfg = tiny_config(hidden_dropout=0.1, attention_dropout=0.1)
    ids, mask = tiny_batch(20)
    results = []
    for remat in (False, True):
        model = build(dataclasses.replace(cfg, remat=remat), head="mlm", seed=1)
        model.train()
        step = nnx.jit(lambda m: nnx.value_and_grad(lambda m: jnp.mean(m(ids, mask) ** 2))(m))
        loss, g = step(model)
        results.append((float(loss), np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    np.testing.assert_allclose(results[0][1], results[1][1], atol=1e-6 * np.abs(results[0][1]).max())
    layer = model.encoder.layers[1]
    assert not layer.dropout.deterministic and layer.dropout.rate == layer.attn_dropout.rate == 0.1  # dropout on


# ------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a GPU")
@pytest.mark.parametrize("seq_len", [20, 19])
def test_bf16_model_on_cudnn_stays_close_to_custom(seq_len):
    # Two layers: the second, local, computes only the [CLS] query (odd for cuDNN, as is an odd sequence length).
    cfg = tiny_config(hidden_dropout=0.0, attention_dropout=0.0, dtype="bfloat16")
    ids, mask = tiny_batch(seq_len)
    losses, grads = {}, {}
    for name in ("custom", "cudnn"):
        model = build(dataclasses.replace(cfg, attention=name), head="sequence", num_labels=2)
        model.train()
        losses[name], g = nnx.value_and_grad(lambda m: jnp.sum(m(ids, mask) ** 2))(model)
        grads[name] = np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
    assert np.all(np.isfinite(grads["cudnn"]))
    # bf16 matmuls in both, rounded in different places: agreement to a few bf16 steps (2^-8 relative).
    assert float(losses["cudnn"]) == pytest.approx(float(losses["custom"]), rel=0.02)
    assert np.linalg.norm(grads["cudnn"] - grads["custom"]) / np.linalg.norm(grads["custom"]) < 0.02
