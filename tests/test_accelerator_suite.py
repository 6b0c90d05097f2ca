"""benchmarks/accelerator_suite.py, so that it is known to work before an accelerator is at hand: its smoke mode
(every part with tiny models on the CPU) and its deadlines."""

from __future__ import annotations

import importlib.util
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


def test_smoke_fine_tuning_part_runs_both_systems(tmp_path):
    """The part that drives finetune_end_to_end.py's systems: outside the slow marker, since that script's options
    change more often than the step parts."""
    rows = run_suite(tmp_path, "--smoke", "--parts", "finetune-commonlit")["rows"]
    assert not [r for r in rows if "failed" in r], rows
    runs = {r["run"]: r for r in rows}
    assert set(runs) == {"first run", "warm cache", "Trainer"}
    assert runs["warm cache"]["score"] == runs["first run"]["score"]
    assert 0.0 < runs["Trainer"]["score"] <= 1.0


def test_a_part_past_its_deadline_is_written_down_and_the_rest_kept(tmp_path):
    rows = run_suite(tmp_path, "--smoke", "--parts", "pretrain-bert", "--step-deadline", "1")["rows"]
    assert len(rows) == 2 and all(r["failed"].startswith(("stopped at", "not run")) for r in rows), rows


def test_device_tests_part_runs_the_gpu_marked_tests(tmp_path):
    # On a CPU every test marked gpu skips; the part still collects and runs them, in its own pytest process.
    marked = sum(p.read_text().count("@pytest.mark.gpu") for p in SUITE.parent.parent.glob("tests/test_*.py"))
    (row,) = run_suite(tmp_path, "--smoke", "--parts", "device-tests")["rows"]
    assert row["counts"]["passed"] == row["counts"]["failed"] == row["counts"]["errors"] == 0, row
    assert row["counts"]["skipped"] >= marked > 0  # parametrized tests skip once per case
    assert row["failures"] == []
    assert "| pytest -m gpu | 0 | 0 |" in (tmp_path / "out" / "accelerator_suite.md").read_text()


def test_device_tests_read_pytest_summaries():
    spec = importlib.util.spec_from_file_location("device_tests", SUITE.parent / "device_tests.py")
    device_tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(device_tests)
    failed = "FAILED tests/test_attention.py::test_x[8] - AssertionError: NaN\n1 failed, 3 passed, 2 skipped in 12.31s"
    assert device_tests.summary(failed) == {
        "counts": {"passed": 3, "failed": 1, "skipped": 2, "errors": 0},
        "failures": ["tests/test_attention.py::test_x[8]"],
    }
    errored = "ERROR tests/test_arch_modernbert.py - ImportError\n==== 1 error in 3.02s ===="
    assert device_tests.summary(errored)["counts"]["errors"] == 1
    assert device_tests.summary(errored)["failures"] == ["tests/test_arch_modernbert.py"]
    assert device_tests.summary("no tests ran in 0.01s")["counts"] == dict.fromkeys(device_tests.OUTCOMES, 0)
