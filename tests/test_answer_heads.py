"""The question-answering (span) and multiple-choice heads of every family against transformers'
*ForQuestionAnswering and *ForMultipleChoice: start and end logits, choice scores, the heads' dropout, weights
through a round trip, and fresh heads over a masked-LM or sequence-classification folder."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from test_model_hf import TEXTS, batch_for, max_diff_on_tokens, run_ours
from test_token_heads import CASES, params, reference
from transformers import AutoModelForMultipleChoice, AutoModelForQuestionAnswering

from bertforge.card import AUTO, PIPELINES
from bertforge.errors import UserError
from bertforge.model.architectures import build, config_from_hf, key_table
from bertforge.model.hf import load_pretrained, save_pretrained
from bertforge.model.load import load_model


def torch_spans(model, batch) -> np.ndarray:
    """(B, T, 2): transformers' start and end logits, stacked as bertforge's span head gives them."""
    inputs = {k: torch.tensor(batch[k], dtype=torch.long) for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        out = model.eval()(**inputs)
    return np.stack([out.start_logits.numpy(), out.end_logits.numpy()], axis=-1)


def span_dropout(model) -> float:
    """The rate of the dropout before a transformers QA model's output layer; 0 where it has none."""
    layer = getattr(model, "drop", None) or getattr(model, "dropout", None)
    return 0.0 if layer is None else layer.p


def checked_reference(family: str, kind: str, head: str, request, tmp_path):
    """A random transformers {prefix}For{kind} folder and its tokenizer, after checking that config.json is read as
    `head` and that the key table names every parameter transformers saves, and only those."""
    folder, tok = reference(family, kind, request, tmp_path / "hf")
    cfg, info = config_from_hf(json.loads((folder / "config.json").read_text()), "config.json")
    assert info.head == head
    assert sorted(row.hf for row in key_table(cfg, head)) == sorted(load_file(folder / "model.safetensors"))
    return folder, tok


@pytest.mark.parametrize("family", CASES)
def test_span_logits_match_transformers_and_round_trip(family, request, tmp_path):
    folder, tok = checked_reference(family, "QuestionAnswering", "span", request, tmp_path)

    pre = load_model(folder)  # config.json names the head
    assert pre.head == "span" and pre.missing_head == [] and pre.model.num_labels == 2
    ref = AutoModelForQuestionAnswering.from_pretrained(folder)
    assert pre.model.head.dropout.rate == pytest.approx(span_dropout(ref))
    batch = batch_for(tok, TEXTS[:2])
    mask = batch["attention_mask"]
    ours = run_ours(pre.model, batch)
    assert ours.shape == (2, mask.shape[1], 2) and ours.dtype == np.float32
    assert max_diff_on_tokens(ours, torch_spans(ref, batch), mask) <= 1e-4

    out = save_pretrained(pre.model, tmp_path / "export", tok)
    back = AutoModelForQuestionAnswering.from_pretrained(out)
    assert type(back).__name__ == f"{CASES[family].exported or CASES[family].prefix}ForQuestionAnswering"
    assert back.config.num_labels == 2 and span_dropout(back) == pytest.approx(span_dropout(ref))
    assert max_diff_on_tokens(ours, torch_spans(back, batch), mask) <= 1e-4
    again = load_model(out)
    assert again.head == "span" and again.missing_head == []
    for path, value in params(pre.model).items():
        np.testing.assert_array_equal(np.asarray(params(again.model)[path]), np.asarray(value), err_msg=str(path))


@pytest.mark.parametrize("family", ["bert", "modernbert", "distilbert"])
def test_a_span_model_over_a_masked_lm_folder_has_its_encoder_and_a_fresh_head(family, request, tmp_path):
    folder, _ = reference(family, "MaskedLM", request, tmp_path / "mlm")
    pre = load_pretrained(folder, head="span", seed=3, need_tokenizer=False)
    fresh = {row.hf for row in key_table(pre.model.config, "span") if row.head}
    stored = set(load_file(folder / "model.safetensors"))
    theirs = AutoModelForQuestionAnswering.from_pretrained(folder).state_dict()
    assert pre.head == "span" and pre.missing_head and set(pre.missing_head) <= fresh
    built = params(build(pre.model.config, "span", seed=3))
    ours = params(pre.model)
    for row in key_table(pre.model.config, "span"):
        if row.hf in pre.missing_head:
            np.testing.assert_allclose(np.asarray(ours[row.path]), np.asarray(built[row.path]), atol=1e-7)
        elif row.hf in theirs:  # what transformers' own class takes from the folder, bertforge takes
            want = theirs[row.hf].numpy()
            np.testing.assert_array_equal(np.asarray(ours[row.path]), want.T if row.transpose else want)
    assert fresh - set(pre.missing_head) <= stored  # ModernBERT's MLM `head` (dense, norm) is the span head's too
    with pytest.raises(UserError, match="has no question-answering head weights"):
        load_pretrained(folder, head="span", require_head=True, need_tokenizer=False)


def test_the_card_names_the_question_answering_and_multiple_choice_classes():
    assert (PIPELINES["span"], AUTO["span"]) == ("question-answering", "AutoModelForQuestionAnswering")
    assert (PIPELINES["choice"], AUTO["choice"]) == ("multiple-choice", "AutoModelForMultipleChoice")


# ------------------------------------------------------------------------------------------------ multiple choice
def choice_batch(tok) -> dict[str, np.ndarray]:
    """Two questions of two choices each, (2, 2, T): four texts of different lengths, padded."""
    batch = batch_for(tok, [*TEXTS, "And one more text."])
    return {k: v.reshape(2, 2, -1) for k, v in batch.items()}


def torch_choices(model, batch) -> np.ndarray:
    inputs = {k: torch.tensor(batch[k], dtype=torch.long) for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        return model.eval()(**inputs).logits.numpy()


@pytest.mark.parametrize("family", CASES)
def test_choice_scores_match_transformers_and_round_trip(family, request, tmp_path):
    folder, tok = checked_reference(family, "MultipleChoice", "choice", request, tmp_path)

    pre = load_model(folder)
    assert pre.head == "choice" and pre.missing_head == [] and pre.model.num_labels == 1
    ref = AutoModelForMultipleChoice.from_pretrained(folder)
    batch = choice_batch(tok)
    ours = run_ours(pre.model, batch)
    assert ours.shape == (2, 2) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, torch_choices(ref, batch), atol=1e-4)

    out = save_pretrained(pre.model, tmp_path / "export", tok)
    back = AutoModelForMultipleChoice.from_pretrained(out)
    assert type(back).__name__ == f"{CASES[family].exported or CASES[family].prefix}ForMultipleChoice"
    np.testing.assert_allclose(ours, torch_choices(back, batch), atol=1e-4)
    again = load_model(out)
    assert again.head == "choice" and again.missing_head == []
    for path, value in params(pre.model).items():
        np.testing.assert_array_equal(np.asarray(params(again.model)[path]), np.asarray(value), err_msg=str(path))


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_a_sequence_classifier_read_as_a_choice_model_gets_a_fresh_head(family, request, tmp_path):
    # The choice head's layers have the sequence head's names (BERT's pooler, the classifier) but mean another thing.
    folder, _ = reference(family, "SequenceClassification", request, tmp_path / "seq", num_labels=3)
    pre = load_pretrained(folder, head="choice", seed=5, need_tokenizer=False)
    fresh = {row.hf for row in key_table(pre.model.config, "choice") if row.head}
    assert set(pre.missing_head) == fresh  # nothing of another labelled head is taken
    with pytest.raises(UserError, match="has no multiple-choice head weights"):
        load_pretrained(folder, head="choice", require_head=True, need_tokenizer=False)
