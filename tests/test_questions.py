"""Question answering and multiple choice data: the readers and their malformed records, the question windows
against transformers' overflowing tokens, and exact match / F1 against the official SQuAD evaluation's rules."""

from __future__ import annotations

import json
import random
import re
import string
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bertforge.data.choices import choice_texts, read_choices
from bertforge.data.question_windows import question_windows
from bertforge.data.questions import Answer, Question, read_questions
from bertforge.data.windows import overflow_ranges
from bertforge.errors import UserError
from bertforge.finetuning.spans import answers_of, question_spans
from bertforge.tokenizer.load import Tokenizer
from bertforge.train.answers import answer_scores, exact_match, f1, normalize, without_spaces


# ------------------------------------------------------------------------------------------------------ metrics
def _official_normalize(s: str) -> str:
    """The official SQuAD v1.1 evaluation's normalize_answer, written out from its rules."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _official_f1(prediction: str, truth: str) -> float:
    p, g = _official_normalize(prediction).split(), _official_normalize(truth).split()
    same = sum((Counter(p) & Counter(g)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


@pytest.mark.parametrize(
    "prediction, truth, em, f",
    [
        ("The Eiffel Tower!", "eiffel tower", 1.0, 1.0),
        ("the cat sat", "a cat sat down", 0.0, 0.8),  # 2 of 2 predicted words, 2 of 3 true: 2 * 1 * 2/3 / (5/3)
        ("Denver Broncos", "Broncos", 0.0, 2 / 3),
        ("in 1990s,", "1990s", 0.0, 2 / 3),
        ("an apple a day", "apple day", 1.0, 1.0),  # articles go
        ("theatre", "the atre", 0.0, 0.0),  # 'the' only as a word
        ("Saint-Étienne", "SaintÉtienne", 1.0, 1.0),  # ASCII punctuation goes, letters stay
    ],
)
def test_exact_match_and_f1_on_fixed_strings_follow_the_official_squad_evaluation(prediction, truth, em, f):
    assert exact_match(prediction, truth) == em
    assert f1(prediction, truth) == pytest.approx(f)
    assert normalize(prediction) == _official_normalize(prediction)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="abc theAN,.!'-", max_size=30), st.text(alphabet="abc theAN,.!'-", max_size=30))
def test_f1_equals_the_official_formula_on_any_strings(prediction, truth):
    p, g = _official_normalize(prediction).split(), _official_normalize(truth).split()
    if p and g:  # v1.1's formula; v2.0 scores an empty answer 1 against an empty one, else 0
        assert f1(prediction, truth) == pytest.approx(_official_f1(prediction, truth))
    else:
        assert f1(prediction, truth) == float(p == g)
    assert exact_match(prediction, truth) == float(_official_normalize(prediction) == _official_normalize(truth))


def test_character_f1_for_text_without_spaces():
    assert f1("東京都", "東京", chars=True) == pytest.approx(0.8)  # 2 of 3 characters, 2 of 2
    assert f1("東京都", "京都府", chars=True) == pytest.approx(2 / 3)
    assert f1("東京都", "東京", chars=False) == 0.0  # as words, one each, different
    assert f1("大阪", "東京", chars=True) == 0.0
    assert without_spaces(["梅雨（つゆ）は日本の気象現象。", "東京"]) and not without_spaces(["the cat sat on it"])


def test_scores_take_each_questions_best_answer_and_split_v2_by_answerability():
    got = answer_scores(["cat", "dog house", ""], [["a cat", "cats"], ["house"], []], chars=False)
    assert got["exact_match"] == pytest.approx(100 * 2 / 3)  # 'cat', none, '' against no answer
    assert got["f1"] == pytest.approx(100 * (1 + 2 / 3 + 1) / 3)
    assert got["has_answer_f1"] == pytest.approx(100 * (1 + 2 / 3) / 2) and got["no_answer_exact_match"] == 100.0
    assert "has_answer_f1" not in answer_scores(["cat"], [["cat"]], chars=False)


# ------------------------------------------------------------------------------------------------------ readers
def _squad(path: Path, qas: list[dict], context: str = "The cat sat on the mat. It was red.") -> Path:
    data = {"version": "v2.0", "data": [{"title": "Cats", "paragraphs": [{"context": context, "qas": qas}]}]}
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_squad_json_v1_and_v2_are_read_with_their_answers(tmp_path):
    qas = [
        {"id": "q1", "question": "Who sat?", "answers": [{"text": "The cat", "answer_start": 0}]},
        {
            "id": "q2",
            "question": "What colour?",
            "answers": [],
            "is_impossible": True,
            "plausible_answers": [{"text": "red", "answer_start": 31}],
        },  # fmt: skip
        {
            "id": "q3",
            "question": "On what?",
            "answers": [{"text": "the mat", "answer_start": 15}, {"text": "mat", "answer_start": 19}],
        },  # fmt: skip
    ]
    got = read_questions(str(_squad(tmp_path / "d.json", qas)))
    assert [q.id for q in got] == ["q1", "q2", "q3"] and {q.group for q in got} == {"Cats"}
    assert got[0].answers == (Answer("The cat", 0),) and got[1].answers == () and got[1].impossible
    assert got[2].answers == (Answer("the mat", 15), Answer("mat", 19))


def test_flat_records_in_every_format_are_read_alike(tmp_path):
    import pandas as pd

    rows = [
        {"id": "a", "question": "Who sat?", "context": "The cat sat.", "answer_text": "cat", "answer_start": 4},
        {"id": "b", "question": "Did it?", "context": "Yes it did.", "answer_text": "Yes", "answer_start": 0},
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (tmp_path / "d.json").write_text(json.dumps(rows), encoding="utf-8")
    pd.DataFrame(rows).to_csv(tmp_path / "d.csv", index=False)
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    hf = [{**{k: r[k] for k in ("id", "question", "context")},
           "answers": {"text": [r["answer_text"]], "answer_start": [r["answer_start"]]}} for r in rows]  # fmt: skip
    (tmp_path / "hf.jsonl").write_text("".join(json.dumps(r) + "\n" for r in hf), encoding="utf-8")
    expected = read_questions(str(tmp_path / "d.jsonl"))
    assert expected[0] == Question("a", "Who sat?", "The cat sat.", (Answer("cat", 4),))
    for name in ("d.json", "d.csv", "d.parquet", "hf.jsonl"):
        assert read_questions(str(tmp_path / name)) == expected, name


@pytest.mark.parametrize(
    "record, message",
    [
        (
            {"question": "Who?", "context": "The cat sat.", "answer_text": "dog", "answer_start": 4},
            r"line 2 \(id 1\): the answer 'dog' is not at answer_start 4 in the context \(which reads 'cat'",
        ),
        (
            {"question": "Who?", "context": "The cat sat.", "answer_text": "cat", "answer_start": "four"},
            "line 2 .*answer_start must be a whole number",
        ),
        (
            {"question": "Who?", "context": "The cat sat.", "answer_text": "cat", "answer_start": True},
            "line 2 .*answer_start must be a whole number, got true",
        ),
        ({"question": "", "context": "The cat sat.", "answer_text": "cat", "answer_start": 4}, "line 2: 'question'"),
        ({"question": "Who?", "answer_text": "cat", "answer_start": 4}, "line 2: 'context' is missing"),
        ({"question": "Who?", "context": "The cat sat."}, r"line 2 \(id 1\): no answer given"),
        ({"question": "Who?", "context": "The cat sat.", "answers": "cat"}, "line 2 .*answers must be a list"),
        (
            {"id": "q0", "question": "Who?", "context": "The cat sat.", "answer_text": "cat", "answer_start": 4},
            "the id 'q0' is given to more than one question",
        ),
    ],  # fmt: skip
)
def test_a_malformed_record_is_one_line_naming_the_file_and_record(tmp_path, record, message):
    good = {"id": "q0", "question": "Who sat?", "context": "The cat sat.", "answer_text": "cat", "answer_start": 4}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match=message) as e:
        read_questions(str(path))
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)


def test_squad_json_errors_name_the_place_in_the_file(tmp_path):
    bad = _squad(
        tmp_path / "d.json", [{"id": "q1", "question": "Who?", "answers": [{"text": "dog", "answer_start": 0}]}]
    )
    with pytest.raises(UserError, match=r"data\[0\]\.paragraphs\[0\]\.qas\[0\] \(id q1\): the answer 'dog'"):
        read_questions(str(bad))
    (tmp_path / "x.json").write_text('{"version": 1, "data": {}}', encoding="utf-8")
    with pytest.raises(UserError, match="neither SQuAD JSON"):
        read_questions(str(tmp_path / "x.json"))
    (tmp_path / "r.json").write_text('{"question": "Who?"}', encoding="utf-8")  # one record of one-line JSONL
    with pytest.raises(UserError, match="r.json: line 1: 'context' is missing"):
        read_questions(str(tmp_path / "r.json"))
    (tmp_path / "y.json").write_text('{"data": [', encoding="utf-8")
    with pytest.raises(UserError, match="line 1 is not valid JSON"):
        read_questions(str(tmp_path / "y.json"))


def test_unlabelled_questions_are_read_for_prediction(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"id": "x", "question": "Who?", "context": "The cat."}) + "\n", encoding="utf-8")
    assert read_questions(str(path), labelled=False)[0].answers == ()
    with pytest.raises(UserError, match="no answer given"):
        read_questions(str(path))


def test_multiple_choice_tables_and_choice_lists(tmp_path):
    rows = [{"q_id": 7, "question": "Which flies?", "choice0": "a stone", "choice1": "a bird", "choice2": "a log",
             "label": 1}]  # fmt: skip
    (tmp_path / "m.json").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    got = read_choices(str(tmp_path / "m.json"))  # JSON lines under a .json name, as JGLUE ships JCommonsenseQA
    assert got[0].id == "7" and got[0].choices == ("a stone", "a bird", "a log") and got[0].label == 1
    listed = [{"id": "z", "question": "Which flies?", "choices": ["a stone", "a bird", "a log"], "label": "1",
               "story": "Birds fly."}]  # fmt: skip
    (tmp_path / "l.jsonl").write_text(json.dumps(listed[0]) + "\n", encoding="utf-8")
    with_context = read_choices(str(tmp_path / "l.jsonl"), context="story")
    assert with_context[0].choices == got[0].choices and with_context[0].label == 1
    assert choice_texts(got) == (["Which flies?"] * 3, ["a stone", "a bird", "a log"])
    assert choice_texts(with_context)[1][1] == "Which flies? a bird"


@pytest.mark.parametrize(
    "record, message",
    [
        ({"question": "Q", "choice0": "a", "choice1": "b", "label": 2}, "line 2: 'label' is 2, outside the 2 choices"),
        ({"question": "Q", "choice0": "a", "choice1": "b", "label": "x"}, "line 2: 'label' must be a choice's index"),
        ({"question": "Q", "choice0": "a", "choice1": "b", "label": 0.5}, "line 2: 'label' must be a choice's index"),
        ({"question": "Q", "choice0": "a", "choice2": "b", "label": 0}, "line 2: no choices"),
        ({"question": "Q", "choice0": "a", "choice1": "", "label": 0}, "line 2: choice 1 is empty"),
        ({"question": "Q", "choices": "a, b", "label": 0}, "line 2: 'choices' must be a list"),
        ({"question": "Q", "choices": ["a"], "label": 0}, "line 2: 1 choice"),
        ({"question": "", "choices": ["a", "b"], "label": 0}, "line 2: 'question' is missing or empty"),
        ({"question": "Q", "choice0": "a", "choice1": "b", "choice2": "c", "label": 0}, "line 2 has 3 choices"),
    ],
)
def test_a_malformed_choice_record_is_one_line_naming_it(tmp_path, record, message):
    good = {"question": "Q", "choice0": "a", "choice1": "b", "label": 0}
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match=message) as e:
        read_choices(str(path))
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------------ windows
@pytest.mark.parametrize("n, capacity, stride", [(80, 16, 5), (16, 16, 4), (3, 8, 2), (0, 4, 1), (33, 10, 9)])
def test_overflow_ranges_are_the_tokenizers(n, capacity, stride):
    ranges = overflow_ranges(n, capacity, stride)
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(b[0] - a[0] == capacity - stride for a, b in zip(ranges, ranges[1:], strict=False))
    assert all(e - s == capacity for s, e in ranges[:-1]) and ranges[-1][1] - ranges[-1][0] <= capacity


def _hf(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _questions(n: int, seed: int) -> list[Question]:
    rng = random.Random(seed)
    words = "the river city walked over a bridge into old town near water, and then".split()
    out = []
    for i in range(n):
        context = " ".join(rng.choice(words) for _ in range(rng.randint(5, 90))) + "."
        start = rng.randrange(len(context) - 5)
        start = context.rfind(" ", 0, start) + 1
        end = context.find(" ", start + 1)
        end = len(context) - 1 if end < 0 else end
        question = " ".join(rng.choice(words) for _ in range(rng.randint(2, 5))) + "?"
        out.append(Question(str(i), question, context, (Answer(context[start:end], start),)))
    return out


@pytest.mark.parametrize("which", ["wordpiece_dir", "bpe_dir"])
@pytest.mark.parametrize("limit, stride", [(40, 8), (64, 16)])
def test_question_windows_equal_transformers_overflowing_tokens_and_hold_the_answer(request, which, limit, stride):
    folder = request.getfixturevalue(which)
    tok, hf = Tokenizer.load(folder), _hf(folder)
    questions = _questions(40, seed=limit)
    rows = question_windows(tok, questions, limit, stride, max_question=64)
    compared = 0
    for i, q in enumerate(questions):
        mine = [r for r in rows if r.question == i]
        if limit - tok.num_special(pair=True) - len(tok.tokenize_ids([q.question])[0]) <= stride:
            continue  # tokenizers refuses a stride the room left cannot hold (bertforge narrows it)
        compared += 1
        ref = hf(q.question, q.context, truncation="only_second", max_length=limit, stride=stride,
                 return_overflowing_tokens=True, return_offsets_mapping=True)  # fmt: skip
        assert [r.encoded.ids for r in mine] == ref["input_ids"], i
        for w, row in enumerate(mine):
            context = [k for k, s in enumerate(ref.sequence_ids(w)) if s == 1]
            np.testing.assert_array_equal(row.offsets[context], np.array(ref["offset_mapping"][w])[context])
            assert (row.offsets[[k for k in range(limit) if k not in context]] == -1).all()
            first, last = row.targets
            a = q.answers[0]
            inside = row.offsets[context[0], 0] <= a.start and row.offsets[context[-1], 1] >= a.start + len(a.text)
            if not inside:
                assert (first, last) == (0, 0)
                continue
            span = q.context[row.offsets[first, 0] : row.offsets[last, 1]]
            assert a.text.strip() in span  # the answer's tokens, and no fewer
            assert row.offsets[first, 0] <= a.start < row.offsets[first, 1] or q.context[a.start].isspace()
        assert any(r.targets[0] > 0 for r in mine) or len(q.answers[0].text.strip()) == 0
    assert compared > 30


def test_a_question_that_leaves_no_room_for_its_context_is_refused(wordpiece_dir):
    tok = Tokenizer.load(wordpiece_dir)
    q = Question("long", " ".join(["river"] * 40) + "?", "The cat sat.", (Answer("cat", 4),))
    with pytest.raises(UserError, match="question long: its 41 tokens leave no room"):
        question_windows(tok, [q], limit=32, doc_stride=8, max_question=64)
    assert question_windows(tok, [q], limit=32, doc_stride=8, max_question=16)  # the question cut to 16 tokens


# ------------------------------------------------------------------------------------------------------ answers
def _brute_force(context, starts, ends, offsets, max_answer):
    """The best span of a question's windows by looking at every pair of context tokens of every window."""
    best = (-np.inf, "", -1)
    for w in range(len(starts)):
        inside = [t for t in range(starts.shape[1]) if offsets[w, t, 0] >= 0]
        for s in inside:
            for e in inside:
                if s <= e < s + max_answer and starts[w, s] + ends[w, e] > best[0]:
                    a, b = offsets[w, s, 0], offsets[w, e, 1]
                    best = (starts[w, s] + ends[w, e], context[a:b], a)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_best_span_is_the_exhaustive_searchs_over_every_window(wordpiece_dir, seed):
    tok = Tokenizer.load(wordpiece_dir)
    questions = _questions(8, seed=seed)
    rows = question_windows(tok, questions, limit=40, doc_stride=8, max_question=64)
    rng = np.random.default_rng(seed)
    outputs = rng.normal(size=(len(rows), 40, 2)).astype(np.float32)
    offsets = np.stack([r.offsets for r in rows])
    question_of = np.array([r.question for r in rows])
    found = answers_of([q.context for q in questions], question_of, outputs, offsets, max_answer=5, n_best=10)
    for i, q in enumerate(questions):
        mine = question_of == i
        score, text, start = _brute_force(q.context, outputs[mine, :, 0], outputs[mine, :, 1], offsets[mine], 5)
        assert (found[i][0].text, found[i][0].start) == (text, start) and found[i][0].score == pytest.approx(score)
        assert q.context[found[i][0].start :].startswith(found[i][0].text)  # it slices out of the context
        assert [s.score for s in found[i]] == sorted((s.score for s in found[i]), reverse=True)
        assert sum(s.probability for s in found[i]) == pytest.approx(1.0)


def test_a_span_across_a_window_boundary_is_found_in_the_window_that_holds_it_whole():
    context = "aa bb cc dd ee"
    # Two windows of three tokens: aa bb cc, then cc dd ee; the best pair (bb .. dd) crosses them and is not a
    # span of either, so each window's own best spans are the candidates.
    offsets = np.array([[[0, 2], [3, 5], [6, 8]], [[6, 8], [9, 11], [12, 14]]], np.int32)
    starts = np.array([[0.0, 5.0, 0.0], [1.0, 0.0, 0.0]])
    ends = np.array([[0.0, -1.0, 1.0], [0.0, 4.0, 0.0]])
    best = question_spans(context, starts, ends, offsets, max_answer=3)
    assert (best[0].text, best[0].start, best[0].score) == ("bb cc", 3, 6.0)
    assert [s.text for s in best[:2]] == ["bb cc", "cc dd"]


def test_the_null_answer_wins_when_it_beats_the_best_span_by_more_than_the_threshold():
    context = "aa bb"
    offsets = np.array([[[-1, -1], [0, 2], [3, 5]]], np.int32)  # the first token is [CLS]
    starts, ends = np.array([[3.0, 1.0, 0.0]]), np.array([[3.0, 0.0, 2.0]])  # null 6, best span 'aa bb' 3
    assert question_spans(context, starts, ends, offsets, null_threshold=0.0)[0].text == ""
    assert question_spans(context, starts, ends, offsets, null_threshold=3.5)[0].text == "aa bb"
    assert question_spans(context, starts, ends, offsets)[0].text == "aa bb"  # v1.1: always an answer
    assert all(s.text for s in question_spans(context, starts, ends, offsets))
