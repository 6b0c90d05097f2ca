"""Long texts of the sequence tasks as windows (data.long_text='windows'): the windows, their pooling, and
`finetune` / `predict` end to end against the fold model's own outputs on each window."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import numpy as np
import pytest

from bertforge.cli import main as cli
from bertforge.data.labelled import TableConfig
from bertforge.data.long_text import pool, text_windows
from bertforge.errors import UserError
from bertforge.model.hf import load_pretrained
from bertforge.tasks.model_outputs import forward_of, outputs_by_length
from bertforge.tokenizer.load import Tokenizer

WORDS = "the river city walked over a bridge into old town near water".split()


def sentences(n: int, seed: int, low: int = 3, high: int = 120) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))) for _ in range(n)]


@pytest.fixture(scope="module", params=["wordpiece", "bpe"])
def tok(request, wordpiece_dir, bpe_dir) -> Tokenizer:
    return Tokenizer.load(wordpiece_dir if request.param == "wordpiece" else bpe_dir)


# ------------------------------------------------------------------------------------------------------ windows
def test_a_text_that_fits_is_one_window_encoded_as_truncation_encodes_it(tok):
    texts = sentences(20, seed=0, high=10)
    pairs = sentences(20, seed=1, high=6)
    for p in (None, pairs):
        encs, record = text_windows(tok, texts, p, limit=64, stride=8)
        assert record.tolist() == list(range(20))
        assert encs == tok.encode_batch(texts, p, max_length=64)


@pytest.mark.parametrize("limit, stride", [(16, 4), (24, 0), (12, 9)])
def test_windows_cover_every_token_each_overlapping_the_one_before_by_the_stride(tok, limit, stride):
    texts = sentences(30, seed=2)
    encs, record = text_windows(tok, texts, None, limit, stride)
    ids = tok.tokenize_ids(texts)
    prefix, suffix = tok.template.prefix, tok.template.single_suffix
    for i, text_ids in enumerate(ids):
        mine = [encs[j].ids for j in np.flatnonzero(record == i)]
        assert all(len(w) <= limit and w[: len(prefix)] == prefix and w[len(w) - len(suffix) :] == suffix for w in mine)
        bodies = [w[len(prefix) : len(w) - len(suffix)] for w in mine]
        starts = [0]
        for body in bodies[1:]:  # each window is the text's tokens from a start after the one before
            starts.append(_find(text_ids, body, starts[-1] + 1))
        assert bodies[0] == text_ids[: len(bodies[0])] and starts[-1] + len(bodies[-1]) == len(text_ids), i
        capacity = limit - tok.num_special()
        if len(bodies) > 1:  # full windows, each starting capacity - stride after the one before but the last
            assert all(len(b) == capacity for b in bodies)
            assert all(b - a == capacity - stride for a, b in zip(starts[:-2], starts[1:-1], strict=True))
            assert 0 < starts[-1] - starts[-2] <= capacity - stride
        else:
            assert len(text_ids) <= capacity


def _find(ids: list[int], body: list[int], after: int) -> int:
    """The first start at or after `after` where `body` sits in `ids`."""
    return next(s for s in range(after, len(ids) - len(body) + 1) if ids[s : s + len(body)] == body)


def test_a_pair_goes_whole_into_every_window_while_it_takes_at_most_half_the_room(tok):
    long_text = sentences(1, seed=3, low=100, high=100)
    short_pair, long_pair = "river city", sentences(1, seed=4, low=80, high=80)[0]
    limit = 32
    budget = limit - tok.num_special(pair=True)
    for pair, truncation in ((short_pair, "head"), (long_pair, "head"), (long_pair, "tail")):
        encs, _ = text_windows(tok, long_text, [pair], limit, stride=4, truncation=truncation)
        b = tok.tokenize_ids([pair])[0]
        kept = b if len(b) <= budget // 2 else (b[: budget // 2] if truncation == "head" else b[-(budget // 2) :])
        assert len(encs) > 1
        for e in encs:
            assert len(e.ids) <= limit
            end = tok.template.middle + kept + tok.template.suffix  # the pair after the window's text
            assert e.ids[len(e.ids) - len(end) :] == end


def test_a_length_that_leaves_no_room_for_text_is_refused(tok):
    with pytest.raises(UserError, match="no room"):
        text_windows(tok, ["river"], None, limit=tok.num_special(), stride=0)


@pytest.mark.parametrize("how", ["mean", "max"])
def test_pooling_is_the_mean_or_the_max_of_each_records_windows(how):
    rng = np.random.default_rng(0)
    record = np.sort(rng.choice([0, 3, 4, 9], size=23))
    outputs = rng.normal(size=(23, 3)).astype(np.float32)
    records, pooled = pool(outputs, record, how)
    assert records.tolist() == sorted(set(record.tolist()))
    for r, got in zip(records, pooled, strict=True):
        mine = outputs[record == r]
        np.testing.assert_allclose(got, mine.mean(axis=0) if how == "mean" else mine.max(axis=0), rtol=1e-6)


def test_unknown_long_text_and_pool_settings_are_refused():
    with pytest.raises(ValueError, match="long_text"):
        TableConfig(long_text="chunks")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window_pool"):
        TableConfig(window_pool="sum")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------------ end to end
def _table(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["id", "text", "target"])
        for i, text in enumerate(sentences(n, seed, low=3, high=60)):
            words = text.split()
            writer.writerow([f"t{i}", text, f"{4 * words.count('river') / len(words) + rng.random() * 0.1:.4f}"])
    return path


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


FAST = ["--optim.lr=3e-3", "--train.batch_size=16", "--mesh.num_devices=1", "--train.evals_per_epoch=1",
        "--log.progress=false", "--train.epochs=2", "--max-length", "16", "--stride", "4"]  # fmt: skip


@pytest.mark.parametrize("how", ["mean", "max"])
def test_windowed_folds_score_each_text_on_its_pooled_windows_and_predict_pools_alike(model_dir, tmp_path, how):
    data = _table(tmp_path / "train.csv", 48, seed=5)
    base = ["finetune", "--model", str(model_dir), "--data", str(data), "--folds", "2", "--fold", "0", *FAST]
    assert cli([*base, "--out", str(tmp_path / "cut")]) == 0
    out = tmp_path / "win"
    assert cli([*base, "--out", str(out), "--long-text", "windows", "--window-pool", how]) == 0

    # The folds are the records', the same as without windows; oof.csv has a row per text of fold 0.
    assert _csv(out / "folds.csv") == _csv(tmp_path / "cut" / "folds.csv")
    rows = _csv(data)
    fold0 = [r["id"] for r in _csv(out / "folds.csv") if r["fold"] == "0"]
    oof = _csv(out / "oof.csv")
    assert [r["id"] for r in oof] == fold0

    # Each text's output is the pool of the best fold model's outputs on its windows, computed here directly.
    pre = load_pretrained(out / "fold-0" / "model", head="sequence")
    texts = [r["text"] for r in rows if r["id"] in set(fold0)]
    encs, record = text_windows(pre.tokenizer, texts, None, limit=16, stride=4)
    assert len(encs) > 2 * len(texts)  # most texts are longer than one window
    pre.model.eval()
    windows_out = outputs_by_length(forward_of(pre.model), encs, pre.tokenizer.pad_id, 16, 16)
    expected = windows_out[record == 0].mean(0) if how == "mean" else windows_out[record == 0].max(0)
    _, pooled = pool(windows_out, record, how)
    np.testing.assert_allclose(pooled[0], expected, rtol=1e-6)
    got = np.array([float(r["prediction"]) for r in oof])
    np.testing.assert_allclose(got, pooled[:, 0], atol=1e-5)
    truth = np.array([float(r["target"]) for r in oof])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["out_of_fold"]["rmse"] == pytest.approx(np.sqrt(np.mean((got - truth) ** 2)), abs=1e-5)

    # predict on the run pools the windows as the run did (run.json), one row per text.
    pred = tmp_path / "pred.csv"
    fold_texts = tmp_path / "fold0.csv"
    with open(fold_texts, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["id", "text"])
        writer.writerows([r["id"], r["text"]] for r in rows if r["id"] in set(fold0))
    model = str(out / "fold-0" / "model")
    assert cli(["predict", "--model", model, "--data", str(fold_texts), "--out", str(pred), "--max-length", "16",
                "--long-text", "windows", "--window-pool", how, "--stride", "4"]) == 0  # fmt: skip
    np.testing.assert_allclose([float(r["prediction"]) for r in _csv(pred)], got, atol=1e-5)
    import bertforge

    np.testing.assert_allclose(bertforge.predict(out, texts)[:, 0], got, atol=1e-5)


def test_a_separate_validation_file_is_scored_per_text_too(model_dir, tmp_path):
    train, valid = _table(tmp_path / "train.csv", 32, seed=6), _table(tmp_path / "valid.csv", 12, seed=7)
    out = tmp_path / "run"
    assert cli(["finetune", "--model", str(model_dir), "--data", str(train), "--valid-data", str(valid),
                "--out", str(out), *FAST, "--long-text", "windows"]) == 0  # fmt: skip
    oof = _csv(out / "oof.csv")
    assert [r["id"] for r in oof] == [f"t{i}" for i in range(12)]
    result = json.loads((out / "fold-0" / "result.json").read_text())
    assert result["rows"] == list(range(12)) and result["valid_rows"] > 12
