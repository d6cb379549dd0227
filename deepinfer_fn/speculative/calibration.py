"""STS calibration of the confidence head (docs/MODEL.md §D1.5): sequential temperature scaling
(`sts_calibrate`) and its report (ECE, AUC, Brier per draft position, before and after)."""

from __future__ import annotations

import numpy as np

from deepinfer_fn.speculative.survival import sigmoid_np, survivals_np


def default_temperature_grid(n: int = 60, lo: float = 0.25, hi: float = 8.0) -> np.ndarray:
    """n log-spaced temperatures in [lo, hi], plus 1.0 (the uncalibrated head)."""
    return np.unique(np.append(np.geomspace(lo, hi, n), 1.0))


def ece(prob, outcome, n_bins: int = 15) -> float:
    """Expected calibration error: count-weighted mean |mean prob - mean outcome| over
    n_bins equal-width probability bins."""
    prob = np.asarray(prob, np.float64).ravel()
    y = np.asarray(outcome, np.float64).ravel()
    if prob.size == 0:
        return float("nan")
    b = np.minimum((prob * n_bins).astype(np.int64), n_bins - 1)
    sp = np.bincount(b, prob, minlength=n_bins)
    sy = np.bincount(b, y, minlength=n_bins)
    return float(np.sum(np.abs(sp - sy)) / prob.size)


def auc(score, outcome) -> float:
    """Area under the ROC curve (Mann-Whitney, ties count half); nan with one class only."""
    s = np.asarray(score, np.float64).ravel()
    y = np.asarray(outcome, bool).ravel()
    n1, n0 = int(y.sum()), int((~y).sum())
    if n1 == 0 or n0 == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s))
    sorted_s = s[order]
    # average ranks over ties
    starts = np.flatnonzero(np.r_[True, np.diff(sorted_s) != 0])
    ends = np.r_[starts[1:], len(s)]
    avg = (starts + ends - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[y].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def brier(prob, outcome) -> float:
    prob = np.asarray(prob, np.float64).ravel()
    return float(np.mean((prob - np.asarray(outcome, np.float64).ravel()) ** 2))


def prefix_outcomes(accepted, g: int) -> np.ndarray:
    """A [N,g] bool: A_k = 1[first k drafts all accepted] from accepted counts [N] of steps
    verified at full length g."""
    acc = np.asarray(accepted)
    if acc.ndim != 1 or np.any(acc < 0) or np.any(acc > g):
        raise ValueError(f"accepted must be [N] counts in 0..{g} (full-length verification)")
    return acc[:, None] >= np.arange(1, g + 1)[None]


def sts_calibrate(conf_logits, accepted, grid=None, n_bins: int = 15):
    """Sequential temperature scaling (§1.5).

    conf_logits [N,g] the head's confidence logits of N logged steps verified at FULL length
    g (fixed verification: dynamic logs are biased); accepted [N] the accepted draft count of
    each step. For k = 1..g in order, with t_1..t_{k-1} frozen, pick t_k from `grid` (default
    `default_temperature_grid`) minimising the ECE of prod_{i<=k} sigmoid(z_i / t_i) against
    A_k = 1[first k accepted]; ties -> the temperature closest to 1. Returns (temps [g] float32,
    report = `calibration_report(conf_logits, accepted, temps)`)."""
    z = np.asarray(conf_logits, np.float64)
    if z.ndim != 2 or z.shape[0] == 0:
        raise ValueError(f"conf_logits must be [N, g] with N > 0, got {z.shape}")
    N, g = z.shape
    A = prefix_outcomes(accepted, g)
    grid = default_temperature_grid() if grid is None else np.asarray(grid, np.float64)
    if grid.ndim != 1 or grid.size == 0 or np.any(grid <= 0):
        raise ValueError("grid must be a non-empty 1-D array of positive temperatures")
    grid = grid[np.argsort(np.abs(np.log(grid)), kind="stable")]   # ties -> closest to 1
    temps = np.ones(g)
    prefix = np.ones(N)
    for k in range(g):
        errs = [ece(prefix * sigmoid_np(z[:, k] / t), A[:, k], n_bins) for t in grid]
        temps[k] = grid[int(np.argmin(errs))]
        prefix = prefix * sigmoid_np(z[:, k] / temps[k])
    return temps.astype(np.float32), calibration_report(z, accepted, temps, n_bins)


def calibration_report(conf_logits, accepted, temps, n_bins: int = 15) -> dict:
    """Per position k: ECE, AUC and Brier of the cumulative product against A_k, before
    (temperatures 1) and after (`temps`) calibration; plus the base rate of A_k."""
    z = np.asarray(conf_logits, np.float64)
    g = z.shape[1]
    A = prefix_outcomes(accepted, g)
    before = survivals_np(z, np.ones(g))
    after = survivals_np(z, temps)
    rows = []
    for k in range(g):
        rows.append(dict(position=k + 1, temperature=float(np.asarray(temps)[k]),
                         base_rate=float(A[:, k].mean()),
                         ece_before=ece(before[:, k], A[:, k], n_bins),
                         ece_after=ece(after[:, k], A[:, k], n_bins),
                         auc_before=auc(before[:, k], A[:, k]),
                         auc_after=auc(after[:, k], A[:, k]),
                         brier_before=brier(before[:, k], A[:, k]),
                         brier_after=brier(after[:, k], A[:, k])))
    return dict(n=int(z.shape[0]), positions=rows)
