"""Python's cyclic garbage collector kept off the objects a training run holds for its whole length.

A run keeps most of what it makes until it ends: the modules, the tables, JAX's traced and compiled programs. Every
full collection walks all of them and frees nothing, and on a small CPU run those passes, and the interpreter's own
at exit, cost seconds (docs/benchmarks.md#the-garbage-collector-and-the-model-folder-2026-12-06-intel-xeon). A
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
    a first step or evaluation); unfreeze at the end. Where something else froze objects before (an application
    that embeds the run), do nothing: unfreezing would unfreeze theirs too."""
    if gc.get_freeze_count():
        yield lambda: None
        return
    settle()
    try:
        yield settle
    finally:
        gc.unfreeze()


# A collection of the youngest objects after every this many more made than freed (Python's default: 700): a run's
# start (imports, reading, tracing) makes objects that live on by the hundred thousand, and a command, whose process
# ends with it, lets its little garbage wait longer.
COMMAND_THRESHOLD = 10_000


def for_command() -> None:
    """The collector's settings for a `bertforge` command: fewer, larger collections of the young objects."""
    gc.set_threshold(COMMAND_THRESHOLD, *gc.get_threshold()[1:])


def freeze_for_exit() -> None:
    """Freeze every object before the process exits, so that the collections the interpreter runs at shutdown
    skip them."""
    gc.freeze()
