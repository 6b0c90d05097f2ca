"""The fault suite: kills, damaged files, full disks, hostile inputs, security.

Each test says through `tally(kind, n)` how many faults it tried; they count as handled when the test passes. The
totals are printed at the end of the run and written as JSON to $BERTFORGE_FAULT_REPORT when it is set. CI runs
the fast subset (`-m "not slow"`); `make faults` runs all of it (20 seeds per kill).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
KINDS = {
    "kill": "kills survived",
    "corruption": "corruptions detected",
    "disk": "full disks handled",
    "hostile": "hostile inputs handled",
    "security": "security checks held",
}
SEEDS = 20
_tried: Counter = Counter()
_held: Counter = Counter()


def seeds(fast: int = 1) -> list:
    """Seeds 0..SEEDS-1; all but the first `fast` are marked slow."""
    return [pytest.param(s, marks=() if s < fast else pytest.mark.slow) for s in range(SEEDS)]


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def tally(request):
    pending: Counter = Counter()

    def add(kind: str, n: int = 1) -> None:
        assert kind in KINDS, kind
        pending[kind] += n

    yield add
    passed = getattr(request.node, "report_call", None) is not None and request.node.report_call.passed
    for kind, n in pending.items():
        _tried[kind] += n
        _held[kind] += n if passed else 0


def pytest_terminal_summary(terminalreporter):
    if not _tried:
        return
    terminalreporter.section("faults")
    for kind, words in KINDS.items():
        if _tried[kind]:
            terminalreporter.write_line(f"{words}: {_held[kind]} / {_tried[kind]}")
    if os.environ.get("BERTFORGE_FAULT_REPORT"):
        report = {kind: {"held": _held[kind], "tried": _tried[kind]} for kind in KINDS if _tried[kind]}
        Path(os.environ["BERTFORGE_FAULT_REPORT"]).write_text(json.dumps(report, indent=2) + "\n")


# ------------------------------------------------------------------------------------------------------ processes
def bertforge(*args: str) -> list[str]:
    return [sys.executable, "-m", "bertforge.cli", *args]


def killer(spec: str, *args: str) -> list[str]:
    return [sys.executable, str(HERE / "killer.py"), spec, "--", *args]


def run_ok(cmd: list[str], timeout: float = 300) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def run_killed(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a command that is expected to be killed (by killer.py or by `kill_when`)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == -signal.SIGKILL, f"not killed (exit {proc.returncode}): {proc.stderr[-3000:]}"
    return proc


def kill_when(cmd: list[str], ready, delay: float, timeout: float = 300) -> None:
    """Start `cmd`, wait until ready() holds, then `delay` seconds more, then SIGKILL it."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"finished before the kill (exit {proc.returncode}): {proc.stderr.read()[-3000:]}")
        assert time.time() < deadline, "too slow"
        time.sleep(0.02)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def rng(name: str, seed: int) -> random.Random:
    return random.Random(f"{name}-{seed}")
