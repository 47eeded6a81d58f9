"""A task's evaluation loss as a curve of its trained tokens: the model ``simulate`` replays early stops by,
and its fit to measured points.

**The model.** With ``n`` the task's trained real tokens in millions (:data:`TOKENS_UNIT`; the tokens its
batches held, padding excluded, as ``StepReport.task_tokens`` counts them)::

    L(n) = l_inf + a * n^-alpha + rise * max(0, n - rise_after)            (n > 0)

a power law in the data seen, as LLM losses are (Kaplan et al. 2020: ``L(D) = (D_c / D)^alpha_D``; a
fine-tuning loss falls to a floor, ``l_inf``, so the floor is added), and an overfitting rise, linear in the
tokens trained past ``rise_after`` (a held-out loss that climbs once a small dataset is learnt by heart).
Without ``rise`` the curve falls for ever and only ``min_delta`` can stop its task: two evaluations ``dn``
million tokens apart improve by about ``alpha a n^(-alpha-1) dn``. With ``rise`` the minimum is at
``rise_after`` when ``rise > alpha a rise_after^(-alpha-1)`` (the power law's slope there), else further on,
where the two slopes cancel. The parameters are a task's ``eval.curve`` (``specs.loss_curve``).

**The fit** (:func:`fit_curve`) to measured ``(tokens, loss)`` points (a training run's evaluations) is in two
parts. The power law is fitted to the points up to the lowest loss by least squares
(``scipy.optimize.curve_fit``, bounds ``l_inf, a >= 0``, ``0 < alpha <= 10``; at least three points). The
rise is the least-squares slope, through 0 at the lowest point, of the later points' residuals
``r_j = loss_j - P(n_j)`` against ``n_j - n_min``::

    rise = max(0, Σ_j r_j (n_j - n_min) / Σ_j (n_j - n_min)^2),        rise_after = n_min

(0 when the lowest loss is the last point). Pure numpy and scipy: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.optimize import curve_fit

from lorafleet.specs.loss_curve import LossCurveSpec

TOKENS_UNIT = 1e6
"""The curve's ``n`` is tokens over this: millions of tokens."""

MIN_POINTS = 3
"""The power law has three parameters: a fit needs at least this many points up to the lowest loss."""


def curve_loss(curve: LossCurveSpec, tokens: float | np.ndarray) -> float | np.ndarray:
    """``L(n)`` of the module doc at ``tokens`` trained tokens (> 0; vectorised over an array)."""
    n = np.asarray(tokens, dtype=float) / TOKENS_UNIT
    if np.any(n <= 0):
        raise ValueError("a loss curve is evaluated after some tokens are trained (tokens > 0)")
    loss = _power_law(n, curve.l_inf, curve.a, curve.alpha) + curve.rise * np.maximum(0.0, n - curve.rise_after)
    return float(loss) if loss.ndim == 0 else loss


def _power_law(n: np.ndarray, l_inf: float, a: float, alpha: float) -> np.ndarray:
    return l_inf + a * n ** (-alpha)


def fit_curve(tokens: Sequence[float], losses: Sequence[float]) -> LossCurveSpec:
    """The curve fitted to the points ``(tokens[j], losses[j])`` (module doc, "The fit"); ValueError when they
    are not finite, not all tokens are > 0, or fewer than :data:`MIN_POINTS` lie up to the lowest loss."""
    n = np.asarray(tokens, dtype=float) / TOKENS_UNIT
    loss = np.asarray(losses, dtype=float)
    if n.shape != loss.shape or n.ndim != 1:
        raise ValueError(f"{n.size} token counts for {loss.size} losses")
    if not (np.all(np.isfinite(n)) and np.all(np.isfinite(loss)) and np.all(n > 0)):
        raise ValueError("fit a loss curve to finite losses after tokens > 0")
    order = np.argsort(n, kind="stable")
    n, loss = n[order], loss[order]
    low = int(np.argmin(loss))
    if low + 1 < MIN_POINTS:
        raise ValueError(f"{low + 1} points up to the lowest loss: a power law needs at least {MIN_POINTS}")
    fall_n, fall = n[: low + 1], loss[: low + 1]
    start = (float(fall.min()) * 0.9, max(float(fall[0] - fall.min()), 1e-6) * float(fall_n[0]) ** 0.5, 0.5)
    (l_inf, a, alpha), _ = curve_fit(
        _power_law, fall_n, fall, p0=start, bounds=([0.0, 0.0, 1e-6], [np.inf, np.inf, 10.0]), maxfev=20_000
    )
    past = n[low + 1 :] - n[low]
    residual = loss[low + 1 :] - _power_law(n[low + 1 :], l_inf, a, alpha)
    rise = max(0.0, float(residual @ past / (past @ past))) if past.size else 0.0
    return LossCurveSpec(
        l_inf=float(l_inf), a=float(a), alpha=float(alpha), rise=rise, rise_after=float(n[low]) if rise else 0.0
    )
