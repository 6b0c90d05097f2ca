"""k-fold assignment: stratified by class or by binned regression target, or grouped, always seeded."""

from __future__ import annotations

import math

import numpy as np


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
