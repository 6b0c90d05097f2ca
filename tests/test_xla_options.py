"""The XLA options the `bertforge` command runs under: per command, on the CPU backend only, the user's own kept."""

from __future__ import annotations

import os
import subprocess
import sys

from bertforge.runtime.xla_options import COMMAND_FLAGS, tuned_xla_flags

LEVEL = "--xla_backend_optimization_level"


def test_finetune_compiles_at_llvm_level_1_on_the_cpu_and_keeps_the_other_flags():
    assert tuned_xla_flags({}, "finetune", accelerator=False) == f"{LEVEL}=1"
    given = "--xla_force_host_platform_device_count=8"
    assert tuned_xla_flags({"XLA_FLAGS": given}, "finetune", accelerator=False) == f"{given} {LEVEL}=1"


def test_the_users_own_level_wins_and_other_commands_and_devices_are_left_alone():
    assert tuned_xla_flags({"XLA_FLAGS": f"{LEVEL}=3"}, "finetune", accelerator=False) is None
    assert tuned_xla_flags({}, "pretrain", accelerator=False) is None
    assert tuned_xla_flags({}, None, accelerator=False) is None
    assert tuned_xla_flags({}, "finetune", accelerator=True) is None  # JAX prefers the GPU or TPU
    assert tuned_xla_flags({"JAX_PLATFORMS": "cuda"}, "finetune", accelerator=True) is None
    assert tuned_xla_flags({"JAX_PLATFORMS": "cpu"}, "finetune", accelerator=True) == f"{LEVEL}=1"


def test_xla_takes_the_flags_it_is_given():
    # XLA stops the process at its first compilation when XLA_FLAGS names an option it does not have.
    script = (
        "import os, sys\n"
        "from bertforge.runtime.xla_options import set_xla_flags\n"
        "set_xla_flags('finetune')\n"
        "import jax, jax.numpy as jnp\n"
        "print(os.environ['XLA_FLAGS'], float(jax.jit(lambda x: jnp.tanh(x).sum())(jnp.ones(8))))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-c", script], env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    flags, value = out.stdout.split()
    assert flags == " ".join(COMMAND_FLAGS["finetune"])
    assert abs(float(value) - 8 * 0.7615941559557649) < 1e-5
    bad = subprocess.run(
        [sys.executable, "-c", script],
        env={**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_no_such_option=1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0  # the check above would catch a misspelt option
