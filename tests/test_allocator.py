"""The allocator tunables that the `bertforge` command runs under: set once, the user's own kept, opt-out honoured."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bertforge.runtime.allocator import OPT_OUT, TUNABLES, tunables, tuned_environment


def _tunables(env):
    return dict(item.split("=") for item in env["GLIBC_TUNABLES"].split(":"))


def test_every_tunable_is_set_and_the_rest_of_the_environment_kept():
    env = tuned_environment({"PATH": "/bin"}, "linux")
    assert env["PATH"] == "/bin"
    assert _tunables(env) == TUNABLES


def test_the_users_own_tunables_win_and_are_kept():
    given = "glibc.malloc.trim_threshold=1024:glibc.malloc.arena_max=2"
    env = tuned_environment({"GLIBC_TUNABLES": given}, "linux")
    found = _tunables(env)
    assert found["glibc.malloc.trim_threshold"] == "1024"
    assert found["glibc.malloc.arena_max"] == "2"
    assert found["glibc.malloc.mmap_threshold"] == TUNABLES["glibc.malloc.mmap_threshold"]


def test_no_rerun_once_set_when_opted_out_or_off_linux():
    env = tuned_environment({}, "linux")
    assert tuned_environment(env, "linux") is None  # what stops the re-run from running again
    assert tuned_environment({OPT_OUT: "system"}, "linux") is None
    assert tuned_environment({}, "darwin") is None
    assert tuned_environment({}, "win32") is None


def test_the_command_runs_again_once_in_the_same_process_with_its_options():
    script = (
        "import os, sys\n"
        "from bertforge.runtime.allocator import rerun_with_tuned_allocator\n"
        "print('pid', os.getpid(), sys.flags.dont_write_bytecode, flush=True)\n"
        "rerun_with_tuned_allocator()\n"
        "print('tunables', os.environ['GLIBC_TUNABLES'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", OPT_OUT)}
    out = subprocess.run([sys.executable, "-B", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    if not sys.platform.startswith("linux"):
        assert len(lines) == 2
        return
    assert len(lines) == 3 and lines[0] == lines[1]  # ran twice, same process id, -B kept
    assert lines[0].endswith(" 1")
    assert _tunables({"GLIBC_TUNABLES": lines[2].split(" ", 1)[1]}) == TUNABLES
    opted = subprocess.run(
        [sys.executable, "-c", script], env={**env, OPT_OUT: "system"}, capture_output=True, text=True, timeout=120
    )
    assert opted.returncode == 1 and len(opted.stdout.splitlines()) == 1  # no re-run, so no tunables to print


def test_tuned_only_where_jax_runs_on_its_cpu_backend():
    assert tuned_environment({}, "linux", accelerator=False) is not None
    assert tuned_environment({}, "linux", accelerator=True) is None  # a GPU or TPU plugin: JAX prefers the device
    assert tuned_environment({"JAX_PLATFORMS": "cuda"}, "linux", accelerator=True) is None
    assert tuned_environment({"JAX_PLATFORMS": "tpu,cpu"}, "linux", accelerator=False) is None
    # Asked for the CPU by name: tuned even where an accelerator is installed.
    assert _tunables(tuned_environment({"JAX_PLATFORMS": "cpu"}, "linux", accelerator=True)) == TUNABLES


def test_finetune_adds_its_own_and_stops_rerunning_once_they_are_set():
    assert tunables("pretrain") == tunables(None) == TUNABLES
    extra = {k: v for k, v in tunables("finetune").items() if k not in TUNABLES}
    assert extra == {"glibc.malloc.arena_max": "1", "glibc.malloc.mmap_max": "0"}
    env = tuned_environment({}, "linux", accelerator=False, command="finetune")
    assert _tunables(env) == tunables("finetune")
    assert tuned_environment(env, "linux", accelerator=False, command="finetune") is None
    # A process tuned for another command still lacks finetune's: it runs again once.
    base = tuned_environment({}, "linux", accelerator=False)
    assert _tunables(tuned_environment(base, "linux", accelerator=False, command="finetune")) == tunables("finetune")


# A jitted program whose temporaries are an attention's (16, 12, 256, 256) float32 scores and probabilities (48 MiB
# each, over glibc's largest mmap threshold), run on XLA's worker threads: the page faults of one call, once warm.
FAULTS_SCRIPT = """
import resource, sys
from bertforge.runtime.allocator import rerun_with_tuned_allocator
rerun_with_tuned_allocator(sys.argv[1])
import jax, jax.numpy as jnp
@jax.jit
def f(x, w):
    p = jax.nn.softmax(jnp.einsum("bnqh,bnkh->bnqk", x, x), axis=-1)
    return jnp.einsum("bnqk,bnkh->bnqh", p, x) @ w
x, w = jnp.ones((16, 12, 256, 32)), jnp.ones((32, 32))
for _ in range(10):  # the heap settles over the first calls, whose threads allocate in varying order
    f(x, w).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    f(x, w).block_until_ready()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables")
def test_finetunes_tunables_keep_a_steps_temporaries_mapped():
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", OPT_OUT)}
    env["JAX_PLATFORMS"] = "cpu"

    def faults(**extra: str) -> float:
        out = subprocess.run(
            [sys.executable, "-c", FAULTS_SCRIPT, "finetune"],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        return float(out.stdout.split()[-1])

    # glibc's defaults (opted out): every call maps its temporaries afresh, thousands of 4 KiB faults; finetune's
    # tunables keep them, so a warm call faults in (almost) nothing.
    system = faults(**{OPT_OUT: "system"})
    assert system > 1000
    # A warm call may still fault in the heap's last growth (a few hundred 4 KiB pages when XLA's threads allocate in
    # another order, under load), against every page of its 96 MiB of temporaries under glibc's defaults.
    assert faults() < system / 20
