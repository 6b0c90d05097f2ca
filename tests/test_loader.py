"""The shard loader: seeded epochs, exact resume, 8 simulated devices, and 2 processes with disjoint parts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from test_preprocess import make_documents, run

from bertforge.data.shards import BatchLoader, Shards
from bertforge.errors import UserError
from bertforge.runtime.devices import batch_sharding, make_mesh


@pytest.fixture(scope="module")
def shards_dir(tmp_path_factory, wordpiece_dir):
    tmp = tmp_path_factory.mktemp("loader")
    run(tmp, wordpiece_dir, make_documents(n_docs=40, seed=4), seq_len=16, shard_size=64, valid_fraction=0.0)
    return tmp / "out"


def test_epochs_are_permutations(shards_dir):
    shards = Shards(str(shards_dir))
    loader = BatchLoader(shards, global_batch=16, seed=1, prefetch=0)
    n = loader.batches_per_epoch
    for epoch in range(2):
        seen = np.concatenate([loader.global_indices(epoch * n + j) for j in range(n)])
        assert len(np.unique(seen)) == len(seen) == n * 16
    assert not np.array_equal(loader.global_indices(0), loader.global_indices(n))  # reshuffled each epoch
    np.testing.assert_array_equal(next(loader), shards.rows(loader.global_indices(0)))


def test_restored_loader_yields_the_same_next_100_batches(shards_dir):
    shards = Shards(str(shards_dir))
    reference = BatchLoader(shards, global_batch=16, seed=3)
    stopped = BatchLoader(Shards(str(shards_dir)), global_batch=16, seed=3)
    k = 7
    for _ in range(k):
        next(reference)
        next(stopped)
    state = stopped.state_dict()
    stopped.close()
    restored = BatchLoader(Shards(str(shards_dir)), global_batch=16, seed=3)
    restored.load_state_dict(state)
    assert reference.batches_per_epoch < 100  # the 100 batches cross several epochs
    for _ in range(100):
        np.testing.assert_array_equal(next(restored), next(reference))
    assert restored.epoch == reference.epoch > 1
    reference.close()
    restored.close()


def test_restoring_with_another_batch_size_is_refused(shards_dir):
    loader = BatchLoader(Shards(str(shards_dir)), global_batch=16, seed=3)
    other = BatchLoader(Shards(str(shards_dir)), global_batch=8, seed=3)
    with pytest.raises(UserError, match="global_batch=16, this run has 8"):
        other.load_state_dict(loader.state_dict())


def test_eight_devices_get_the_same_batches_laid_out_on_the_mesh(shards_dir):
    mesh = make_mesh()
    plain = BatchLoader(Shards(str(shards_dir)), global_batch=16, seed=2)
    sharded = BatchLoader(Shards(str(shards_dir)), global_batch=16, seed=2, sharding=batch_sharding(mesh))
    for _ in range(5):
        a, b = next(plain), next(sharded)
        assert isinstance(b, jax.Array) and len(b.addressable_shards) == 8
        assert b.addressable_shards[0].data.shape == (2, 16)
        np.testing.assert_array_equal(np.asarray(b), a)
    state = sharded.state_dict()
    resumed = BatchLoader(Shards(str(shards_dir)), global_batch=16, seed=2, sharding=batch_sharding(mesh))
    resumed.load_state_dict(state)
    for _ in range(5):
        np.testing.assert_array_equal(np.asarray(next(resumed)), next(plain))
    for loader in (plain, sharded, resumed):
        loader.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_read_disjoint_parts_and_resume(shards_dir, tmp_path):
    script = Path(__file__).with_name("multiprocess_loader.py")
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(i), "2", port, str(shards_dir), str(tmp_path / f"p{i}.npz")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out.decode()[-3000:]
    parts = [np.load(tmp_path / f"p{i}.npz") for i in range(2)]
    reference = BatchLoader(Shards(str(shards_dir)), global_batch=16, seed=5, prefetch=0)
    expected = [reference.local_rows(k) for k in range(6)]
    for k in range(6):
        p0, p1 = parts[0]["first"][k], parts[1]["first"][k]
        assert p0.shape == p1.shape == (8, 16)
        np.testing.assert_array_equal(np.concatenate([p0, p1]), expected[k])  # process 0 rows 0-7, process 1 rows 8-15
        rows0 = set(reference.global_indices(k)[:8])
        rows1 = set(reference.global_indices(k)[8:])
        assert not rows0 & rows1
    for k in range(4):
        np.testing.assert_array_equal(np.concatenate([parts[0]["after"][k], parts[1]["after"][k]]), expected[2 + k])
