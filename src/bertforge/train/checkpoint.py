"""Checkpoints (orbax) and the run lock.

Orbax writes each checkpoint into a temporary folder and renames it when whole, so a crash during a save leaves
the previous checkpoint in force. We keep the latest K and the best K by validation loss. Besides the train
state, a checkpoint holds JSON metadata: the data loader's position, the run's random key and the elapsed time.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import AnyPreservationPolicy, BestN, LatestN

from bertforge.errors import UserError


class RunLock:
    """An exclusive lock on a run folder. The kernel drops it when the holder dies, even by kill -9."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / ".lock"
        self.fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            raise UserError(f"{self.path.parent}: another trainer is using this run ({holder})") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"host {socket.gethostname()}, pid {os.getpid()}\n".encode())
        os.fsync(fd)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Checkpoints:
    """Save and restore (train state, metadata) under RUN/checkpoints/<step>."""

    def __init__(self, directory: str | Path, keep_last: int = 2, keep_best: int = 1):
        policies: list[Any] = [LatestN(n=keep_last)]
        if keep_best > 0:
            policies.append(BestN(get_metric_fn=lambda m: m["valid_loss"], reverse=True, n=keep_best))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=AnyPreservationPolicy(policies),
            cleanup_tmp_directories=True,
            enable_async_checkpointing=True,
        )
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def best_step(self) -> int | None:
        return self.manager.best_step()

    def save(self, step: int, state: Any, meta: dict[str, Any], valid_loss: float | None = None) -> None:
        metrics = None if valid_loss is None else {"valid_loss": float(valid_loss)}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self.manager.save(step, args=args, metrics=metrics, force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def restore(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        """The state laid out like `target` and the metadata. Leaves of `target` without a sharding (plain arrays
        or ShapeDtypeStructs) land on this process's first device: the saved layout may name devices of other
        processes or another mesh, which orbax does not take."""
        here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

        def abstract_leaf(x: Any) -> jax.ShapeDtypeStruct:
            s = ocp.utils.to_shape_dtype_struct(x)
            sharding = getattr(x, "sharding", None)
            return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding if sharding is not None else here)

        abstract = jax.tree.map(abstract_leaf, target)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        restored = self.manager.restore(step, args=args)
        return restored["state"], dict(restored["meta"])

    def close(self) -> None:
        self.manager.close()
