"""XLA options for a command on JAX's CPU backend, set in the process's XLA_FLAGS before JAX starts its backend.

`bertforge finetune` compiles with LLVM at optimisation level 1 instead of XLA's default 3: a fine-tuning run
compiles a gradient program per padded length, and on a CPU that compilation is a large part of a first run on
short texts, while its products are library calls that the level does not touch, so the steps keep their speed
(docs/benchmarks.md#where-the-time-goes-on-short-texts-profile-before-and-after). The results differ from level 3's
by rounding; a run continued from its checkpoint compiles under the same level, so it continues exactly.

Applied only on the CPU backend, where it was measured (on a GPU the same option would set the kernels' LLVM level).
A value the user gave in XLA_FLAGS for the same option wins.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from bertforge.runtime.allocator import runs_on_cpu

COMMAND_FLAGS = {"finetune": ("--xla_backend_optimization_level=1",)}


def _name(flag: str) -> str:
    return flag.partition("=")[0]


def tuned_xla_flags(environ: Mapping[str, str], command: str | None, accelerator: bool | None = None) -> str | None:
    """XLA_FLAGS for `command`: the environment's, then each of COMMAND_FLAGS[command] the user did not set; None
    when nothing is to be added (another command, JAX not on its CPU, or every option already set)."""
    if not runs_on_cpu(environ, accelerator):
        return None
    current = environ.get("XLA_FLAGS", "").split()
    given = {_name(f) for f in current}
    added = [f for f in COMMAND_FLAGS.get(command or "", ()) if _name(f) not in given]
    return " ".join([*current, *added]) if added else None


def set_xla_flags(command: str | None) -> None:
    """Put tuned_xla_flags in this process's environment (inherited by the processes it starts). Call it before
    JAX starts its backend: XLA reads XLA_FLAGS once."""
    flags = tuned_xla_flags(os.environ, command)
    if flags is not None:
        os.environ["XLA_FLAGS"] = flags
