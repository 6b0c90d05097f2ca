"""Embedding models: an export is a sentence-transformers folder that `SentenceTransformer` loads and encodes to
bertforge's vectors (BERT, ModernBERT, DeBERTa-v3; cls, mean and max pooling, normalised or not); a
sentence-transformers folder loads with its pooling; `finetune --task embedding` and `--task similarity`, then
`embed`, end to end, their metrics recomputed from the vectors `embed` writes; malformed pair tables."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer
from test_model_hf import TEXTS
from test_token_heads import reference

import bertforge
from bertforge.cli import main as cli
from bertforge.model.load import load_model
from bertforge.model.sentence_folder import read_pooling
from bertforge.tasks.embed import embed
from bertforge.train.retrieval import retrieval_scores


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


CASES = [("bert", "mean", True), ("modernbert", "cls", False), ("deberta-v2", "max", True)]


@pytest.mark.parametrize(("family", "pooling", "normalize"), CASES)
def test_an_export_encodes_in_sentence_transformers_as_in_bertforge(family, pooling, normalize, request, tmp_path):
    folder, _ = reference(family, "MaskedLM", request, tmp_path / "mlm")
    pre = load_model(folder, head="embedding", overrides={"pooling": pooling, "normalize": normalize})
    assert pre.missing_head == [] and pre.model.config.pooling == pooling
    ours = embed(pre, TEXTS)  # several texts to a row where the family allows it
    np.testing.assert_allclose(embed(pre, TEXTS, packed=False), ours, atol=1e-5)  # batches padded by length
    bertforge.save(pre.model, tmp_path / "export", pre.tokenizer)
    # Saved again over the first export (its 1_Pooling/ folder included), as a resumed fine-tuning run rewrites
    # a fold's model folder.
    out = bertforge.save(pre.model, tmp_path / "export", pre.tokenizer)
    st = SentenceTransformer(str(out), device="cpu")
    theirs = st.encode(TEXTS, convert_to_numpy=True)
    assert theirs.shape == ours.shape
    assert np.min(cosines(ours, theirs)) >= 1 - 1e-5
    np.testing.assert_allclose(ours, theirs, atol=1e-4 * max(1.0, float(np.abs(theirs).max())))
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)
    again = load_model(out, head="embedding")  # the folder's pooling comes back with it
    assert (again.model.config.pooling, again.model.config.normalize) == (pooling, normalize)
    np.testing.assert_allclose(embed(again, TEXTS), ours, atol=1e-6)


def test_a_sentence_transformers_folder_keeps_its_pooling(model_dir, tmp_path):
    st_folder = tmp_path / "st"
    (st_folder / "p").mkdir(parents=True)
    for f in model_dir.iterdir():
        (st_folder / f.name).write_bytes(f.read_bytes())
    kinds = ["base.modules.transformer.Transformer", "sentence_transformer.modules.pooling.Pooling"]
    modules = [{"idx": i, "name": str(i), "path": ["", "p"][i], "type": f"sentence_transformers.{kind}"}
               for i, kind in enumerate(kinds)]  # fmt: skip
    (st_folder / "modules.json").write_text(json.dumps(modules))
    (st_folder / "p" / "config.json").write_text(json.dumps({"embedding_dimension": 32, "pooling_mode": "max"}))
    found = read_pooling(st_folder)  # sentence-transformers 6's layout
    assert (found.pooling, found.normalize) == ("max", False)
    pre = load_model(st_folder, head="embedding")
    assert pre.model.config.pooling == "max"
    theirs = SentenceTransformer(str(st_folder), device="cpu").encode(TEXTS)
    assert np.min(cosines(embed(pre, TEXTS), theirs)) >= 1 - 1e-5
    assert load_model(model_dir, head="embedding").model.config.pooling == "mean"  # a plain encoder's
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (st_folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(bertforge.errors.UserError, match="modules.json: has a Dense module"):
        load_model(st_folder, head="embedding")


# ------------------------------------------------------------------------------------------------ end to end
TOPICS = ["anna", "boris", "clara", "dmitri", "elena", "fyodor", "river", "city", "music", "school", "army", "league"]
FILLER = "the old town near water and then over a bridge".split()


def pair_rows(n: int, seed: int) -> list[dict[str, str]]:
    """Queries naming a topic, passages about it among filler words, hard negatives about another topic."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        topic, other = rng.sample(TOPICS, 2)
        words = lambda: " ".join(rng.sample(FILLER, 4))  # noqa: E731
        rows.append({"id": f"p{i}", "query": f"{topic} {words()}", "passage": f"{words()} {topic} {words()}",
                     "negative": f"{words()} {other} {words()}", "score": str(rng.randint(0, 5))})  # fmt: skip
    return rows


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def write_rows(path: Path, rows: list[dict[str, str]]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


FAST = ["--optim.lr=2e-3", "--train.batch_size=16", "--mesh.num_devices=1", "--train.evals_per_epoch=1",
        "--log.progress=false", "--max-length", "16", "--text-column", "query",
        "--text-pair-column", "passage"]  # fmt: skip


@pytest.fixture(scope="module")
def embedding_run(model_dir, tmp_path_factory) -> tuple[Path, Path]:
    work = tmp_path_factory.mktemp("embedding")
    train, valid = write_rows(work / "train.csv", pair_rows(64, 1)), write_rows(work / "valid.csv", pair_rows(24, 2))
    out = work / "run"
    code = cli(["finetune", "--task", "embedding", "--model", str(model_dir), "--data", str(train), "--valid-data",
                str(valid), "--out", str(out), "--negative-column", "negative", "--train.epochs=3", *FAST])  # fmt: skip
    assert code == 0
    return out, valid


def test_finetune_embedding_then_embed(embedding_run, model_dir, tmp_path):
    out, valid = embedding_run
    summary = json.loads((out / "summary.json").read_text())
    rows = read_rows(valid)
    for column in ("query", "passage", "negative"):
        assert cli(["embed", "--model", str(out), "--data", str(valid), "--text-column", column, "--out",
                    str(tmp_path / f"{column}.npy"), "--max-length", "16"]) == 0  # fmt: skip
    vec = {c: np.load(tmp_path / f"{c}.npy") for c in ("query", "passage", "negative")}
    # The run's nDCG@10, from the vectors `embed` wrote: each query's passage among all passages and negatives.
    docs = [r["passage"] for r in rows] + [r["negative"] for r in rows]
    first = {t: i for i, t in reversed(list(enumerate(docs)))}
    keep = sorted(set(first.values()))
    doc_vectors = np.concatenate([vec["passage"], vec["negative"]])[keep]
    relevant = [{keep.index(first[r["passage"]]): 1.0} for r in rows]
    expected = retrieval_scores(vec["query"], doc_vectors, relevant, [str(i) for i in range(len(keep))])
    assert summary["folds"][0]["score"] == pytest.approx(expected["ndcg@10"], abs=1e-4)
    # evaluate-retrieval on the pairs table: each query's passage among the distinct passages.
    assert cli(["evaluate-retrieval", "--model", str(out), "--data", str(valid), "--query-column", "query",
                "--out", str(tmp_path / "scores.json")]) == 0  # fmt: skip
    passages = list(dict.fromkeys(r["passage"] for r in rows))
    first_row = [next(i for i, r in enumerate(rows) if r["passage"] == p) for p in passages]
    alone = retrieval_scores(vec["query"], vec["passage"][first_row], [{passages.index(r["passage"]): 1.0}
                             for r in rows], [str(i) for i in range(len(passages))])  # fmt: skip
    found = json.loads((tmp_path / "scores.json").read_text())
    assert found["documents"] == len(passages) and found["ndcg@10"] == pytest.approx(alone["ndcg@10"], abs=1e-4)
    # oof.csv's cosine is the query's and passage's.
    oof = read_rows(out / "oof.csv")
    np.testing.assert_allclose([float(r["cosine"]) for r in oof], cosines(vec["query"], vec["passage"]), atol=1e-5)
    # It learned: better than the encoder it started from, and the fold model is a sentence-transformers folder.
    start = load_model(model_dir, head="embedding")
    zero = {c: embed(start, [r[c] for r in rows]) for c in ("query", "passage", "negative")}
    before = retrieval_scores(zero["query"], np.concatenate([zero["passage"], zero["negative"]])[keep], relevant,
                              [str(i) for i in range(len(keep))])  # fmt: skip
    assert expected["ndcg@10"] > before["ndcg@10"] + 0.05
    card = (out / "fold-0" / "model" / "README.md").read_text(encoding="utf-8")
    assert "library_name: sentence-transformers" in card and "SentenceTransformer(" in card
    st = SentenceTransformer(str(out / "fold-0" / "model"), device="cpu")
    assert np.min(cosines(st.encode([r["query"] for r in rows]), vec["query"])) >= 1 - 1e-5
    api = bertforge.embed(out, [r["query"] for r in rows[:3]])
    np.testing.assert_allclose(api, vec["query"][:3], atol=1e-5)


def test_embed_writes_parquet_with_ids_and_predict_points_to_it(embedding_run, tmp_path, capsys):
    import pyarrow.parquet as pq

    out, valid = embedding_run
    assert cli(["embed", "--model", str(out), "--data", str(valid), "--text-column", "query", "--out",
                str(tmp_path / "v.parquet")]) == 0  # fmt: skip
    table = pq.read_table(tmp_path / "v.parquet")
    assert table.column_names == ["id", "embedding"] and table.column("id").to_pylist()[0] == "p0"
    assert cli(["predict", "--model", str(out), "--data", str(valid), "--out", str(tmp_path / "p.csv")]) == 2
    assert "an embedding model; `bertforge embed` writes its vectors" in capsys.readouterr().err


def test_finetune_similarity_scores_spearman_of_the_cosines(model_dir, tmp_path):
    train = write_rows(tmp_path / "train.csv", pair_rows(48, 3))
    valid = write_rows(tmp_path / "v.csv", pair_rows(16, 4))
    out = tmp_path / "run"
    assert cli(["finetune", "--task", "similarity", "--model", str(model_dir), "--data", str(train), "--valid-data",
                str(valid), "--out", str(out), "--target-column", "score", "--head.normalize=true",
                *FAST]) == 0  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    rows = read_rows(valid)
    pre = load_model(out / "fold-0" / "model", head="embedding")
    assert pre.model.config.normalize
    q, p = (embed(pre, [r[c] for r in rows], max_length=16) for c in ("query", "passage"))
    from scipy.stats import spearmanr

    expected = spearmanr(cosines(q, p), [float(r["score"]) for r in rows]).statistic
    assert summary["metric"] == "spearman" and summary["folds"][0]["score"] == pytest.approx(expected, abs=1e-4)
    # `evaluate` on the same pairs: scipy's Spearman of the cosines too.
    assert bertforge.evaluate(out, valid)["spearman"] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize(
    ("table", "extra", "message"),
    [
        ("query,passage\nq,\n", [], "row 1 has an empty text in column 'passage'"),
        ("query,text\nq,p\n", [], "no column 'passage'"),
        ("query,passage\nq,p\n", ["--negative-column", "neg"], "no column 'neg'"),
        ("query,passage\nq,p\n", ["--negative-column", "passage"], "a column is named twice"),
        ("query,passage,score\nq,p,high\n", ["--task", "similarity", "--target-column", "score"], "not a number"),
    ],
)
def test_malformed_pair_tables_are_one_line(model_dir, tmp_path, capsys, table, extra, message):
    data = tmp_path / "pairs.csv"
    data.write_text(table, encoding="utf-8")
    args = ["finetune", "--task", "embedding", "--model", str(model_dir), "--data", str(data), "--out",
            str(tmp_path / "run"), *FAST, *extra]  # fmt: skip
    assert cli(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {data}: ") and message in err and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_a_table_without_named_texts_is_read_by_position_as_sentence_transformers_reads_it(tmp_path):
    from bertforge.data.labelled import TableConfig
    from bertforge.finetuning import pairs

    rows = pair_rows(6, 5)
    named = pairs.read(str(write_rows(tmp_path / "named.csv", rows)), TableConfig(
        text_column="query", text_pair_column="passage", negative_columns=("negative",)), scored=False)  # fmt: skip
    # id, score and a teacher's score_* columns are not texts; the rest are anchor, positive, negatives in order.
    st_rows = [{"id": r["id"], "anchor": r["query"], "score_1": "0.5", "positive": r["passage"],
                "negative_1": r["negative"], "score": r["score"]} for r in rows]  # fmt: skip
    by_position = pairs.read(str(write_rows(tmp_path / "st.csv", st_rows)), TableConfig(), scored=False)
    assert by_position.source.columns == ("anchor", "positive", "negative_1")
    assert by_position.source.texts == named.source.texts
    np.testing.assert_array_equal(by_position.targets, named.targets)
    assert list(by_position.ids) == [r["id"] for r in rows]
    # A similarity table (sentence1, sentence2, score or label): the score is the target.
    for target in ("score", "label"):
        table = [{"sentence1": r["query"], "sentence2": r["passage"], target: r["score"]} for r in rows]
        scored = pairs.read(str(write_rows(tmp_path / f"{target}.csv", table)), TableConfig(), scored=True)
        assert scored.source.columns == ("sentence1", "sentence2")
        np.testing.assert_array_equal(scored.targets[:, 0], [float(r["score"]) for r in rows])
    # data.text_column, where the table has it, is the anchor.
    swapped = [{"passage": r["passage"], "text": r["query"]} for r in rows]
    first = pairs.read(str(write_rows(tmp_path / "text.csv", swapped)), TableConfig(), scored=False)
    assert first.source.columns == ("text", "passage") and first.source.texts == [t[:2] for t in named.source.texts]


@pytest.mark.parametrize(
    ("table", "task", "message"),
    [
        ("id,query,score\na,q,1\n", "embedding", "no second text column (columns: id, query, score)"),
        ("query,passage\nq,p\n", "similarity", "no score column"),
        ("a,b,c,score\nq,p,n,1\n", "similarity", "the table has 3 text columns (a, b, c)"),
    ],
)
def test_a_table_read_by_position_that_does_not_fit_is_one_line(model_dir, tmp_path, capsys, table, task, message):
    data = tmp_path / "pairs.csv"
    data.write_text(table, encoding="utf-8")
    args = ["finetune", "--task", task, "--model", str(model_dir), "--data", str(data), "--out",
            str(tmp_path / "run"), "--mesh.num_devices=1"]  # fmt: skip
    assert cli(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {data}: ") and message in err and "\n" not in err, err
    assert not (tmp_path / "run").exists()


def test_a_distilled_runs_first_loss_is_sentence_transformers_on_the_teachers_score_columns(model_dir, tmp_path):
    import torch
    from sentence_transformers.sentence_transformer.losses import DistillKLDivLoss

    rows = pair_rows(16, 9)
    rng = np.random.default_rng(3)
    table = [{"anchor": r["query"], "positive": r["passage"], "negative_1": r["negative"],
              "score_positive": f"{rng.normal(4, 1):.4f}", "score_negative_1": f"{rng.normal(1, 1):.4f}"}
             for r in rows]  # fmt: skip
    data = write_rows(tmp_path / "mined.csv", table)
    out = tmp_path / "run"
    # One step of the whole table, no dropout: the logged loss is the loss of the starting model's vectors.
    assert cli(["finetune", "--task", "embedding", "--model", str(model_dir), "--data", str(data), "--valid-data",
                str(data), "--out", str(out), "--head.loss=kl", "--head.temperature=2", "--head.hidden_dropout=0",
                "--head.attention_dropout=0", "--train.batch_size=16", "--train.epochs=1", "--log.every=1",
                "--mesh.num_devices=1", "--max-length", "16", "--log.progress=false"]) == 0  # fmt: skip
    logged = [json.loads(line) for line in (out / "fold-0" / "metrics.jsonl").read_text().splitlines()]
    loss = next(r["loss"] for r in logged if "loss" in r)
    pre = load_model(model_dir, head="embedding")
    columns = [torch.tensor(embed(pre, [r[c] for r in table], max_length=16)) for c in ("anchor", "positive",
                                                                                         "negative_1")]  # fmt: skip
    teacher = torch.tensor([[float(r["score_positive"]), float(r["score_negative_1"])] for r in table])
    expected = DistillKLDivLoss(model=None, temperature=2.0).compute_loss_from_embeddings(columns, teacher)
    assert loss == pytest.approx(float(expected), rel=1e-4)


@pytest.mark.parametrize(
    ("header", "loss", "message"),
    [
        ("anchor,positive,negative_1", "kl", "no columns score_positive, score_negative_1"),
        ("anchor,positive,negative_1,score_positive", "margin_mse", "for some candidates only: no column score_negat"),
        ("anchor,positive,score_positive", "margin_mse", "compares each row's positive with its hard negatives"),
    ],
)
def test_a_distillation_table_without_its_teachers_scores_is_one_line(model_dir, tmp_path, capsys, header, loss,
                                                                      message):  # fmt: skip
    data = tmp_path / "mined.csv"
    values = ["1.0" if c.startswith("score_") else f"text {c}" for c in header.split(",")]
    data.write_text(header + "\n" + ",".join(values) + "\n")
    args = ["finetune", "--task", "embedding", "--model", str(model_dir), "--data", str(data), "--out",
            str(tmp_path / "run"), f"--head.loss={loss}", "--mesh.num_devices=1"]  # fmt: skip
    assert cli(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {data}: ") and message in err and "\n" not in err, err
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------ BEIR folders
def beir_folder(root: Path) -> Path:
    """A BEIR folder: 12 documents (some titled), 5 queries, graded judgements, one query without any."""
    rows = pair_rows(12, 7)
    root.mkdir(parents=True)
    corpus = [{"_id": f"d{i}", "title": "city" if i % 3 == 0 else "", "text": r["passage"]} for i, r in enumerate(rows)]
    (root / "corpus.jsonl").write_text("".join(json.dumps(c) + "\n" for c in corpus), encoding="utf-8")
    queries = [{"_id": f"q{i}", "text": rows[i]["query"]} for i in range(5)]
    (root / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries), encoding="utf-8")
    (root / "qrels").mkdir()
    judged = ["query-id\tcorpus-id\tscore", "q0\td0\t1", "q1\td1\t2", "q1\td7\t1", "q2\td2\t1", "q3\td3\t1"]
    (root / "qrels" / "test.tsv").write_text("\n".join(judged) + "\n", encoding="utf-8")
    return root


def test_evaluate_retrieval_on_a_beir_folder_equals_trec_eval_measures_of_the_embeddings(model_dir, tmp_path):
    from test_retrieval import reference_measures

    folder = beir_folder(tmp_path / "beir")
    assert cli(["evaluate-retrieval", "--model", str(model_dir), "--data", str(folder), "--out",
                str(tmp_path / "scores.json")]) == 0  # fmt: skip
    got = json.loads((tmp_path / "scores.json").read_text())
    pre = load_model(model_dir, head="embedding")
    corpus = [json.loads(line) for line in (folder / "corpus.jsonl").read_text().splitlines()]
    docs = embed(pre, [f"{c['title']} {c['text']}".strip() for c in corpus])
    queries = embed(pre, [json.loads(line)["text"] for line in (folder / "queries.jsonl").read_text().splitlines()])
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    scores = unit(queries) @ unit(docs).T
    grades = [{"d0": 1}, {"d1": 2, "d7": 1}, {"d2": 1}, {"d3": 1}]  # q4 has none: left out
    expected = []
    for q, judged in enumerate(grades):
        ranked = sorted((c["_id"] for c in corpus), key=lambda d: (scores[q, int(d[1:])], d), reverse=True)
        expected.append(reference_measures(ranked, judged))
    assert got["queries"] == 4 and got["documents"] == 12
    for name in ("ndcg@10", "mrr@10", "recall@10"):
        assert got[name] == pytest.approx(np.mean([e[name] for e in expected]), abs=1e-6), name


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda f: (f / "qrels" / "test.tsv").unlink(), "qrels/test.tsv: missing"),
        (lambda f: (f / "corpus.jsonl").write_text('{"_id": "d0", "text": "a"}\nnot json\n'), "line 2 is not JSON"),
        (lambda f: (f / "queries.jsonl").write_text('{"_id": "q0"}\n'), "line 1 has no 'text'"),
        (lambda f: (f / "qrels" / "test.tsv").write_text("q0\td99\t1\n"), "document 'd99' is not in corpus.jsonl"),
        (lambda f: (f / "qrels" / "test.tsv").write_text("q0 d0 1\n"), "line 1: expected query-id, corpus-id"),
    ],
)
def test_a_malformed_beir_folder_is_one_line(model_dir, tmp_path, capsys, damage, message):
    folder = beir_folder(tmp_path / "beir")
    damage(folder)
    assert cli(["evaluate-retrieval", "--model", str(model_dir), "--data", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {folder}") and message in err and "\n" not in err, err


def test_a_pooling_path_outside_the_folder_is_refused(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}))
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "path": "../outside", "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
    (tmp_path / "m" / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(bertforge.errors.UserError, match="leaves the folder"):
        read_pooling(tmp_path / "m")


def test_evaluate_gives_the_retrieval_scores_finetune_reported_on_the_same_pairs(embedding_run, tmp_path):
    out, valid = embedding_run
    metrics = tmp_path / "metrics.json"
    assert cli(["evaluate", "--model", str(out), "--data", str(valid), "--out", str(metrics)]) == 0
    found = json.loads(metrics.read_text())
    reported = json.loads((out / "fold-0" / "result.json").read_text())["metrics"]
    assert found["records"] == 24 and set(found) - {"records"} == set(reported) - {"loss"}
    for key in set(found) - {"records"}:
        assert found[key] == pytest.approx(reported[key], abs=1e-6), key
