"""JAX's persistent compilation cache: a second process loads what the first compiled, the folder and the switch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_finetune import river_rows, write_table

# Runs a bertforge command as the CLI does and writes, per compiled function, JAX's compile requests and the
# persistent cache's hits and misses (entries written), as jax.monitoring reports them. The cache is enabled first,
# as `bertforge` does before JAX is imported; the listeners need JAX, so they come after.
COUNTING = """
import collections, json, sys
from bertforge.runtime import compile_cache
compile_cache.enable()
from jax import monitoring
from bertforge.cli import main
compiling = [None]
counts = collections.defaultdict(collections.Counter)
def started(event, value, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        compiling[0] = kw["fun_name"]
def happened(event, **kw):
    if event.startswith("/jax/compilation_cache/"):
        counts[compiling[0]][event.rsplit("/", 1)[1]] += 1
monitoring.register_scalar_listener(started)
monitoring.register_event_listener(happened)
code = main(sys.argv[2:])
with open(sys.argv[1], "w") as fh:
    json.dump({"code": code, "counts": counts}, fh)
"""


def _env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env.pop("BERTFORGE_COMPILE_CACHE", None)
    return {**env, **settings}


def _counted_finetune(tmp_path: Path, name: str, model_dir: Path, data: Path, env: dict[str, str], *extra: str) -> dict:
    script = tmp_path / "counting.py"
    script.write_text(COUNTING)
    out = tmp_path / f"{name}.json"
    argv = ["finetune", "--model", model_dir, "--data", data, "--out", tmp_path / name, "--folds", "2", "--fold", "0",
            "--train.epochs=1", "--train.batch_size=16", "--mesh.num_devices=1", "--data.max_length=32",
            "--data.bucket=0", "--data.pack=false", "--log.progress=false", *extra]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(script), str(out), *map(str, argv)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    assert "compile cache" not in proc.stderr, proc.stderr
    result = json.loads(out.read_text())
    assert result["code"] == 0
    return result["counts"]


def _total(counts: dict, event: str, function: str = "") -> int:
    return sum(c.get(event, 0) for name, c in counts.items() if function in str(name))


def test_a_second_process_compiles_nothing_the_first_compiled(model_dir, tmp_path):
    data = write_table(tmp_path / "train.csv", river_rows(32, seed=5))
    env = _env(BERTFORGE_COMPILE_CACHE=str(tmp_path / "cache"))
    first = _counted_finetune(tmp_path, "first", model_dir, data, env)
    second = _counted_finetune(tmp_path, "second", model_dir, data, env)
    # The first process compiled the train step (its gradients and its update) and wrote it (a miss is an entry
    # written), the rest with it.
    for program in ("jit(gradients)", "jit(update)"):
        assert _total(first, "cache_misses", program) >= 1, first
    assert _total(first, "cache_misses") > _total(first, "cache_misses", "jit(gradients)")
    assert _total(first, "cache_hits") == 0, first
    # The second asked for every program again and loaded each one: no compilation written, for the step or else.
    for program in ("jit(gradients)", "jit(update)"):
        asked = _total(second, "compile_requests_use_cache", program)
        assert asked >= 1 and _total(second, "cache_hits", program) == asked, second
    assert _total(second, "cache_misses") == 0, second
    assert _total(second, "cache_hits") == _total(first, "cache_misses")


def test_another_seed_loads_every_program_the_first_seed_compiled(model_dir, tmp_path):
    # The seed draws the new head's weights, the batches' order and dropout's masks: values, not programs.
    data = write_table(tmp_path / "train.csv", river_rows(32, seed=5))
    env = _env(BERTFORGE_COMPILE_CACHE=str(tmp_path / "cache"))
    first = _counted_finetune(tmp_path, "first", model_dir, data, env, "--train.seed=1")
    second = _counted_finetune(tmp_path, "second", model_dir, data, env, "--train.seed=2")
    assert _total(first, "cache_misses", "jit(initial)") == 1, first
    assert _total(second, "cache_hits", "jit(initial)") == 1, second
    assert _total(second, "cache_misses") == 0, second


def _bertforge(env: dict[str, str], *argv: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bertforge.cli", *map(str, argv)], env=env, capture_output=True, text=True, timeout=600
    )


def test_the_cache_lives_in_the_user_cache_folder_and_off_turns_it_off(model_dir, tmp_path):
    fill = ["fill-mask", "--model", model_dir, "the river [MASK] of the city"]
    home = tmp_path / "xdg"
    proc = _bertforge(_env(XDG_CACHE_HOME=str(home), BERTFORGE_COMPILE_CACHE="off"), *fill)
    assert proc.returncode == 0 and "compile cache" not in proc.stderr, proc.stderr
    assert not (home / "bertforge").exists()
    proc = _bertforge(_env(XDG_CACHE_HOME=str(home)), *fill)
    assert proc.returncode == 0 and "compile cache" not in proc.stderr, proc.stderr
    assert any(p.name.endswith("-cache") for p in (home / "bertforge" / "jax").iterdir())


CHOOSE = """
import json, sys
from bertforge.runtime import compile_cache
folder = compile_cache.enable()
import jax
print(json.dumps([folder, jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache,
                  jax.config.jax_persistent_cache_min_compile_time_secs]))
"""


def _choice(**settings: str) -> tuple[list, str]:
    proc = subprocess.run([sys.executable, "-c", CHOOSE], env=_env(**settings), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def test_folder_choices_a_folder_given_to_jax_and_an_unwritable_folder(tmp_path):
    home = tmp_path / "home"
    assert _choice(HOME=str(home), XDG_CACHE_HOME="")[0] == [str(home / ".cache/bertforge/jax")] * 2 + [True, 0.0]
    mine = tmp_path / "mine"
    assert (
        _choice(BERTFORGE_COMPILE_CACHE=str(mine), JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax"))[0][:2]
        == [str(mine)] * 2
    )
    # A folder given to JAX itself is kept, with JAX's own threshold (1 s).
    theirs = str(tmp_path / "theirs")
    assert _choice(JAX_COMPILATION_CACHE_DIR=theirs, XDG_CACHE_HOME=str(tmp_path))[0] == [theirs, theirs, True, 1.0]
    assert _choice(BERTFORGE_COMPILE_CACHE="off", JAX_COMPILATION_CACHE_DIR=theirs)[0][::2] == [None, False]
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    (folder, _, enabled, _), err = _choice(BERTFORGE_COMPILE_CACHE=str(blocked / "cache"))
    assert folder is None and not enabled
    assert err.count("\n") == 1 and err.startswith(f"warning: compile cache {blocked / 'cache'}: "), err


def test_failed_cache_reads_and_writes_are_one_line_and_never_an_error():
    # JAX warns at each entry it cannot write (a full disk), as below; under -W error a warning would be an error.
    script = """
import warnings
from bertforge.runtime import compile_cache
compile_cache.say_cache_errors_once("/the/folder")
for name in ("jit_a", "jit_b"):
    warnings.warn(f"Error writing persistent compilation cache entry for '{name}': OSError: [Errno 28] No space")
    warnings.warn(f"Error reading persistent compilation cache entry for '{name}': error: truncated stream")
print("went on")
"""
    proc = subprocess.run([sys.executable, "-W", "error", "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == "went on\n", proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: compile cache: Error writing") and "'jit_a'" in lines[0]
    assert "delete /the/folder" in lines[0]
