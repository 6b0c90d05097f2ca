"""Several processes through JAX's distributed runtime (2 processes x 4 CPU devices), against 1 process x 8."""

from __future__ import annotations

import csv
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from test_finetune import river_rows, write_table
from test_pretrain import _wait_for_step, losses, params_of

from bertforge.cli import main as cli
from bertforge.errors import failed_collective
from bertforge.tasks.launch import LaunchConfig, describe_exit, process_env

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PRETRAIN = {
    "model": {"preset": "test", "hidden_dropout": 0.1, "attention_dropout": 0.1},
    "train": {"global_batch": 16, "max_steps": 20},
    "optim": {"lr": 3e-3, "warmup_steps": 2},
    "eval": {"every": 10},
    "checkpoint": {"every": 10},
    "log": {"every": 1, "tensorboard": False, "progress": False},
}


def write_config(path: Path, **sections) -> Path:
    data = {k: dict(v) for k, v in PRETRAIN.items()}
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(data))
    return path


def launch(*command: str, n: int = 2) -> list[str]:
    return [sys.executable, "-m", "bertforge.cli", "launch", "--num-processes", str(n), "--devices-per-process",
            str(8 // n), "--", *command]  # fmt: skip


def assert_same_metrics(got: Path, ref: Path, after: int = 0) -> None:
    for key in ("loss", "accuracy", "grad_norm", "valid_loss"):
        a, b = losses(ref, key), losses(got, key)
        steps = [s for s in a if s > after]
        assert steps and sorted(s for s in b if s > after) == steps, key
        np.testing.assert_allclose([b[s] for s in steps], [a[s] for s in steps], rtol=0, atol=1e-5, err_msg=key)


def test_two_processes_train_like_one_and_their_checkpoint_continues_in_one(shards, tmp_path):
    cfg = write_config(tmp_path / "config.yaml")
    common = ["pretrain", "--config", str(cfg), "--data", str(shards)]
    done = subprocess.run(launch(*common, "--out", str(tmp_path / "two")), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "on 8 device(s)" in done.stdout + done.stderr
    assert (tmp_path / "two" / "logs" / "process-1.log").exists()
    assert cli([*common, "--out", str(tmp_path / "one")]) == 0  # this process: 8 devices
    assert_same_metrics(tmp_path / "two", tmp_path / "one")
    for x, y in zip(params_of(tmp_path / "one"), params_of(tmp_path / "two"), strict=True):
        np.testing.assert_allclose(y, x, atol=1e-5)

    # The 2-process checkpoint of step 10, restored by one process onto 2 devices, continues with the same losses.
    resume = str(tmp_path / "two" / "checkpoints" / "10")
    assert cli([*common, "--out", str(tmp_path / "continued"), "--resume", resume, "--mesh.num_devices=2"]) == 0
    assert min(losses(tmp_path / "continued")) == 11
    assert_same_metrics(tmp_path / "continued", tmp_path / "two", after=10)
    for x, y in zip(params_of(tmp_path / "two"), params_of(tmp_path / "continued"), strict=True):
        np.testing.assert_allclose(y, x, atol=1e-5)


@pytest.mark.slow  # `make slow`; the fast suite keeps two processes training like one and a killed launch resuming
def test_two_processes_fine_tune_like_one(model_dir, tmp_path):
    data = write_table(tmp_path / "train.csv", river_rows(128))
    command = ["finetune", "--model", str(model_dir), "--data", str(data), "--folds", "2", "--fold", "0",
               "--optim.lr=3e-3", "--train.batch_size=16", "--train.epochs=2", "--train.evals_per_epoch=1",
               "--log.progress=false"]  # fmt: skip
    done = subprocess.run(launch(*command, "--out", str(tmp_path / "two")), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert cli([*command, "--out", str(tmp_path / "one")]) == 0

    def oof(run_dir: Path) -> dict[str, float]:
        with open(run_dir / "oof.csv") as fh:
            return {r["id"]: float(r["prediction"]) for r in csv.DictReader(fh)}

    one, two = oof(tmp_path / "one"), oof(tmp_path / "two")
    assert sorted(one) == sorted(two) and len(one) == 64
    np.testing.assert_allclose([two[k] for k in one], [one[k] for k in one], atol=1e-5)
    assert (tmp_path / "two" / "fold-0" / "model" / "model.safetensors").exists()


def _process_pid(parent: int, process_id: int) -> int:
    """The pid of the launched process with JAX_PROCESS_ID=process_id among `parent`'s children."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    for pid in children:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"JAX_PROCESS_ID={process_id}".encode() in env:
            return int(pid)
    raise AssertionError(f"no child with JAX_PROCESS_ID={process_id}")


def _signal_process_1(
    command: list[str], run_dir: Path, sig: signal.Signals, steps: tuple[int, int]
) -> tuple[int, str, float]:
    """Launch `command` and send `sig` to its process 1 at a random step within `steps`: (the launcher's return code,
    its stderr, seconds from the signal to its end)."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(run_dir, random.Random(os.environ.get("PYTEST_SEED", "bertforge")).randint(*steps), proc)
    os.kill(_process_pid(proc.pid, 1), sig)
    signalled_at = time.monotonic()
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err, time.monotonic() - signalled_at


def _resume_and_compare(command: list[str], common: list[str], run_dir: Path, step: int) -> None:
    """The same command resumes from `step` and continues as one process that was never stopped."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming from step {step}" in done.stdout + done.stderr
    assert cli([*common, "--out", str(run_dir.parent / "reference")]) == 0
    assert_same_metrics(run_dir, run_dir.parent / "reference", after=step)


# A long run: the two-process run below checks the launch and its checkpoint in CI.
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the launched processes through /proc")
def test_a_killed_process_stops_the_launch_and_the_same_command_resumes(shards, tmp_path):
    cfg = write_config(tmp_path / "config.yaml", train={"max_steps": 40}, checkpoint={"every": 4})
    common = ["pretrain", "--config", str(cfg), "--data", str(shards)]
    command = launch(*common, "--out", str(tmp_path / "killed"))
    code, err, seconds = _signal_process_1(command, tmp_path / "killed", signal.SIGKILL, (6, 30))
    assert seconds < 60
    assert code == 128 + signal.SIGKILL
    assert "error: process 1 of 2" in err and "was killed by SIGKILL" in err and "same command" in err

    checkpoints = [int(p.name) for p in (tmp_path / "killed" / "checkpoints").iterdir() if p.name.isdigit()]
    resumed_from = max(checkpoints)
    assert 4 <= resumed_from < 40
    _resume_and_compare(command, common, tmp_path / "killed", resumed_from)


@pytest.mark.slow  # `make slow`; the fast suite keeps two processes training like one and a killed launch resuming
def test_a_time_budget_over_two_processes_ends_both_after_the_same_step(shards, tmp_path):
    cfg = write_config(tmp_path / "config.yaml", train={"max_steps": None, "time_budget_minutes": 0.1})
    done = subprocess.run(
        launch("pretrain", "--config", str(cfg), "--data", str(shards), "--out", str(tmp_path / "run")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ends = [
        re.findall(r"pretrained (\d+) steps", text)
        for text in (done.stdout, (tmp_path / "run" / "logs" / "process-1.log").read_text())
    ]
    assert len(ends[0]) == 1 and ends[0] == ends[1]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the launched processes through /proc")
@pytest.mark.slow  # `make slow`; the fast suite keeps two processes training like one and a killed launch resuming
def test_a_sigterm_to_one_process_stops_all_after_the_same_step_with_a_checkpoint(shards, tmp_path):
    # A scheduler signals hosts a moment apart: here only process 1 hears it. Had each process stopped on its own
    # signal, process 0 would train on alone and both would wait forever in different collectives.
    cfg = write_config(tmp_path / "config.yaml", train={"max_steps": 40}, checkpoint={"every": 100})
    common = ["pretrain", "--config", str(cfg), "--data", str(shards)]
    command = launch(*common, "--out", str(tmp_path / "stopped"))
    code, err, _ = _signal_process_1(command, tmp_path / "stopped", signal.SIGTERM, (4, 25))
    assert code == 143, err[-3000:]
    stopped = re.search(r"stopped by signal 15 at step (\d+); checkpoint saved", err)
    assert stopped, err[-3000:]
    step = int(stopped.group(1))
    assert stopped.group(0) in (tmp_path / "stopped" / "logs" / "process-1.log").read_text()
    assert [p.name for p in (tmp_path / "stopped" / "checkpoints").iterdir() if p.name.isdigit()] == [str(step)]
    _resume_and_compare(command, common, tmp_path / "stopped", step)


@pytest.mark.slow  # `make slow`; the fast suite keeps two processes training like one and a killed launch resuming
def test_without_the_launcher_a_dead_process_stops_the_others_within_a_minute(shards, tmp_path):
    # As on a cluster: each process started on its own, meeting at a coordinator address.
    cfg = write_config(tmp_path / "config.yaml", train={"max_steps": 5000})
    command = [sys.executable, "-m", "bertforge.cli", "pretrain", "--config", str(cfg), "--data", str(shards),
               "--out", str(tmp_path / "run")]  # fmt: skip
    launch_cfg = LaunchConfig(command=("pretrain",), num_processes=2, devices_per_process=4)
    port = 20000 + random.randrange(20000)
    procs = [
        subprocess.Popen(
            command,
            env=process_env(dict(os.environ), i, launch_cfg, port),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        _wait_for_step(tmp_path / "run", 5, procs[0])
        procs[1].kill()
        killed_at = time.monotonic()
        _, err = procs[0].communicate(timeout=120)
        assert time.monotonic() - killed_at < 60
        assert procs[0].returncode != 0
        # Waiting for process 1, process 0 is stopped by JAX's distributed runtime once the heartbeats stop; caught
        # exchanging data with it, its collective fails and it says so.
        lost = "error: process 0 of 2: a collective with the other processes failed"
        assert "another task died" in err or lost in err, err[-3000:]
        assert "Traceback" not in err
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_failed_collective_is_told_apart_from_other_errors():
    # The end of what process 0 printed when process 1 was killed in the middle of a step (the start was cut off).
    seen = (
        "256 vs 8. Received data size doesn't match expected size. Is there a distributed collective mismatch in "
        "your code?"
    )
    assert failed_collective(jax.errors.JaxRuntimeError(seen)) == seen
    assert failed_collective(RuntimeError("Gloo allgather failed:\n  Connection closed by peer [10.0.0.2]:4321")) == (
        "Gloo allgather failed: Connection closed by peer [10.0.0.2]:4321"
    )
    assert failed_collective(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory")) is None
    assert failed_collective(ValueError("row 3: empty text")) is None


def test_exit_descriptions_and_process_environments():
    assert describe_exit(-9) == "was killed by SIGKILL" and describe_exit(2) == "exited with status 2"
    cfg = LaunchConfig(command=("pretrain",), num_processes=3, devices_per_process=2)
    env = process_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo=1"}, 2, cfg, 1234)
    assert env["XLA_FLAGS"].split() == ["--xla_foo=1", "--xla_force_host_platform_device_count=2"]
    assert env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:1234"
    assert (env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"], env["JAX_PLATFORMS"]) == ("3", "2", "cpu")
    with pytest.raises(ValueError, match="launch cannot launch itself"):
        LaunchConfig(command=("launch", "--", "pretrain"))
