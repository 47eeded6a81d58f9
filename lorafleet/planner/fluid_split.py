"""An upper bound on the dispatcher's fluid LP bound (``dispatch.fluid_bound``) from one feasible split: when it
is below a makespan to beat, so is the LP's optimum, and the LP need not be solved to say so.

``fluid_bound(load)`` is the optimum τ* of (``dispatch.balance``)::

    min τ   s.t.   Σ_i x_ij = D_j,  Σ_i y_ij = Y_j,  s_j x_ij <= y_ij <= l_j x_ij,  x, y >= 0 on the allowed (i, j)
                   o + Σ_j (u_ij x_ij + v_ij y_ij) / p_i <= τ      every class i

(u, v: the load model's ``bound_per_seq_s`` and ``bound_per_token_s``, v = 0 where it has none; o the least
overhead; s_j, l_j the shortest and longest length of bucket j). Every feasible point bounds τ* from above. Take
the tokens at each bucket's mean, y_ij = x_ij Y_j / D_j (within [s_j x_ij, l_j x_ij], the mean being between the
shortest and the longest), so class i's row is o + Σ_j c_ij x_ij / p_i with c_ij = u_ij + v_ij Y_j / D_j, and
split the sequences by water-filling, the buckets longest first (the fewest classes hold them): bucket j's D_j
raise the loads L_i of the classes allowed it to a common level λ (x_ij = (λ - L_i) p_i / c_ij where L_i < λ),
and a class with c_ij = 0 takes them all at no cost. Then τ* <= o + max_i L_i.

The polish's swaps (``local_search``) are screened by the LP, which rejects a swap whose bound is at or above the
makespan it must beat; a split below that makespan says the LP would pass it (at service scale it passes every
swap: service-64's 64 swaps have LP bounds 11.5-12.0 s against makespans of 15.7-19.4 s to beat).
"""

from __future__ import annotations

import numpy as np

from lorafleet.dispatch import LoadModel

SPLIT_MARGIN = 1e-6
"""The LP's optimum is computed to a solver's tolerance: a split is trusted to be below it only by this fraction
less than the makespan to beat (:func:`passes_fluid_bound`)."""


def split_makespan(load: LoadModel) -> float:
    """o + max_i L_i of the module docstring's water-filled split: at least ``fluid_bound(load)``; inf when a
    non-empty bucket has no allowed class (the LP has no solution either)."""
    counts = load.counts
    present = counts > 0
    mean = np.where(present, load.tokens / np.maximum(counts, 1), 0.0)
    cost = load.bound_per_seq_s + load.bound_per_token_s * mean[None, :]
    speed = load.n_replicas.astype(float)
    allowed = load.feasible
    level = np.zeros(len(load.classes))
    for j in np.argsort(-load.boundaries, kind="stable"):
        if not present[j]:
            continue
        holders = np.flatnonzero(allowed[:, j])
        if holders.size == 0:
            return float("inf")
        c = cost[holders, j]
        if np.any(c <= 0):
            continue  # a class takes the bucket at no cost
        level[holders] = _water_fill(level[holders], speed[holders] / c, float(counts[j]))
    return float(load.overhead_s.min() + level.max())


def _water_fill(loads: np.ndarray, rate: np.ndarray, amount: float) -> np.ndarray:
    """The loads after ``amount`` sequences raise them to a common level λ: class k takes (λ - L_k) r_k where
    L_k < λ (r_k = p_k / c_k sequences per second of load), Σ_k max(0, λ - L_k) r_k = amount."""
    order = np.argsort(loads, kind="stable")
    sorted_loads, sorted_rate = loads[order], rate[order]
    filled_rate = np.cumsum(sorted_rate)
    # the amount that raises the k + 1 lowest to the (k + 1)-th lowest load, and to the next one
    to_next = np.append(filled_rate[:-1] * np.diff(sorted_loads), np.inf)
    reach = np.cumsum(to_next)
    k = int(np.searchsorted(reach, amount))  # the lowest k + 1 share the level
    before = reach[k - 1] if k > 0 else 0.0
    level = sorted_loads[k] + (amount - before) / filled_rate[k]
    return np.maximum(loads, level)


def passes_fluid_bound(load: LoadModel, limit: float) -> bool:
    """Whether the split alone shows ``fluid_bound(load) < limit`` (:data:`SPLIT_MARGIN` below it); False says
    nothing (the LP decides)."""
    return split_makespan(load) < limit * (1 - SPLIT_MARGIN)
