"""How a suite's units run: their processes, one unit at a time or several at once over a machine's devices.

With `--devices 0,1,2,3` each unit's processes see one GPU (CUDA_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES), and as many
units run at once as there are ids; an id given twice shares its device between two units, each allowed its share
of the device's memory (XLA_PYTHON_CLIENT_MEM_FRACTION) instead of the three quarters a JAX process takes by default.
A SIGTERM or Ctrl-C the suite gets is passed on to every running unit, which saves its checkpoint and stops.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from bertforge.errors import UserError

Unit = TypeVar("Unit")
Result = TypeVar("Result")
VISIBLE = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
MEMORY = "XLA_PYTHON_CLIENT_MEM_FRACTION"
SHARED_MEMORY = 0.9  # of a device's memory, split among the units that share it


def dying_with(parent: int, cmd: list[str]) -> list[str]:
    """`cmd`, started so that it dies with the process `parent`, a kill -9 included (Linux: prctl's parent-death
    signal, which exec keeps), and none runs on alone in a run folder that a run again resumes; elsewhere as it is.
    A wrapper rather than preexec_fn, which is not safe in a process with threads (a pretraining run's)."""
    if not sys.platform.startswith("linux"):
        return cmd
    code = (f"import ctypes, os, sys; ctypes.CDLL(None).prctl(1, {int(signal.SIGKILL)}); "
            f"os.getppid() == {parent} or os._exit(137); os.execv(sys.argv[1], sys.argv[1:])")  # fmt: skip
    return [sys.executable, "-c", code, *cmd]


class Processes:
    """The suite's running unit processes, each with its output appended to its log; a signal sent to the suite is
    passed on to every one of them."""

    def __init__(self) -> None:
        self.live: set[subprocess.Popen] = set()
        self.lock = threading.Lock()

    def run(self, cmd: list[str], log: Path, env: dict[str, str]) -> int:
        """Run `cmd` with `env` added to the suite's environment; its exit status. In the main thread a Ctrl-C is
        passed on and the process waited for, so that it saves its checkpoint and stops as a finetune alone does."""
        with open(log, "ab") as fh:
            proc = subprocess.Popen(dying_with(os.getpid(), cmd), stdout=fh, stderr=subprocess.STDOUT,
                                    env={**os.environ, **env} if env else None)  # fmt: skip
            with self.lock:
                self.live.add(proc)
            try:
                while True:
                    try:
                        return proc.wait()
                    except KeyboardInterrupt:
                        proc.send_signal(signal.SIGINT)
            finally:
                with self.lock:
                    self.live.discard(proc)

    def send(self, signum: int) -> None:
        with self.lock:
            for proc in self.live:
                proc.send_signal(signum)

    @contextlib.contextmanager
    def forwarding(self) -> Iterator[None]:
        """While inside: a SIGTERM (a preemption) the suite gets goes to every running unit."""
        previous = signal.signal(signal.SIGTERM, lambda *_: self.send(signal.SIGTERM))
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)


def gpu_count() -> int:
    """The GPUs JAX sees, counted in a process of its own so that this one takes none of their memory."""
    code = "import jax, json; print(json.dumps([d.platform for d in jax.devices()]))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    platforms = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 and done.stdout else []
    return sum(p in ("gpu", "cuda", "rocm") for p in platforms)


def device_slots(devices: str, count: Callable[[], int] = gpu_count) -> list[dict[str, str]]:
    """`--devices` as the environment of each slot a unit runs in: "" one slot that sees every device; "0,1,..."
    one slot per id; "all" one per GPU (one slot that sees everything on a machine without GPUs)."""
    if not devices:
        return [{}]
    if devices == "all":
        found = count()
        return [{}] if found < 1 else device_slots(",".join(map(str, range(found))))
    ids = [d.strip() for d in devices.split(",")]
    if not all(d.isdigit() for d in ids):
        raise UserError(f"--devices {devices}: give device ids such as 0,1,2,3 (an id twice shares it), or all")
    shares = collections.Counter(ids)
    memory = lambda d: {MEMORY: f"{SHARED_MEMORY / shares[d]:.3f}"} if shares[d] > 1 else {}  # noqa: E731
    return [{**dict.fromkeys(VISIBLE, d), **memory(d)} for d in ids]


class _NotStarted(Exception):
    """A unit left alone because another failed."""


def run_all(units: Sequence[Unit], run: Callable[[Unit, dict[str, str]], Result], slots: Sequence[dict[str, str]],
            done: Callable[[Unit, Result], None], interrupted: Callable[[], None] = lambda: None
            ) -> list[Result]:  # fmt: skip
    """`run(unit, slot)` for every unit, as many at once as there are slots, each in a free slot; `done(unit,
    result)` as each finishes. The results in the units' order. After a failure no further unit starts; those
    running finish (a signal stops them), then the first failure is raised. A Ctrl-C meanwhile calls
    `interrupted` (which passes it on to the units) and the running units are waited for."""
    if len(slots) == 1:
        return [_done(done, unit, run(unit, slots[0])) for unit in units]
    free: queue.Queue = queue.Queue()
    for slot in slots:
        free.put(slot)
    failed = threading.Event()

    def job(unit: Unit) -> Result:
        if failed.is_set():
            raise _NotStarted
        slot = free.get()
        try:
            return _done(done, unit, run(unit, slot))
        except BaseException:
            failed.set()
            raise
        finally:
            free.put(slot)

    with concurrent.futures.ThreadPoolExecutor(len(slots)) as pool:
        futures = [pool.submit(job, unit) for unit in units]
        _wait(futures, interrupted)
    errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None and not isinstance(e, _NotStarted)), None)
    if first is not None:
        raise first
    return [f.result() for f in futures]


def _done(done: Callable[[Any, Any], None], unit: Any, result: Any) -> Any:
    done(unit, result)
    return result


def _wait(futures: list[concurrent.futures.Future], interrupted: Callable[[], None]) -> None:
    while True:
        try:
            concurrent.futures.wait(futures)
            return
        except KeyboardInterrupt:
            interrupted()
