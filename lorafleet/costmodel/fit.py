"""Fitting cost-model coefficients to measurements: non-negative, relative-error least squares.

LobRA fits t(b, s) with an unbounded ``curve_fit`` (absolute error, coefficients of any
sign). Two things go wrong with that: the long micro-batches dominate the squared error, so
the short ones (where the constant term rules) are off by up to 16%; and negative
coefficients extrapolate to negative times outside the grid. Here every fit solves::

    min_c  Σ_i ρ( (x_i · c - y_i) / y_i )    subject to  c >= 0

with ``scipy.optimize.least_squares`` (trust-region reflective, bounds c >= 0), residuals
relative to the measurement, and a soft-L1 loss ρ that stops one noisy record (a CPU
timing hiccup) from pulling the whole curve. Columns are scaled to unit size first, since
s^2 and 1 differ by eight orders of magnitude. The start point is the NNLS solution of the
same relative problem.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lorafleet.costmodel.time_model import AffineTime, LayerTimeCoeffs, Link, MicroBatchShape, features_of

#: Relative residual beyond which the soft-L1 loss grows linearly instead of quadratically.
ROBUST_SCALE = 0.05


def fit_nonneg_relative(features: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """argmin_{c >= 0} Σ soft_l1((X c - y) / y): the one fitting routine every coefficient set uses."""
    x = np.asarray(features, dtype=float)
    y = np.asarray(measured, dtype=float)
    if x.ndim != 2 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise ValueError(f"need a non-empty (n, k) feature matrix matching {y.shape[0]} measurements")
    if np.any(y <= 0):
        raise ValueError("measurements must be positive to fit relative errors")
    rel = x / y[:, None]
    scale = np.abs(rel).max(axis=0)
    scale[scale == 0] = 1.0
    a = rel / scale
    from scipy.optimize import least_squares, nnls  # here: planning never imports scipy.optimize (0.15 s)

    start, _ = nnls(a, np.ones(len(y)))
    result = least_squares(
        lambda c: a @ c - 1.0, start, bounds=(0.0, np.inf), loss="soft_l1", f_scale=ROBUST_SCALE, x_scale=1.0
    )
    return result.x / scale


@dataclass(frozen=True)
class ErrorSummary:
    """Relative errors |pred - meas| / meas of a set of predictions."""

    n: int
    median: float
    p90: float
    max: float

    @classmethod
    def of(cls, predicted: Sequence[float] | np.ndarray, measured: Sequence[float] | np.ndarray) -> ErrorSummary:
        p = np.asarray(predicted, dtype=float)
        m = np.asarray(measured, dtype=float)
        if p.size == 0:
            return cls(0, float("nan"), float("nan"), float("nan"))
        err = np.abs(p - m) / m
        return cls(int(err.size), float(np.median(err)), float(np.percentile(err, 90)), float(err.max()))

    def to_json(self) -> dict:
        return {"n": self.n, "median": round(self.median, 5), "p90": round(self.p90, 5), "max": round(self.max, 5)}

    def __str__(self) -> str:
        return f"n={self.n} median={self.median:.1%} p90={self.p90:.1%} max={self.max:.1%}"


def fit_layer_time(shapes: Sequence[MicroBatchShape], times_ms: Sequence[float]) -> LayerTimeCoeffs:
    """LobRA's t(b, s) (and its packed form) for one TP degree from measured micro-batches (ms)."""
    x = features_of(shapes)
    return LayerTimeCoeffs(tuple(float(c) for c in fit_nonneg_relative(x, np.asarray(times_ms))))


def kfold_layer_predictions(
    shapes: Sequence[MicroBatchShape], times_ms: Sequence[float], k: int = 5, seed: int = 0
) -> np.ndarray:
    """Out-of-fold predictions: record i predicted by the fit on the k-1 folds that exclude it."""
    n = len(shapes)
    if n < 2:
        raise ValueError("cross-validation needs at least two records")
    folds = np.array_split(np.random.default_rng(seed).permutation(n), min(k, n))
    times = np.asarray(times_ms, dtype=float)
    pred = np.empty(n)
    for test in folds:
        train = np.setdiff1d(np.arange(n), test)
        coeffs = fit_layer_time([shapes[i] for i in train], times[train])
        pred[test] = [coeffs.shape(shapes[i]) for i in test]
    return pred


def fit_affine(sizes: Sequence[float], times_ms: Sequence[float]) -> AffineTime:
    """``fixed + slope * size`` (both >= 0) through measured (size, ms) points."""
    s = np.asarray(sizes, dtype=float)
    fixed, slope = fit_nonneg_relative(np.stack([np.ones_like(s), s], axis=1), np.asarray(times_ms))
    return AffineTime(float(fixed), float(slope))


def fit_link(nbytes: Sequence[float], times_ms: Sequence[float], ranks: int = 2, allreduce: bool = False) -> Link:
    """Alpha-beta link from timed transfers (one message each) or ring all-reduces over ``ranks``.

    A ring all-reduce costs 2(p-1)*alpha + 2(p-1)/p * n/beta (``Link.allreduce_ms``), so the
    fitted line's intercept and slope are divided by those step counts.
    """
    line = fit_affine(nbytes, times_ms)
    steps, volume = (2 * (ranks - 1), 2 * (ranks - 1) / ranks) if allreduce else (1, 1.0)
    gb_per_s = float("inf") if line.slope == 0 else volume / line.slope / 1e6
    return Link(line.fixed / steps, gb_per_s)
