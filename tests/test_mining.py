"""`bertforge mine`: hard negatives against a brute-force search in numpy (the same negatives, in blocks over 8
devices), the margins' boundaries exact as sentence-transformers' mine_hard_negatives draws them, and the mined
table read back by position with its scores."""

from __future__ import annotations

import csv

import jax.numpy as jnp
import numpy as np
import pytest
from test_embedding import pair_rows, write_rows

from bertforge.cli import main as cli
from bertforge.data.hard_negatives import NONE, Margins, mine, select, unit
from bertforge.data.labelled import TableConfig
from bertforge.finetuning import pairs
from bertforge.model.load import load_model
from bertforge.tasks.embed import embed


def brute_force(q: np.ndarray, c: np.ndarray, positives, own, k: int, margins: Margins) -> np.ndarray:
    """Each query's K best remaining candidates by cosine, over the whole corpus, written out in numpy."""
    scores = unit(q) @ unit(c).T
    out = np.full((len(q), k), NONE)
    for i in range(len(q)):
        positive = min(scores[i, p] for p in positives[i])
        keep = []
        for j in np.argsort(-scores[i], kind="stable"):
            s = scores[i, j]
            if j in positives[i] or j == own[i]:
                continue
            if margins.absolute is not None and s + np.float32(margins.absolute) > positive:
                continue
            if margins.relative is not None and s > positive - abs(positive) * np.float32(margins.relative):
                continue
            keep.append(j)
        out[i, : min(k, len(keep))] = keep[:k]
    return out


def test_the_filters_boundaries_are_exact():
    # Binary fractions: every sum and product below is exact in float32.
    scores = jnp.asarray([[0.75, 0.5, 0.5625, 0.25, 0.875, 0.0]], jnp.float32)
    positives, own = jnp.asarray([[0, NONE]]), jnp.asarray([4])  # the positive scores 0.75; candidate 4 is the query
    best, index, positive = select(scores, positives, own, Margins(absolute=0.25), 3)
    # 0.5 + 0.25 = 0.75 is not above the positive: kept; 0.5625 + 0.25 is: removed.
    assert float(positive[0]) == 0.75 and index[0].tolist()[:3] == [1, 3, 5]
    _, index, _ = select(scores, positives, own, Margins(relative=0.25), 2)  # threshold 0.75 - 0.1875 = 0.5625: kept
    assert index[0].tolist() == [2, 1]
    negative = jnp.asarray([[-0.5, -0.625, -0.375, -0.75]], jnp.float32)  # a negative positive score
    _, index, positive = select(negative, jnp.asarray([[0, NONE]]), jnp.asarray([NONE]), Margins(relative=0.25), 2)
    assert float(positive[0]) == -0.5 and index[0].tolist() == [1, 3]  # threshold -0.625: -0.375 removed
    # Two positives: the lower-scored is the positive; neither is a negative.
    best, index, positive = select(scores, jnp.asarray([[0, 2]]), own, Margins(absolute=0.0625), 4)
    assert float(positive[0]) == 0.5625 and index[0].tolist()[:2] == [1, 3] and np.isneginf(float(best[0, 3]))


@pytest.mark.parametrize("margins", [Margins(), Margins(absolute=0.05), Margins(relative=0.1)])
def test_mining_in_blocks_over_eight_devices_finds_the_brute_force_negatives(margins):
    rng = np.random.default_rng(0)
    corpus = rng.normal(size=(101, 16)).astype(np.float32)
    queries = corpus[rng.choice(101, 37)] + rng.normal(scale=0.6, size=(37, 16)).astype(np.float32)
    positives = [sorted({int(j) for j in rng.choice(101, rng.integers(1, 3))}) for _ in range(37)]
    own = [NONE] * 37
    own[5] = 17  # a query that is itself a passage of the corpus
    index, best, positive = mine(queries, corpus, positives, own, 6, margins, block=16, dtype="float32")
    np.testing.assert_array_equal(index, brute_force(queries, corpus, positives, own, 6, margins))
    scores = unit(queries) @ unit(corpus).T
    found = index != NONE
    np.testing.assert_allclose(best[found], np.take_along_axis(scores, np.maximum(index, 0), 1)[found], atol=1e-6)
    assert 17 not in index[5]
    if margins != Margins():
        assert not found.all()  # the filters did remove candidates
    # Half precision ranks alike where no two candidates are within its rounding.
    half, _, _ = mine(queries, corpus, positives, own, 6, margins, block=16)
    assert (half == index).mean() > 0.95


def test_mine_writes_a_table_that_reads_back_by_position_with_the_models_scores(model_dir, tmp_path):
    rows = pair_rows(24, 11)
    data = write_rows(tmp_path / "pairs.csv", [{"id": r["id"], "q": r["query"], "p": r["passage"]} for r in rows])
    more = tmp_path / "corpus.csv"
    more.write_text("text\n" + "".join(f"{r['negative']}\n" for r in rows), encoding="utf-8")
    out = tmp_path / "mined.csv"
    assert cli(["mine", "--model", str(model_dir), "--data", str(data), "--corpus", str(more), "--negatives", "4",
                "--margin", "0.001", "--scores", "--out", str(out), "--max-length", "16", "--precision",
                "float32"]) == 0  # fmt: skip
    with open(out, newline="", encoding="utf-8") as fh:
        mined = list(csv.DictReader(fh))
    table = pairs.read(str(out), TableConfig(), scored=False)  # by position: q, p, the negatives
    assert table.source.columns == ("q", "p", "negative_1", "negative_2", "negative_3", "negative_4")
    assert table.targets.shape[1] == 4 + 5  # the positive's and each negative's score
    # The negatives and scores of the brute-force search over the model's own vectors.
    pre = load_model(model_dir, head="embedding")
    queries = list(dict.fromkeys(r["query"] for r in rows))
    corpus = list(dict.fromkeys([r["passage"] for r in rows] + [r["negative"] for r in rows]))
    q_vec, c_vec = embed(pre, queries, max_length=16), embed(pre, corpus, max_length=16)
    positives = [[corpus.index(r["passage"]) for r in rows if r["query"] == q] for q in queries]
    expected = brute_force(q_vec, c_vec, positives, [NONE] * len(queries), 4, Margins(absolute=0.001))
    cos = unit(q_vec) @ unit(c_vec).T
    kept = [r for r in rows if NONE not in expected[queries.index(r["query"])]]
    assert [m["id"] for m in mined] == [r["id"] for r in kept]
    for m in mined:
        i = queries.index(m["q"])
        assert [m[f"negative_{j}"] for j in range(1, 5)] == [corpus[j] for j in expected[i]]
        assert float(m["score_p"]) == pytest.approx(cos[i, corpus.index(m["p"])], abs=1e-5)
        got = [float(m[f"score_negative_{j}"]) for j in range(1, 5)]
        np.testing.assert_allclose(got, cos[i, expected[i]], atol=1e-5)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--relative-margin", "1.5"], "relative_margin in [0, 1)"),
        (["--negatives", "0"], "negatives must be at least 1"),
        (["--out", "mined.parquet"], "mine writes a .csv table"),
        (["--corpus", "missing.csv"], "missing.csv"),
    ],
)
def test_a_wrong_mining_command_is_one_line(model_dir, tmp_path, capsys, extra, message, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_rows(tmp_path / "pairs.csv", [{"q": r["query"], "p": r["passage"]} for r in pair_rows(4, 1)])
    args = ["mine", "--model", str(model_dir), "--data", "pairs.csv", "--out", "mined.csv", *extra]
    assert cli(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err, err
    assert not (tmp_path / "mined.csv").exists()
