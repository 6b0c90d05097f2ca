"""Where metrics go: a JSONL file in RUN, TensorBoard event files, Weights & Biases when asked, a progress bar.

Only process 0 writes. Secrets never reach the logs: W&B reads its key from its own environment.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
from tqdm.auto import tqdm

from bertforge.errors import UserError
from bertforge.fileio import finite_json, nan_for_null, write_atomic

METRICS = "metrics.jsonl"


@dataclasses.dataclass(frozen=True)
class LogConfig:
    every: int = 10
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "bertforge"
    progress: bool | None = None  # None: a bar when stderr is a terminal


class MetricsLog:
    def __init__(
        self,
        run_dir: str | Path,
        cfg: LogConfig,
        total_steps: int | None,
        start_step: int,
        config: dict[str, Any] | None = None,  # the run's whole config, for W&B
    ):
        self.main = jax.process_index() == 0
        self.path = Path(run_dir) / METRICS
        self.tb = self.wandb = None
        self.bar = None
        if not self.main:
            return
        if self.path.exists():
            # A resumed run continues the file: entries past the restored step are from the lost attempt.
            kept = [line for line in self.path.read_text().splitlines() if _step_of(line) <= start_step]
            write_atomic(self.path, "".join(line + "\n" for line in kept))
        if cfg.tensorboard:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=start_step + 1)
        if cfg.wandb:
            try:
                import wandb as wandb_lib
            except ImportError:
                raise UserError("log.wandb is true but wandb is not installed (pip install wandb)") from None
            self.wandb = wandb_lib.init(project=cfg.wandb_project, dir=str(run_dir), config=config, resume="allow")
        show = sys.stderr.isatty() if cfg.progress is None else cfg.progress
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", disable=not show, dynamic_ncols=True)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.main:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a") as fh:
            fh.write(finite_json(record) + "\n")  # an undefined metric (NaN) as null
        if self.tb is not None:
            at = int(record.get("suite_step", step))  # a suite's scores at the step of the model it scored
            for k, v in record.items():
                if k not in ("step", "suite_step") and isinstance(v, (int, float)) and math.isfinite(v):
                    name = k.replace("_", "/", 1) if k.startswith(("train_", "valid_", "suite_")) else k
                    self.tb.add_scalar(name, v, at)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(record, step=step)

    def record(self, step: int, metrics: dict[str, float], shown: Sequence[str]) -> None:
        """Write `metrics`, and show those of `shown` that it has (and the throughput) beside the progress bar."""
        self.write(step, metrics)
        postfix = {k: f"{metrics[k]:.4g}" for k in shown if k in metrics}
        if "tokens_per_s" in metrics:
            postfix["tok/s"] = f"{metrics['tokens_per_s']:,.0f}"
        self.progress(step, postfix)

    def progress(self, step: int, postfix: dict[str, str]) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(postfix, refresh=True)

    def message(self, text: str) -> None:
        if not self.main:
            return
        if self.bar is not None and not self.bar.disable:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _plain(v: Any) -> Any:
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS
    lines = [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    if lines and _step_of(lines[-1]) == 1 << 62:
        lines.pop()  # torn by a kill during the append; the next run drops it too
    return [nan_for_null(json.loads(line)) for line in lines]
