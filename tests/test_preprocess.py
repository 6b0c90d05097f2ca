"""Preprocessing: no token lost (concat), no sentence cut (complete/doc), atomic and deterministic output."""

from __future__ import annotations

import gzip
import json
import random

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bertforge.data.documents import split_sentences
from bertforge.data.shards import Shards
from bertforge.errors import UserError
from bertforge.tasks import preprocess
from bertforge.tasks.preprocess import PreprocessConfig
from bertforge.tokenizer.load import Tokenizer

WORDS = "river city music game season film league army church school station album king war team story".split()


def make_documents(n_docs=60, seed=0):
    """Documents of sentences; a few sentences are long, so that packing has to make choices."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        sentences = []
        for _ in range(rng.randint(1, 8)):
            words = [rng.choice(WORDS) for _ in range(rng.choice([3, 5, 9, 14, 20]))]
            sentences.append(" ".join(words).capitalize() + ".")
        docs.append(" ".join(sentences))
    return docs


def write_text(path, docs):
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def rows_of(out, split="train"):
    shards = Shards(str(out), split)
    return shards.rows(np.arange(shards.num_sequences)), shards


def content(row, tok):
    """Tokens between the leading [CLS] and the [SEP] that closes the row."""
    assert row[0] == tok.cls_id
    n = int(np.sum(row != tok.pad_id))
    assert row[n - 1] == tok.sep_id and np.all(row[n:] == tok.pad_id)
    return list(row[1 : n - 1])


def run(tmp_path, wordpiece_dir, docs, name="out", **kwargs):
    src = write_text(tmp_path / f"{name}.txt", docs)
    cfg = PreprocessConfig(tokenizer=str(wordpiece_dir), files=(str(src),), out=str(tmp_path / name), **kwargs)
    return preprocess.main(cfg, progress=False)


def test_concat_loses_no_token(tmp_path, wordpiece_dir):
    tok = Tokenizer.load(wordpiece_dir)
    docs = make_documents()
    manifest = run(tmp_path, wordpiece_dir, docs, seq_len=32, valid_fraction=0.0, shard_size=7)
    rows, shards = rows_of(tmp_path / "out")
    joined = [t for row in rows for t in content(row, tok)]
    expected = [t for ids in tok.tokenize_ids(docs) for t in [*ids, tok.sep_id]]
    assert joined == expected
    assert len(shards.entries) == -(-len(rows) // 7) > 1  # several shards, read back in order
    assert manifest["text_tokens"] == sum(len(ids) for ids in tok.tokenize_ids(docs))
    assert all(np.sum(r != tok.pad_id) == 32 for r in rows[:-1])  # only the last row is padded


def test_special_tokens_written_in_the_corpus_stay_text(tmp_path, wordpiece_dir):
    """A corpus that quotes "[PAD]" or "[MASK]" must not put pad or mask ids inside a row (they would be padding)."""
    tok = Tokenizer.load(wordpiece_dir)
    run(tmp_path, wordpiece_dir, ["the [PAD] word and [MASK] or [SEP]."], seq_len=32, valid_fraction=0.0)
    rows, _ = rows_of(tmp_path / "out")
    spaced = tok.tokenize_ids(["the [ pad ] word and [ mask ] or [ sep ] ."])[0]  # BERT splits brackets off words
    assert [content(row, tok) for row in rows] == [[*spaced, tok.sep_id]]
    assert tok.tokenize_ids(["[PAD]"]) == [[tok.pad_id]]  # fine-tuning and fill-mask still read them as specials


@pytest.mark.parametrize("mode", ["complete", "doc"])
def test_complete_and_doc_never_split_a_sentence(mode, tmp_path, wordpiece_dir):
    tok = Tokenizer.load(wordpiece_dir)
    docs = make_documents(seed=1)
    seq_len = 128
    manifest = run(tmp_path, wordpiece_dir, docs, mode=mode, seq_len=seq_len, valid_fraction=0.0)
    assert manifest["splits"]["train"]["split_sentences"] == 0
    rows, _ = rows_of(tmp_path / "out")
    # Walk the sentences in corpus order: each row must be a run of whole sentences.
    stream = []  # (token ids, starts a new document)
    for doc in docs:
        for i, sentence in enumerate(split_sentences(doc)):
            stream.append((tok.tokenize_ids([sentence])[0], i == 0))
    assert max(len(ids) for ids, _ in stream) <= seq_len - 2
    pos = 0
    for row in rows:
        body = content(row, tok)
        taken: list[int] = []
        first = True
        while pos < len(stream) and len(taken) < len(body):
            ids, new_doc = stream[pos]
            if new_doc and not first:
                assert mode == "complete", "doc mode put two documents in one row"
                taken.append(tok.sep_id)
            taken.extend(ids)
            first = False
            pos += 1
        assert taken == body
    assert pos == len(stream)
    if mode == "doc":
        assert len(rows) >= len(docs)


def test_long_sentences_are_cut_and_counted(tmp_path, wordpiece_dir):
    docs = [" ".join(["river"] * 100) + "."]
    manifest = run(tmp_path, wordpiece_dir, docs, mode="complete", seq_len=16, valid_fraction=0.0)
    assert manifest["splits"]["train"]["split_sentences"] == 1


def test_output_does_not_depend_on_worker_count(tmp_path, wordpiece_dir):
    docs = make_documents(n_docs=1200, seed=2)  # more than two chunks of work
    one = run(tmp_path, wordpiece_dir, docs, name="w1", mode="complete", workers=1, shard_size=50)
    two = run(tmp_path, wordpiece_dir, docs, name="w2", mode="complete", workers=2, shard_size=50)
    assert [s["sha256"] for s in one["splits"]["train"]["shards"]] == [
        s["sha256"] for s in two["splits"]["train"]["shards"]
    ]
    assert one["splits"]["valid"] == two["splits"]["valid"]
    assert one["splits"]["valid"]["documents"] > 0


def test_interrupted_run_leaves_no_manifest_and_a_rerun_finishes(tmp_path, wordpiece_dir, monkeypatch):
    docs = make_documents()
    reference = run(tmp_path, wordpiece_dir, docs, name="ref", seq_len=32, shard_size=5)
    real_write = preprocess.ShardWriter._write
    calls = {"n": 0}

    def crash_on_third(self, rows):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # as if killed while writing
        real_write(self, rows)

    monkeypatch.setattr(preprocess.ShardWriter, "_write", crash_on_third)
    src = write_text(tmp_path / "again.txt", docs)
    cfg = PreprocessConfig(
        tokenizer=str(wordpiece_dir), files=(str(src),), out=str(tmp_path / "again"), seq_len=32, shard_size=5
    )
    with pytest.raises(KeyboardInterrupt):
        preprocess.main(cfg, progress=False)
    assert not (tmp_path / "again" / "manifest.json").exists()
    with pytest.raises(UserError, match="no manifest.json"):
        Shards(str(tmp_path / "again"))
    monkeypatch.setattr(preprocess.ShardWriter, "_write", real_write)
    finished = preprocess.main(cfg, progress=False)
    assert [s["sha256"] for s in finished["splits"]["train"]["shards"]] == [
        s["sha256"] for s in reference["splits"]["train"]["shards"]
    ]
    # Run again once finished: nothing to do, same manifest.
    assert preprocess.main(cfg, progress=False)["splits"] == finished["splits"]


def test_jsonl_parquet_gzip_and_fsspec_output(tmp_path, wordpiece_dir):
    tok = Tokenizer.load(wordpiece_dir)
    docs = make_documents(n_docs=20, seed=3)
    jsonl = tmp_path / "c.jsonl.gz"
    with gzip.open(jsonl, "wt", encoding="utf-8") as fh:
        for d in docs[:10]:
            fh.write(json.dumps({"body": d}) + "\n")
    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.table({"body": docs[10:]}), parquet)
    cfg = PreprocessConfig(
        tokenizer=str(wordpiece_dir),
        files=(str(jsonl), str(parquet)),
        out="memory://shards/x",
        seq_len=32,
        valid_fraction=0.0,
        text_field="body",
    )
    preprocess.main(cfg, progress=False)
    assert fsspec.filesystem("memory").exists("/shards/x/manifest.json")
    shards = Shards("memory://shards/x")
    rows = shards.rows(np.arange(shards.num_sequences))
    joined = [t for row in rows for t in content(row, tok)]
    assert joined == [t for ids in tok.tokenize_ids(docs) for t in [*ids, tok.sep_id]]


# ---------------------------------------------------------------------------------------------------- bad input
def test_empty_and_unreadable_files_are_named_and_nothing_is_finished(tmp_path, wordpiece_dir):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    good = write_text(tmp_path / "good.txt", make_documents(n_docs=5))
    cfg = PreprocessConfig(tokenizer=str(wordpiece_dir), files=(str(good), str(empty)), out=str(tmp_path / "o1"))
    with pytest.raises(UserError, match=r"empty.txt: no text in this file"):
        preprocess.main(cfg, progress=False)
    assert not (tmp_path / "o1" / "manifest.json").exists()

    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine line\n\n\xff\xfe broken\n")
    cfg = PreprocessConfig(tokenizer=str(wordpiece_dir), files=(str(bad),), out=str(tmp_path / "o2"))
    with pytest.raises(UserError, match=r"bad.txt: line 3 is not UTF-8"):
        preprocess.main(cfg, progress=False)
    assert not (tmp_path / "o2" / "manifest.json").exists()

    jsonl = tmp_path / "x.jsonl"
    jsonl.write_text('{"text": "ok"}\n{"other": 1}\n')
    cfg = PreprocessConfig(tokenizer=str(wordpiece_dir), files=(str(jsonl),), out=str(tmp_path / "o3"))
    with pytest.raises(UserError, match=r"x.jsonl: line 2 has no field 'text'"):
        preprocess.main(cfg, progress=False)


def test_damaged_shard_is_named(tmp_path, wordpiece_dir):
    run(tmp_path, wordpiece_dir, make_documents(), seq_len=32, shard_size=10)
    victim = tmp_path / "out" / "train-00001.npy"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01
    victim.write_bytes(bytes(data))
    shards = Shards(str(tmp_path / "out"))
    shards.rows(np.arange(5))  # shard 0 is intact
    with pytest.raises(UserError, match=r"train-00001.npy: sha256 does not match manifest.json"):
        shards.verify()


def test_manifest_cannot_point_outside_its_folder(tmp_path, wordpiece_dir):
    run(tmp_path, wordpiece_dir, make_documents(), seq_len=32)
    path = tmp_path / "out" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["splits"]["train"]["shards"][0]["path"] = "../../etc/passwd.npy"
    path.write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="is not a plain file name"):
        Shards(str(tmp_path / "out"))


def test_other_tokenizer_and_too_long_sequences_are_refused(tmp_path, wordpiece_dir, bpe_dir):
    run(tmp_path, wordpiece_dir, make_documents(), seq_len=64)
    shards = Shards(str(tmp_path / "out"))
    shards.check_tokenizer(Tokenizer.load(wordpiece_dir), str(wordpiece_dir))
    with pytest.raises(UserError, match=r"manifest.json was made with another tokenizer than .*bpe"):
        shards.check_tokenizer(Tokenizer.load(bpe_dir), str(bpe_dir))
    with pytest.raises(UserError, match=r"sequences of 64 tokens do not fit the position table of the model \(32"):
        shards.check_model(max_seq_len=32, vocab_size=700, source="the model")


def test_seq_len_beyond_the_tokenizer_limit_and_changed_settings(tmp_path, wordpiece_dir):
    docs = make_documents(n_docs=5)
    with pytest.raises(UserError, match=r"--seq-len 1024 is longer than the tokenizer's model_max_length 512"):
        run(tmp_path, wordpiece_dir, docs, seq_len=1024)
    run(tmp_path, wordpiece_dir, docs, name="same", seq_len=32)
    with pytest.raises(UserError, match=r"same: already holds shards made with other settings"):
        run(tmp_path, wordpiece_dir, docs, name="same", seq_len=64)
