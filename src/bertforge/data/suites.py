"""Benchmark suites (GLUE, JGLUE, or a YAML file of one's own): which tasks, read from which files as each suite
distributes them, scored by which metrics, fine-tuned with which settings and learning rates.

A suite file (configs/suites/*.yaml; `--suite glue` names a shipped one):

    name: glue
    source: where the suite's files are published (named when a file is missing)
    seeds: 3                      # fine-tuning runs per task and learning rate
    max_length: 128               # the defaults of every task, each of which may set its own
    epochs: 3
    batch_size: 32
    lrs: [2.0e-5, 3.0e-5, 5.0e-5] # each task's learning rate is chosen by its mean validation score
    tasks:
      cola:                       # the name --tasks takes: lower case, no punctuation
        name: CoLA                # as the suite's leaderboard writes it
        task: classification      # a `finetune --task`
        train: CoLA/train.tsv     # under the suite's --data folder
        valid: CoLA/dev.tsv
        columns: [source, label, original_label, sentence]   # a table without a header: its columns
        text: sentence
        target: label
        metrics: [matthews]       # the validation metrics reported; the first chooses the learning rate
      mnli:
        ...
        also: {mismatched: MNLI/dev_mismatched.tsv}          # more validation sets, scored by the same model
        metrics: [accuracy, mismatched_accuracy]             # a set's metrics as <set>_<metric>

A task's score is the mean of its metrics' means over seeds (in percent); the suite's average is the mean of its
tasks' scores, as GLUE's leaderboard computes it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from bertforge.config import from_dict, read_yaml
from bertforge.data import tabular
from bertforge.errors import UserError
from bertforge.train.metrics import HIGHER_IS_BETTER

SHIPPED = Path(__file__).resolve().parent.parent / "configs" / "suites"
TASK_TYPES = ("classification", "regression", "similarity", "question-answering", "multiple-choice")
# Tasks whose data is a table of texts and a target column, whose columns a suite names.
TABLE_TASKS = ("classification", "regression", "similarity")
# Tasks whose metrics finetune reports in percent already (SQuAD's rules); the others' are fractions.
PERCENT_TASKS = ("question-answering",)


@dataclasses.dataclass(frozen=True)
class SuiteTask:
    name: str  # as the suite's leaderboard writes it
    task: str  # a finetune --task
    train: str  # the training file, relative to the suite's data folder
    valid: str  # the validation file whose main metric chooses the learning rate
    metrics: tuple[str, ...]  # validation metrics; <set>_<metric> for a set of `also`
    also: dict = dataclasses.field(default_factory=dict)  # set name -> another validation file
    columns: tuple[str, ...] = ()  # a headerless table's columns, in order
    text: str | None = None  # the text column (a pair's first)
    pair: str | None = None  # a pair's second text column
    target: str | None = None  # the label or score column
    max_length: int | None = None  # the suite's when not given
    epochs: float | None = None
    batch_size: int | None = None
    lrs: tuple[float, ...] = ()
    seeds: int | None = None  # runs per learning rate (default: the suite's)

    def __post_init__(self) -> None:
        if self.task not in TASK_TYPES:
            raise ValueError(f"task {self.task!r} is not one of {', '.join(TASK_TYPES)}")
        if not self.metrics:
            raise ValueError("metrics: name at least one")
        for metric in self.metrics:
            base = metric.split("_", 1)[1] if metric.split("_", 1)[0] in self.also else metric
            if not HIGHER_IS_BETTER.get(base, False):
                raise ValueError(f"metric {metric!r}: a suite's metrics are scores where higher is better "
                                 f"({', '.join(m for m, up in HIGHER_IS_BETTER.items() if up)})")  # fmt: skip
        if not all(isinstance(v, str) for v in self.also.values()):
            raise ValueError("also: each set's file must be a path")
        scored = {m.split("_", 1)[0] for m in self.metrics}
        if set(self.also) - scored:
            raise ValueError(f"each set of also ({', '.join(self.also)}) needs a metric named <set>_<metric>")
        check_settings(self.seeds, self.max_length, self.epochs, self.batch_size, self.lrs)
        if self.task in TABLE_TASKS and (self.text is None or self.target is None):
            raise ValueError(f"a {self.task} task needs its text and target columns")
        for column in (self.text, self.pair, self.target):
            if self.columns and column is not None and column not in self.columns:
                raise ValueError(f"column {column!r} is not one of columns ({', '.join(self.columns)})")

    @property
    def percent(self) -> bool:
        return self.task in PERCENT_TASKS


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    source: str  # where its files are published
    tasks: dict  # short name -> SuiteTask (built by load_suite)
    seeds: int = 3
    max_length: int = 128
    epochs: float = 3.0
    batch_size: int = 32
    lrs: tuple[float, ...] = (2e-5, 3e-5, 5e-5)
    path: str = ""  # the file it was read from

    def __post_init__(self) -> None:
        check_settings(self.seeds, self.max_length, self.epochs, self.batch_size, self.lrs)
        if not self.lrs:
            raise ValueError("lrs: give at least one learning rate")

    def settings(self, short: str) -> dict[str, Any]:
        """The fine-tuning settings of a task: its own, else the suite's."""
        task = self.tasks[short]
        pick = lambda mine, suite: suite if mine in (None, ()) else mine  # noqa: E731
        return {"max_length": pick(task.max_length, self.max_length), "epochs": pick(task.epochs, self.epochs),
                "batch_size": pick(task.batch_size, self.batch_size), "lrs": pick(task.lrs, self.lrs)}  # fmt: skip


def check_settings(seeds: int | None, max_length: int | None, epochs: float | None, batch_size: int | None,
                    lrs: tuple[float, ...]) -> None:  # fmt: skip
    """A suite's or a task's fine-tuning settings, each positive where given."""
    for name, value in (("seeds", seeds), ("max_length", max_length), ("epochs", epochs), ("batch_size", batch_size)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if any(not lr > 0 for lr in lrs):
        raise ValueError(f"lrs must be positive, got {list(lrs)}")


def suite_path(suite: str) -> Path:
    """A suite's file: a path, or the name of a shipped suite (glue, jglue)."""
    if suite.endswith((".yaml", ".yml")) or "/" in suite:
        return Path(suite)
    path = SHIPPED / f"{suite}.yaml"
    if not path.exists():
        shipped = ", ".join(sorted(p.stem for p in SHIPPED.glob("*.yaml")))
        raise UserError(f"no suite named {suite!r} (shipped: {shipped}; or give a YAML file)")
    return path


def load_suite(suite: str) -> Suite:
    """A suite by name or file, checked: unknown keys, wrong types and missing columns name the file and key."""
    path = suite_path(suite)
    data = read_yaml(path)
    tasks = data.pop("tasks", None)
    if not isinstance(tasks, dict) or not tasks:
        raise UserError(f"{path}: 'tasks' must map each task's short name to its settings")
    try:
        built = {str(k): from_dict(SuiteTask, v, f"tasks.{k}") for k, v in tasks.items()}
        return from_dict(Suite, {**data, "tasks": built, "path": str(path)})
    except UserError as e:
        raise UserError(f"{path}: {e}") from None


def pick_tasks(suite: Suite, names: str | None) -> list[str]:
    """The tasks --tasks names (comma-separated short names), in the suite's order; all when None."""
    if not names:
        return list(suite.tasks)
    wanted = [n.strip().lower() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in suite.tasks]
    if unknown:
        raise UserError(f"--tasks: {', '.join(unknown)} not in suite {suite.name} ({', '.join(suite.tasks)})")
    return [n for n in suite.tasks if n in wanted]


def task_files(suite: Suite, short: str, data: str) -> dict[str, Path]:
    """A task's files under the suite's data folder, by role (train, valid, each set of also); a missing one is
    one line naming it and where the suite is published."""
    task = suite.tasks[short]
    files = {"train": task.train, "valid": task.valid, **task.also}
    found = {role: Path(data) / rel for role, rel in files.items()}
    for role, path in found.items():
        if not path.is_file():
            raise UserError(f"{path}: no such file ({task.name}'s {role} file; {suite.name} is published at "
                            f"{suite.source})")  # fmt: skip
    return found


def check_table(task: SuiteTask, path: Path) -> None:
    """A table's header against the columns the task reads, one line naming what is off."""
    columns, _ = tabular.read_table(str(path))
    for column in (task.text, task.pair, task.target):
        if column is not None and column not in columns:
            raise UserError(f"{path}: no column {column!r} ({task.name} reads it; the file has "
                            f"{', '.join(map(repr, columns))})")  # fmt: skip


def read_headerless(task: SuiteTask, path: Path) -> list[dict[str, str]]:
    """A tab-separated table without a header (CoLA's) as rows of the task's columns."""
    return tabular.read_table(str(path), columns=task.columns)[1]
