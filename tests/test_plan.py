"""`bertforge plan` against the memory JAX reports for the compiled step, and rematerialisation."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from flax import nnx
from test_pretrain import config, losses, params_of

from bertforge.cli import main as cli
from bertforge.config import from_dict
from bertforge.model.architectures import build
from bertforge.model.config import preset
from bertforge.runtime.devices import make_mesh, param_shardings
from bertforge.tasks import plan, pretrain
from bertforge.tasks.pretrain import PretrainConfig

# One layout per size: one device, accumulation, long sequences, 8-way data parallel.
CASES = [
    ("tiny", {"global_batch": 16, "grad_accum": 2}, {"num_devices": 1}, 128),
    ("mini", {"global_batch": 64}, {}, 128),
    pytest.param("small", {"global_batch": 4}, {"num_devices": 1}, 512, marks=pytest.mark.slow),
    pytest.param("medium", {"global_batch": 64}, {}, 128, marks=pytest.mark.slow),  # `make slow`
    ("base", {"global_batch": 64}, {}, 128),
]


def plan_config(name: str, train: dict, mesh: dict, **model) -> PretrainConfig:
    return from_dict(
        PretrainConfig,
        {"model": {"preset": name, **model}, "train": {"max_steps": 1, **train}, "mesh": {"data": -1, **mesh}},
    )


@pytest.mark.parametrize(("name", "train", "mesh", "seq_len"), CASES, ids=["tiny", "mini", "small", "medium", "base"])
def test_plan_is_within_ten_percent_of_the_compiled_step(name, train, mesh, seq_len):
    cfg = plan_config(name, train, mesh)
    estimate = plan.estimate(cfg, mesh.get("num_devices") or jax.device_count(), seq_len)
    measured = plan.compiled_bytes(cfg, seq_len)
    assert abs(estimate.peak / measured - 1) < 0.10, (estimate, measured)


@pytest.mark.parametrize("family", ["deberta-v2", "modernbert"])
def test_plan_knows_the_memory_of_other_architectures(family):
    cfg = plan_config("mini", {"global_batch": 32}, {"num_devices": 1}, family=family)
    estimate = plan.estimate(cfg, 1, 128)
    measured = plan.compiled_bytes(cfg, 128)
    assert abs(estimate.peak / measured - 1) < 0.10, (estimate, measured)


def test_parameter_bytes_are_those_of_the_sharded_arrays():
    cfg = preset("tiny")
    model = build(cfg, "mlm")
    total_bytes = cfg.num_params() * 4
    for shape in ({"data": 8, "fsdp": 1, "tensor": 1}, {"data": 2, "fsdp": 4, "tensor": 1}):
        mesh = make_mesh(shape["data"], shape["fsdp"], shape["tensor"])
        shardings = jax.tree.leaves(param_shardings(model, mesh))
        params = jax.tree.leaves(nnx.state(model, nnx.Param))
        per_device = sum(math.prod(s.shard_shape(p.shape)) * 4 for s, p in zip(shardings, params, strict=True))
        assert plan.parameter_bytes(cfg, shape) == (per_device, total_bytes)
    assert plan.parameter_bytes(cfg, {"data": 2, "fsdp": 4, "tensor": 1})[0] < total_bytes


def test_plan_command_prints_the_table_and_refuses_a_mesh_that_does_not_fit(capsys):
    assert cli(["plan", "--config", "configs/pretrain/base.yaml", "--devices", "64", "--train.global_batch=1024"]) == 0
    out = capsys.readouterr().out
    assert "on 64 device(s) [data 64, fsdp 1, tensor 1]" in out and "| peak of the step |" in out
    assert cli(["plan", "--config", "configs/pretrain/base.yaml", "--devices", "6", "--mesh.fsdp=4"]) == 2
    assert "config 'mesh': 6 devices do not split into fsdp=4 x tensor=1" in capsys.readouterr().err


def test_remat_gives_the_losses_and_parameters_of_the_plain_step(tmp_path, shards):
    dropout = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
    pretrain.main(config(shards, model=dropout, train={"max_steps": 6}), str(tmp_path / "plain"))
    pretrain.main(config(shards, model={**dropout, "remat": True}, train={"max_steps": 6}), str(tmp_path / "remat"))
    np.testing.assert_allclose(
        list(losses(tmp_path / "remat").values()), list(losses(tmp_path / "plain").values()), rtol=0, atol=1e-6
    )
    for x, y in zip(params_of(tmp_path / "plain"), params_of(tmp_path / "remat"), strict=True):
        np.testing.assert_allclose(y, x, atol=1e-6)
