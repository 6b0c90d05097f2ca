"""Python's cyclic garbage collector kept off the objects a training run holds for its whole length.

A run keeps most of what it makes until it ends: the modules, the tables, JAX's traced and compiled programs. Every
full collection walks all of them and frees nothing; in a fine-tuning run on short texts on 2 CPU cores, eleven such
passes took 2.0-2.6 s of a 35 s run, and the interpreter's own passes at exit 0.6 s more (docs/benchmarks.md). A
settled run collects once, then moves every object alive into the permanent generation, which collections skip;
what it makes afterwards is collected as before. When the run ends the frozen objects are collectable again, so a
process that runs many (a notebook, a k-fold run, the tests) does not keep what the earlier ones left.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator


def settle() -> None:
    """Free the garbage there is now, and keep every object left out of later collections."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def settled() -> Iterator[Callable[[], None]]:
    """Settle now, and give a `settle` to call again where the run has made objects it keeps (its programs, after
    a first step or evaluation); unfreeze at the end. Where something else froze objects before (the process's
    own owner), do nothing: unfreezing would take theirs too."""
    if gc.get_freeze_count():
        yield lambda: None
        return
    settle()
    try:
        yield settle
    finally:
        gc.unfreeze()


# A collection of the youngest objects after every this many more made than freed (Python's default: 700). At the
# default, a run's start (imports, reading, tracing) made about 1,700 of them and 6 full passes before its first
# step; a command, whose process ends with it, lets more garbage wait.
COMMAND_THRESHOLD = 10_000


def for_command() -> None:
    """The collector's settings for a `bertforge` command: fewer, larger collections of the young objects."""
    gc.set_threshold(COMMAND_THRESHOLD, *gc.get_threshold()[1:])


def freeze_for_exit() -> None:
    """Before the process exits: the interpreter's last collections, at shutdown, then skip what is alive."""
    gc.freeze()
