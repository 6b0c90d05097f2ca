"""Host memory allocator settings for XLA's CPU runtime, applied by running the command again once at start-up.

XLA on CPU allocates and frees its large temporary buffers at every step. With glibc's defaults, each buffer over
its mmap threshold goes back to the kernel when freed and is faulted in again, 4 KiB page by 4 KiB page, at the next
step: fine-tuning MiniLM at a batch of 16 x 224 tokens on 2 cores took about 290,000 page faults and 0.44 s of kernel
time per 0.96 s step. Keeping freed memory in the process (higher mmap and trim thresholds) and backing it with
transparent huge pages (`glibc.malloc.hugetlb=1`) brings that to about 1,000 faults and the step to 0.73 s. PyTorch
keeps the same step time either way. glibc reads these tunables only when a process starts, hence the re-run.

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


def tuned_environment(
    environ: Mapping[str, str], platform: str = sys.platform, accelerator: bool | None = None
) -> dict[str, str] | None:
    """The environment to run the command again with, or None to go on as is.

    None when not on Linux, when opted out, when JAX will not run on its CPU (see runs_on_cpu), or when every
    tunable is already set (by the user, or by the re-run itself, which is what stops it from running again)."""
    if not platform.startswith("linux") or environ.get(OPT_OUT, "").lower() == "system":
        return None
    if not runs_on_cpu(environ, accelerator):
        return None
    current = _parse(environ.get("GLIBC_TUNABLES", ""))
    missing = {k: v for k, v in TUNABLES.items() if k not in current}
    if not missing:
        return None
    merged = {**missing, **current}  # the user's own settings stay as they are
    return {**environ, "GLIBC_TUNABLES": ":".join(f"{k}={v}" for k, v in merged.items())}


def rerun_with_tuned_allocator() -> None:
    """Replace this process by the same command line with the tunables set; returns only when none are needed.

    Call it first thing in an entry point, before anything is allocated or any thread started. The process keeps
    its id, so locks, signals and process managers see no difference."""
    env = tuned_environment(os.environ)
    if env is None or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # orig_argv: the interpreter's own options and the script or -m module exactly as they were given.
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
