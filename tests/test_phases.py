"""Pretraining in phases (tasks/phases.py): each phase with its own data, sequence length, mask rate, piece of the
schedule and rotary positions, one program compiled per phase, and a context extension whose export gives
transformers' logits at the new length."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import pytest
from jax import monitoring
from test_preprocess import make_documents, run
from test_pretrain import MODERNBERT, config
from test_pretrain_modernbert import assert_transformers_logits

from bertforge.cli import main as cli
from bertforge.config import from_dict, load_config, to_dict
from bertforge.data.batching import pad_batch
from bertforge.model.load import load_run
from bertforge.tasks import pretrain
from bertforge.tasks.phases import phase_configs
from bertforge.tokenizer.load import Tokenizer
from bertforge.train.metrics_log import read_metrics

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "pretrain"
COMPILES: collections.Counter = collections.Counter()


def _count(event: str, value: float, **kw) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES[kw.get("fun_name")] += 1


monitoring.register_scalar_listener(_count)


@pytest.fixture(scope="module")
def long_shards(tmp_path_factory, wordpiece_dir):
    """Shards of 64 tokens (the `shards` fixture's are 32) from the same tokenizer."""
    tmp = tmp_path_factory.mktemp("long")
    run(tmp, wordpiece_dir, make_documents(n_docs=200, seed=5), name="long", seq_len=64, valid_fraction=0.05)
    return tmp / "long"


def phased(shards, long_shards, **train):
    """A ModernBERT of 32 positions: 6 steps of 32 tokens at a 30% mask rate and a constant rate after 2 warmup
    steps, then 6 steps' worth of tokens of 64 at 15% with a linear decay, a larger RoPE theta and 64 positions."""
    phases = [
        {"name": "short", "steps": 6, "mlm": {"rate": 0.3}, "optim": {"schedule": "constant", "warmup_steps": 2}},
        {"name": "long", "tokens": 6 * 16 * 64, "data": {"shards": str(long_shards)}, "mlm": {"rate": 0.15},
         "optim": {"schedule": "linear", "warmup_steps": 0, "warmup_fraction": 0.0},
         "model": {"global_rope_theta": 320_000.0, "max_position_embeddings": 64}},
    ]  # fmt: skip
    cfg = config(shards, model={**MODERNBERT, "max_position_embeddings": 32}, train={"max_steps": None, **train},
                 eval={"every": 3}, checkpoint={"every": 3})  # fmt: skip
    return from_dict(pretrain.PretrainConfig, {**to_dict(cfg), "phases": phases})


def test_phases_run_with_their_own_settings_compile_once_each_and_export_the_extended_model(
    shards, long_shards, wordpiece_dir, tmp_path
):
    before = COMPILES.copy()
    pretrain.main(phased(shards, long_shards), str(tmp_path / "run"))
    compiled = COMPILES - before
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["phase"] for r in records] == ["short"] * 6 + ["long"] * 6
    lr = [r["lr"] for r in records]
    np.testing.assert_allclose(lr[:6], [0.0, 1.5e-3, 3e-3, 3e-3, 3e-3, 3e-3], rtol=1e-6)  # warmup, stable
    np.testing.assert_allclose(lr[6:], [3e-3 * (1 - j / 6) for j in range(6)], rtol=1e-6)  # the decay over 6 steps
    tokens = [r["tokens"] for r in records]
    assert tokens[5] == 6 * 16 * 32 and tokens[11] == 6 * 16 * 32 + 6 * 16 * 64
    steps = {name: n for name, n in compiled.items() if "train_step" in str(name)}
    assert sum(steps.values()) == 2, compiled  # one train program per phase, each compiled once
    model = load_run(tmp_path / "run").model
    assert (model.config.max_position_embeddings, model.config.global_rope_theta) == (64, 320_000.0)

    # The context extension: the export says the new length and theta, and transformers computes its logits there.
    assert cli(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf["max_position_embeddings"], hf["global_rope_theta"]) == (64, 320_000.0)
    tok = Tokenizer.load(wordpiece_dir)
    encs = tok.encode_batch([" ".join(["the river city had a music school by the station"] * 2), "a short one"])
    batch = pad_batch(encs, tok.pad_id, 64)
    assert 32 < batch["attention_mask"][0].sum() <= 64  # past the first phase's 32 positions
    assert_transformers_logits(load_run(tmp_path / "run").model, tmp_path / "hf", batch)

    # A Hugging Face ModernBERT folder continued (--init-from) in a phase that extends it again.
    phases = [{"steps": 2, "data": {"shards": str(long_shards)}, "model": {"global_rope_theta": 640_000.0}}]
    again = {**to_dict(config(shards, train={"max_steps": None})), "init_from": str(tmp_path / "hf"), "phases": phases}
    pretrain.main(from_dict(pretrain.PretrainConfig, again), str(tmp_path / "again"))
    model = load_run(tmp_path / "again").model
    assert (model.config.max_position_embeddings, model.config.global_rope_theta) == (64, 640_000.0)


@pytest.mark.parametrize(
    ("phases", "line"),
    [
        ([{"steps": 2}, {"steps": 2, "model": {"hidden_size": 64}}], "a phase may change only global_rope_theta"),
        ([{"steps": 2, "tokens": 10}], "a phase takes steps or tokens, one of them"),
        ([{"steps": 2}, {"tokens": 10}], "phases[1]: 10 tokens are less than one step of 16 x 32"),
    ],
)
def test_a_wrong_phase_is_one_line(shards, tmp_path, capsys, phases, line):
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"preset": "test"}, "phases": phases}))
    args = ["pretrain", "--config", str(path), "--data", str(shards), "--out", str(tmp_path / "run"),
            "--train.global_batch=16", "--log.tensorboard=false"]  # fmt: skip
    assert cli(args) == 2
    err = capsys.readouterr().err.strip()
    assert line in err.splitlines()[-1] and "Traceback" not in err, err


def test_phases_and_a_budget_of_the_whole_run_are_not_both_given(shards, long_shards, tmp_path, capsys):
    cfg = phased(shards, long_shards, max_steps=5)
    with pytest.raises(Exception, match="train.max_steps: with phases, each phase's steps or tokens are the budget"):
        pretrain.main(cfg, str(tmp_path / "run"))


@pytest.mark.parametrize("name", ["wikitext-modernbert-phases", "modernbert-base-phases"])
def test_the_shipped_phased_recipes_extend_the_context_and_decay_in_their_last_phase(name):
    cfg = load_config(pretrain.PretrainConfig, CONFIGS / f"{name}.yaml")
    (_, first, _), (_, last, phase) = phase_configs(cfg)
    assert (first.optim.schedule, last.optim.schedule, last.optim.decay_fraction) == ("constant", "wsd", 1.0)
    assert last.model.max_position_embeddings in (
        4 * first.model.max_position_embeddings,
        8 * first.model.max_position_embeddings,
    )
    assert last.model.global_rope_theta == 16 * first.model.global_rope_theta
    assert last.data.shards == phase.data["shards"] and first.model.family == "modernbert"
