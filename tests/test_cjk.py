"""Japanese text: a Unigram tokenizer on text without spaces, a word-level one on the same text segmented with
spaces; both preprocess, pretrain, fill a mask in the middle of a sentence, and load in transformers."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer

from bertforge.cli import main as cli
from bertforge.data.masking import continuation_table
from bertforge.errors import UserError
from bertforge.model.hf import load_pretrained
from bertforge.tasks.preprocess import PreprocessConfig
from bertforge.tasks.preprocess import main as preprocess
from bertforge.tokenizer.load import Tokenizer
from bertforge.tokenizer.train import train_tokenizer

PLACES = ["東京", "大阪", "京都", "北海道", "名古屋", "横浜", "福岡", "神戸"]
PEOPLE = ["私", "先生", "学生", "友達", "母", "父", "子供たち", "社長"]
THINGS = ["本", "寿司", "ラーメン", "手紙", "写真", "コーヒー", "新聞", "映画"]
VERBS = ["読みます", "食べます", "書きました", "見ました", "買います", "飲みました", "送ります", "撮りました"]
GOES = ["行きます", "来ました", "住んでいます", "帰ります"]


def sentences(n: int, seed: int = 0) -> list[list[str]]:
    """Segmented sentences (lists of words) of two patterns: PERSON は PLACE で THING を VERB 。 and
    PERSON は PLACE に GO 。"""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        who, where = rng.choice(PEOPLE), rng.choice(PLACES)
        if rng.random() < 0.6:
            out.append([who, "は", where, "で", rng.choice(THINGS), "を", rng.choice(VERBS), "。"])
        else:
            out.append([who, "は", where, "に", rng.choice(GOES), "。"])
    return out


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ja")
    words = sentences(2000)
    raw, spaced = root / "raw.txt", root / "spaced.txt"
    # Documents of 20 sentences, one per line, blank-line separated.
    raw.write_text("".join("".join(s) + ("\n\n" if i % 20 == 19 else "\n") for i, s in enumerate(words)), "utf-8")
    spaced.write_text("".join(" ".join(s) + ("\n\n" if i % 20 == 19 else "\n") for i, s in enumerate(words)), "utf-8")
    return raw, spaced


def lines(path: Path, n: int = 1000) -> list[str]:
    return [line for line in path.read_text("utf-8").splitlines() if line][:n]


@pytest.mark.parametrize("kind", ["unigram", pytest.param("wordlevel", marks=pytest.mark.slow)])  # `make slow`
def test_japanese_tokenizers_pretrain_fill_a_mask_and_load_in_transformers(kind, corpora, tmp_path):
    raw, spaced = corpora
    text = raw if kind == "unigram" else spaced
    tok_dir = tmp_path / "tok"
    train_tokenizer([str(text)], kind, 300, tok_dir, min_frequency=1)
    ours, theirs = Tokenizer.load(tok_dir), AutoTokenizer.from_pretrained(tok_dir)
    sample = lines(text)
    assert len(sample) == 1000
    assert [e.ids for e in ours.encode_batch(sample)] == theirs(sample)["input_ids"]
    if kind == "unigram":  # no [UNK] in text it was trained on, and no space anywhere in its pieces' decoding
        assert ours.unk_id not in {i for e in ours.encode_batch(sample) for i in e.ids}
        assert ours.decode(ours.encode(sample[0]).ids) == sample[0]

    shards = tmp_path / "shards"
    extra = ["--pretokenized"] if kind == "wordlevel" else []
    assert cli(["preprocess", "--tokenizer", str(tok_dir), "--files", str(text), "--out", str(shards),
                "--seq-len", "32", "--mode", "complete", *extra]) == 0  # fmt: skip
    run = tmp_path / "run"
    assert cli([
        "pretrain", "--data", str(shards), "--out", str(run), "--model.preset=test", "--train.global_batch=16",
        "--train.max_steps=30", "--optim.lr=3e-3", "--optim.warmup_steps=2", "--eval.every=30", "--log.every=10",
        "--log.tensorboard=false", "--log.progress=false", "--mesh.num_devices=1", "--mlm.whole_word=true",
    ]) == 0  # fmt: skip
    export = tmp_path / "export"
    assert cli(["export", str(run), "--out", str(export), "--language", "ja"]) == 0

    masked = "先生は東京で[MASK]を読みます。" if kind == "unigram" else "先生 は 東京 で [MASK] を 読みます 。"
    from bertforge.tasks.infer import fill_mask

    pre = load_pretrained(export, head="mlm")
    (options,) = fill_mask(pre, [masked], top_k=5)[0]
    vocab = ours.tok.get_vocab()
    for option in options:
        token = ours.id_to_token(option["token"])
        assert option["token_str"] == token.lstrip("\u2581") and token in vocab  # a whole token, its marker off
        assert option["sequence"] == masked.replace("[MASK]", option["token_str"])  # no stray spaces

    # The exported folder in transformers gives bertforge's MLM logits.
    hf = AutoModelForMaskedLM.from_pretrained(export).eval()
    batch = theirs(sample[:4], padding=True, return_tensors="pt")
    with torch.no_grad():
        want = hf(**batch).logits.numpy()
    ids, mask = batch["input_ids"].numpy(), batch["attention_mask"].numpy()
    pre.model.eval()
    got = np.asarray(pre.model(ids, mask, np.zeros_like(ids)))
    np.testing.assert_allclose(got[mask == 1], want[mask == 1], atol=1e-4, rtol=1e-4)


def test_whole_word_marks_follow_each_tokenizer(corpora, tmp_path):
    raw, spaced = corpora
    train_tokenizer([str(spaced)], "wordlevel", 300, tmp_path / "wl", min_frequency=1)
    train_tokenizer([str(spaced)], "unigram", 300, tmp_path / "uni")
    word = Tokenizer.load(tmp_path / "wl")
    table = continuation_table(word.tok.get_vocab(), word.vocab_size, **word.word_marks())
    assert not any(table)  # every token is a word
    uni = Tokenizer.load(tmp_path / "uni")
    table = continuation_table(
        uni.tok.get_vocab(), uni.vocab_size, special=uni.special_ids()["all"], **uni.word_marks()
    )
    for token, i in uni.tok.get_vocab().items():
        if i not in uni.special_ids()["all"]:
            assert table[i] == (not token.startswith("\u2581")), token


def test_pretokenized_refuses_a_tokenizer_that_cuts_words_and_warns_on_text_without_spaces(
    corpora, wordpiece_dir, tmp_path, capsys
):
    raw, spaced = corpora
    train_tokenizer([str(raw)], "wordpiece", 300, tmp_path / "wp", min_frequency=1)
    cfg = PreprocessConfig(tokenizer=str(tmp_path / "wp"), files=(str(spaced),), out=str(tmp_path / "a"),
                           seq_len=32, pretokenized=True)  # fmt: skip
    with pytest.raises(UserError, match="cuts the given word"):  # BERT's normaliser splits every kanji
        preprocess(cfg)
    train_tokenizer([str(raw)], "wordlevel", 300, tmp_path / "wl", min_frequency=1)
    cfg = PreprocessConfig(tokenizer=str(tmp_path / "wl"), files=(str(raw),), out=str(tmp_path / "b"),
                           seq_len=32, pretokenized=True)  # fmt: skip
    preprocess(cfg)
    assert "every line is one word" in capsys.readouterr().err
