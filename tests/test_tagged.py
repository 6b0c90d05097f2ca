"""Token-classification data: the CoNLL, JSONL and JSON readers and their named errors, the tag schemes (entities
read exactly as seqeval's default mode reads them), and entity-level scores equal to seqeval's."""

from __future__ import annotations

import gzip
import json
import re
import warnings
from pathlib import Path

import fsspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from seqeval.metrics import accuracy_score, classification_report, f1_score, precision_score, recall_score
from seqeval.metrics.sequence_labeling import get_entities

from bertforge.data.tagged import Document, Entity, data_format, read_documents
from bertforge.data.tags import convert, labels_of, scheme_of, spans_of, tags_of
from bertforge.errors import UserError
from bertforge.train.entities import entity_scores


def write(path: Path, content: str | bytes) -> str:
    path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return str(path)


def jsonl(*records: object) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def words_match_tokens(doc: Document, tokens: list[str]) -> None:
    assert doc.words is not None
    assert [doc.text[start:end] for start, end in doc.words] == tokens


# ------------------------------------------------------------------------------------------------------ readers
CONLL = (
    "-DOCSTART- -X- -X- O\n"
    "\n"
    "EU NNP B-NP B-ORG\n"
    "rejects\tVBZ\tB-VP\tO  \n"
    "German JJ B-NP B-MISC \n"
    "\n"
    "\n"
    "-DOCSTART- -X- -X- O\n"
    "\n"
    "Peter NNP B-NP B-PER\n"
    "Blackburn NNP I-NP I-PER"
)


def test_conll_documents_skip_docstart_and_blank_lines_and_take_the_last_column(tmp_path):
    docs = read_documents(write(tmp_path / "train.conll", CONLL))
    assert docs == [
        Document("0", "EU rejects German", ((0, 2), (3, 10), (11, 17)), ("B-ORG", "O", "B-MISC"), None),
        Document("1", "Peter Blackburn", ((0, 5), (6, 15)), ("B-PER", "I-PER"), None),
    ]
    words_match_tokens(docs[0], ["EU", "rejects", "German"])
    words_match_tokens(docs[1], ["Peter", "Blackburn"])


def test_conll_without_tags_reads_when_unlabelled(tmp_path):
    path = write(tmp_path / "test.txt", "\ufeffEU\r\nrejects\r\n\r\nPeter B-PER\n")
    assert read_documents(path, labelled=False) == [
        Document("0", "EU rejects", ((0, 2), (3, 10)), None, None),
        Document("1", "Peter", ((0, 5),), ("B-PER",), None),
    ]


def test_jsonl_word_records(tmp_path):
    path = write(
        tmp_path / "train.jsonl",
        jsonl({"id": "a", "tokens": ["New", "York", "!"], "tags": ["B-LOC", "E-LOC", "O"]}, {"tokens": [], "tags": []})
        + "\n  \n"
        + jsonl({"id": 7, "tokens": ["Ann"], "ner_tags": ["S-PER"], "pos": [1]}),
    )
    docs = read_documents(path)
    assert docs == [
        Document("a", "New York !", ((0, 3), (4, 8), (9, 10)), ("B-LOC", "E-LOC", "O"), None),
        Document("1", "", (), (), None),
        Document("7", "Ann", ((0, 3),), ("S-PER",), None),
    ]
    words_match_tokens(docs[0], ["New", "York", "!"])


def test_json_list_of_word_records_with_and_without_tags(tmp_path):
    records = [{"tokens": ["Oslo", "sleeps"], "tags": ["I-LOC", "O"]}, {"tokens": ["Rome"]}]
    path = write(tmp_path / "dev.json", json.dumps(records, indent=2))
    assert read_documents(path, labelled=False) == [
        Document("0", "Oslo sleeps", ((0, 4), (5, 11)), ("I-LOC", "O"), None),
        Document("1", "Rome", ((0, 4),), None, None),
    ]
    with pytest.raises(UserError, match=re.escape(f"{path}: record 2 has no 'tags'")):
        read_documents(path)


def test_span_records_with_span_or_start_and_end(tmp_path):
    text = "Ada Lovelace met Charles Babbage in London."
    path = write(
        tmp_path / "spans.jsonl",
        jsonl(
            {
                "curid": "w1",
                "text": text,
                "entities": [
                    {"start": 36, "end": 42, "label": "LOC"},
                    {"span": [0, 12], "type": "PER", "name": "not the text"},
                    {"span": [17, 32], "type": "PER"},
                ],
            },
            {"text": "nothing here", "entities": []},
        ),
    )
    assert read_documents(path) == [
        Document("0", text, None, None, (Entity(0, 12, "PER"), Entity(17, 32, "PER"), Entity(36, 42, "LOC")), "w1"),
        Document("1", "nothing here", None, None, ()),
    ]
    unlabelled = write(tmp_path / "raw.json", json.dumps([{"text": "just text", "id": "x"}]))
    assert read_documents(unlabelled, labelled=False) == [Document("x", "just text", None, None, None)]


def test_files_are_read_through_fsspec_urls_and_compressed(tmp_path):
    with fsspec.open("memory://tagged/train.conll", "wb") as fh:
        fh.write(CONLL.encode())
    assert read_documents("memory://tagged/train.conll") == read_documents(write(tmp_path / "a.conll", CONLL))
    packed = write(tmp_path / "a.conll.gz", gzip.compress(CONLL.encode()))
    assert read_documents(packed) == read_documents(write(tmp_path / "b.conll", CONLL))


def test_the_format_comes_from_the_file_name_unless_given(tmp_path):
    assert data_format("x/train.conll") == "conll"
    assert data_format("gs://b/train.TXT") == "conll"
    assert data_format("train.jsonl.gz") == "jsonl"
    assert data_format("train.json") == "json"
    assert data_format("train.data", "conll") == "conll"
    with pytest.raises(UserError, match=r"^train\.data: cannot tell the format from the file name; give --data-fo"):
        data_format("train.data")
    with pytest.raises(UserError, match="unknown --data-format 'csv'"):
        data_format("train.conll", "csv")
    path = write(tmp_path / "records.data", jsonl({"tokens": ["a"], "tags": ["O"]}))
    assert read_documents(path, "jsonl")[0].tags == ("O",)


# ------------------------------------------------------------------------------------------------------ malformed
WORD = {"tokens": ["EU", "rejects"], "tags": ["B-ORG", "O"]}
SPAN = {"text": "EU rejects", "entities": [{"span": [0, 2], "type": "ORG"}]}


def ent(**changes: object) -> dict:
    return {"text": "EU rejects", "entities": [{"span": [0, 2], "type": "ORG"} | changes]}


# (file name, content, labelled, the message after "PATH: ")
MALFORMED = [
    ("a.conll", "EU B-ORG\nrejects\n", True, "line 2: 'rejects' has no tag column"),
    ("a.conll", "EU B-ORG\nrejects\n", False, "line 2 has no tag column, line 1 of the same sentence has one"),
    ("a.conll", "\nEU\nrejects O\n", False, "line 3 has a tag column, line 2 of the same sentence has none"),
    ("a.conll", "EU X-ORG\n", True, "line 1: the tag 'X-ORG' is neither O nor B-, I-, E- or S- followed by"),
    ("a.conll", "EU O\n\nEU B\n", True, "line 3: the tag 'B' has no entity type (write B-TYPE, e.g. B-PER)"),
    ("a.conll", "EU B-\n", True, "line 1: the tag 'B-' has an empty entity type"),
    ("a.conll", "E\u00a0U B-ORG\n", True, "line 1: 'E\\xa0U B-ORG' holds a whitespace character other than"),
    ("a.conll", b"EU O\n\xff O\n", True, "line 2 is not UTF-8 text"),
    ("a.conll", "-DOCSTART- O\n\n\n", True, "no records"),
    ("a.jsonl", "", True, "no records"),
    ("a.jsonl", jsonl(WORD) + "{oops\n", True, "line 2 is not valid JSON"),
    ("a.jsonl", "[1]\n", True, "line 1 is not a JSON object"),
    ("a.jsonl", jsonl({"words": ["a"]}), True, "line 1 has neither 'tokens' (with 'tags') nor 'text'"),
    ("a.jsonl", jsonl(WORD, {"tags": ["O"]}), True, "line 2 has no 'tokens'"),
    ("a.jsonl", jsonl(WORD, {"tokens": ["EU"]}), True, "line 2 has no 'tags'"),
    ("a.jsonl", jsonl({"tokens": "EU rejects", "tags": ["O"]}), True, "line 1: 'tokens' is not a list"),
    ("a.jsonl", jsonl({"tokens": ["EU", 3], "tags": ["O", "O"]}), True, "line 1: token 2 is not a string (3)"),
    ("a.jsonl", jsonl({"tokens": ["EU", ""], "tags": ["O", "O"]}), True, "line 1: token 2 is empty"),
    ("a.jsonl", jsonl({"tokens": ["E U"], "tags": ["O"]}), True, "line 1: token 1 'E U' holds whitespace"),
    ("a.jsonl", jsonl({"tokens": ["EU"], "tags": "O"}), True, "line 1: 'tags' is not a list"),
    ("a.jsonl", jsonl({"tokens": ["EU"], "tags": ["O", "O"]}), True, "line 1 has 1 tokens and 2 'tags'"),
    ("a.jsonl", jsonl({"tokens": ["EU"], "tags": [None]}), True, "line 1: tag 1: the tag None is not a string"),
    ("a.jsonl", jsonl({"tokens": ["EU"], "ner_tags": [3]}), True, "line 1: 'ner_tags' holds numbers (3 at 1)"),
    ("a.jsonl", jsonl({"tokens": ["EU"], "tags": ["ORG"]}), True, "line 1: tag 1: the tag 'ORG' is neither O"),
    ("a.jsonl", jsonl({"tokens": ["EU"], "tags": ["I"]}), True, "line 1: tag 1: the tag 'I' has no entity type"),
    ("a.jsonl", jsonl(WORD, SPAN), True, "line 2 holds 'text' where the file's first record holds 'tokens'"),
    ("a.jsonl", jsonl(WORD | {"id": 1}, WORD | {"id": "1"}), True, "line 2 repeats the id '1' of line 1"),
    ("a.jsonl", jsonl(WORD | {"id": [1]}), True, "line 1: 'id' is not a string or an integer ([1])"),
    ("a.jsonl", jsonl(SPAN, {"text": 5, "entities": []}), True, "line 2: 'text' is not a string"),
    ("a.jsonl", jsonl({"text": "EU"}), True, "line 1 has no 'entities'"),
    ("a.jsonl", jsonl({"text": "EU", "entities": {}}), True, "line 1: 'entities' is not a list"),
    ("a.jsonl", jsonl({"text": "EU", "entities": ["ORG"]}), True, "line 1: entity 1 is not a JSON object"),
    ("a.jsonl", jsonl({"text": "EU", "entities": [{"start": 0}]}), True, "line 1: entity 1 has no 'span' (or 'st"),
    ("a.jsonl", jsonl(ent(span=["0", 2])), True, "line 1: entity 1: the span ['0', 2] is not two integers"),
    ("a.jsonl", jsonl(ent(span=[0, 2, 4])), True, "line 1: entity 1: the span [0, 2, 4] is not two integers"),
    ("a.jsonl", jsonl(ent(span=[0, 11])), True, "line 1: entity 1: the span [0, 11] is not within the text"),
    ("a.jsonl", jsonl(ent(span=[2, 2])), True, "line 1: entity 1: the span [2, 2] is not within the text"),
    ("a.jsonl", jsonl(ent(span=[-1, 2])), True, "line 1: entity 1: the span [-1, 2] is not within the text"),
    ("a.jsonl", jsonl(ent(type="")), True, "line 1: entity 1: the type is empty"),
    ("a.jsonl", jsonl(ent(type=None)), True, "line 1: entity 1: the type None is not a string"),
    ("a.jsonl", jsonl({"text": "EU", "entities": [{"span": [0, 2]}]}), True, "line 1: entity 1 has no 'type'"),
    (
        "a.jsonl",
        jsonl({"text": "EU rejects", "entities": [{"span": [3, 10], "type": "A"}, {"span": [0, 4], "type": "B"}]}),
        True,
        "line 1: entity 2 [0, 4) and entity 1 [3, 10) overlap",
    ),
    ("a.json", json.dumps(WORD), True, "a JSON file must hold a list of records, this one holds an object"),
    ("a.json", "[]", True, "no records"),
    ("a.json", json.dumps([WORD, 1]), True, "record 2 is not a JSON object"),
    ("a.json", json.dumps([WORD, WORD | {"tags": ["O", "B"]}]), True, "record 2: tag 2: the tag 'B' has no entity"),
    ("a.json", json.dumps([SPAN, ent(span=[0, 99])]), True, "record 2: entity 1: the span [0, 99] is not within"),
    ("a.json", "[" * 100_000, True, "its JSON nests too deeply to read"),
    ("a.jsonl", jsonl(WORD) + "[" * 100_000, True, "line 2 nests too deeply to read"),
    ("a.json", jsonl(WORD, WORD), True, "line 2 is not valid JSON (Extra data); a file of one object per line is"),
]


@pytest.mark.parametrize("name, content, labelled, message", MALFORMED)
def test_malformed_files_are_named_by_file_and_line_or_record(name, content, labelled, message, tmp_path):
    path = write(tmp_path / name, content)
    with pytest.raises(UserError, match="^" + re.escape(f"{path}: {message}")) as caught:
        read_documents(path, labelled=labelled)
    assert "\n" not in str(caught.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(UserError, match=re.escape(f"{tmp_path / 'none.conll'}: no such file")):
        read_documents(str(tmp_path / "none.conll"))


# ------------------------------------------------------------------------------------------------------ tag schemes
TYPES = ("PER", "LOC", "MISC-X")
TAGS = ["O", *(f"{p}-{t}" for p in "BIES" for t in TYPES)]
tag_lists = st.lists(st.sampled_from(TAGS), max_size=16)


@settings(max_examples=300, deadline=None)
@given(tags=tag_lists)
def test_spans_are_seqevals_entities(tags):
    assert spans_of(tags) == get_entities(tags)


@settings(max_examples=300, deadline=None)
@given(tags=tag_lists)
def test_conversions_keep_the_entities(tags):
    bio, bioes, io = convert(tags, "bio"), convert(tags, "bioes"), convert(tags, "io")
    assert spans_of(bio) == spans_of(bioes) == spans_of(tags)
    assert convert(bioes, "bio") == bio and convert(bio, "bioes") == bioes and convert(bio, "bio") == bio
    assert convert(io, "io") == io and convert(bio, "io") == convert(bioes, "io") == io
    assert scheme_of(bio) in ("io", "bio") and scheme_of(io) == "io"
    assert scheme_of(bioes) == ("bioes" if spans_of(tags) else "io")
    assert set(bioes) <= set(labels_of(TYPES, "bioes")) and set(io) <= set(labels_of(TYPES, "io"))


def test_scheme_names_labels_and_tags():
    assert scheme_of([]) == scheme_of(["O", "I-PER"]) == "io"
    assert scheme_of(["B-PER", "I-PER", "O"]) == "bio"
    assert scheme_of(["B-PER", "E-PER", "O"]) == scheme_of(["S-LOC"]) == "bioes"
    assert labels_of(["PER", "LOC", "PER"], "bio") == ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"]
    assert labels_of(["LOC"], "bioes") == ["O", "B-LOC", "I-LOC", "E-LOC", "S-LOC"]
    assert labels_of(["LOC"], "io") == ["O", "I-LOC"]
    spans = [("PER", 0, 1), ("PER", 2, 2), ("LOC", 4, 6)]
    assert tags_of(spans, 7, "bioes") == ["B-PER", "E-PER", "S-PER", "O", "B-LOC", "I-LOC", "E-LOC"]
    assert tags_of(spans, 7, "bio") == ["B-PER", "I-PER", "B-PER", "O", "B-LOC", "I-LOC", "I-LOC"]
    assert spans_of(tags_of(spans, 7, "io")) == [("PER", 0, 2), ("LOC", 4, 6)]  # IO merges neighbours of a type
    with pytest.raises(ValueError, match="overlaps"):
        tags_of([("PER", 0, 2), ("LOC", 2, 3)], 4, "bio")
    with pytest.raises(ValueError, match="no entity type"):
        spans_of(["B"])


# ------------------------------------------------------------------------------------------------------ scores
documents = st.lists(st.lists(st.sampled_from(TAGS), max_size=10), min_size=1, max_size=6)


@st.composite
def true_and_predicted(draw) -> tuple[list[list[str]], list[list[str]]]:
    true = draw(documents)
    pred = [draw(st.lists(st.sampled_from(TAGS), min_size=len(t), max_size=len(t))) for t in true]
    return true, pred


@settings(max_examples=300, deadline=None)
@given(pair=true_and_predicted())
def test_entity_scores_are_seqevals(pair):
    true, pred = pair
    scores = entity_scores(true, pred)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # seqeval warns where a ratio has nothing to count, and gives 0
        expected = {
            "precision": precision_score(true, pred),
            "recall": recall_score(true, pred),
            "f1": f1_score(true, pred),
        }
        if any(true):
            expected["accuracy"] = accuracy_score(true, pred)
        report = classification_report(true, pred, output_dict=True)
    for kind, row in report.items():
        if not kind.endswith(" avg"):
            expected |= {f"precision_{kind}": row["precision"], f"recall_{kind}": row["recall"]}
            expected[f"f1_{kind}"] = row["f1-score"]
    assert set(scores) == set(expected) | {"accuracy"}
    assert scores == pytest.approx(expected | {"accuracy": scores["accuracy"]}, rel=0, abs=1e-9)
    assert any(true) or scores["accuracy"] == 0.0


def test_entity_scores_by_hand():
    true = [["B-PER", "I-PER", "O", "B-LOC"], ["S-ORG"]]
    pred = [["B-PER", "I-PER", "O", "I-LOC"], ["B-PER"]]
    scores = entity_scores(true, pred)
    assert scores["precision"] == scores["recall"] == scores["f1"] == 2 / 3
    assert scores["accuracy"] == 3 / 5  # I-LOC is the right entity but not the right tag
    assert scores["f1_PER"] == pytest.approx(2 / 3) and scores["recall_ORG"] == 0.0 and scores["f1_LOC"] == 1.0
    assert entity_scores([["O"]], [["O"]]) == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "accuracy": 1.0}
    with pytest.raises(ValueError, match="sequence 1: 1 true tags but 2 predicted"):
        entity_scores(true, [pred[0], ["O", "O"]])
    with pytest.raises(ValueError, match="2 true sequences but 1 predicted"):
        entity_scores(true, pred[:1])
