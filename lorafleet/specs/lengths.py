"""Distributions of sequence lengths (tokens per example).

A :class:`LengthDistribution` is a discrete pmf over integer lengths ``>= 1``. Besides the
empirical constructors (samples, histograms) it can be built from published summary
statistics — mean, skewness and excess kurtosis of the lengths *after* truncation to the
context length, with no variance given — by fitting a parametric family
(:meth:`LengthDistribution.from_moments`; the family and its fit: :mod:`.length_family`).
This module holds the distribution itself: its constructors, statistics, sampling and
context limits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from lorafleet.specs.length_family import SKEW_FLOOR, family_pmf, fit_params

#: Acceptance of :meth:`LengthDistribution.from_moments`: relative error of the mean ...
MEAN_RTOL = 0.02
#: ... and of the skewness (relative to ``max(|target|, SKEW_FLOOR)``).
SKEW_RTOL = 0.10


@dataclass(frozen=True, eq=False)
class LengthDistribution:
    """A discrete distribution over integer sequence lengths (tokens, >= 1).

    ``lengths`` are int64, strictly increasing and ``>= 1``; ``probs`` are float64,
    positive and sum to 1 (renormalised here if they are off by < 1e-9). Both arrays are
    made read-only. Equality is identity (arrays have no single truth value).
    """

    lengths: np.ndarray
    probs: np.ndarray

    def __post_init__(self) -> None:
        lengths = np.asarray(self.lengths)
        probs = np.asarray(self.probs, dtype=np.float64)
        if lengths.ndim != 1 or lengths.shape != probs.shape or lengths.size == 0:
            raise ValueError(
                f"lengths and probs must be non-empty 1-D arrays of one shape, got {lengths.shape} and {probs.shape}"
            )
        if not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(f"lengths must be integers, got dtype {lengths.dtype}")
        lengths = lengths.astype(np.int64)
        if lengths[0] < 1 or np.any(np.diff(lengths) <= 0):
            raise ValueError("lengths must be >= 1 and strictly increasing")
        if not np.all(np.isfinite(probs)) or np.any(probs <= 0):
            raise ValueError("probs must be finite and > 0")
        if abs(probs.sum() - 1.0) > 1e-9:
            raise ValueError(f"probs must sum to 1, got {probs.sum()!r}")
        probs = probs / probs.sum()
        lengths.setflags(write=False)
        probs.setflags(write=False)
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "probs", probs)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_samples(cls, values: Sequence[int] | np.ndarray) -> LengthDistribution:
        """Empirical distribution: ``P(L = k) = #{i : v_i = k} / n``."""
        arr = np.asarray(values).ravel()
        if arr.size == 0:
            raise ValueError("no samples")
        if not np.issubdtype(arr.dtype, np.integer):
            if not np.issubdtype(arr.dtype, np.floating) or not np.all(np.isfinite(arr) & (arr == np.round(arr))):
                raise ValueError("samples must be integer lengths")
        if np.min(arr) < 1:
            raise ValueError(f"lengths must be >= 1, got {np.min(arr)}")
        lengths, counts = np.unique(arr.astype(np.int64), return_counts=True)
        return cls(lengths, counts / counts.sum())

    @classmethod
    def from_histogram(cls, counts: Mapping[int, float]) -> LengthDistribution:
        """``P(L = k) = counts[k] / sum(counts)``; zero-weight lengths are dropped."""
        if not counts:
            raise ValueError("empty histogram")
        items = sorted(counts.items())
        keys = np.array([k for k, _ in items])
        weights = np.array([w for _, w in items], dtype=np.float64)
        if not np.issubdtype(keys.dtype, np.integer) or keys[0] < 1:
            raise ValueError("histogram lengths must be integers >= 1")
        if not np.all(np.isfinite(weights)) or np.any(weights < 0) or weights.sum() <= 0:
            raise ValueError("histogram weights must be finite, >= 0, and not all zero")
        keep = weights > 0
        return cls(keys[keep], weights[keep] / weights[keep].sum())

    @classmethod
    def from_params(cls, params: Sequence[float], context_length: int) -> LengthDistribution:
        """The family's pmf on ``1..context_length`` (see :func:`family_pmf`)."""
        return cls.from_pmf(family_pmf(params, context_length))

    @classmethod
    def from_pmf(cls, pmf: np.ndarray) -> LengthDistribution:
        """The lengths ``k`` with ``pmf[k - 1] > 0``, for a pmf over ``1..len(pmf)``."""
        context_length = len(pmf)
        keep = pmf > 0
        lengths = np.arange(1, context_length + 1, dtype=np.int64)[keep]
        return cls(lengths, pmf[keep] / pmf[keep].sum())

    @classmethod
    def from_moments(cls, mean: float, skewness: float, kurtosis: float, context_length: int) -> LengthDistribution:
        """Fit the family to (mean, skewness, excess kurtosis) of the truncated lengths.

        Raises ValueError when the targets are infeasible or the best fit misses the mean
        by more than :data:`MEAN_RTOL` or the skewness by more than :data:`SKEW_RTOL`
        (kurtosis is matched on a best-effort basis).
        """
        dist = cls.from_params(fit_params(mean, skewness, kurtosis, context_length), context_length)
        mean_err = abs(dist.mean / mean - 1.0)
        skew_err = abs(dist.skewness - skewness) / max(abs(skewness), SKEW_FLOOR)
        if not (mean_err <= MEAN_RTOL and skew_err <= SKEW_RTOL):
            raise ValueError(
                f"cannot match mean={mean}, skewness={skewness}, kurtosis={kurtosis} on "
                f"context {context_length}: best fit has mean={dist.mean:.4g}, "
                f"skewness={dist.skewness:.4g}, kurtosis={dist.kurtosis:.4g}"
            )
        return dist

    # ------------------------------------------------------------------ statistics
    @property
    def mean(self) -> float:
        """``E[L] = sum_k k p_k``."""
        return float(self.probs @ self.lengths)

    def _central(self, order: int) -> float:
        """Central moment ``E[(L - E[L])**order]``."""
        return float(self.probs @ (self.lengths - self.mean) ** order)

    @property
    def std(self) -> float:
        """``sqrt(E[(L - mu)**2])`` (population standard deviation)."""
        return float(np.sqrt(self._central(2)))

    @property
    def skewness(self) -> float:
        """``m3 / m2**1.5``; NaN for a point mass."""
        m2 = self._central(2)
        return self._central(3) / m2**1.5 if m2 > 0 else float("nan")

    @property
    def kurtosis(self) -> float:
        """Excess (Fisher) kurtosis ``m4 / m2**2 - 3``; NaN for a point mass."""
        m2 = self._central(2)
        return self._central(4) / m2**2 - 3.0 if m2 > 0 else float("nan")

    @property
    def max_length(self) -> int:
        """Largest length with positive probability."""
        return int(self.lengths[-1])

    def quantile(self, q: float) -> int:
        """Smallest length ``k`` with ``P(L <= k) >= q``, for ``0 <= q <= 1``."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile level must be in [0, 1], got {q}")
        idx = np.searchsorted(np.cumsum(self.probs), q, side="left")
        return int(self.lengths[min(idx, self.lengths.size - 1)])

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` iid lengths by inverse-CDF sampling (int64; deterministic given ``rng``)."""
        if n < 0:
            raise ValueError(f"sample size must be >= 0, got {n}")
        idx = np.searchsorted(np.cumsum(self.probs), rng.random(n), side="right")
        return self.lengths[np.minimum(idx, self.lengths.size - 1)]

    def expected_tokens(self, n: int) -> float:
        """Expected total tokens of ``n`` examples: ``n * E[L]``."""
        return n * self.mean

    # ------------------------------------------------------------------ context limits
    def truncate(self, context_length: int) -> LengthDistribution:
        """``min(L, C)``: the mass above ``C`` moves to ``C``."""
        if context_length < 1:
            raise ValueError(f"context length must be >= 1, got {context_length}")
        keep = self.lengths < context_length
        if keep.all():
            return self
        lengths = np.append(self.lengths[keep], context_length)
        probs = np.append(self.probs[keep], self.probs[~keep].sum())
        return LengthDistribution(lengths, probs)

    def reject_above(self, context_length: int) -> tuple[LengthDistribution, float]:
        """``L | L <= C`` and the rejected mass ``P(L > C)``."""
        keep = self.lengths <= context_length
        if not keep.any():
            raise ValueError(f"every length exceeds the context length {context_length}")
        rejected = float(self.probs[~keep].sum())
        kept = self.probs[keep]
        return LengthDistribution(self.lengths[keep], kept / kept.sum()), rejected
