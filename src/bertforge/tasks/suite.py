"""`bertforge suite`: fine-tune one encoder on every task of a suite (GLUE, JGLUE or a YAML file), for each
learning rate of its grid and each seed, and write the scoreboard.

Each (task, learning rate, seed) is a unit: a `bertforge finetune` process on the task's files as the suite
distributes them (a headerless table is written once as JSON lines with its columns named), then a `bertforge
evaluate` on each further validation set (MNLI's mismatched one). A unit's result, unit.json, is written whole once
its processes have finished, and its model folders are removed then (unless --keep-models). A suite run again skips
the units that have their result; a unit that was running resumes where its finetune stopped, as finetune does.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bertforge.data.suites import (
    TABLE_TASKS,
    Suite,
    check_settings,
    check_table,
    load_suite,
    pick_tasks,
    read_headerless,
    task_files,
)
from bertforge.errors import UserError
from bertforge.fileio import finite_json, read_json_object, write_atomic
from bertforge.tasks import scoreboard, suite_units


@dataclasses.dataclass(frozen=True)
class SuiteConfig:
    suite: str  # a shipped suite (glue, jglue) or a suite YAML file
    data: str  # the folder that holds the suite's files as it distributes them (GLUE: CoLA/, SST-2/, ...)
    model: str  # the encoder: a Hugging Face folder, hub id, or a bertforge pretraining run
    out: str  # the suite's folder: units/, data/, scoreboard.json, .md and .png
    tasks: str = ""  # comma-separated short names (cola, sst2, stsb, jsts, ...); default every task
    seeds: int | None = None  # runs per task and learning rate (default: the suite's)
    lrs: tuple[float, ...] = ()  # the learning rates tried per task (default: the suite's, or the task's)
    keep_models: bool = False  # keep each unit's fine-tuned model folder
    # Units at once: "" one at a time on every device; "0,1,2,3" one per GPU id (an id twice: two units share it);
    # "all" one per GPU the machine has.
    devices: str = ""

    def __post_init__(self) -> None:
        check_settings(self.seeds, None, None, None, self.lrs)
        suite_units.device_slots(self.devices, count=lambda: 0)  # the ids checked before any unit runs


@dataclasses.dataclass(frozen=True)
class Unit:
    task: str  # the short name
    lr: float
    seed: int

    def folder(self, out: Path) -> Path:
        return out / "units" / self.task / f"lr{self.lr:g}-seed{self.seed}"


class Stopped(Exception):
    """A unit's process stopped on a signal after saving its checkpoint (exit 143): run the suite again."""


Runner = Callable[[list[str], Path, dict[str, str]], int]  # (command, log file, environment added) -> exit status


def prepared_files(suite: Suite, short: str, data: str, out: Path) -> dict[str, Path]:
    """A task's files by role, checked; a headerless table written once as JSON lines with its columns named."""
    task = suite.tasks[short]
    files = task_files(suite, short, data)
    if task.task not in TABLE_TASKS:
        return files
    for role, path in files.items():
        if not task.columns:
            check_table(task, path)
            continue
        target = out / "data" / short / f"{role}.jsonl"
        if not target.exists():  # read, and so checked, once: the rows written are the file's
            rows = read_headerless(task, path)
            target.parent.mkdir(parents=True, exist_ok=True)
            # ASCII JSON: a line separator (U+2028) inside a sentence stays inside its line.
            write_atomic(target, "".join(json.dumps(r) + "\n" for r in rows))
        files[role] = target
    return files


def finetune_command(suite: Suite, unit: Unit, files: dict[str, Path], model: str, overrides: Sequence[str],
                     folder: Path) -> list[str]:  # fmt: skip
    """The unit's `bertforge finetune` command line."""
    task, settings = suite.tasks[unit.task], suite.settings(unit.task)
    cmd = [sys.executable, "-m", "bertforge.cli", "finetune", "--model", model, "--out", str(folder / "run"),
           "--task", task.task, "--data", str(files["train"]), "--valid-data", str(files["valid"]),
           "--max-length", str(settings["max_length"]), f"--train.epochs={settings['epochs']}",
           f"--train.batch_size={settings['batch_size']}", f"--optim.lr={unit.lr}", f"--train.seed={unit.seed}",
           "--log.progress=false"]  # fmt: skip
    for flag, column in (("--text-column", task.text), ("--text-pair-column", task.pair),
                         ("--target-column", task.target)):  # fmt: skip
        cmd += [flag, column] if column else []
    chosen = task.metrics[0]
    if chosen.split("_", 1)[0] not in task.also:  # the best checkpoint by the main metric, unless another set's
        cmd.append(f"--head.metric={chosen}")
    return cmd + list(overrides)


def run_unit(suite: Suite, unit: Unit, files: dict[str, Path], model: str, overrides: Sequence[str], out: Path,
             runner: Runner, env: dict[str, str]) -> dict[str, Any]:  # fmt: skip
    """Fine-tune the unit and score it on each further validation set, its processes in `env` (the devices it
    may use); its metrics (<set>_<metric> for those)."""
    folder = unit.folder(out)
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "log.txt"
    _run(runner, finetune_command(suite, unit, files, model, overrides, folder), log, unit, env)
    found = dict(read_json_object(folder / "run" / "summary.json")["out_of_fold"])
    for name in suite.tasks[unit.task].also:
        scores = folder / f"{name}.json"
        cmd = [sys.executable, "-m", "bertforge.cli", "evaluate", "--model", str(folder / "run"),
               "--data", str(files[name]), "--out", str(scores)]  # fmt: skip
        _run(runner, cmd, log, unit, env)
        found.update({f"{name}_{k}": v for k, v in read_json_object(scores).items() if isinstance(v, (int, float))})
    return found


def _run(runner: Runner, cmd: list[str], log: Path, unit: Unit, env: dict[str, str]) -> None:
    code = runner(cmd, log, env)
    if code == 143:
        raise Stopped(f"{unit.task} lr {unit.lr:g} seed {unit.seed} stopped with its checkpoint saved")
    if code != 0:
        last = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
        said = f": {last[-1]}" if last else ""
        raise UserError(f"{unit.task} lr {unit.lr:g} seed {unit.seed}: `bertforge {cmd[3]}` failed (exit {code})"
                        f"{said} (its log: {log})")  # fmt: skip


def _result(suite: Suite, unit: Unit, metrics: dict[str, Any]) -> dict[str, Any]:
    """unit.json's content, once the suite's metrics of the task are all there."""
    missing = [m for m in suite.tasks[unit.task].metrics if not isinstance(metrics.get(m), (int, float))]
    if missing:
        raise UserError(f"{suite.path}: tasks.{unit.task}.metrics: {', '.join(missing)} not among what fine-tuning "
                        f"reports ({', '.join(sorted(metrics))})")  # fmt: skip
    return {"task": unit.task, "lr": unit.lr, "seed": unit.seed, "metrics": metrics}


def _drop_models(folder: Path) -> None:
    for model in (folder / "run").glob("fold-*/model"):
        shutil.rmtree(model, ignore_errors=True)


def units_of(suite: Suite, cfg: SuiteConfig, names: Sequence[str]) -> list[Unit]:
    """Every (task, learning rate, seed) of the run, task by task."""
    return [Unit(short, lr, seed) for short in names for lr in (cfg.lrs or suite.settings(short)["lrs"])
            for seed in range(cfg.seeds or suite.tasks[short].seeds or suite.seeds)]  # fmt: skip


def _lr_and_seed(cfg: SuiteConfig, overrides: Sequence[str]) -> tuple[SuiteConfig, list[str]]:
    """--optim.lr=X among the overrides is the one learning rate of every task (as --lrs X); a seed is the suite's
    to set (--seeds)."""
    if any(o.startswith("--train.seed=") for o in overrides):
        raise UserError("--train.seed: a suite runs seeds 0 to N-1 of each task; give --seeds N")
    rates = [o.split("=", 1)[1] for o in overrides if o.startswith("--optim.lr=")]
    if not rates:
        return cfg, list(overrides)
    try:
        lr = float(rates[-1])
    except ValueError:
        raise UserError(f"--optim.lr={rates[-1]}: not a number") from None
    return dataclasses.replace(cfg, lrs=(lr,)), [o for o in overrides if not o.startswith("--optim.lr=")]


def main(cfg: SuiteConfig, overrides: Sequence[str] = (), runner: Runner | None = None) -> dict[str, Any]:
    """Run every unit not finished yet, one at a time or several at once over cfg.devices, then write the
    scoreboard of the tasks run; returns it."""
    cfg, overrides = _lr_and_seed(cfg, overrides)
    suite = load_suite(cfg.suite)
    names = pick_tasks(suite, cfg.tasks)
    out = Path(cfg.out)
    files = {short: prepared_files(suite, short, cfg.data, out) for short in names}
    processes = suite_units.Processes()

    def one(unit: Unit, env: dict[str, str]) -> tuple[dict[str, Any], str]:
        done = unit.folder(out) / "unit.json"
        start = time.perf_counter()
        if done.exists():
            return read_json_object(done), "finished before"
        metrics = run_unit(suite, unit, files[unit.task], cfg.model, overrides, out, runner or processes.run, env)
        result = _result(suite, unit, metrics)
        write_atomic(done, finite_json(result, indent=2) + "\n")
        return result, f"{time.perf_counter() - start:.0f} s"

    def finished(unit: Unit, found: tuple[dict[str, Any], str]) -> None:
        if not cfg.keep_models:
            _drop_models(unit.folder(out))
        main_metric = suite.tasks[unit.task].metrics[0]
        print(f"{unit.task} lr {unit.lr:g} seed {unit.seed}: {main_metric} {found[0]['metrics'][main_metric]:.4f} "
              f"({found[1]})", flush=True)  # fmt: skip

    units = units_of(suite, cfg, names)
    with processes.forwarding():
        found = suite_units.run_all(units, one, suite_units.device_slots(cfg.devices), finished,
                                    interrupted=lambda: processes.send(signal.SIGINT))  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {short: [] for short in names}
    for unit, (result, _) in zip(units, found, strict=True):
        results[unit.task].append(result)
    board = scoreboard.scoreboard(suite, cfg.model, results)
    scoreboard.write(board, out)
    return board
