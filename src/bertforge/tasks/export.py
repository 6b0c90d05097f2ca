"""`bertforge export RUN`: a pretraining run's weights as a Hugging Face folder (config, safetensors, tokenizer)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from bertforge import runs
from bertforge.model.hf import save_pretrained


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    run: str  # run folder
    out: str  # Hugging Face folder to write
    step: str = "latest"  # latest, best, or a step number


def main(cfg: ExportConfig) -> Path:
    """Export RUN's model at checkpoint `step` ('latest', 'best' or a step) into `out`, with the run's run.json
    (and where it lies) as bertforge.json."""
    run, out, which = cfg.run, cfg.out, cfg.step
    pre = runs.load_run(run, which)
    info = runs.read_info(run) or {}
    provenance = json.dumps({"run": str(Path(run).absolute()), **info}, indent=2) + "\n"
    return save_pretrained(pre.model, out, pre.tokenizer, extra_files={"bertforge.json": provenance})
