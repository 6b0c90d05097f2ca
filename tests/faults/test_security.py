"""Weights only from safetensors, no remote code, no writes or reads outside the folders named, no secrets in
what a run writes."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
from test_pretrain import config

from bertforge.cli import main as cli
from bertforge.tasks import pretrain


def test_a_model_folder_cannot_run_code_or_point_outside_itself(model_dir, tmp_path, capsys, tally):
    tally("security", 3)
    marker = tmp_path / "ran"
    evil = shutil.copytree(model_dir, tmp_path / "evil")
    (evil / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    cfg = json.loads((evil / "config.json").read_text())
    (evil / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoModel": "modeling_evil.EvilModel"}}))
    capsys.readouterr()
    assert cli(["fill-mask", "--model", str(evil), "the [MASK] river"]) == 0  # config.json's code is never imported
    assert not marker.exists()

    (evil / "model.safetensors").rename(tmp_path / "outside.safetensors")
    index = {"weight_map": {"bert.embeddings.word_embeddings.weight": "../outside.safetensors"}}
    (evil / "model.safetensors.index.json").write_text(json.dumps(index))
    assert cli(["fill-mask", "--model", str(evil), "the [MASK] river"]) == 2
    assert "weight file '../outside.safetensors' is not a plain .safetensors file name" in capsys.readouterr().err

    (evil / "model.safetensors.index.json").unlink()
    (evil / "pytorch_model.bin").write_bytes(b"\x80\x04\x95 a pickle")
    assert cli(["fill-mask", "--model", str(evil), "the [MASK] river"]) == 2
    assert "never loads because unpickling can run arbitrary code" in capsys.readouterr().err


def test_a_pickled_shard_with_a_matching_checksum_is_not_unpickled(shards, tmp_path, capsys, tally):
    tally("security")
    import hashlib

    data = shutil.copytree(shards, tmp_path / "shards")
    victim = data / "train-00000.npy"
    np.save(victim, np.array([{"a": 1}] * 4, dtype=object), allow_pickle=True)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["sha256"] = hashlib.sha256(victim.read_bytes()).hexdigest()
    (data / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    code = cli(["pretrain", "--data", str(data), "--out", str(tmp_path / "run"), "--model.preset=test",
                "--train.max_steps=1", "--train.global_batch=16", "--log.progress=false"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "train-00000.npy" in err, err


def test_secrets_in_the_environment_never_reach_the_run_folder(shards, tmp_path, monkeypatch, tally):
    tally("security")
    secrets = {"WANDB_API_KEY": "wandb-secret-7f3a9c", "AWS_SECRET_ACCESS_KEY": "aws-secret-81bd20",
               "HF_TOKEN": "hf_secret_55e1d9", "GOOGLE_APPLICATION_CREDENTIALS": "/secret/gcp-2c4e.json"}  # fmt: skip
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = {"every": 1, "tensorboard": True, "wandb": True, "progress": False}
    cfg = config(shards, train={"max_steps": 4}, checkpoint={"every": 2}, log=log)
    pretrain.main(cfg, str(tmp_path / "run"))
    assert cli(["export", str(tmp_path / "run"), "--out", str(tmp_path / "run" / "hf")]) == 0
    written = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert any("wandb" in str(p) for p in written) and any("checkpoints" in str(p) for p in written)
    for path in written:
        blob = path.read_bytes()
        for name, value in secrets.items():
            assert value.encode() not in blob, f"{name} found in {path}"
    assert os.environ["WANDB_API_KEY"] == secrets["WANDB_API_KEY"]
