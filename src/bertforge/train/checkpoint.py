"""Checkpoints (orbax).

Orbax writes each checkpoint into a temporary folder and renames it when whole, so a crash during a save leaves
the previous checkpoint in force. We keep the latest K and the best K by validation loss. Besides the train
state, a checkpoint holds JSON metadata: the data loader's position, the run's random key and the elapsed time.

A rename proves a save finished, not that the bytes are still the ones written: disks, copies and partial
deletions damage files later. So every checkpoint carries CHECKSUMS (size and sha256 of each file), written into
the temporary folder once all processes have written their part and before orbax renames it, and a restore
checks them first. A damaged checkpoint is reported and skipped for the previous good one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint._src.path.atomicity_types import TMP_DIR_SUFFIX
from orbax.checkpoint.checkpoint_managers import AnyPreservationPolicy, BestN, LatestN

from bertforge.errors import StorageError, UserError, mentions_storage_problem, storage_problem
from bertforge.fileio import write_atomic

CHECKSUMS = "bertforge-checksums.json"
DAMAGED = "damaged"  # where damaged checkpoints of a run are set aside


class DamagedCheckpoint(UserError):
    def __init__(self, folder: Path, problem: str):
        super().__init__(f"{folder}: checkpoint damaged ({problem})")
        self.problem = problem


# Orbax rewrites these two after the checksums are taken (commit time, success marker); neither holds the state.
_UNCHECKED = {CHECKSUMS, "_CHECKPOINT_METADATA", "commit_success.txt"}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def write_checksums(folder: Path) -> None:
    """Record the size and sha256 of every file under `folder` in folder/CHECKSUMS."""
    files = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel not in _UNCHECKED:
            files[rel] = [path.stat().st_size, _sha256(path)]
    write_atomic(folder / CHECKSUMS, json.dumps({"files": files}) + "\n")


def damage(folder: Path) -> str | None:
    """What is wrong with a checkpoint folder's files, or None when each matches its recorded checksum."""
    try:
        files = json.loads((folder / CHECKSUMS).read_text(encoding="utf-8"))["files"]
    except FileNotFoundError:
        return f"{CHECKSUMS} is missing"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return f"{CHECKSUMS} is unreadable"
    if not isinstance(files, dict) or not files:
        return f"{CHECKSUMS} is unreadable"
    for rel, entry in files.items():
        path = folder / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            return f"{CHECKSUMS} names {rel!r}, outside the checkpoint"
        if not path.is_file():
            return f"{rel} is missing"
        if not (isinstance(entry, list) and len(entry) == 2):
            return f"{CHECKSUMS} is unreadable"
        size, digest = entry
        if path.stat().st_size != size:
            return f"{rel} has {path.stat().st_size} bytes, {size} were written"
        if _sha256(path) != digest:
            return f"{rel} does not match its sha256"
    return None


def _valid_loss(metrics: dict[str, float]) -> float:
    return metrics["valid_loss"]


class _WithoutMetricsIsExpected(logging.Filter):
    """Orbax warns at every save without metrics once best_fn is set; here such saves are normal (a step that was
    not evaluated, a save on SIGTERM)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "did not provide metrics" not in record.getMessage()


logging.getLogger("absl").addFilter(_WithoutMetricsIsExpected())


class _RefusedWritesAreReportedOnce(logging.Filter):
    """When the disk refuses a write, each of orbax's writer threads logs its own traceback of it (hundreds of
    lines); Checkpoints.save reports the refusal in one line, so those records are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return not (mentions_storage_problem(record.getMessage()) or (exc is not None and storage_problem(exc)))


for _name in ("absl", "asyncio"):  # asyncio: the failed writes of tasks that orbax no longer awaits
    logging.getLogger(_name).addFilter(_RefusedWritesAreReportedOnce())


def _is_write_landing_on_closed_loop(exc: BaseException | None, tb: Any) -> bool:
    """tensorstore finishes each write on its own thread by calling back into the event loop that awaits it.
    Once one write has failed, orbax abandons the others and closes their loops, and tensorstore prints this
    RuntimeError for every write still in flight; the failure itself reaches Checkpoints.save."""
    return (
        isinstance(exc, RuntimeError)
        and str(exc) == "Event loop is closed"
        and tb is not None
        and tb.tb_frame.f_code.co_name == "call_soon_threadsafe"  # called from native code, not from Python
    )


def _drop_writes_landing_on_closed_loops() -> None:
    """Both hooks: tensorstore reports the error through one or the other depending on where it is raised."""
    if getattr(sys.excepthook, "_drops_writes_landing_on_closed_loops", False):
        return
    excepthook, unraisablehook = sys.excepthook, sys.unraisablehook

    def on_exception(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if not _is_write_landing_on_closed_loop(exc, tb):
            excepthook(exc_type, exc, tb)

    def on_unraisable(unraisable: Any) -> None:
        if not _is_write_landing_on_closed_loop(unraisable.exc_value, unraisable.exc_traceback):
            unraisablehook(unraisable)

    on_exception._drops_writes_landing_on_closed_loops = True  # type: ignore[attr-defined]
    sys.excepthook, sys.unraisablehook = on_exception, on_unraisable


class Checkpoints:
    """Save and restore (train state, metadata) under RUN/checkpoints/<step>."""

    def __init__(self, directory: str | Path, keep_last: int = 2, keep_best: int = 1):
        policies: list[Any] = [LatestN(n=keep_last)]
        if keep_best > 0:
            # Steps saved without a validation loss are kept by LatestN alone (orbax would keep them all).
            policies.append(
                BestN(get_metric_fn=_valid_loss, reverse=True, n=keep_best, keep_checkpoints_without_metrics=False)
            )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=AnyPreservationPolicy(policies),
            # The preservation policy only decides what stays on disk; best_step() ranks by best_fn, and without
            # it returns the latest step (also with keep_best=0, where the best of the steps kept is still asked for).
            best_fn=_valid_loss,
            best_mode="min",
            cleanup_tmp_directories=True,
            enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._seal),
        )
        self.directory = Path(directory).absolute()
        self._saving: int | None = None
        _drop_writes_landing_on_closed_loops()
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def _seal(self) -> None:
        """Orbax calls this on the primary process once every process has written its part of the step and before
        it renames the temporary folder, so the checksums arrive with the rename or not at all."""
        step = self._saving
        tmp = self.directory / f"{step}{TMP_DIR_SUFFIX}"
        write_checksums(tmp if tmp.is_dir() else self.directory / str(step))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def best_step(self) -> int | None:
        return self.manager.best_step()

    def score(self, step: int) -> float | None:
        """The validation loss `step` was saved with, or None."""
        found = self.manager.metrics(step)
        return None if not found else float(found["valid_loss"])

    def save(self, step: int, state: Any, meta: dict[str, Any], valid_loss: float | None = None) -> None:
        metrics = None if valid_loss is None else {"valid_loss": float(valid_loss)}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self.wait()  # _saving belongs to one save at a time
        self._saving = step
        self._check_space(step, state)
        with self._refused_writes():
            self.manager.save(step, args=args, metrics=metrics, force=True)

    def wait(self) -> None:
        with self._refused_writes():
            self.manager.wait_until_finished()

    def _check_space(self, step: int, state: Any) -> None:
        """Refuse a save that cannot fit before orbax starts it: a disk filling up halfway through a save is
        handled too, but then orbax's writers fail all at once and loudly. Old checkpoints are deleted only after
        the new one is whole, so the new one needs room beside them."""
        need = sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(state)) + (1 << 20)
        free = shutil.disk_usage(self.directory).free
        if free < need:
            raise StorageError(
                f"{self.directory}: {free / 2**20:.1f} MiB free, checkpoint {step} needs up to {need / 2**20:.1f} MiB; "
                f"{self._whole()}. Free space and run the same command to continue"
            )

    def _whole(self) -> str:
        whole = [s for s in self.all_steps() if s != self._saving]
        return f"checkpoint {max(whole)} is whole" if whole else "no checkpoint was completed"

    @contextlib.contextmanager
    def _refused_writes(self) -> Iterator[None]:
        """A save the disk refused (the background write of the previous one surfaces here) -> StorageError."""
        try:
            yield
        except Exception as e:
            refused = storage_problem(e)
            if refused is None:
                raise
            problem, remedy = refused
            raise StorageError(
                f"{self.directory}: could not save checkpoint {self._saving} ({problem}); {self._whole()}. "
                f"{remedy.capitalize()} and run the same command to continue"
            ) from None

    def restore(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        """The state laid out like `target` and the metadata. Leaves of `target` without a sharding (plain arrays
        or ShapeDtypeStructs) land on this process's first device: the saved layout may name devices of other
        processes or another mesh, which orbax does not take."""
        here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

        def abstract_leaf(x: Any) -> jax.ShapeDtypeStruct:
            s = ocp.utils.to_shape_dtype_struct(x)
            sharding = getattr(x, "sharding", None)
            return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding if sharding is not None else here)

        problem = self.damage(step)
        if problem is not None:
            raise DamagedCheckpoint(self.directory / str(step), problem)
        abstract = jax.tree.map(abstract_leaf, target)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        try:
            restored = self.manager.restore(step, args=args)
        except Exception as e:
            # The files are the ones written, so this is not damage (which would set the checkpoint aside): most
            # likely the run's model or optimizer config changed since the save.
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            raise UserError(
                f"{self.directory / str(step)}: checkpoint does not restore into this run's state "
                f"({type(e).__name__}: {first}); was the config changed since it was saved? Use another --out"
            ) from None
        return restored["state"], dict(restored["meta"])

    def damage(self, step: int) -> str | None:
        return damage(self.directory / str(step))

    def restore_newest_good(
        self, target: Any, set_aside: Path | None = None, say: Callable[[str], None] | None = None
    ) -> tuple[int, Any, dict[str, Any]] | None:
        """(step, state, metadata) of the newest checkpoint that is whole, or None when there is none. Each damaged
        one on the way is reported through `say` and, when `set_aside` is given, moved there so that the run can
        write that step again (kept, not deleted: it may be worth a look)."""
        say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        for step in sorted(self.all_steps(), reverse=True):
            try:
                return (step, *self.restore(step, target))
            except DamagedCheckpoint as e:
                problem = e.problem
            moved = ""
            if set_aside is not None:
                if jax.process_index() == 0:
                    set_aside.mkdir(parents=True, exist_ok=True)
                    stamp = time.strftime("%Y%m%d-%H%M%S")
                    shutil.move(self.directory / str(step), set_aside / f"checkpoint-{step}-{stamp}")
                if jax.process_count() > 1:
                    from jax.experimental import multihost_utils

                    multihost_utils.sync_global_devices(f"bertforge set aside checkpoint {step}")
                self.manager.reload()
                moved = f"moved to {set_aside}; "
            older = [s for s in self.all_steps() if s < step]
            then = f"trying checkpoint {max(older)}" if older else "no older checkpoint"
            say(f"warning: checkpoint {step} is damaged ({problem}); {moved}{then}")
        return None

    def close(self) -> None:
        with self._refused_writes():  # the background write of the last save may surface here
            self.manager.close()
