"""The results index: benchmarks/results/index.jsonl, one JSON object a line, one line per system per benchmark run.
Every table in README.md and docs/ is rendered from it (report.py), never typed.

A line holds at least:
- `benchmark` (the script's name), `recipe` (what the script ran: task, data, model, lengths, epochs),
- `run` (one id for the lines of one run of a script), `commit`, `date`, `machine` (the CPU's model string as
  /proc/cpuinfo gives it, with its family, model and core count; or the GPU's as nvidia-smi gives it),
- `system` (`bertforge`, or the reference's name), `variant` (a reference's `shipped` or `tuned`; bertforge's
  precision and options), `cache` (`cold`: bertforge's compile cache empty at each run, the cost of a first run;
  `warm`), `seeds`,
- `wall_s` (the median over the seeds of the whole process's wall time), `metric`, `value` (its median),
  and per seed `wall_s_by_seed`, `value_by_seed`, in the order of `seeds`.
Where a benchmark measures a speed rather than a time, `wall_s` is null and `metric` names the speed.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import uuid
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
# BENCH_INDEX names another file (a trial run's, a test's).
INDEX = Path(os.environ.get("BENCH_INDEX") or RESULTS / "index.jsonl")
CODE = ("src", "benchmarks/*.py", "configs", "pyproject.toml")  # what a result depends on, for `commit`
REQUIRED = ("benchmark", "recipe", "run", "commit", "date", "machine", "system", "variant", "cache", "seeds",
            "wall_s", "metric", "value")  # fmt: skip


def cpu_machine(cpuinfo: str | None = None) -> str:
    """'<model name>, family F model M, N cores' from /proc/cpuinfo's text (read when None): CPUs of one model name
    (an "AMD EPYC" of three generations) run XLA and PyTorch at different relative speeds."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8")
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name", "unknown CPU")
    cores = sum(1 for text in cpuinfo.splitlines() if text.startswith("processor")) or os.cpu_count()
    family = f", family {fields['cpu family']} model {fields['model']}" if "cpu family" in fields else ""
    return f"{name}{family}, {cores} cores"


def gpu_machine() -> str | None:
    """The first GPU's name as nvidia-smi gives it, or None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, check=False, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = out.stdout.strip().splitlines() if out.returncode == 0 else []
    return names[0].strip() if names else None


def commit() -> str:
    """The checkout's commit (short), with '+changes' when the code a benchmark runs (the package, the benchmark
    scripts, the configs, pyproject.toml) differs from it."""
    root = Path(__file__).resolve().parent.parent
    git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, check=False)  # noqa: E731
    head = git("rev-parse", "--short=10", "HEAD").stdout.strip() or "unknown"
    return head + (
        "+changes" if git("status", "--porcelain", "--untracked-files=no", "--", *CODE).stdout.strip() else ""
    )


def summarise(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """`wall_s` and `value` as medians of the seeds' (each a dict with seed, wall_s, value), with the per-seed
    lists."""
    seeds = [r["seed"] for r in per_seed]
    walls = [r["wall_s"] for r in per_seed]
    values = [r["value"] for r in per_seed]
    return {"seeds": seeds, "wall_s": statistics.median(walls), "value": statistics.median(values),
            "wall_s_by_seed": walls, "value_by_seed": values}  # fmt: skip


def line(benchmark: str, recipe: str, system: str, variant: str, cache: str, metric: str, per_seed: list[dict],
         machine: str | None = None, **extra: Any) -> dict[str, Any]:  # fmt: skip
    """One index line of a system's runs (`per_seed`: seed, wall_s, value), the run's id and commit added by
    `append`."""
    return {"benchmark": benchmark, "recipe": recipe, "machine": machine or cpu_machine(), "system": system,
            "variant": variant, "cache": cache, "metric": metric, **summarise(per_seed), **extra}  # fmt: skip


def run_lines(benchmark: str, recipe: str, metric: str, rows: list[dict], seeds: list[int], cache: str,
              machine: str | None = None, value: str = "score", name: Any = None,
              by_seed: tuple[str, ...] = ()) -> list[dict[str, Any]]:  # fmt: skip
    """A run's lines, one per system: `rows` are a benchmark's rows (system, seed, wall_s, `value`, variant,
    evaluations, steps_s and eval_s where it has them), of which those of `seeds` count; `name(system)` is the
    system's name in the index (default: as it is); `by_seed`: row fields kept as per-seed lists."""
    out = []
    ran = [r for r in rows if r["seed"] in seeds]
    for system in dict.fromkeys(r["system"] for r in ran):
        rs = [r for r in ran if r["system"] == system]
        per_seed = [{"seed": r["seed"], "wall_s": r["wall_s"], "value": r[value]} for r in rs]
        medians = {k: statistics.median(r[k] for r in rs) for k in ("steps_s", "eval_s") if all(k in r for r in rs)}
        extra = {f"{k}_by_seed": [r[k] for r in rs] for k in by_seed}
        out.append(line(benchmark, recipe, name(system) if name else system, rs[0].get("variant", ""), cache, metric,
                        per_seed, machine, evaluations=rs[0].get("evaluations"), **medians, **extra))  # fmt: skip
    return out


def append(lines: list[dict[str, Any]], index: Path | None = None) -> None:
    """Add `lines` (one run's) to the index, each with the run's id, commit and date."""
    index = index or INDEX
    stamp = {"run": uuid.uuid4().hex[:12], "commit": commit(), "date": datetime.date.today().isoformat()}
    index.parent.mkdir(parents=True, exist_ok=True)
    with open(index, "a", encoding="utf-8") as fh:
        for entry in lines:
            full = {**stamp, **entry}
            missing = [k for k in REQUIRED if k not in full]
            if missing:
                raise ValueError(f"an index line lacks {', '.join(missing)}: {entry}")
            fh.write(json.dumps(full, ensure_ascii=False) + "\n")


def read(index: Path | None = None) -> list[dict[str, Any]]:
    """Every line of the index, in the order written."""
    index = index or INDEX
    if not index.exists():
        return []
    out = []
    for number, text in enumerate(index.read_text(encoding="utf-8").splitlines(), 1):
        if text.strip():
            try:
                out.append(json.loads(text))
            except json.JSONDecodeError as e:
                raise ValueError(f"{index}:{number}: not a JSON line ({e.msg})") from None
    return out
