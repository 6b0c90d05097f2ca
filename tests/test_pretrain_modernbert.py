"""ModernBERT pretraining from scratch, and continued pretraining (`--init-from`) of transformers-made checkpoints."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_models import save_hf_model
from test_arch_modernbert import reference
from test_pretrain import MODERNBERT, config, losses
from transformers import AutoModelForMaskedLM, BertForMaskedLM, ModernBertForMaskedLM

from bertforge.cli import main as cli
from bertforge.config import load_config
from bertforge.data.batching import pad_batch
from bertforge.data.masking import mask_tokens
from bertforge.data.shards import BatchLoader, Shards
from bertforge.errors import UserError
from bertforge.model.architectures import build, count_params
from bertforge.model.load import load_run
from bertforge.tasks import pretrain
from bertforge.tokenizer.load import Tokenizer
from bertforge.train import objectives

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "pretrain"
TEXTS = ["the river city had a music school and a church by the station", "a short one", "the king of the river"]


def test_a_modernbert_pretrains_and_its_export_gives_its_logits_in_transformers(shards, wordpiece_dir, tmp_path):
    cfg = config(shards, model=MODERNBERT, train={"max_steps": 60}, eval={"every": 20}, checkpoint={"every": 20})
    pretrain.main(cfg, str(tmp_path / "run"))
    train, valid = losses(tmp_path / "run"), losses(tmp_path / "run", "valid_loss")
    assert train[1] > np.log(700) - 0.5
    assert np.mean([train[s] for s in range(51, 61)]) < train[1] - 1.0 and valid[60] < valid[20]

    assert cli(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "modernbert"
    tok = Tokenizer.load(wordpiece_dir)
    encs = tok.encode_batch(TEXTS)
    batch = pad_batch(encs, tok.pad_id, max(len(e.ids) for e in encs))  # padded, longer than the local window
    assert batch["attention_mask"].sum(1).min() < batch["input_ids"].shape[1] > 8
    assert_transformers_logits(load_run(tmp_path / "run").model, tmp_path / "hf", batch)


def assert_transformers_logits(model, folder: Path, batch: dict) -> None:
    """`model`'s masked-LM logits on `batch` equal those transformers' ModernBERT gives from `folder` (its export)."""
    theirs = ModernBertForMaskedLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        want = theirs(input_ids=torch.tensor(batch["input_ids"]), attention_mask=torch.tensor(batch["attention_mask"]))
    model.eval()
    got = np.asarray(model(*(jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "token_type_ids"))))
    real = batch["attention_mask"] == 1
    np.testing.assert_allclose(got[real], want.logits.numpy()[real], atol=1e-4, rtol=1e-4)


def test_the_shipped_modernbert_configs_have_modernberts_shape():
    base = load_config(pretrain.PretrainConfig, CONFIGS / "modernbert-base.yaml").model
    base = dataclasses.replace(base, vocab_size=50368)
    abstract = nnx.eval_shape(lambda: build(base, "mlm"))
    assert count_params(nnx.state(abstract, nnx.Param)) == pytest.approx(149e6, rel=0.01)  # ModernBERT-base's
    assert (base.attention_bias, base.hidden_dropout, base.global_attn_every_n_layers) == (False, 0.0, 3)
    mini = load_config(pretrain.PretrainConfig, CONFIGS / "modernbert-mini.yaml")
    assert (mini.model.family, mini.model.num_layers, mini.model.hidden_size) == ("modernbert", 4, 256)
    assert (mini.mlm.rate, mini.optim.schedule) == (0.3, "wsd")


# ------------------------------------------------------------------------------------------------ --init-from
def hf_checkpoint(family: str, tokenizer_dir: Path, out: Path) -> Path:
    if family == "bert":
        return save_hf_model(BertForMaskedLM, "bert", tokenizer_dir, out)
    reference(ModernBertForMaskedLM, tokenizer_dir, out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, out / name)
    return out


@pytest.mark.parametrize("family", [pytest.param("bert", marks=pytest.mark.slow), "modernbert"])  # bert: `make slow`
def test_continued_pretraining_starts_at_the_loss_transformers_gives_on_the_same_masked_batch(
    family, shards, wordpiece_dir, tmp_path
):
    folder = hf_checkpoint(family, wordpiece_dir, tmp_path / "hf")
    runtime = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
    cfg = config(shards, train={"global_batch": 8, "max_steps": 3}, mesh={"num_devices": 1}, model=runtime)
    cfg = dataclasses.replace(cfg, init_from=str(folder))
    pretrain.main(cfg, str(tmp_path / "run"), model_keys=list(runtime))
    first = losses(tmp_path / "run")[1]

    # The first step's batch and masks, drawn as the step draws them.
    train = Shards(str(shards), "train")
    loader = BatchLoader(train, 8, seed=cfg.data.seed)
    ids = np.asarray(next(loader))
    loader.close()
    spec = objectives.masking_spec(cfg, Tokenizer.load(folder), train.manifest["special_ids"], 700)
    mask_key, _ = jax.random.split(jax.random.fold_in(jax.random.key(cfg.train.seed), 0))
    inputs, labels = (torch.tensor(np.asarray(x), dtype=torch.long) for x in mask_tokens(mask_key, ids, spec))
    theirs = AutoModelForMaskedLM.from_pretrained(folder).eval()
    with torch.no_grad():
        want = theirs(input_ids=inputs, attention_mask=torch.tensor(ids != 0, dtype=torch.long), labels=labels).loss
    assert first == pytest.approx(float(want), abs=1e-4)

    # The run exports a folder of the checkpoint's family, which transformers loads.
    assert cli(["export", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    config_json = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config_json["model_type"] == family
    assert AutoModelForMaskedLM.from_pretrained(tmp_path / "out").config.hidden_size == 32


def test_init_from_refuses_other_shards_and_architecture_keys(shards, bpe_dir, tmp_path):
    folder = save_hf_model(BertForMaskedLM, "bert", bpe_dir, tmp_path / "hf-bpe")
    cfg = config(shards, train={"max_steps": 2}, mesh={"num_devices": 1})
    with pytest.raises(UserError, match="made with another tokenizer"):
        pretrain.main(dataclasses.replace(cfg, init_from=str(folder)), str(tmp_path / "a"))
    with pytest.raises(UserError, match="model.hidden_size: --init-from"):
        pretrain.main(dataclasses.replace(cfg, init_from=str(folder)), str(tmp_path / "b"), model_keys=["hidden_size"])
