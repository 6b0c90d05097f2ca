"""Token classification: alignment of words and tokens (against transformers' word_ids), windows over long texts,
the per-token loss and one step's gradients (against torch), and fine-tuning then predicting end to end."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bertforge.cli import main as cli
from bertforge.data.windows import (
    IGNORE,
    document_windows,
    owners,
    token_units,
    unit_outputs,
    window_ranges,
    word_units,
)
from bertforge.tokenizer.load import Tokenizer
from bertforge.train.sequence_step import LOSSES, loss_count

WORDS = "the of and to in a is was for on that with as by at from his her it an were are which this be".split()
FAST = ["--optim.lr=3e-3", "--train.batch_size=16", "--mesh.num_devices=1", "--log.progress=false"]


def tagged_sentences(n: int, seed: int = 0) -> list[dict]:
    """Sentences of common words with places ('city', or 'city station') and teams ('team'): learnable from the
    words alone."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tokens, tags = [], []
        for _ in range(rng.randint(4, 20)):
            r = rng.random()
            if r < 0.12:
                tokens += ["city", "station"] if rng.random() < 0.5 else ["city"]
                tags += ["B-PLACE", "I-PLACE"] if len(tokens) - len(tags) == 2 else ["B-PLACE"]
            elif r < 0.2:
                tokens.append("team")
                tags.append("B-TEAM")
            else:
                tokens.append(rng.choice(WORDS))
                tags.append("O")
        out.append({"id": f"s{i}", "tokens": tokens, "tags": tags})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------------ alignment
def test_word_alignment_equals_transformers_word_ids(wordpiece_dir):
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast(tokenizer_file=str(wordpiece_dir / "tokenizer.json"))
    tok = Tokenizer.load(wordpiece_dir)
    rng = random.Random(3)
    sentences = [[rng.choice(["river", "Cityscape", "don't", "x-ray", "café", "zzqxv", "the", "ALBUM!"])
                  for _ in range(rng.randint(1, 12))] for _ in range(40)]  # fmt: skip
    texts, spans = [], []
    for words in sentences:
        starts = np.cumsum([0] + [len(w) + 1 for w in words[:-1]])
        texts.append(" ".join(words))
        spans.append([(int(s), int(s) + len(w)) for s, w in zip(starts, words, strict=True)])
    units = word_units(tok, texts, spans)
    for words, u in zip(sentences, units, strict=True):
        enc = ref(words, is_split_into_words=True, add_special_tokens=False)
        assert list(u.ids) == enc["input_ids"]
        assert list(u.unit_of) == enc.word_ids()


def test_token_units_drop_spaces_and_keep_offsets(wordpiece_dir):
    tok = Tokenizer.load(wordpiece_dir)
    text = "The  river, and  city!"
    (u,) = token_units(tok, [text])
    assert [text[s:e] for s, e in u.spans] == ["The", "river", ",", "and", "city", "!"]
    assert list(u.unit_of) == list(range(6))


# ------------------------------------------------------------------------------------------------------ windows
def test_windows_cover_the_text_with_the_overlap_asked():
    assert window_ranges(5, 8, 2) == [(0, 5)]
    assert window_ranges(20, 8, 2) == [(0, 8), (6, 14), (12, 20)]
    assert window_ranges(21, 8, 3) == [(0, 8), (5, 13), (10, 18), (13, 21)]
    with pytest.raises(ValueError):
        window_ranges(10, 4, 4)


def test_each_token_takes_the_window_where_it_has_most_context():
    ranges = window_ranges(20, 8, 4)  # starts 0, 4, 8, 12
    got = owners(ranges, 20)
    for p in range(20):
        margins = [min(p - s, e - 1 - p) if s <= p < e else -1 for s, e in ranges]
        assert got[p] == int(np.argmax(margins))  # the first best on a tie


def test_window_targets_label_first_sub_tokens_and_mark_owners(wordpiece_dir):
    tok = Tokenizer.load(wordpiece_dir)
    words = ["zzqxvw", "river"] * 30
    text = " ".join(words)
    starts = np.cumsum([0] + [len(w) + 1 for w in words[:-1]])
    (u,) = word_units(tok, [text], [[(int(s), int(s) + len(w)) for s, w in zip(starts, words, strict=True)]])
    labels = np.arange(len(words)) % 3
    for all_tokens in (False, True):
        wins = document_windows(tok, u, labels, 7, limit=24, stride=6, all_tokens=all_tokens)
        owned = np.concatenate([w.targets[:, 1] for w in wins])
        assert set(owned[owned >= 0]) == {7} and np.sum(owned >= 0) == len(words)  # each word once
        for w in wins:
            tokens = w.encoded.ids[1:-1]
            assert w.targets[0, 0] == IGNORE and w.targets[len(tokens) + 1 :, 0].tolist() == [IGNORE] * (
                24 - len(tokens) - 1
            )
            for t in range(len(tokens)):
                unit = u.unit_of[w.start + t]
                is_first = u.first_tokens()[unit] == w.start + t
                want = labels[unit] if (is_first or all_tokens) else IGNORE
                assert w.targets[t + 1, 0] == want


def test_a_long_text_in_windows_gets_what_one_long_window_gives_on_a_local_model(wordpiece_dir):
    """A ModernBERT whose one local layer attends within 8 tokens (its first, global, layer silenced): each token's
    output depends only on tokens at most 4 away, which its owning window holds (10 or more tokens on each side of
    it); so windows of 32 tokens over a text of 5 x 32 give the outputs of
    one window holding the whole text."""
    from bertforge.model.architectures import build
    from bertforge.model.config import preset

    tok = Tokenizer.load(wordpiece_dir)
    cfg = preset("test", family="modernbert", vocab_size=tok.vocab_size, local_attention=8,
                 global_attn_every_n_layers=99, max_position_embeddings=512)  # fmt: skip
    model = build(cfg, "token", num_labels=5, seed=1)
    first = model.encoder.layers[0].attn_out  # layer 0 is always global: silence its attention
    first.kernel[...] = jnp.zeros_like(first.kernel[...])
    model.eval()
    rng = random.Random(0)
    words = [rng.choice(WORDS + ["river", "zzqxvw"]) for _ in range(140)]
    text = " ".join(words)
    starts = np.cumsum([0] + [len(w) + 1 for w in words[:-1]])
    (u,) = word_units(tok, [text], [[(int(s), int(s) + len(w)) for s, w in zip(starts, words, strict=True)]])
    assert len(u.ids) >= 5 * 32

    def outputs(limit: int, stride: int) -> np.ndarray:
        wins = document_windows(tok, u, None, 0, limit, stride, False)
        ids = np.full((len(wins), limit), tok.pad_id, np.int32)
        for i, w in enumerate(wins):
            ids[i, : len(w.encoded.ids)] = w.encoded.ids
        logits = np.asarray(model(jnp.asarray(ids), jnp.asarray((ids != tok.pad_id).astype(np.int32))))
        return unit_outputs(wins, logits, u, 1), len(wins)

    whole, one = outputs(len(u.ids) + 2, 0)
    cut, several = outputs(32, 20)
    assert one == 1 and several >= 5
    np.testing.assert_allclose(cut, whole, atol=1e-5)
    assert (cut.argmax(-1) == whole.argmax(-1)).all()


# ------------------------------------------------------------------------------------------------------ the loss
def test_token_loss_equals_torch_cross_entropy_over_labelled_tokens():
    rng = np.random.default_rng(0)
    outputs = rng.normal(size=(3, 7, 4)).astype(np.float32)
    labels = rng.integers(0, 4, size=(3, 9)).astype(np.int32)
    labels[rng.random((3, 9)) < 0.4] = IGNORE
    labels[2] = IGNORE  # a row with nothing labelled
    labels[:, 7:] = IGNORE  # targets run to the longest length; past a batch's padded length none is labelled
    targets = np.stack([labels, np.full_like(labels, -1)], -1)
    weight = np.array([1.0, 1.0, 0.0], np.float32)  # the third, a filler row
    total = jnp.sum(LOSSES["token_cross_entropy"](jnp.asarray(outputs), jnp.asarray(targets)) * weight)
    mean = float(total / loss_count("token_cross_entropy", jnp.asarray(targets), jnp.asarray(weight)))
    ref = torch.nn.functional.cross_entropy(
        torch.tensor(outputs[:2]).reshape(-1, 4), torch.tensor(labels[:2, :7]).reshape(-1).long(), ignore_index=IGNORE
    )
    assert mean == pytest.approx(float(ref), abs=1e-6)


def test_one_step_gradients_equal_torch_token_classification(wordpiece_dir, tmp_path):
    """The gradients of a BERT token classifier's loss on a padded batch, against BertForTokenClassification's."""
    from flax import nnx
    from hf_models import save_hf_model
    from transformers import BertForTokenClassification

    from bertforge.model.load import load_model
    from bertforge.train.sequence_step import SequenceStepConfig, gradients

    folder = save_hf_model(BertForTokenClassification, "bert", wordpiece_dir, tmp_path / "hf", num_labels=5,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    ref = BertForTokenClassification.from_pretrained(folder).eval()
    pre = load_model(str(folder), head="token", num_labels=5)
    rng = np.random.default_rng(1)
    ids = rng.integers(5, pre.tokenizer.vocab_size, size=(2, 12)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 8:] = 0
    labels = rng.integers(0, 5, size=(2, 12)).astype(np.int32)
    labels[mask == 0] = IGNORE
    labels[:, 0] = IGNORE
    out = ref(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long(),
              labels=torch.tensor(labels).long())  # fmt: skip
    out.loss.backward()
    graphdef, params, rest = nnx.split(pre.model, nnx.Param, ...)
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids),
             "targets": np.stack([labels, np.full_like(labels, -1)], -1), "weight": np.ones(2, np.float32)}  # fmt: skip
    grads, loss, _ = gradients(graphdef, rest, params, None, jax.tree.map(jnp.asarray, batch),
                               SequenceStepConfig("token_cross_entropy", dropout=False))  # fmt: skip
    assert float(loss) == pytest.approx(float(out.loss), abs=1e-5)
    got = nnx.to_flat_state(grads)
    want = dict(ref.named_parameters())
    classifier = np.asarray(dict(got)[("head", "out", "kernel")].get_value())
    np.testing.assert_allclose(classifier, want["classifier.weight"].grad.numpy().T, atol=1e-5)
    word = np.asarray(dict(got)[("encoder", "embeddings", "word", "embedding")].get_value())
    np.testing.assert_allclose(word, want["bert.embeddings.word_embeddings.weight"].grad.numpy(), atol=1e-5)


# ------------------------------------------------------------------------------------------------------ reading
def write_spans(path: Path, records: list[dict]) -> Path:
    return write_jsonl(path, records)


SPAN_RECORDS = [
    {"id": "a", "text": "the river and the city station", "entities": [{"span": [4, 9], "type": "WATER"},
                                                                     {"span": [18, 30], "type": "PLACE"}]},
    {"id": "b", "text": "a team at the city", "entities": [{"span": [2, 6], "type": "TEAM"},
                                                          {"span": [14, 17], "type": "PLACE"}]},  # "cit": no boundary
]  # fmt: skip


def test_character_spans_become_token_tags_and_a_cut_entity_is_reported(wordpiece_dir, tmp_path, capsys):
    from bertforge.data.labelled import TableConfig
    from bertforge.finetuning import tokens

    tok = Tokenizer.load(wordpiece_dir)
    data = tokens.read(str(write_spans(tmp_path / "train.jsonl", SPAN_RECORDS)), TableConfig(), None)
    assert data.scheme == "bio"
    assert data.names == ["O", "B-PLACE", "I-PLACE", "B-TEAM", "I-TEAM", "B-WATER", "I-WATER"]
    table = tokens.rows(data, tok, TableConfig(), limit=32)
    err = capsys.readouterr().err
    assert "1 of 4 entities match no token boundary" in err and "record 2 'cit' (PLACE)" in err
    found = [tokens.true_entities(r["text"], u, t)
             for r, u, t in zip(SPAN_RECORDS, table.source.units, table.source.tags, strict=True)]  # fmt: skip
    assert [[(e["text"], e["type"]) for e in f] for f in found] == [
        [("river", "WATER"), ("city station", "PLACE")],
        [("team", "TEAM")],
    ]
    assert all(t[0] == "O" for t in table.source.tags)


def test_validation_data_with_a_type_the_training_data_lacks_is_named(tmp_path):
    from bertforge.data.labelled import TableConfig
    from bertforge.errors import UserError
    from bertforge.finetuning import tokens

    records = [{"id": "v", "text": "the king", "entities": [{"span": [4, 8], "type": "PERSON"}]}]
    path = write_spans(tmp_path / "valid.jsonl", records)
    with pytest.raises(UserError, match=r"valid.jsonl: record 1 \(id v\): entity type 'PERSON' never occurs"):
        tokens.read(str(path), TableConfig(), ["O", "B-PLACE", "I-PLACE"])


def test_scores_over_windows_equal_seqeval_on_each_documents_words(wordpiece_dir):
    """The fold's metric reads each word at the window that owns it: the same as seqeval on the documents'
    words predicted as `predict` reads them."""
    from seqeval.metrics import f1_score

    from bertforge.finetuning import tokens

    tok = Tokenizer.load(wordpiece_dir)
    names = ["O", "B-PLACE", "I-PLACE", "B-TEAM", "I-TEAM"]
    records = tagged_sentences(30, seed=4)
    texts = [" ".join(r["tokens"]) for r in records]
    spans = []
    for r in records:
        starts = np.cumsum([0] + [len(w) + 1 for w in r["tokens"][:-1]])
        spans.append([(int(a), int(a) + len(w)) for a, w in zip(starts, r["tokens"], strict=True)])
    units = word_units(tok, texts, spans)
    rng = np.random.default_rng(0)
    wins, true, pred = [], [], []
    for d, (r, u) in enumerate(zip(records, units, strict=True)):
        labels = np.array([names.index(t) for t in r["tags"]])
        wins += document_windows(tok, u, labels, d, limit=10, stride=3, all_tokens=False)
    outputs = rng.normal(size=(len(wins), 10, len(names))).astype(np.float32)
    per_doc = tokens.document_outputs(wins, units, 1, outputs)
    for d, r in enumerate(records):
        true.append(list(r["tags"]))
        pred.append([names[i] for i in per_doc[d].argmax(-1)])
    got = tokens.scores(outputs, np.stack([w.targets for w in wins]), names)
    assert got["f1"] == pytest.approx(f1_score(true, pred), abs=1e-12)


# ------------------------------------------------------------------------------------------------------ end to end
def finetune_args(model_dir: Path, data: Path, run: Path) -> list[str]:
    return ["finetune", "--task", "token-classification", "--model", str(model_dir), "--data", str(data),
            "--out", str(run), "--folds", "2", "--train.epochs=12", "--max-length", "16", "--stride", "4",
            *FAST]  # fmt: skip


@pytest.fixture(scope="module")
def token_run(model_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tokens")
    data = write_jsonl(root / "train.jsonl", tagged_sentences(96, seed=1))
    assert cli(finetune_args(model_dir, data, root / "run")) == 0
    return root / "run"


def test_finetune_learns_the_entities_and_writes_them_out_of_fold(token_run):
    import csv

    summary = json.loads((token_run / "summary.json").read_text())
    assert summary["task"] == "token-classification" and summary["metric"] == "f1" and len(summary["folds"]) == 2
    assert summary["out_of_fold"]["f1"] > 0.8, summary["out_of_fold"]  # the task is learnable from the words
    with open(token_run / "oof.csv", encoding="utf-8") as fh:
        oof = list(csv.DictReader(fh))
    assert [r["id"] for r in oof] == [f"s{i}" for i in range(96)]
    for row, record in zip(oof, tagged_sentences(96, seed=1), strict=True):
        text = " ".join(record["tokens"])
        truth = json.loads(row["entities"])
        assert [e["type"] for e in truth] == [t[2:] for t in record["tags"] if t.startswith("B-")]
        assert all(text[e["start"] : e["end"]] == e["text"] for e in truth + json.loads(row["predicted"]))


def test_predict_writes_entities_whose_offsets_slice_the_text(token_run, tmp_path):
    raw = [dict(text=" ".join(r["tokens"]), id=r["id"]) for r in tagged_sentences(8, seed=9)]
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"id": r["id"], "text": r["text"]} for r in raw])
    out = tmp_path / "entities.jsonl"
    assert cli(["predict", "--model", str(token_run), "--data", str(texts), "--out", str(out)]) == 0
    found = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [f["id"] for f in found] == [r["id"] for r in raw]
    assert any(f["entities"] for f in found)
    for f, r in zip(found, raw, strict=True):
        for e in f["entities"]:
            assert r["text"][e["start"] : e["end"]] == e["text"]
            assert e["type"] in ("PLACE", "TEAM") and 0 < e["score"] <= 1


def test_the_python_api_gives_what_predict_writes(token_run, tmp_path):
    import bertforge

    texts = ["the city station and the team", "of the city"]
    path = write_jsonl(tmp_path / "texts.jsonl", [{"id": str(i), "text": t} for i, t in enumerate(texts)])
    out = tmp_path / "entities.jsonl"
    assert cli(["predict", "--model", str(token_run), "--data", str(path), "--out", str(out)]) == 0
    written = [json.loads(line)["entities"] for line in out.read_text(encoding="utf-8").splitlines()]
    assert bertforge.entities(token_run, texts) == written


def test_predict_on_conll_writes_a_tag_per_word(token_run, tmp_path):
    records = tagged_sentences(6, seed=12)
    conll = tmp_path / "test.conll"
    conll.write_text("".join("".join(f"{w}\n" for w in r["tokens"]) + "\n" for r in records), encoding="utf-8")
    out = tmp_path / "tagged.conll"
    assert (
        cli(["predict", "--model", str(token_run / "fold-0" / "model"), "--data", str(conll), "--out", str(out)]) == 0
    )
    sentences = [s.splitlines() for s in out.read_text(encoding="utf-8").strip().split("\n\n")]
    assert [[line.split("\t")[0] for line in s] for s in sentences] == [r["tokens"] for r in records]
    tags = [line.split("\t")[1] for s in sentences for line in s]
    assert set(tags) <= {"O", "B-PLACE", "I-PLACE", "B-TEAM", "I-TEAM"} and set(tags) != {"O"}


def test_evaluate_on_a_folds_held_out_sentences_gives_the_entity_scores_finetune_reported(token_run, tmp_path):
    import csv

    from seqeval.metrics import f1_score

    with open(token_run / "folds.csv", encoding="utf-8") as fh:
        held_out = {r["id"] for r in csv.DictReader(fh) if r["fold"] == "0"}
    records = [r for r in tagged_sentences(96, seed=1) if r["id"] in held_out]
    data = write_jsonl(tmp_path / "held-out.jsonl", records)
    metrics, conll = tmp_path / "metrics.json", tmp_path / "held-out.conll"
    # The fold's model folder knows nothing of the run: its length and stride are given as the run had them.
    folder = token_run / "fold-0" / "model"
    assert cli(["evaluate", "--model", str(folder), "--data", str(data), "--max-length", "16", "--stride", "4",
                "--out", str(metrics)]) == 0  # fmt: skip
    found = json.loads(metrics.read_text())
    reported = json.loads((token_run / "fold-0" / "result.json").read_text())["metrics"]
    assert found["records"] == len(records)
    for key in set(reported) - {"loss"}:
        assert found[key] == pytest.approx(reported[key], abs=1e-9), key
    # seqeval on the tags `predict` writes for the same sentences as CoNLL.
    conll.write_text("".join("\n".join(f"{w}\tO" for w in r["tokens"]) + "\n\n" for r in records), encoding="utf-8")
    out = tmp_path / "predicted.conll"
    assert (
        cli(
            [
                "predict",
                "--model",
                str(folder),
                "--data",
                str(conll),
                "--out",
                str(out),
                "--max-length",
                "16",
                "--stride",
                "4",
            ]
        )
        == 0
    )
    predicted = [
        [line.split("\t")[1] for line in block.splitlines()] for block in out.read_text().split("\n\n") if block.strip()
    ]
    assert found["f1"] == pytest.approx(f1_score([r["tags"] for r in records], predicted), abs=1e-9)
