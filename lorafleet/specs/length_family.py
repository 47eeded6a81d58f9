"""The parametric family of sequence-length distributions, and its fit to published moments.

:func:`family_pmf` is the family's pmf and :func:`fit_params` fits its parameters to the mean,
skewness and excess kurtosis of truncated lengths; :class:`~lorafleet.specs.lengths.LengthDistribution`
builds a distribution from either (``from_params``, ``from_moments``).

**The family.** ``X ~ GG(a, c, s)``, the generalised gamma of :func:`scipy.stats.gengamma`
(``X = s * Y**(1/c)`` with ``Y ~ Gamma(a)``; ``c < 0`` gives a power-law right tail, and
``a -> inf`` approaches the lognormal), discretised and truncated to ``1..C``, plus an
extra point mass ``w`` at ``C``::

    P(L = k) = (1 - w) * (F(k + 1/2) - F(k - 1/2))        1 < k < C
    P(L = 1) = (1 - w) * F(3/2)
    P(L = C) = (1 - w) * (1 - F(C - 1/2)) + w

``w`` stands for the examples the dataset truncated at the context length; it lets the
family reach a skewness the truncated continuous tail alone cannot (MeetingBank, XSum).
The parameters are ``(a, c, log_scale, tail_mass)``; see :func:`family_pmf`.

**Which shape.** Four parameters against three moments leave a curve of exact fits, and
the unconstrained optimum tends to degenerate shapes (20–40 % of the mass below 16 tokens).
:func:`fit_params` therefore bounds the bulk — ``sd(log X) <= MAX_LOG_SPREAD``, and for
``c > 0`` a density finite at zero (``a * c >= 1``) — and among the fits that remain it
takes the one closest to a lognormal (largest ``a``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # scipy only where a pmf is evaluated or fitted: planning the presets never imports it
    from scipy import optimize

#: Largest standard deviation of log-length the fitted bulk may have: e**1.25 ~ 3.5x per
#: sd, so the 1 % quantile stays above ~5 % of the median.
MAX_LOG_SPREAD = 1.25
#: Least scale of a skewness error, ``max(|target|, SKEW_FLOOR)``: in the fit's residuals and in the
#: acceptance of :meth:`~lorafleet.specs.lengths.LengthDistribution.from_moments`.
SKEW_FLOOR = 0.1

_A_RANGE = (0.1, 1e4)  # bounds of the gamma shape a
_MAX_TAIL_MASS = 0.5
#: Residual weights of (mean, skewness, kurtosis): the mean matters most, kurtosis least.
_WEIGHTS = np.array([10.0, 3.0, 1.0])
_GRID_A = np.geomspace(0.3, 1000.0, 7)
_GRID_SPREAD = np.array([0.12, 0.25, 0.4, 0.6, 0.8, 1.0])  # fractions of the allowed spread
_GRID_TAIL = np.array([0.0, 1e-3, 1e-2])
#: Weight of the lognormal tie-breaker ``log(a_max / a)`` in the residuals.
_PRIOR = 1e-3
_MEAN_SWEEPS = 5  # fixed-point sweeps matching the mean on the start grid
_STARTS = 3  # best grid points refined by least squares
_EXACT_COST = 1e-12  # a cost this low ends the multistart early
_MAX_NFEV = 100  # evaluation budget of one least-squares run
_CORRECTIONS = 2  # deferred-correction rounds against the exact pmf
_FD_STEP = 1e-6  # relative forward-difference step of the Jacobian
_BIN_RATIO = 1.05  # growth of the coarse fitting bins
_DENSE_UP_TO = 32  # every length below this is its own coarse bin


# ---------------------------------------------------------------------- the family
def _log_edges(cuts: np.ndarray) -> np.ndarray:
    """``[-inf, log(cuts), inf]``: bin edges in log space around the given cut points."""
    return np.concatenate([[-np.inf], np.log(cuts), [np.inf]])


@dataclass(frozen=True)
class _Grid:
    """Bins over ``1..C``: ``log_edges`` (with ``+-inf``) and each bin's mean length."""

    log_edges: np.ndarray
    points: np.ndarray

    @classmethod
    def exact(cls, context_length: int) -> _Grid:
        """One bin per length."""
        cuts = np.arange(1, context_length, dtype=np.float64) + 0.5
        return cls(_log_edges(cuts), np.arange(1, context_length + 1, dtype=np.float64))

    @classmethod
    def coarse(cls, context_length: int) -> _Grid:
        """Unit bins below :data:`_DENSE_UP_TO`, then bins growing by :data:`_BIN_RATIO`.

        Each bin stands for its integer lengths ``lo..hi`` at the point ``(lo + hi) / 2``;
        :func:`fit_params` corrects for the moment error this makes.
        """
        n_geo = max(int(np.log(context_length / _DENSE_UP_TO) / np.log(_BIN_RATIO)), 0) + 2
        uppers = np.unique(
            np.concatenate(
                [
                    np.arange(1, min(_DENSE_UP_TO, context_length)),
                    np.round(np.geomspace(_DENSE_UP_TO, context_length, n_geo)),
                ]
            ).astype(np.int64)
        )
        uppers = uppers[uppers < context_length]  # last length of every bin but the top one
        lowers = np.concatenate([[1], uppers + 1])
        highs = np.append(uppers, context_length)
        return cls(_log_edges(uppers + 0.5), (lowers + highs) / 2.0)


def _incomplete_gamma(a: np.ndarray, c: np.ndarray, log_scale: np.ndarray, log_x: np.ndarray) -> np.ndarray:
    """``G(x) = P(a, (x/s)**c)``, computed as ``P(a, exp(c (log x - log s)))``.

    ``P`` is the regularised lower incomplete gamma; the family's CDF is ``F = G`` for
    ``c > 0`` and ``F = 1 - G`` for ``c < 0``. Parameters broadcast as ``(n, 1)`` against
    the ``(m,)`` log-points (``-inf`` and ``inf`` allowed): ``n`` members at once.
    """
    from scipy import special  # 0.2 s of imports: not at module level (length_presets.npz)

    with np.errstate(over="ignore", invalid="ignore"):
        t = np.exp(c * (log_x - log_scale))
    return special.gammainc(a, t)


def _binned_pmf(params: np.ndarray, log_edges: np.ndarray) -> np.ndarray:
    """Mass of each bin between consecutive edges, for rows ``(a, c, log_scale, w)``.

    ``log_edges`` starts at ``-inf`` and ends at ``inf``; the last bin is the length ``C``
    and also receives the point mass ``w``. A bin's mass is ``sign(c) * (G(hi) - G(lo))``,
    which avoids ``1 - G`` cancellation in the tails. Shape ``(n, len(log_edges) - 1)``.
    """
    a, c, log_scale, w = (params[:, i : i + 1] for i in range(4))
    mass = np.sign(c) * np.diff(_incomplete_gamma(a, c, log_scale, log_edges), axis=1)
    mass = np.maximum(mass, 0.0) * (1.0 - w)
    mass[:, -1] += w[:, 0]
    return mass


def family_pmf(params: Sequence[float], context_length: int) -> np.ndarray:
    """``P(L = k)`` for ``k = 1..C`` of the truncated discretised family (module docstring).

    ``params = (a, c, log_scale, tail_mass)``: gamma shape ``a > 0``, power ``c != 0``,
    ``log`` of the scale ``s``, and the extra point mass ``w`` in ``[0, 1)`` at ``C``.
    """
    if len(params) != 4:
        raise ValueError(f"expected (a, c, log_scale, tail_mass), got {tuple(params)}")
    a, c, log_scale, w = (float(v) for v in params)
    if not (a > 0 and c != 0 and np.isfinite(log_scale) and 0 <= w < 1):
        raise ValueError(f"invalid family parameters {tuple(params)}")
    if context_length < 1:
        raise ValueError(f"context length must be >= 1, got {context_length}")
    return _binned_pmf(np.array([[a, c, log_scale, w]]), _Grid.exact(context_length).log_edges)[0]


def _moments(mass: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Rows of ``(mean, skewness, excess kurtosis)`` of pmfs ``mass`` (n, m) on ``points``."""
    mean = mass @ points
    dev = points - mean[:, None]
    dev2 = dev * dev
    m2 = np.einsum("ij,ij->i", mass, dev2)
    m3 = np.einsum("ij,ij->i", mass, dev2 * dev)
    m4 = np.einsum("ij,ij->i", mass, dev2 * dev2)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.stack([mean, m3 / m2**1.5, m4 / m2**2 - 3.0], axis=1)


# ---------------------------------------------------------------------- fitting
def _members(x: np.ndarray, sign: np.ndarray) -> np.ndarray:
    """Map search coordinates to family rows ``(a, c, log_scale, w)``.

    ``x = (log a, u, mu, w)``: ``u`` in (0, 1] is the log-spread as a fraction of the
    largest allowed one, ``mu = E[log X]``. With ``sd(log X) = sqrt(psi1(a)) / |c|`` and
    ``E[log X] = log s + psi(a) / c``::

        sigma = u * min(MAX_LOG_SPREAD, a sqrt(psi1(a)) if c > 0)   # a c >= 1 for c > 0
        c = sign * sqrt(psi1(a)) / sigma,   log s = mu - psi(a) / c
    """
    from scipy import special

    a = np.exp(x[:, 0])
    root_trigamma = np.sqrt(special.polygamma(1, a))
    cap = np.where(sign > 0, np.minimum(MAX_LOG_SPREAD, a * root_trigamma), MAX_LOG_SPREAD)
    c = sign * root_trigamma / (x[:, 1] * cap)
    return np.stack([a, c, x[:, 2] - special.digamma(a) / c, x[:, 3]], axis=1)


def _stats(x: np.ndarray, sign: np.ndarray, grid: _Grid) -> np.ndarray:
    """``(mean, skewness, kurtosis)`` rows of the members at search coordinates ``x``."""
    return _moments(_binned_pmf(_members(x, sign), grid.log_edges), grid.points)


def _residuals(x: np.ndarray, stats: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Rows ``W * (relerr(mean), relerr(skew), relerr(kurt + 3)) ++ PRIOR * log(a_max / a)``.

    Skewness errors are relative to ``max(|skew|, SKEW_FLOOR)``, kurtosis errors to the
    raw kurtosis. The last entry breaks the tie between the many shapes that match three
    moments in favour of the largest ``a`` — the one closest to a lognormal bulk (the
    ``a -> inf`` limit). It is linear in ``log a``, so a Gauss-Newton step resolves it
    at once, and small enough to cost the moments nothing measurable.
    """
    scale = np.array([target[0], max(abs(target[1]), SKEW_FLOOR), target[2] + 3.0])
    res = np.nan_to_num((stats - target) / scale * _WEIGHTS, nan=1e3, posinf=1e3, neginf=-1e3)
    return np.concatenate([res, _PRIOR * (np.log(_A_RANGE[1]) - x[:, :1])], axis=1)


def _start_grid(target: np.ndarray, grid: _Grid) -> tuple[np.ndarray, np.ndarray]:
    """Search coordinates and signs of a grid of candidate shapes, each with its
    location ``mu`` moved by a few fixed-point sweeps ``mu += log(target_mean / mean)``."""
    sign, log_a, u, w = (g.ravel() for g in np.meshgrid([1.0, -1.0], np.log(_GRID_A), _GRID_SPREAD, _GRID_TAIL))
    x = np.stack([log_a, u, np.full(sign.shape, np.log(target[0])), w], axis=1)
    for _ in range(_MEAN_SWEEPS):
        with np.errstate(divide="ignore", invalid="ignore"):
            step = np.log(target[0] / _stats(x, sign, grid)[:, 0])
        x[:, 2] += np.nan_to_num(np.clip(step, -3.0, 3.0))
    return x, sign


def _least_squares(
    x0: np.ndarray, sign: float, target: np.ndarray, grid: _Grid, offset: np.ndarray
) -> optimize.OptimizeResult:
    """Bounded least squares (dogbox) of :func:`_residuals` of ``stats + offset``.

    The forward-difference Jacobian evaluates ``x`` and its four shifted copies as one
    vectorised batch (steps point into the box at an upper bound).
    """
    lower = np.array([np.log(_A_RANGE[0]), 1e-3, -np.inf, 0.0])
    upper = np.array([np.log(_A_RANGE[1]), 1.0, np.inf, _MAX_TAIL_MASS])

    def rows(xs: np.ndarray) -> np.ndarray:
        signs = np.full(len(xs), sign)
        return _residuals(xs, _stats(xs, signs, grid) + offset, target)

    def jac(x: np.ndarray) -> np.ndarray:
        step = _FD_STEP * np.maximum(1.0, np.abs(x))
        step = np.where(x + step > upper, -step, step)
        res = rows(np.vstack([x, x + np.diag(step)]))
        return ((res[1:] - res[0]) / step[:, None]).T

    from scipy import optimize

    return optimize.least_squares(
        lambda x: rows(x[None, :])[0],
        np.clip(x0, lower, upper),
        jac=jac,
        bounds=(lower, upper),
        method="dogbox",
        max_nfev=_MAX_NFEV,
    )


def fit_params(mean: float, skewness: float, kurtosis: float, context_length: int) -> tuple[float, float, float, float]:
    """Family parameters ``(a, c, log_scale, tail_mass)`` matching the truncated moments.

    Minimises the squared norm of :func:`_residuals`. Moments are computed on coarse
    geometric bins (:meth:`_Grid.coarse`): a vectorised scan of 252 shapes, then least
    squares from the best :data:`_STARTS` of them (stopping early at a cost below
    :data:`_EXACT_COST`), then :data:`_CORRECTIONS` rounds of deferred correction —
    re-solve with the target shifted by ``exact(x) - coarse(x)`` — so the returned
    parameters fit the exact per-length pmf. Deterministic; 0.05–0.5 s on a 16k context.
    """
    if context_length < 2:
        raise ValueError(f"context length must be >= 2 to fit a shape, got {context_length}")
    if not 1.0 < mean < context_length:
        raise ValueError(f"mean must lie in (1, {context_length}), got {mean}")
    if not (np.isfinite(skewness) and np.isfinite(kurtosis)):
        raise ValueError("skewness and kurtosis must be finite")
    if kurtosis < skewness**2 - 2.0:
        raise ValueError(f"no distribution has excess kurtosis {kurtosis} < skewness**2 - 2 = {skewness**2 - 2}")
    target = np.array([mean, skewness, kurtosis], dtype=np.float64)
    coarse, exact = _Grid.coarse(context_length), _Grid.exact(context_length)
    starts, signs = _start_grid(target, coarse)
    loss = np.sum(_residuals(starts, _stats(starts, signs, coarse), target) ** 2, axis=1)
    best, sign = None, 0.0
    for i in np.argsort(loss, kind="stable")[:_STARTS]:
        fit = _least_squares(starts[i], signs[i], target, coarse, np.zeros(3))
        if best is None or fit.cost < best.cost:
            best, sign = fit, signs[i]
        if best.cost < _EXACT_COST:  # moments matched by a lognormal bulk: nothing beats it
            break
    x, member_sign = best.x, np.array([sign])
    for _ in range(_CORRECTIONS):
        row = x[None, :]
        offset = (_stats(row, member_sign, exact) - _stats(row, member_sign, coarse))[0]
        x = _least_squares(x, sign, target, coarse, offset).x
    a, c, log_scale, w = _members(x[None, :], member_sign)[0]
    return float(a), float(c), float(log_scale), float(w)
