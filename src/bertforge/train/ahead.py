"""A jitted function's programs compiled ahead of their first use, in background threads.

Fine-tuning pads its batches to a few lengths and evaluates at a few more: one program each. Compiled on first use
(as jax.jit does), a first run waits for every one in turn; compiled ahead, the ones the run will need later
compile on the host's other cores while the first steps run, and a step waits only for a program not yet ready.
XLA releases the GIL while it compiles, so threads are enough.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import os
import threading
from collections.abc import Callable
from typing import Any

import jax


def signature(args: tuple, kwargs: dict) -> tuple:
    """What decides which program runs: the arguments' tree, and each leaf's shape, dtype and layout (arrays and
    ShapeDtypeStructs alike; None where a leaf has no layout yet). Taken at every step: dtypes are compared as
    themselves, where their names cost a step about a millisecond for MiniLM's 317 leaves."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    return tree, tuple((tuple(x.shape), x.dtype, getattr(x, "sharding", None)) for x in leaves)


def workers() -> int:
    """Threads that compile: every core but one, which the running steps keep, at most four; none on a machine of
    two cores or fewer, whose steps already use every core (there, compiling ahead did not shorten a first run)."""
    cores = os.cpu_count() or 1
    return 0 if cores <= 2 else min(4, cores - 1)


class Ahead:
    """`fn` (a jax.jit function) with one compiled program per argument signature.

    `ahead(*args)` starts compiling the program for arguments of args' shapes (ShapeDtypeStructs with their
    shardings, or arrays) in a background thread (with no threads, it does nothing); a call runs the program of its
    arguments' signature, waiting for it if it is being compiled, or compiling it at once if nobody asked for it
    ahead. Each signature compiles once, so the folds of a k-fold run share every program. The programs are those
    jax.jit would make (the same lowering, the persistent cache included), so the numbers are the same.
    """

    def __init__(self, fn: Any, threads: int | None = None):
        self.fn = fn
        self.threads = workers() if threads is None else threads
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.programs: dict[tuple, concurrent.futures.Future] = {}
        self.lock = threading.Lock()

    def _compile(self, args: tuple, kwargs: dict) -> Callable[..., Any]:
        return self.fn.lower(*args, **kwargs).compile()

    def ahead(self, *args: Any, **kwargs: Any) -> None:
        if not self.threads:
            return
        key = signature(args, kwargs)
        with self.lock:
            if key in self.programs:
                return
            if self.pool is None:
                self.pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="compile")
            # The thread traces in the caller's context (runtime/devices.py's run mesh).
            self.programs[key] = self.pool.submit(contextvars.copy_context().run, self._compile, args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = signature(args, kwargs)
        with self.lock:
            future = self.programs.get(key)
            if future is None:  # not asked for ahead: compiled here, as jax.jit would
                future = self.programs[key] = concurrent.futures.Future()
                mine = True
            else:
                mine = False
        if mine:
            try:
                future.set_result(self._compile(args, kwargs))
            except BaseException as e:
                future.set_exception(e)
                raise
        return future.result()(*args, **kwargs)

    def compiled(self) -> int:
        """Programs compiled or being compiled."""
        return len(self.programs)
