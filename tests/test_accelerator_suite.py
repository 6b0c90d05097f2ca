"""benchmarks/accelerator_suite.py, so that it is known to work before an accelerator is at hand: its smoke mode
(every part with tiny models on the CPU) and its deadlines."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parent.parent / "benchmarks" / "accelerator_suite.py"


def run_suite(tmp_path: Path, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as a user's machine
    env["BERTFORGE_COMPILE_CACHE"] = "off"  # the suite gives its fine-tuning runs their own cache
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(SUITE), "--out", str(out), "--work", str(tmp_path / "work"), *args],
                   check=True, env=env, timeout=900)  # fmt: skip
    return json.loads((out / "accelerator_suite.json").read_text())


@pytest.mark.slow  # `make slow`: a benchmark's smoke run, minutes of CPU
def test_smoke_runs_every_part(tmp_path):
    saved = run_suite(tmp_path, "--smoke")
    rows = saved["rows"]
    assert not [r for r in rows if "failed" in r], rows
    for part in ("pretrain-bert", "pretrain-modernbert", "finetune-deberta"):
        names = {r["implementation"] for r in rows if r["part"] == part and r["tokens_per_s"] > 0}
        assert {"bertforge bf16", "transformers eager bf16 autocast"} <= names, part
    runs = {r["run"]: r for r in rows if r["part"] == "finetune-commonlit"}
    assert set(runs) == {"first run", "warm cache", "Trainer"}
    # The warm run loads what the first compiled, and on a CPU computes the same numbers to the last digit.
    assert runs["warm cache"]["score"] == runs["first run"]["score"]
    assert 0.0 < runs["Trainer"]["score"] <= 1.0  # an accuracy
    table = (tmp_path / "out" / "accelerator_suite.md").read_text()
    assert "| pretrain-modernbert | 2 x 256 | bertforge bf16 |" in table
    assert (tmp_path / "out" / "accelerator_suite.png").stat().st_size > 0


@pytest.mark.slow  # `make slow`: test_same_work checks finetune_end_to_end.py's recipes in every run of the suite
def test_smoke_fine_tuning_part_runs_both_systems(tmp_path):
    """The part that drives finetune_end_to_end.py's systems."""
    rows = run_suite(tmp_path, "--smoke", "--parts", "finetune-commonlit")["rows"]
    assert not [r for r in rows if "failed" in r], rows
    runs = {r["run"]: r for r in rows}
    assert set(runs) == {"first run", "warm cache", "Trainer"}
    assert runs["warm cache"]["score"] == runs["first run"]["score"]
    assert 0.0 < runs["Trainer"]["score"] <= 1.0


def test_a_part_past_its_deadline_is_written_down_and_the_rest_kept(tmp_path):
    rows = run_suite(tmp_path, "--smoke", "--parts", "pretrain-bert", "--step-deadline", "1")["rows"]
    assert len(rows) == 3 and all(r["failed"].startswith(("stopped at", "not run")) for r in rows), rows


def test_a_failed_run_names_its_error_in_the_table(tmp_path):
    # A step process that fails (here: an attention bertforge does not have) leaves its error's line in the
    # table's cell and its error output in the JSON row, so that a run on a device says why without a rerun.
    suite = _benchmark("accelerator_suite")
    results = suite.Results(tmp_path, "CPU", float("nan"), smoke=True)
    job = {"part": "pretrain-bert", "implementation": "bertforge bf16, attention none", "impl": "jax",
           "kw": {"attention": "none"}, "shape": {"rows": 2, "seq": 16, "steps": 1}, "device": "cpu"}  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu", "BENCH_SMOKE": "1"}
    suite.run_step_job(job, env, suite.time.perf_counter() + 300, results)
    (row,) = results.rows
    assert row["failed"].startswith("failed (exit 1): ValueError: attention 'none' is not one of auto, custom"), row
    assert "Traceback" in row["stderr"]
    assert f"| {row['failed']} |" in (tmp_path / "accelerator_suite.md").read_text()


@pytest.mark.parametrize("torch_device", ["cuda", "cpu"])
def test_on_a_gpu_the_fine_tuning_part_adds_a_first_run_without_autotuning(tmp_path, monkeypatch, torch_device):
    suite = _benchmark("accelerator_suite")
    calls = []

    def bertforge(ns, out, padded, cache=None, timeout=None, xla_flags=""):
        calls.append((out.name, cache.name, xla_flags))
        return {"score": 0.5, "wall_s": 1.0, "fit_s": 1.0}

    monkeypatch.setattr(suite.e2e, "_bertforge", bertforge)
    monkeypatch.setattr(suite.e2e, "_hf", lambda *a: {"score": 0.5, "wall_s": 2.0, "fit_s": 1.0})
    args = suite.argparse.Namespace(parts=["finetune-commonlit"], work=str(tmp_path / "work"), smoke=False, epochs=1,
                                    torch_device=torch_device, model="m", data="d")  # fmt: skip
    results = suite.Results(tmp_path, "GPU", float("nan"), smoke=False)
    suite.run_e2e(args, results)
    first = [("first", "compile-cache", ""), ("warm", "compile-cache", "")]
    untuned = [("untuned", "untuned-cache", "--xla_gpu_autotune_level=0")] if torch_device == "cuda" else []
    assert calls == first + untuned
    runs = [r["run"] for r in results.rows]
    assert runs == ["first run", "warm cache"] + ([suite.NO_AUTOTUNE] if untuned else []) + ["Trainer"]


def test_last_error_takes_the_traceback_line_that_names_the_error():
    stderr = "Traceback (most recent call last):\n  File 'x.py'\nRuntimeError: CUDA error | bad\nW0101 a warning\n"
    last_error = _benchmark("accelerator_suite").last_error
    assert last_error(stderr) == "RuntimeError: CUDA error / bad"
    assert last_error("only a line\n") == "only a line"
    assert last_error("") == "no error output"
    assert last_error("ValueError: " + "x" * 300, width=20) == "ValueError: xxxxx..."


def test_device_tests_part_runs_the_gpu_marked_tests(tmp_path):
    # On a CPU every test marked gpu skips; the part still collects and runs them, in its own pytest process.
    marked = sum(p.read_text().count("@pytest.mark.gpu") for p in SUITE.parent.parent.glob("tests/test_*.py"))
    (row,) = run_suite(tmp_path, "--smoke", "--parts", "device-tests")["rows"]
    assert row["counts"]["passed"] == row["counts"]["failed"] == row["counts"]["errors"] == 0, row
    assert row["counts"]["skipped"] >= marked > 0  # parametrized tests skip once per case
    assert row["failures"] == []
    assert "| pytest -m gpu | 0 | 0 |" in (tmp_path / "out" / "accelerator_suite.md").read_text()


def test_device_tests_take_device_memory_as_they_need_it():
    # The step processes start beside the tests: a JAX process that takes 75% of the device's memory up front
    # leaves them too little for their first steps.
    device_tests = _benchmark("device_tests")
    for accelerator in (True, False):
        assert device_tests.tests_env(accelerator)["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert device_tests.tests_env(True)["JAX_PLATFORMS"] == ""


def test_device_tests_read_pytest_summaries():
    device_tests = _benchmark("device_tests")
    failed = "FAILED tests/test_attention.py::test_x[8] - AssertionError: NaN\n1 failed, 3 passed, 2 skipped in 12.31s"
    assert device_tests.summary(failed) == {
        "counts": {"passed": 3, "failed": 1, "skipped": 2, "errors": 0},
        "failures": ["tests/test_attention.py::test_x[8]"],
    }
    errored = "ERROR tests/test_arch_modernbert.py - ImportError\n==== 1 error in 3.02s ===="
    assert device_tests.summary(errored)["counts"]["errors"] == 1
    assert device_tests.summary(errored)["failures"] == ["tests/test_arch_modernbert.py"]
    assert device_tests.summary("no tests ran in 0.01s")["counts"] == dict.fromkeys(device_tests.OUTCOMES, 0)


def _benchmark(name: str):
    """A benchmarks/ script as a module (they import each other by name, so their folder goes on the path)."""
    if str(SUITE.parent) not in sys.path:
        sys.path.insert(0, str(SUITE.parent))
    return importlib.import_module(name)


def test_step_kernels_sums_a_jax_traces_stream_kernels_once():
    sk = _benchmark("step_kernels")
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "pid": 2, "tid": 8, "name": "thread_name", "args": {"name": "Stream #8(MemcpyD2D)"}},
        {"ph": "M", "pid": 2, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}},
    ]
    kernel = lambda tid, name, ts, dur: {"ph": "X", "pid": 2, "tid": tid, "name": name, "ts": ts, "dur": dur}  # noqa: E731
    events = [
        kernel(7, "nvjet_sm90_gemm", 0, 10),  # two steps of: a product, a fusion, and a copy on another stream
        kernel(7, "loop_add_fusion", 12, 4),
        kernel(8, "memcpy", 14, 6),  # overlaps the fusion by 2
        kernel(7, "nvjet_sm90_gemm", 30, 10),
        kernel(7, "loop_add_fusion", 42, 4),
        kernel(8, "memcpy", 44, 6),
        kernel(9, "dot.3", 0, 50),  # the ops line over the same time: not counted again
        {"ph": "X", "pid": 1, "tid": 1, "name": "PjitFunction", "ts": 0, "dur": 50},
    ]
    summary = sk.summarize(sk.device_events({"traceEvents": meta + events}), steps=2)
    assert summary["source"] == "device streams" and summary["events"] == 6
    assert summary["kernel_ms"] == pytest.approx(20e-3)  # (10 + 4 + 6) us a step
    assert summary["busy_ms"] == pytest.approx(18e-3)  # the 2 us of overlap counted once
    assert summary["kinds"] == pytest.approx({"matmul": 10e-3, "copy": 6e-3, "element-wise": 4e-3})
    assert [k["name"] for k in summary["top"]] == ["nvjet_sm90_gemm", "memcpy", "loop_add_fusion"]
    assert summary["top"][0]["calls"] == 1


def test_step_kernels_reads_torch_kernels_by_category():
    sk = _benchmark("step_kernels")
    events = [
        {"ph": "X", "pid": 0, "tid": 1, "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 30},
        {"ph": "X", "pid": 0, "tid": 7, "cat": "kernel", "name": "cutlass_gemm", "ts": 5, "dur": 20},
        {"ph": "X", "pid": 0, "tid": 7, "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 26, "dur": 2},
    ]
    found, source = sk.device_events({"traceEvents": events})
    assert source == "device" and [e["name"] for e in found] == ["cutlass_gemm", "Memcpy DtoD"]


@pytest.mark.slow  # `make slow`: tiny shapes on the CPU, about 90 s
def test_step_kernels_smoke_writes_a_row_for_every_variant(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    script = SUITE.parent / "step_kernels.py"
    subprocess.run([sys.executable, str(script), "--smoke", "--out", str(tmp_path)], check=True, env=env, timeout=600)
    rows = json.loads((tmp_path / "step_kernels.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == list(_benchmark("step_kernels").VARIANTS)
    assert not [r for r in rows if "failed" in r], rows
    assert all(r["step_s"] > 0 for r in rows)
    assert (tmp_path / "step_kernels.png").stat().st_size > 0
