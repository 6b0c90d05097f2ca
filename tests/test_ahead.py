"""Programs compiled ahead of their first use (train/ahead.py): the same results as jax.jit, each signature
compiled once, and a k-fold fine-tuning that compiles each of its programs once, and none it does not use."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import monitoring
from test_finetune import river_rows, write_table

from bertforge.runtime import devices
from bertforge.train.ahead import Ahead, signature

COMPILES: collections.Counter = collections.Counter()


def _count(event: str, value: float, **kw) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES[kw.get("fun_name")] += 1


monitoring.register_scalar_listener(_count)


def polynomial(x: jax.Array, scale: jax.Array) -> jax.Array:
    return jnp.sum(x**3 - 2 * x, axis=-1) * scale


def test_ahead_runs_what_jit_runs_and_compiles_each_signature_once():
    fn = Ahead(jax.jit(polynomial), threads=2)
    xs = {n: jnp.asarray(np.random.default_rng(n).normal(size=(4, n)), jnp.float32) for n in (8, 16, 24)}
    like_8 = jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=xs[8].sharding)
    assert signature((like_8,), {}) == signature((xs[8],), {}) != signature((xs[16],), {})
    before = COMPILES["jit(polynomial)"]
    fn.ahead(like_8, jnp.float32(1.0))
    fn.ahead(xs[16], jnp.float32(1.0))
    fn.ahead(xs[16], jnp.float32(3.0))  # the same signature: nothing more
    got = [np.asarray(fn(x, jnp.float32(2.0))) for x in xs.values()]  # 24, not asked for ahead, compiles here
    got += [np.asarray(fn(x, jnp.float32(5.0))) for x in xs.values()]
    assert fn.compiled() == 3 and COMPILES["jit(polynomial)"] - before == 3
    jitted = jax.jit(polynomial)
    want = [np.asarray(jitted(x, jnp.float32(s))) for s in (2.0, 5.0) for x in xs.values()]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_threads_calling_a_new_signature_at_once_compile_it_once():
    fn = Ahead(jax.jit(lambda x: jnp.cumsum(x) * 2), threads=2)
    x = jnp.arange(1000.0)
    out = [None] * 6
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, fn(x))) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fn.compiled() == 1
    for o in out:
        np.testing.assert_array_equal(np.asarray(o), np.cumsum(np.arange(1000.0)) * 2)


COUNTING = """
import collections, json, sys
from jax import monitoring
from bertforge.cli import main
counts = collections.Counter()
def started(event, value, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        counts[kw.get("fun_name")] += 1
monitoring.register_scalar_listener(started)
code = main(sys.argv[2:])
with open(sys.argv[1], "w") as fh:
    json.dump({"code": code, "counts": counts}, fh)
"""


def test_a_k_fold_run_compiles_each_program_once(model_dir, tmp_path):
    # Two folds, their batches padded (not packed) to the two lengths of a two-rung ladder, evaluated at lengths of
    # their own:
    # the gradients' program compiles once per length for both folds, the update once, and the evaluation once
    # per evaluated length, whatever fold asks first.
    data = write_table(tmp_path / "train.csv", river_rows(160))
    script = tmp_path / "counting.py"
    script.write_text(COUNTING)
    argv = ["finetune", "--model", model_dir, "--data", data, "--out", tmp_path / "run", "--folds", "2",
            "--train.epochs=2", "--train.batch_size=16", "--mesh.num_devices=1", "--data.shapes=2",
            "--train.eval_batch_size=32", "--log.progress=false", "--data.pack=false"]  # fmt: skip
    env = {"BERTFORGE_COMPILE_CACHE": "off", "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "counts.json"), *map(str, argv)],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    counts = json.loads((tmp_path / "counts.json").read_text())["counts"]
    rungs = [line.split("texts padded to")[1] for line in proc.stderr.splitlines() if "texts padded to" in line]
    assert len(rungs) == 2 and len(set(rungs)) == 1, rungs  # both folds: the same two lengths
    assert counts["jit(gradients)"] == 2
    assert counts["jit(update)"] == 1
    # Evaluation batches of 32 over 80 validation rows: 3 batches, padded to at most 3 lengths over both folds.
    assert 1 <= counts["jit(predict_step)"] <= 3


def test_without_threads_nothing_compiles_ahead(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    fn = Ahead(jax.jit(lambda x: x + 1))
    fn.ahead(jnp.ones(3))
    assert fn.threads == 0 and fn.compiled() == 0
    np.testing.assert_array_equal(np.asarray(fn(jnp.ones(3))), 2.0)
    assert fn.compiled() == 1


def test_a_program_compiled_ahead_is_traced_under_the_run_mesh_of_who_asked():
    # A kernel each device runs on its own part (runtime/devices.py's per_device) finds the run's mesh while
    # its program is traced, in the compiling thread too.
    seen = []

    def traced(x: jax.Array) -> jax.Array:
        seen.append((threading.current_thread().name, devices._RUN_MESH.get()))
        return x * 2

    mesh = devices.make_mesh(data=8)
    fn = Ahead(jax.jit(traced), threads=1)
    with devices.run_mesh(mesh):
        fn.ahead(jax.ShapeDtypeStruct((8,), jnp.float32))
        np.testing.assert_array_equal(np.asarray(fn(jnp.ones(8))), 2.0)
    assert [(name.startswith("compile"), m) for name, m in seen] == [(True, mesh)]
    assert devices._RUN_MESH.get() is None
