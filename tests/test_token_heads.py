"""The token head of every family against transformers' *ForTokenClassification: logits, dropout rates, labels and
weights through a round trip, and a fresh head over a masked-LM, sequence-classification or pretraining checkpoint."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import test_arch_deberta as deberta_refs
import test_arch_distilbert as distilbert_refs
import test_arch_electra as electra_refs
import test_arch_modernbert as modernbert_refs
import torch
import transformers
from flax import nnx
from flax.traverse_util import flatten_dict
from hf_models import hf_config, save_hf_model
from safetensors.numpy import load_file
from test_model_hf import TEXTS, batch_for, max_diff_on_tokens, run_ours
from transformers import AutoModelForTokenClassification

from bertforge.card import AUTO, PIPELINES
from bertforge.errors import UserError
from bertforge.model import load as load_module
from bertforge.model.architectures import build, config_from_hf, config_to_hf, key_table, normalise_keys
from bertforge.model.hf import Pretrained, export_weights, load_pretrained, save_pretrained
from bertforge.model.load import load_model
from bertforge.tokenizer.load import Tokenizer

LABELS = 5
ID2LABEL = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}
HEAD_DROPOUT = 0.3  # the head's own rate where the family's config has one, unlike every hidden rate (0.1)


def xlm_roberta(model_cls, tok_dir: Path, out: Path, **extra) -> Path:
    """hf_models' RoBERTa as an XLM-R config (model_type xlm-roberta), biases shaken as save_hf_model does."""
    roberta = hf_config("roberta", Tokenizer.load(tok_dir).vocab_size, **extra).to_dict()
    config = transformers.XLMRobertaConfig(**{k: v for k, v in roberta.items() if k != "model_type"})
    torch.manual_seed(0)
    return electra_refs.save_reference(model_cls(config), tok_dir, out)


def with_tokenizer(folder: Path, tok_dir: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok_dir / name, folder / name)
    return folder


def deberta_v3(model_cls, tok_dir: Path, out: Path, **extra) -> Path:
    """test_arch_deberta's v3 variant (relative attention only) over the tokenizer's vocabulary."""
    tok = Tokenizer.load(tok_dir)
    deberta_refs.save_reference(model_cls, "v3", out, vocab_size=tok.vocab_size, pad_token_id=tok.pad_id, **extra)
    return with_tokenizer(out, tok_dir)


def modernbert(model_cls, tok_dir: Path, out: Path, **extra) -> Path:
    """test_arch_modernbert's reference with every bias on (the head's dense and norm have theirs)."""
    return with_tokenizer(modernbert_refs.reference(model_cls, tok_dir, out, "all", **extra), tok_dir)


@dataclasses.dataclass(frozen=True)
class Case:
    prefix: str  # of the transformers classes
    tokenizer: str  # the session fixture
    save: Callable[..., Path]  # save(model_cls, tokenizer_dir, out, **config) -> the folder
    head_dropout: str | None  # the config key of the token head's rate; None: the hidden dropout's
    exported: str = ""  # the family bertforge writes it as, when it is another's (XLM-R: RoBERTa)


CASES = {
    "bert": Case(
        "Bert", "wordpiece_dir", lambda c, d, o, **x: save_hf_model(c, "bert", d, o, **x), "classifier_dropout"
    ),
    "roberta": Case(
        "Roberta", "bpe_dir", lambda c, d, o, **x: save_hf_model(c, "roberta", d, o, **x), "classifier_dropout"
    ),
    "xlm-roberta": Case("XLMRoberta", "bpe_dir", xlm_roberta, "classifier_dropout", exported="Roberta"),
    "deberta-v2": Case("DebertaV2", "wordpiece_dir", deberta_v3, None),  # cls_dropout is the sequence head's
    "modernbert": Case("ModernBert", "bpe_dir", modernbert, "classifier_dropout"),
    "electra": Case("Electra", "wordpiece_dir", electra_refs.reference, "classifier_dropout"),
    "distilbert": Case("DistilBert", "wordpiece_dir", distilbert_refs.reference, None),  # not seq_classif_dropout
}
# The head-dropout key as each family's config spells the sequence head's, to show the token head ignores it.
SEQUENCE_DROPOUT = {"deberta-v2": "cls_dropout", "distilbert": "seq_classif_dropout"}


def reference(family: str, kind: str, request, out: Path, **extra) -> tuple[Path, Tokenizer]:
    """A random transformers {prefix}For{kind} of `family` saved to `out`, and the tokenizer its batch is made with."""
    case = CASES[family]
    tok_dir = request.getfixturevalue(case.tokenizer)
    if kind != "MaskedLM":
        extra.setdefault(case.head_dropout or SEQUENCE_DROPOUT[family], HEAD_DROPOUT)
    return case.save(getattr(transformers, f"{case.prefix}For{kind}"), tok_dir, out, **extra), Tokenizer.load(tok_dir)


def torch_logits(model, batch) -> np.ndarray:
    """The texts are single segments, so no family needs token types (DistilBERT takes none)."""
    inputs = {k: torch.tensor(batch[k], dtype=torch.long) for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        return model.eval()(**inputs).logits.numpy()


def head_dropout(model) -> float:
    """The rate of the dropout before a transformers token model's classifier (ModernBERT calls it `drop`)."""
    return (model.drop if hasattr(model, "drop") else model.dropout).p


def params(model) -> dict:
    return flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


# ------------------------------------------------------------------------------------------------ against HF
@pytest.mark.parametrize("family", CASES)
def test_token_logits_match_transformers_and_round_trip(family, request, tmp_path):
    folder, tok = reference(family, "TokenClassification", request, tmp_path / "hf", num_labels=LABELS)
    config = json.loads((folder / "config.json").read_text())
    cfg, info = config_from_hf(config, "config.json")
    assert info.head == "token" and info.num_labels == LABELS and info.problem_type is None
    # The key table names every parameter transformers saves, and only those.
    assert sorted(row.hf for row in key_table(cfg, "token")) == sorted(load_file(folder / "model.safetensors"))

    pre = load_model(folder, head="token", num_labels=LABELS)
    assert pre.head == "token" and pre.missing_head == [] and pre.model.num_labels == LABELS
    ref = AutoModelForTokenClassification.from_pretrained(folder)
    assert pre.model.head.dropout.rate == pytest.approx(head_dropout(ref))
    batch = batch_for(tok, TEXTS[:2])
    mask = batch["attention_mask"]
    assert mask.min() == 0 and mask.sum(axis=1).min() < mask.sum(axis=1).max()  # two lengths, padding
    ours = run_ours(pre.model, batch)
    assert ours.shape == (2, mask.shape[1], LABELS) and ours.dtype == np.float32
    assert max_diff_on_tokens(ours, torch_logits(ref, batch), mask) <= 1e-4

    out = save_pretrained(pre.model, tmp_path / "export", tok, id2label=ID2LABEL)
    back = AutoModelForTokenClassification.from_pretrained(out)
    assert type(back).__name__ == f"{CASES[family].exported or CASES[family].prefix}ForTokenClassification"
    assert back.config.id2label == ID2LABEL and back.config.label2id == {v: k for k, v in ID2LABEL.items()}
    assert head_dropout(back) == pytest.approx(head_dropout(ref))
    assert max_diff_on_tokens(ours, torch_logits(back, batch), mask) <= 1e-4

    again = load_model(out)  # config.json names the token head and its labels
    assert again.head == "token" and again.id2label == ID2LABEL and again.missing_head == []
    for path, value in params(pre.model).items():
        np.testing.assert_array_equal(np.asarray(params(again.model)[path]), np.asarray(value), err_msg=str(path))


# ------------------------------------------------------------------------------------------------- fresh heads
@pytest.mark.parametrize("family", CASES)
def test_a_token_model_over_a_masked_lm_folder_has_its_encoder_and_a_fresh_head(family, request, tmp_path):
    folder, _ = reference(family, "MaskedLM", request, tmp_path / "mlm")
    pre = load_pretrained(folder, head="token", num_labels=LABELS, seed=7, need_tokenizer=False)
    assert pre.head == "token" and pre.model.num_labels == LABELS
    fresh = {row.hf for row in key_table(pre.model.config, "token") if row.head}
    # What transformers' own token class takes from the folder, bertforge takes: ModernBERT's MLM `head` (dense,
    # norm) has the token head's names, so only its classifier is fresh, as with a sequence head.
    theirs = AutoModelForTokenClassification.from_pretrained(folder, num_labels=LABELS).state_dict()
    stored = fresh & set(normalise_keys(load_file(folder / "model.safetensors"), pre.model.config))
    assert sorted(pre.missing_head) == sorted(fresh - stored) and "classifier.weight" in pre.missing_head
    built = params(build(pre.model.config, "token", num_labels=LABELS, seed=7))
    ours = params(pre.model)
    for row in key_table(pre.model.config, "token"):
        if row.hf in pre.missing_head:  # drawn as a freshly built model draws it
            np.testing.assert_allclose(np.asarray(ours[row.path]), np.asarray(built[row.path]), atol=1e-7)
        else:
            want = theirs[row.hf].numpy()
            np.testing.assert_array_equal(np.asarray(ours[row.path]), want.T if row.transpose else want)
    with pytest.raises(UserError, match="has no token-classification head weights"):
        load_pretrained(folder, head="token", require_head=True, need_tokenizer=False)


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_a_sequence_classifier_read_as_a_token_model_gets_a_fresh_head(family, request, tmp_path):
    # Its classifier (and ModernBERT's pooled-vector `head`) means something else: nothing of the head is taken.
    folder, _ = reference(family, "SequenceClassification", request, tmp_path / "seq", num_labels=3)
    pre = load_pretrained(folder, head="token", num_labels=LABELS, seed=2, need_tokenizer=False)
    fresh = [row for row in key_table(pre.model.config, "token") if row.head]
    assert sorted(pre.missing_head) == sorted(row.hf for row in fresh)
    built = params(build(pre.model.config, "token", num_labels=LABELS, seed=2))
    for row in fresh:
        np.testing.assert_allclose(np.asarray(params(pre.model)[row.path]), np.asarray(built[row.path]), atol=1e-7)
    stored = load_file(folder / "model.safetensors")
    for name, value in export_weights(pre.model, "token").items():
        if name not in pre.missing_head:
            np.testing.assert_array_equal(value, stored[name])
    with pytest.raises(UserError, match="has no token-classification head weights"):
        load_pretrained(folder, head="token", require_head=True, need_tokenizer=False)
    # The same folder still loads as the sequence classifier it is.
    assert load_pretrained(folder, need_tokenizer=False).missing_head == []


def test_a_pretraining_run_gives_its_encoder_under_a_fresh_token_head(monkeypatch, wordpiece_dir, tmp_path):
    tok = Tokenizer.load(wordpiece_dir)
    cfg = electra_refs.family_config("bert", tok)
    mlm = electra_refs.perturbed(build(cfg, "mlm", seed=1))
    run = Pretrained(mlm, tok, "mlm", {}, None, tmp_path / "run", [], 10)
    monkeypatch.setattr(load_module, "is_run", lambda name: True)
    monkeypatch.setattr(load_module, "load_run", lambda name, which="latest", part="": run)
    pre = load_model(tmp_path / "run", head="token", num_labels=LABELS, seed=4)
    assert pre.head == "token" and pre.model.task == "token" and pre.model.num_labels == LABELS
    assert pre.missing_head == ["classifier.weight", "classifier.bias"] and len(pre.id2label) == LABELS
    encoder = flatten_dict(nnx.to_pure_dict(nnx.state(mlm.encoder, nnx.Param)))
    for path, value in flatten_dict(nnx.to_pure_dict(nnx.state(pre.model.encoder, nnx.Param))).items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(encoder[path]))
    built = build(cfg, "token", num_labels=LABELS, seed=4)
    np.testing.assert_array_equal(np.asarray(pre.model.head.out.kernel[...]), np.asarray(built.head.out.kernel[...]))
    with pytest.raises(UserError, match="not a token head"):
        load_model(tmp_path / "run", head="token", require_head=True)


# ------------------------------------------------------------------------------------------------- config.json
@pytest.mark.parametrize("family", [name for name in CASES if not CASES[name].exported])
def test_config_json_of_a_token_model(family, wordpiece_dir):
    cfg = electra_refs.family_config(family, Tokenizer.load(wordpiece_dir), pooling="attention")
    data = config_to_hf(cfg, "token", {0: "O"})
    assert data["architectures"] == [f"{CASES[family].prefix}ForTokenClassification"]
    assert data["id2label"] == {"0": "O"} and data["label2id"] == {"O": 0}
    # One label is not regression for a token head, and no pooling is a token head's.
    assert "problem_type" not in data and "bertforge_pooling" not in data
    head = nnx.eval_shape(lambda: build(cfg, "token", num_labels=1)).head
    assert "score" not in nnx.to_pure_dict(nnx.state(head, nnx.Param)) and head.out.kernel.shape == (32, 1)
    assert (PIPELINES["token"], AUTO["token"]) == ("token-classification", "AutoModelForTokenClassification")
