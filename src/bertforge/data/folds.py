"""k-fold assignment: stratified by class or by binned regression target, or grouped, always seeded; and the fold
plan of a fine-tuning table."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from bertforge.data.labelled import Table
from bertforge.errors import UserError


@dataclasses.dataclass(frozen=True)
class FoldsConfig:
    k: int = 5  # number of folds
    run: str = "all"  # 'all', or fold numbers such as '0' or '0,2'
    seed: int = 42
    bins: int = 0  # bins of a regression target for stratification; 0: Sturges' rule

    def __post_init__(self) -> None:
        if self.k < 2:
            raise ValueError(f"k must be at least 2, got {self.k}")


def sturges_bins(n: int) -> int:
    """Sturges' rule, the usual number of bins for stratifying a regression target: 1 + log2(n)."""
    return int(math.floor(1 + math.log2(max(n, 1))))


def bin_targets(values: np.ndarray, bins: int) -> np.ndarray:
    """Equal-width bins of a continuous target (pandas.cut(..., bins, labels=False))."""
    values = np.asarray(values, np.float64)
    lo, hi = float(values.min()), float(values.max())
    if hi == lo:
        return np.zeros(len(values), np.int64)
    edges = np.linspace(lo, hi, bins + 1)
    return np.clip(np.searchsorted(edges, values, side="left") - 1, 0, bins - 1)


def assign_folds(
    n: int, k: int, seed: int, strata: np.ndarray | None = None, groups: np.ndarray | None = None
) -> np.ndarray:
    """(n,) fold numbers in [0, k).

    Stratified: each stratum's rows are shuffled and dealt round-robin, continuing from stratum to stratum, so each
    fold holds every stratum's rows to within one and fold sizes differ by at most one. Grouped: whole groups go to
    the fold with the fewest rows, largest groups first (stratification is then not attempted).
    """
    if not 2 <= k <= n:
        raise ValueError(f"need 2 <= folds <= rows, got {k} folds for {n} rows")
    rng = np.random.default_rng(seed)
    folds = np.empty(n, np.int64)
    if groups is not None:
        names, inverse, sizes = np.unique(np.asarray(groups), return_inverse=True, return_counts=True)
        if len(names) < k:
            raise ValueError(f"{len(names)} groups cannot fill {k} folds")
        tie = rng.permutation(len(names))
        filled = np.zeros(k, np.int64)
        group_fold = np.empty(len(names), np.int64)
        for g in np.lexsort((tie, -sizes)):
            f = int(np.argmin(filled))
            group_fold[g] = f
            filled[f] += sizes[g]
        return group_fold[inverse]
    strata = np.zeros(n, np.int64) if strata is None else np.asarray(strata)
    position = 0
    for s in rng.permutation(np.unique(strata)):
        rows = rng.permutation(np.flatnonzero(strata == s))
        folds[rows] = (position + np.arange(len(rows))) % k
        position += len(rows)
    return folds


# A task's strata (finetuning.FinetuneTask.strata): (table, folds.bins) -> the stratum of every row, or None.
Strata = Callable[[Table, int], np.ndarray | None]


def fold_plan(cfg: FoldsConfig, table: Table, strata: Strata) -> np.ndarray:
    """(N,) fold of every row, stratified on what a task's `strata` gives (its class, its binned target), or
    grouped."""
    n, k = len(table), cfg.k
    if n < k:
        raise UserError(f"{table.path}: {n} rows cannot make {k} folds (folds.k)")
    by = strata(table, cfg.bins)
    try:
        return assign_folds(n, k, cfg.seed, by, None if table.groups is None else np.array(table.groups))
    except ValueError as e:
        raise UserError(f"{table.path}: {e}") from None


def folds_to_run(cfg: FoldsConfig) -> list[int]:
    """The fold numbers `cfg.run` names."""
    if cfg.run == "all":
        return list(range(cfg.k))
    try:
        chosen = sorted({int(x) for x in cfg.run.split(",")})
    except ValueError:
        chosen = []
    if not chosen or not all(0 <= f < cfg.k for f in chosen):
        raise UserError(f"folds.run={cfg.run!r}: give 'all' or fold numbers from 0 to {cfg.k - 1}")
    return chosen


def check_classes(table: Table, folds: np.ndarray, run: list[int]) -> None:
    """Refuse a fold whose validation rows hold a class its training rows lack: the head could never predict it."""
    if table.labels is None:
        return
    for f in run:
        seen = set(table.targets[folds != f].tolist())
        for i in np.flatnonzero(folds == f):
            if int(table.targets[i]) not in seen:
                raise UserError(
                    f"{table.path}: row {i + 1}: class '{table.labels[i]}' is in the validation rows of fold {f} "
                    f"but never in its training rows; give it more rows or fewer folds (folds.k)"
                )
