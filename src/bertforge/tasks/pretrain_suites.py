"""Downstream scores while pretraining: at every `eval.suite_every` steps the model is exported to
RUN/suites/step-N/model and `bertforge suite` fine-tunes it on `eval.suite` in a process of its own, so that the
training loop does not wait; each suite's scoreboard, once written, is logged beside the loss (metrics.jsonl,
TensorBoard, W&B) as `suite_average` and `suite_<task>` with the `suite_step` it scored.

A run continued after a kill logs the scoreboards its suites wrote meanwhile and starts again those that had not
finished (a suite resumes its own units). The last suites are waited for at the end of the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bertforge.data.suites import load_suite, task_files
from bertforge.errors import UserError
from bertforge.fileio import read_json_object, write_atomic, write_folder_atomic
from bertforge.tasks.suite_units import dying_with

FOLDER = "suites"
LOGGED = "logged.json"  # the suite steps whose scores metrics.jsonl has


def check(suite: str, data: str, every: int, checkpoint_every: int) -> None:
    """eval.suite's settings and files, before training starts: a mistake is one line now, not in an hour."""
    if not data or every < 1:
        raise UserError("eval.suite needs eval.suite_data (the suite's data folder) and eval.suite_every (steps)")
    if every % checkpoint_every:
        raise UserError(f"eval.suite_every ({every}) must be a multiple of checkpoint.every ({checkpoint_every})")
    found = load_suite(suite)
    for short in found.tasks:
        task_files(found, short, data)


def suite_metrics(board: dict[str, Any], step: int) -> dict[str, float]:
    """What a scoreboard adds to the log: its average and each task's score, with the step whose model it scored."""
    return {"suite_step": step, "suite_average": board["average"],
            **{f"suite_{task}": entry["score"] for task, entry in board["tasks"].items()}}  # fmt: skip


class SuiteRuns:
    """The suites of one pretraining run: started at their steps, polled at every log line, waited for at the end."""

    def __init__(self, suite: str, data: str, run_dir: Path, write: Callable[[int, dict], None],
                 say: Callable[[str], None]) -> None:  # fmt: skip
        self.suite, self.data = suite, data
        self.root, self.write, self.say = Path(run_dir) / FOLDER, write, say
        self.running: dict[int, subprocess.Popen] = {}
        self.logged: list[int] = self._read_logged()

    def start(self, step: int, export: Callable[[Path], None]) -> None:
        """Export the model of `step` (`export` writes a Hugging Face folder) and start its suite, unless a run
        before this one did (a continued run saves again at the step it resumed from)."""
        if (self.root / f"step-{step}" / "model").is_dir():
            return
        write_folder_atomic(self.root / f"step-{step}" / "model", export)
        self._launch(step)

    def _launch(self, step: int) -> None:
        folder = self.root / f"step-{step}"
        cmd = [sys.executable, "-m", "bertforge.cli", "suite", "--suite", self.suite, "--data", self.data,
               "--model", str(folder / "model"), "--out", str(folder)]  # fmt: skip
        with open(folder / "log.txt", "ab") as log:
            self.running[step] = subprocess.Popen(dying_with(os.getpid(), cmd), stdout=log, stderr=subprocess.STDOUT)
        self.say(f"step {step}: fine-tuning it on {self.suite} in the background (log: {folder / 'log.txt'})")

    def resume(self, now: int) -> None:
        """After a restart: log the scoreboards written meanwhile, start again the suites that had not finished."""
        for folder in sorted(self.root.glob("step-*"), key=lambda p: int(p.name[5:])):
            step = int(folder.name[5:])
            if step in self.logged or not (folder / "model").is_dir():
                continue
            if (folder / "scoreboard.json").exists():
                self._log(step, now)
            else:
                self._launch(step)

    def poll(self, now: int) -> None:
        """Log the suites that have finished since the last look."""
        for step, proc in list(self.running.items()):
            if proc.poll() is None:
                continue
            del self.running[step]
            if proc.returncode == 0:
                self._log(step, now)
            else:
                log = self.root / f"step-{step}" / "log.txt"
                self.say(f"the suite of step {step} failed (exit {proc.returncode}); its log: {log}")

    def finish(self, now: int) -> None:
        """The end of training: wait for the suites still running, then log them."""
        if self.running:
            self.say(f"waiting for the suites of step(s) {', '.join(map(str, self.running))} to finish")
        for proc in self.running.values():
            proc.wait()
        self.poll(now)

    def _log(self, step: int, now: int) -> None:
        board = read_json_object(self.root / f"step-{step}" / "scoreboard.json")
        self.write(now, suite_metrics(board, step))
        self.logged.append(step)
        write_atomic(self.root / LOGGED, json.dumps(sorted(self.logged)) + "\n")

    def _read_logged(self) -> list[int]:
        path = self.root / LOGGED
        return list(json.loads(path.read_text())) if path.exists() else []
