"""Run by test_loader.py as one of several processes of a jax.distributed CPU run (not a test by itself).

usage: python multiprocess_loader.py PROCESS_ID NUM_PROCESSES PORT SHARDS OUT.npz
Writes the rows this process read for 6 batches, and for 4 batches after a restore at batch 2.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

pid, nproc, port, shards_dir, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)

from bertforge.data.shards import BatchLoader, Shards  # noqa: E402
from bertforge.runtime.devices import batch_sharding, make_mesh  # noqa: E402

assert jax.device_count() == 4 * nproc and jax.local_device_count() == 4
mesh = make_mesh()
loader = BatchLoader(Shards(shards_dir), global_batch=16, seed=5, sharding=batch_sharding(mesh))


def local(batch):
    # This process's rows of the global array, in global row order.
    shards = sorted(batch.addressable_shards, key=lambda s: s.index[0].start)
    return np.concatenate([np.asarray(s.data) for s in shards])


first = [local(next(loader)) for _ in range(6)]
state = {"step": 2, "seed": 5, "global_batch": 16, "num_sequences": loader.shards.num_sequences}
resumed = BatchLoader(Shards(shards_dir), global_batch=16, seed=5, sharding=batch_sharding(mesh))
resumed.load_state_dict(state)
after = [local(next(resumed)) for _ in range(4)]
loader.close()
resumed.close()
np.savez(out, first=np.stack(first), after=np.stack(after))
jax.distributed.shutdown()
