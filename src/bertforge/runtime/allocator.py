"""Host memory allocator settings for XLA's CPU runtime, applied by running the command again once at start-up.

XLA on CPU allocates and frees its large temporary buffers at every step. With glibc's defaults, each buffer over
its mmap threshold goes back to the kernel when freed and is faulted in again, 4 KiB page by 4 KiB page, at the next
step: fine-tuning MiniLM at a batch of 16 x 224 tokens on 2 cores took about 290,000 page faults and 0.44 s of kernel
time per 0.96 s step. Keeping freed memory in the process (higher mmap and trim thresholds) and backing it with
transparent huge pages (`glibc.malloc.hugetlb=1`) brings that to about 1,000 faults and the step to 0.73 s. PyTorch
keeps the same step time either way. glibc reads these tunables only when a process starts, hence the re-run.

`bertforge finetune` also puts every thread on glibc's main heap (`arena_max=1`) and never maps a buffer on its own
(`mmap_max=0`). XLA runs its programs on worker threads, which glibc gives heaps of their own of at most 64 MiB, and
glibc unmaps such a heap whenever it is left empty, whatever the trim threshold: a fine-tuning step then faults in
its temporaries again, as do buffers over the 32 MiB the mmap threshold can reach (an attention's probabilities at
16 x 12 x 224 x 224 float32 are 37 MiB). With both, MiniLM's step on CommonLit (16 x 192-256 tokens, bf16, 2
cores) took about 0.6 s against 0.75-1.0 s, the training steps of a short-text run 12% less time, and the kernel's
share of the CPU time fell from about a quarter to a twentieth. Pretraining gained nothing from them and its peak
memory doubled, so only fine-tuning gets them; compiling takes longer under one heap (LLVM's threads share its lock).

They are applied only when JAX will run on its CPU backend: that is where they were measured. On a GPU or TPU host
the same process drives the accelerator, and the host allocator there was not measured, so it is left alone.

`BERTFORGE_ALLOCATOR=system` keeps the allocator as it is; tunables the user already set in GLIBC_TUNABLES win.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping

TUNABLES = {
    "glibc.malloc.hugetlb": "1",  # madvise(MADV_HUGEPAGE) on the heap: 2 MiB pages, 512x fewer faults
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
