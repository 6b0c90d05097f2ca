"""Validation metrics of fine-tuning, on host numpy arrays: regression and classification."""

from __future__ import annotations

import numpy as np

# name -> True when larger is better
HIGHER_IS_BETTER = {
    "rmse": False,
    "mae": False,
    "pearson": True,
    "spearman": True,
    "accuracy": True,
    "f1": True,
    "matthews": True,
    "exact_match": True,
    "auc": True,
    "ndcg@10": True,
    "mrr@10": True,
    "recall@10": True,
    "recall@100": True,
    "loss": False,
}


def ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of x (N,), ties sharing their average rank: scipy.stats.rankdata's default, in numpy (scipy's
    import alone took a second of a short fine-tuning run)."""
    x = np.asarray(x, np.float64)
    order = np.argsort(x, kind="stable")
    ordered = x[order]
    starts = np.r_[True, ordered[1:] != ordered[:-1]]  # (N,) True where a group of equal values begins
    group = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)  # 0-based position of each group's first value
    count = np.diff(np.r_[first, len(x)])
    out = np.empty(len(x))
    out[order] = (first + (count + 1) / 2)[group]  # positions first+1 .. first+count, averaged
    return out


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    return float(np.clip(np.dot(a, b) / np.sqrt(np.dot(a, a) * np.dot(b, b)), -1.0, 1.0))


def _correlation(kind: str, a: np.ndarray, b: np.ndarray) -> float:
    """Pearson's or Spearman's (Pearson's of the ranks) correlation; NaN where it is undefined (fewer than 2 rows,
    a constant or non-finite column)."""
    if len(a) < 2 or np.ptp(a) == 0 or np.ptp(b) == 0 or not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return float("nan")
    return _pearson(a, b) if kind == "pearson" else _pearson(ranks(a), ranks(b))


def regression(pred: np.ndarray, target: np.ndarray) -> dict[str, float]:
    """pred, target (N,) or (N, L): RMSE and MAE over all values; correlations averaged over the L outputs."""
    pred, target = np.asarray(pred, np.float64).reshape(len(pred), -1), np.asarray(target, np.float64)
    target = target.reshape(pred.shape)
    err = pred - target
    cols = range(pred.shape[1])
    return {
        "rmse": float(np.sqrt(np.mean(err**2))),
        "mae": float(np.mean(np.abs(err))),
        "pearson": float(np.mean([_correlation("pearson", pred[:, j], target[:, j]) for j in cols])),
        "spearman": float(np.mean([_correlation("spearman", pred[:, j], target[:, j]) for j in cols])),
    }


def binary_auc(score: np.ndarray, positive: np.ndarray) -> float:
    """Area under the ROC curve: the chance that a positive outranks a negative (Mann-Whitney U)."""
    positive = np.asarray(positive, bool)
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0 or not np.all(np.isfinite(score)):
        return float("nan")
    ranked = ranks(score)  # ties share their average rank
    return float((ranked[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _f1(pred: np.ndarray, positive: np.ndarray) -> float:
    tp = float(np.sum(pred & positive))
    fp, fn = float(np.sum(pred & ~positive)), float(np.sum(~pred & positive))
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn > 0 else 0.0


def matthews(pred: np.ndarray, labels: np.ndarray, classes: int) -> float:
    """Matthews' correlation of integer predictions and labels (N,) over `classes` classes (Gorodkin's R_K, which
    is the binary coefficient for 2); 0 where it is undefined (a single class predicted or labelled)."""
    s = float(len(labels))
    p = np.bincount(pred, minlength=classes).astype(np.float64)  # (C,) predicted per class
    t = np.bincount(labels, minlength=classes).astype(np.float64)  # (C,) labelled per class
    c = float(np.sum(pred == labels))
    denominator = np.sqrt((s * s - np.dot(p, p)) * (s * s - np.dot(t, t)))
    return float((c * s - np.dot(p, t)) / denominator) if denominator > 0 else 0.0


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Probabilities of scores along `axis`, the largest subtracted first so that exp cannot overflow."""
    z = np.exp(x - x.max(axis=axis, keepdims=True))
    return z / z.sum(axis=axis, keepdims=True)


def classification(logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """logits (N, C), integer labels (N,): accuracy; F1 of class 1 (C == 2) or macro F1; AUC (one-vs-rest);
    Matthews' correlation."""
    logits, labels = np.asarray(logits, np.float64), np.asarray(labels)
    pred = np.argmax(logits, axis=1)
    c = logits.shape[1]
    if c == 2:
        f1 = _f1(pred == 1, labels == 1)
        auc = binary_auc(logits[:, 1] - logits[:, 0], labels == 1)
    else:
        f1 = float(np.mean([_f1(pred == j, labels == j) for j in range(c)]))
        probs = softmax(logits, axis=1)  # one-vs-rest ranks probabilities, as is usual
        aucs = [binary_auc(probs[:, j], labels == j) for j in range(c)]
        auc = float(np.nanmean(aucs)) if not np.all(np.isnan(aucs)) else float("nan")
    mcc = matthews(pred, np.asarray(labels, np.int64), c)
    return {"accuracy": float(np.mean(pred == labels)), "f1": f1, "auc": auc, "matthews": mcc}


def multilabel(logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """logits and 0/1 labels (N, L): exact-match accuracy, macro F1 at p=0.5, macro AUC."""
    logits, labels = np.asarray(logits, np.float64), np.asarray(labels) > 0.5
    pred = logits > 0
    cols = range(logits.shape[1])
    aucs = [binary_auc(logits[:, j], labels[:, j]) for j in cols]
    return {
        "accuracy": float(np.mean(np.all(pred == labels, axis=1))),
        "f1": float(np.mean([_f1(pred[:, j], labels[:, j]) for j in cols])),
        "auc": float(np.nanmean(aucs)) if not np.all(np.isnan(aucs)) else float("nan"),
    }
