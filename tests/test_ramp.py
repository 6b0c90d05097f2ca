"""The batch-size ramp (train.batch_ramp): batches grow by micro-batches in closed form, the first steps are those
of a run with that small batch, and a ramped run stopped by SIGTERM continues to the uninterrupted run's numbers."""

from __future__ import annotations

import math
import signal
import subprocess

import numpy as np
import pytest
from test_pretrain import _command, _wait_for_step, config, losses, params_of

from bertforge.data.ramp import Ramp
from bertforge.errors import UserError
from bertforge.tasks import pretrain

SEQ_LEN = 32  # the shards fixture's


def test_ramp_sizes_in_closed_form():
    ramp = Ramp(start=2, end=6, fraction=0.4)
    sizes = [ramp.micro_batches(k / 1000) for k in range(1000)]
    # Five sizes, 2..6, each an equal share of the first 40%; then 6.
    for n in range(2, 7):
        share = sizes.count(n) / 1000
        assert share == pytest.approx(0.08 if n < 6 else 0.08 + 0.6, abs=0.002)
    assert sizes == sorted(sizes) and sizes[0] == 2 and sizes[400:] == [6] * 600


@pytest.mark.slow  # `make slow`; the fast suite keeps the ramp's closed form and its refused keys
def test_a_ramped_run_grows_its_batch_and_starts_as_the_small_batch_run(shards, tmp_path):
    steps, fraction = 12, 0.5
    ramped = config(shards, train={"global_batch": 32, "grad_accum": 4, "batch_ramp": fraction, "max_steps": steps})
    small = config(shards, train={"global_batch": 8, "max_steps": steps})
    pretrain.main(ramped, str(tmp_path / "ramped"))
    pretrain.main(small, str(tmp_path / "small"))
    tokens = losses(tmp_path / "ramped", "tokens")
    rows = np.diff([0, *(tokens[s] for s in range(1, steps + 1))]) / SEQ_LEN
    want = [
        8 * (4 if s / steps >= fraction else min(4, 1 + math.floor(4 * (s / steps) / fraction))) for s in range(steps)
    ]
    assert rows.tolist() == want and want[:2] == [8, 8] and want[-1] == 32
    # While the ramp is at one micro-batch, the steps take the small run's rows, masks and learning rate.
    ramped_loss, small_loss = losses(tmp_path / "ramped"), losses(tmp_path / "small")
    np.testing.assert_allclose([ramped_loss[1], ramped_loss[2]], [small_loss[1], small_loss[2]], atol=1e-6)
    assert abs(ramped_loss[steps] - small_loss[steps]) > 1e-3


# A long run: the ramp itself is checked in CI by the test above; a stopped run's resumption is the slow set's.
@pytest.mark.slow
def test_a_ramped_run_stopped_by_sigterm_continues_to_the_uninterrupted_runs_numbers(shards, tmp_path):
    ramp = ["--train.global_batch=32", "--train.grad_accum=4", "--train.batch_ramp=0.6", "--train.batch_ramp_start=16"]
    whole = tmp_path / "whole"
    subprocess.run(_command(shards, whole, *ramp, "--train.max_steps=14"), check=True, capture_output=True)
    run = tmp_path / "run"
    cmd = _command(shards, run, *ramp, "--train.max_steps=14", "--checkpoint.every=1000")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _wait_for_step(run, 4, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    stopped = max(losses(run))
    assert stopped < 14
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0 and f"resuming from step {stopped}" in done.stderr + done.stdout
    assert losses(run) == losses(whole) and losses(run, "tokens") == losses(whole, "tokens")
    for x, y in zip(params_of(whole), params_of(run), strict=True):
        np.testing.assert_array_equal(x, y)
    # The checkpoint's data position is the ramp's: resuming without the ramp is refused.
    no_ramp = config(shards, train={"global_batch": 32, "max_steps": 20})
    with pytest.raises(UserError, match="train.batch_ramp"):
        pretrain.main(no_ramp, str(run))


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"global_batch": 32, "batch_ramp": 0.5}, "set grad_accum > 1"),
        ({"global_batch": 32, "grad_accum": 4, "batch_ramp": 1.0}, r"batch_ramp must be in \[0, 1\)"),
        ({"global_batch": 32, "grad_accum": 4, "batch_ramp": 0.5, "batch_ramp_start": 12}, "multiple of the micro"),
    ],
)
def test_ramp_keys_that_cannot_make_a_ramp_are_refused(shards, train, message):
    with pytest.raises(UserError, match=f"config 'train': .*{message}"):
        config(shards, train=train)
