"""Tokenizers trained by SentencePiece (Unigram, and BPE on text without spaces), sampled corpora, and the same
tokenizer from the same files: checked against SentencePiece's own encoder and transformers' AutoTokenizer."""

from __future__ import annotations

import gzip
import random
import unicodedata
from collections import Counter
from pathlib import Path

import pytest
import sentencepiece
from transformers import AutoTokenizer

from bertforge.cli import main as cli
from bertforge.errors import UserError
from bertforge.tokenizer.corpus import mostly_cjk, reservoir
from bertforge.tokenizer.spm_train import SPM_MODEL_FILE
from bertforge.tokenizer.train import train_tokenizer

KANA = "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをん"
KANJI = "日本東京大阪京都学生先生会社年月時間人手口目山川田中上下国語本文字電車駅"
EXTRAS = ["ＡＢＣ", "１２３", "2026年", "AI", "（注）", "、", "。", "・", "ｶﾀｶﾅ"]


def japanese_lines(n: int, seed: int = 0) -> list[str]:
    """Lines without spaces of made-up words of kana and kanji, with fullwidth forms that NFKC folds."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(KANA + KANJI) for _ in range(rng.randint(1, 4))) for _ in range(400)]
    return ["".join(rng.choice(words + EXTRAS) for _ in range(rng.randint(5, 30))) for _ in range(n)]


@pytest.fixture(scope="module")
def ja_corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ja") / "ja.txt"
    lines = japanese_lines(3000)
    lines[7] += "鬱"  # one character in the rarest 0.05%: [UNK] at the default coverage for CJK text
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def first_lines(path: Path, n: int = 1000) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()[:n]


@pytest.mark.parametrize(
    "kind, options",
    [("unigram", {}), ("bpe", {}), ("unigram", {"byte_fallback": True, "lowercase": True})],
)
def test_ids_equal_sentencepieces_own_encoder_and_autotokenizer(kind, options, ja_corpus, tmp_path):
    out = tmp_path / "tok"
    ours = train_tokenizer([str(ja_corpus)], kind, 1000, out, **options)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(out / SPM_MODEL_FILE))
    theirs = AutoTokenizer.from_pretrained(out)
    lines = first_lines(ja_corpus) + ["  全角ＡＢＣ　１２３  ", "未知の字☃と𠮷", "MiXeD Case\ttab"]
    want = [[ours.cls_id, *sp.encode(line), ours.sep_id] for line in lines]
    assert [e.ids for e in ours.encode_batch(lines)] == want
    assert theirs(lines)["input_ids"] == want
    assert ours.vocab_size == sp.get_piece_size() <= 1000
    # The special tokens sit at the style's ids (BERT's for Unigram, RoBERTa's for BPE).
    if kind == "bpe":
        assert (ours.cls_id, ours.pad_id, ours.sep_id, ours.unk_id, ours.mask_id) == (0, 1, 2, 3, 4)
    else:
        assert (ours.pad_id, ours.unk_id, ours.cls_id, ours.sep_id, ours.mask_id) == (0, 1, 2, 3, 4)
    assert ours.word_marks() == {"prefix": "", "word_start": "\u2581"}
    if options.get("byte_fallback"):  # characters never seen come back from their bytes, not as [UNK]
        assert ours.unk_id not in ours.encode("未知の字☃と𠮷").ids
        assert ours.decode(ours.encode("未知の字☃と𠮷").ids) == "未知の字☃と𠮷"
    else:
        assert ours.decode(ours.encode(lines[0]).ids) == unicodedata.normalize("NFKC", lines[0])


def test_character_coverage_defaults_by_script(ja_corpus, tmp_path):
    """SentencePiece's advice: 0.9995 for text that is mostly CJK (the rarest characters become [UNK]), 1.0 else."""
    rare = "鬱"
    ja = train_tokenizer([str(ja_corpus)], "unigram", 1000, tmp_path / "ja")
    assert ja.encode(rare).ids[-2] == ja.unk_id
    full = train_tokenizer([str(ja_corpus)], "unigram", 1000, tmp_path / "full", character_coverage=1.0)
    assert full.unk_id not in full.encode(rare).ids
    assert mostly_cjk(first_lines(ja_corpus, 50)) and not mostly_cjk(["plain English text, 東京 once"])


def test_user_symbols_are_never_split(ja_corpus, tmp_path):
    symbols = ["<url>", "【注】"]
    for kind in ("unigram", "wordpiece"):
        tok = train_tokenizer([str(ja_corpus)], kind, 1000, tmp_path / kind, user_symbols=symbols)
        theirs = AutoTokenizer.from_pretrained(tmp_path / kind)
        text = "東京<url>大阪【注】です"
        pieces = tok.tok.encode(text, add_special_tokens=False).tokens
        assert set(symbols) <= set(pieces), pieces
        assert theirs(text)["input_ids"] == tok.encode(text).ids


@pytest.mark.parametrize("kind", ["wordpiece", "unigram", "bpe", "wordlevel"])
def test_every_type_trains_the_same_files_twice(kind, corpus, ja_corpus, tmp_path):
    files = [str(corpus), str(ja_corpus)] if kind != "bpe" else [str(ja_corpus)]  # BPE on CJK: SentencePiece's
    outs = [tmp_path / f"run{i}" for i in range(2)]
    for out in outs:
        train_tokenizer(files, kind, 900, out, min_frequency=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes()
    has_model = kind in ("unigram", "bpe")
    assert (outs[0] / SPM_MODEL_FILE).exists() == has_model
    if has_model:
        assert (outs[0] / SPM_MODEL_FILE).read_bytes() == (outs[1] / SPM_MODEL_FILE).read_bytes()


def test_reservoir_draws_every_line_with_the_same_chance():
    # Closed form: each of n lines is kept with probability k/n. 4,000 draws of 3 from 12: 1,000 expected each.
    counts = Counter(line for seed in range(4000) for line in reservoir(map(str, range(12)), 3, seed))
    assert set(counts) == {str(i) for i in range(12)}
    assert all(abs(c - 1000) < 125 for c in counts.values()), counts  # > 4 standard deviations (27)
    assert reservoir(iter(["a", "b"]), 5, 0) == ["a", "b"]  # fewer lines than asked: all of them, in order
    assert reservoir(map(str, range(100)), 10, 3) == reservoir(map(str, range(100)), 10, 3)


def test_sample_lines_reads_every_file_and_repeats_on_a_rerun(tmp_path, capsys):
    plain, packed = tmp_path / "a.txt", tmp_path / "b.txt.gz"
    lines = japanese_lines(4000, seed=1)
    plain.write_text("\n".join(lines[:2000]) + "\n", encoding="utf-8")
    with gzip.open(packed, "wt", encoding="utf-8") as fh:
        fh.write("\n".join(lines[2000:]) + "\n")
    runs = [tmp_path / "s1", tmp_path / "s2", tmp_path / "s3"]
    for out, seed in zip(runs, (0, 0, 1), strict=True):
        argv = ["tokenizer", "train", "--files", str(plain), str(packed), "--type", "unigram", "--vocab-size",
                "600", "--sample-lines", "1500", "--seed", str(seed), "--out", str(out)]  # fmt: skip
        assert cli(argv) == 0
    err = capsys.readouterr().err
    assert "read 4,000 lines" in err and "from 2 file(s)" in err and "1,500 lines sampled" in err
    json_of = [(out / "tokenizer.json").read_bytes() for out in runs]
    assert json_of[0] == json_of[1] != json_of[2]  # another seed draws other lines


def test_a_corpus_too_small_for_the_vocabulary_is_one_line_and_writes_nothing(tmp_path, capsys):
    small = tmp_path / "small.txt"
    small.write_text("\n".join(japanese_lines(3)) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"small.txt: too little text for --vocab-size 32000: it gives \d+ tokens"):
        train_tokenizer([str(small)], "unigram", 32000, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match=r"small.txt: --vocab-size 20 is smaller than the \d+ characters"):
        train_tokenizer([str(small)], "unigram", 20, tmp_path / "out")
    # A little short of the vocabulary asked: a warning, and the tokenizer the text gives.
    train_tokenizer([str(small)], "unigram", 100, tmp_path / "out")
    assert "fewer than --vocab-size 100" in capsys.readouterr().err


def test_an_unreadable_file_is_one_line(tmp_path):
    broken = tmp_path / "broken.txt.gz"
    whole = gzip.compress("\n".join(japanese_lines(2000)).encode())
    broken.write_bytes(whole[: len(whole) // 2])  # cut short
    with pytest.raises(UserError, match=r"broken.txt.gz: cannot be read past line \d+ \(Compressed file ended"):
        train_tokenizer([str(broken)], "unigram", 100, tmp_path / "out")
    with pytest.raises(UserError, match=r"--character-coverage, --byte-fallback and --max-piece-length are"):
        train_tokenizer([str(broken)], "wordpiece", 100, tmp_path / "out", byte_fallback=True)
    assert not (tmp_path / "out").exists()
