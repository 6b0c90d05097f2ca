"""Host memory allocator settings for XLA's CPU runtime, applied by running the command again once at start-up.

XLA on CPU allocates and frees its large temporary buffers at every step. With glibc's defaults each buffer over the
mmap threshold goes back to the kernel when freed and is faulted in again, page by page, at the next step; keeping
freed memory in the process (higher mmap and trim thresholds) removes those faults. glibc reads these tunables only
when a process starts, hence the re-run. Transparent huge pages on the heap (glibc.malloc.hugetlb=1) are left off:
their faults cost every run seconds of kernel time at its first steps, more than they saved later.

`bertforge finetune` also puts every thread on glibc's main heap (`arena_max=1`) and never maps a buffer on its own
(`mmap_max=0`): glibc unmaps a worker thread's own heap whenever it is left empty, whatever the trim threshold, so
the step would fault in its temporaries again. Pretraining keeps its step time without them and its peak memory
would double, so only fine-tuning takes them. The figures are in docs/benchmarks.md, at
#where-the-time-goes-on-short-texts-profile-before-and-after.

They apply only where JAX runs on its CPU backend, where they were measured; an accelerator host's allocator is
left alone. `BERTFORGE_ALLOCATOR=system` keeps the allocator as it is; tunables the user set in GLIBC_TUNABLES win.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping

# What `bertforge --help` says of the re-run.
NOTE = (
    "When JAX runs on the CPU, the command runs itself again once at start-up with glibc allocator tunables "
    "(GLIBC_TUNABLES) that keep the memory XLA frees between steps; they were measured to help XLA's CPU runtime "
    "only, so they are not applied where a GPU or TPU backend is installed or JAX_PLATFORMS names one first. "
    "BERTFORGE_ALLOCATOR=system turns them off."
)

TUNABLES = {
    "glibc.malloc.mmap_threshold": str(32 * 2**20),  # glibc's maximum: buffers below it come from the heap
    "glibc.malloc.trim_threshold": str(4 * 2**30),  # keep freed heap memory for the next step
}
# On top of TUNABLES, by subcommand: where they were measured to help (see the module docstring).
COMMAND_TUNABLES = {
    "finetune": {
        "glibc.malloc.arena_max": "1",  # every thread on the main heap, which the trim threshold keeps
        "glibc.malloc.mmap_max": "0",  # buffers over the mmap threshold from the heap too
    },
}
OPT_OUT = "BERTFORGE_ALLOCATOR"
# The packages through which JAX drives a GPU or a TPU; with one installed, JAX prefers that device to the CPU.
ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")


def accelerator_installed() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in ACCELERATOR_PLUGINS)


def runs_on_cpu(environ: Mapping[str, str], accelerator: bool | None = None) -> bool:
    """Whether JAX will compute on its CPU backend: JAX_PLATFORMS names cpu first, or it is unset and no
    accelerator plugin is installed (`accelerator`: whether one is; looked up when None)."""
    platforms = [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return platforms[0] == "cpu"
    return not (accelerator_installed() if accelerator is None else accelerator)


def _parse(tunables: str) -> dict[str, str]:
    pairs = (item.partition("=") for item in tunables.split(":") if item)
    return {name: value for name, _, value in pairs}


def tunables(command: str | None = None) -> dict[str, str]:
    """The glibc tunables that bertforge `command` (a subcommand name, or None for any) runs under on a CPU."""
    return {**TUNABLES, **COMMAND_TUNABLES.get(command or "", {})}


def tuned_environment(
    environ: Mapping[str, str],
    platform: str = sys.platform,
    accelerator: bool | None = None,
    command: str | None = None,
) -> dict[str, str] | None:
    """The environment to run `command` again with (see tunables), or None to go on as is.

    None when not on Linux, when opted out, when JAX will not run on its CPU (see runs_on_cpu), or when every
    tunable is already set (by the user, or by the re-run itself, which is what stops it from running again)."""
    if not platform.startswith("linux") or environ.get(OPT_OUT, "").lower() == "system":
        return None
    if not runs_on_cpu(environ, accelerator):
        return None
    current = _parse(environ.get("GLIBC_TUNABLES", ""))
    missing = {k: v for k, v in tunables(command).items() if k not in current}
    if not missing:
        return None
    merged = {**missing, **current}  # the user's own settings stay as they are
    return {**environ, "GLIBC_TUNABLES": ":".join(f"{k}={v}" for k, v in merged.items())}


def rerun_with_tuned_allocator(command: str | None = None) -> None:
    """Replace this process by the same command line with `command`'s tunables set; returns only when none are
    needed.

    Call it first thing in an entry point, before anything is allocated or any thread started. The process keeps
    its id, so locks, signals and process managers see no difference."""
    env = tuned_environment(os.environ, command=command)
    if env is None or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # orig_argv: the interpreter's own options and the script or -m module exactly as they were given.
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
