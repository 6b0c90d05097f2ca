"""Every architecture through the command line: `init` with the family's conventions, `finetune` on a generated
table of text pairs, `predict` on the run and on each fold model, and long inputs where the positions allow them."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from test_finetune import finetune, river_rows, write_table

import bertforge
from bertforge.cli import main as cli
from bertforge.model.architectures import FAMILIES
from bertforge.model.hf import load_pretrained

NON_BERT_FAMILIES = ["deberta-v2", "modernbert", "electra", "distilbert"]


def init_model(family: str, tokenizer: Path, out: Path, *extra: str) -> Path:
    args = ["init", "--tokenizer", str(tokenizer), "--out", str(out), "--model.preset=test", *extra]
    args += [f"--model.family={family}", "--model.hidden_dropout=0", "--model.attention_dropout=0"]
    assert cli(args) == 0
    return out


@pytest.fixture(scope="module", params=NON_BERT_FAMILIES)
def arch_model(request, wordpiece_dir, tmp_path_factory) -> tuple[str, Path]:
    family = request.param
    return family, init_model(family, wordpiece_dir, tmp_path_factory.mktemp(family) / "model")


def pair_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = river_rows(n, seed)
    for r in rows:
        r["pair"] = " ".join(rng.choice(["river", "city"]) for _ in range(rng.randint(2, 8)))
    return rows


def test_init_takes_the_family_conventions(arch_model):
    family, model_dir = arch_model
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == family
    cfg = load_pretrained(model_dir).model.config
    for field, value in FAMILIES[family].fields.items():
        assert getattr(cfg, field) == value, field


def test_finetune_then_predict_equals_the_fold_models(arch_model, tmp_path):
    family, model_dir = arch_model
    rows = pair_rows(48, seed=3)
    data = write_table(tmp_path / "train.csv", rows)
    out = tmp_path / "run"
    code = finetune(model_dir, data, out, "--folds", "2", "--train.epochs=2", "--data.text_pair_column=pair")
    assert code == 0
    texts, pairs = [r["text"] for r in rows], [r["pair"] for r in rows]
    per_fold = []
    for f in (0, 1):
        folder = out / f"fold-{f}" / "model"
        assert json.loads((folder / "config.json").read_text())["model_type"] == family
        values = bertforge.predict(folder, texts, pairs)[:, 0]
        result = json.loads((out / f"fold-{f}" / "result.json").read_text())
        # The fold model is the best checkpoint: its predictions on the fold's rows are the out-of-fold outputs.
        np.testing.assert_allclose(values[result["rows"]], np.array(result["outputs"])[:, 0], atol=1e-5)
        per_fold.append(values)
    pred = tmp_path / "run.csv"
    assert cli(["predict", "--model", str(out), "--data", str(data), "--out", str(pred)]) == 0
    got = np.loadtxt(pred, delimiter=",", skiprows=1, usecols=1, dtype=np.float64)
    np.testing.assert_allclose(got, np.mean(per_fold, axis=0), atol=1e-5)


@pytest.mark.parametrize("family", ["deberta-v2", "modernbert"])
def test_long_inputs_fine_tune_at_1024_tokens(family, wordpiece_dir, tmp_path):
    # ModernBERT's rotary positions reach as far as its config says (8,192 for the public checkpoints); DeBERTa's
    # relative positions have no limit.
    extra = ["--model.max_position_embeddings=2048"] if family == "modernbert" else []
    model_dir = init_model(family, wordpiece_dir, tmp_path / "model", *extra)
    rng = random.Random(5)
    rows = []
    for i in range(8):
        words = [rng.choice(["river", "city"]) for _ in range(1100)]
        rows.append({"id": f"l{i}", "text": " ".join(words), "target": float(words[-1] == "river")})
    data = write_table(tmp_path / "long.csv", rows)
    out = tmp_path / "run"
    code = finetune(
        model_dir, data, out, "--folds", "2", "--fold", "0", "--train.epochs=1", "--data.max_length=1024",
        "--train.batch_size=4",
    )  # fmt: skip
    assert code == 0
    assert '"max_length": 1024' in (out / "run.json").read_text()


@pytest.mark.parametrize("family", NON_BERT_FAMILIES)
def test_fill_mask_matches_the_transformers_pipeline(family, wordpiece_dir, tmp_path, capsys):
    from transformers import pipeline

    # A wide initialiser makes the scores far from uniform, so the comparison has teeth.
    folder = init_model(family, wordpiece_dir, tmp_path / "model", "--model.initializer_range=0.5")
    reference = pipeline("fill-mask", model=str(folder), top_k=5)
    texts = ["the river [MASK] had a city school.", "a [MASK] of the league and the [MASK] season!"]
    capsys.readouterr()
    assert cli(["fill-mask", "--model", str(folder), "--json", "--top-k", "5", *texts]) == 0
    ours = json.loads(capsys.readouterr().out)
    for text, result in zip(texts, ours, strict=True):
        theirs = reference(text)
        theirs = theirs if isinstance(theirs[0], list) else [theirs]  # one mask: a flat list
        assert len(result["masks"]) == len(theirs) == text.count("[MASK]")
        for our_mask, their_mask in zip(result["masks"], theirs, strict=True):
            assert [o["token"] for o in our_mask] == [t["token"] for t in their_mask]
            np.testing.assert_allclose([o["score"] for o in our_mask], [t["score"] for t in their_mask], atol=1e-4)
            assert our_mask[0]["score"] > 5 / reference.tokenizer.vocab_size
