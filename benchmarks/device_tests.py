"""The tests marked `gpu` (`pytest -m gpu`), run on the device at hand: the accelerator suite's device-tests part.

They compare what only an accelerator computes (cuDNN's fused attention, the bf16 model on it) with the formula; on
a CPU they skip. A GPU-only fault (cuDNN's backward giving NaN to a query that sees no key) is found by them in the
first call on a lent device, before a benchmark trips over it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)\b")
OUTCOMES = ("passed", "failed", "skipped", "errors")


def marked_files(tests: Path = TESTS) -> list[Path]:
    """The test files with a test marked gpu: the only ones collected (collecting every file imports minutes)."""
    return sorted(p for p in tests.glob("test_*.py") if "pytest.mark.gpu" in p.read_text(encoding="utf-8"))


def summary(output: str) -> dict:
    """pytest -q -rfE output -> {'counts': {'passed', 'failed', 'skipped', 'errors'}, 'failures': node ids}."""
    last = next((line for line in reversed(output.splitlines()) if COUNTS.search(line)), "")
    counts = {outcome: 0 for outcome in OUTCOMES}
    for n, outcome in COUNTS.findall(last):
        key = "errors" if outcome.startswith("error") else outcome
        if key in counts:
            counts[key] += int(n)
    failures = [line.split()[1] for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return {"counts": counts, "failures": failures}


def tests_env(accelerator: bool) -> dict:
    """The tests' environment: JAX on the accelerator where there is one, taking device memory as it needs it. By
    default JAX takes 75% of a GPU's memory when it starts; the suite's step processes start their models beside
    the tests (the likeliest reason why, in the H200 run of 2026-12-04, every PyTorch step process and bertforge's
    ModernBERT one failed: those that start their first steps while the tests run)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    if accelerator:
        env["JAX_PLATFORMS"] = ""  # every platform: the GPU first
    return env


def run(timeout: float, accelerator: bool) -> dict:
    """`pytest -m gpu` over marked_files() in a fresh process, JAX on the accelerator where there is one (the
    suite's conftest otherwise pins it to the CPU): summary()'s, seconds, and the output's tail; or 'failed', why
    the run gave no counts (as the suite's other rows say it)."""
    env = tests_env(accelerator)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfE", "-p", "no:cacheprovider",
           *map(str, marked_files())]  # fmt: skip
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=TESTS.parent, env=env,
                              check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"failed": f"stopped at its deadline ({timeout:.0f} s)"}
    seconds = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    found = summary(output)
    if proc.returncode not in (0, 1) or not any(found["counts"].values()):
        return {"failed": f"pytest exited {proc.returncode}", "tail": output[-2000:], "seconds": seconds}
    return {**found, "seconds": seconds, "tail": output[-2000:]}


def table(rows: list[dict]) -> str:
    lines = ["| tests | passed | failed | skipped | errors | seconds | failing |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "counts" not in r:
            lines.append(f"| pytest -m gpu | {r['failed']} | | | | | |")
            continue
        c, failing = r["counts"], ", ".join(r["failures"]) or "-"
        lines.append(f"| pytest -m gpu | {c['passed']} | {c['failed']} | {c['skipped']} | {c['errors']} | "
                     f"{r['seconds']:.0f} | {failing} |")  # fmt: skip
    return "\n".join(lines)
