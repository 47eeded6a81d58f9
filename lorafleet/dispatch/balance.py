"""Min-makespan split of each bucket's sequences over config classes: the fast method and LobRA's baseline.

Both work on the :class:`~lorafleet.dispatch.load.LoadModel` and return class totals
d_ij (sequences of bucket j given to class i) with sum_i d_ij = D_j.

The fast method (the default) improves three starting points and keeps the best:

- *Water-filling, longest bucket first* (LPT over buckets). Bucket j's unassigned
  sequences are split over the classes that can hold them at the least level: with
  T_i(x) class i's time after taking x more, the least tau with
  sum_i max{x : T_i(x) <= tau} >= D_j, searched over the values of the step functions T_i.
  Long buckets fit few classes, so they go first, while the short ones still fill gaps.
- *LP relaxation, rounded.* With the rate of a sequence of bucket j on class i amortised
  over its micro-batch and its class's p_i replicas, a_ij = (alpha_ij + beta_ij / b_ij) / p_i,
  the LP ``min tau s.t. sum_i x_ij = D_j, o_i + sum_j a_ij x_ij <= tau, x >= 0`` sees which
  class is relatively fastest at which lengths (water-filling only sees levels). Its x is
  rounded down to multiples of p_i (a non-multiple costs every replica a whole row), and
  the remainder water-filled. The same LP on rates that bound every step from below gives a
  lower bound on every dispatch's makespan (:func:`fluid_bound`).
- *LPT over whole buckets.* The costliest bucket first, each whole to the class that then
  finishes first: on small batches the optimum often keeps buckets whole, and exchanges
  alone cannot reach a permutation of whole buckets.

Each start is improved by *exchanges* between the slowest class c and another class k:
c gives delta of bucket j to k and optionally takes epsilon of bucket j' back, accepted
when max(T_c', T_k') < T_c. The sizes tried are those where the step functions change
(one row fewer per replica, one micro-batch fewer, what fills the receiver's open rows or
micro-batch, one row or micro-batch on every receiver replica, half, all). Class time is
a sum over buckets plus the pipeline bubble ``bubble_slots * max`` (``pp - 1`` slots, a drain,
whatever the pipeline window: :mod:`~lorafleet.dispatch.load`), so all candidate pairs of one
(c, k) are scored at once from per-bucket differences, the bubble from the top three
micro-batch times. Each exchange lowers the sorted vector of class times
lexicographically, so the search ends.

The length-based baseline (LobRA's "GROUP" dispatch) runs the same search with every
bucket restricted to its tightest classes: the least M >= s_j.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog

from lorafleet.dispatch.load import LoadModel

_REL_TOL = 1e-12
"""An exchange must lower the slowest class by more than this fraction (floating-point noise)."""
_MAX_EXCHANGES = 10_000
"""Safety cap on exchanges; each one strictly improves, so it is not reached in practice."""


@dataclass(frozen=True)
class Assignment:
    """Class totals per bucket and the makespan the load model gives them."""

    counts: np.ndarray
    """(K, R) d_ij: sequences of bucket j on class i (all its replicas together)."""
    makespan_s: float
    """Modelled time of the slowest replica: max_i T_i."""


def balance_fast(load: LoadModel) -> Assignment:
    """The best of three starts (water-filling, rounded LP, whole-bucket LPT), each improved by exchanges."""
    return _balance(load, load.feasible)


def balance_by_length(load: LoadModel) -> Assignment:
    """LobRA's "GROUP" baseline: bucket j only on the classes with the least M >= s_j, balanced among them."""
    max_tokens = np.array([c.max_tokens for c in load.classes])[:, None]
    fitting = np.where(load.feasible, max_tokens, np.iinfo(np.int64).max)
    return _balance(load, load.feasible & (fitting == fitting.min(axis=0, keepdims=True)))


def _balance(load: LoadModel, allowed: np.ndarray) -> Assignment:
    if np.any((load.counts > 0) & ~allowed.any(axis=0)):
        raise ValueError("a non-empty bucket fits no config class")
    empty = np.zeros(allowed.shape, dtype=np.int64)
    starts = (
        _water_fill(load, allowed, empty),
        _water_fill(load, allowed, _lp_rounded(load, allowed)),
        _whole_buckets(load, allowed),
    )
    best = min((_exchange_search(load, allowed, d) for d in starts), key=load.makespan)
    return Assignment(counts=best, makespan_s=load.makespan(best))


def _water_fill(load: LoadModel, allowed: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Add each bucket's sequences not yet in ``start`` (K, R), longest bucket first, at the least level."""
    d = start.copy()
    for j in np.argsort(-load.boundaries, kind="stable"):
        total = int(load.counts[j] - d[:, j].sum())
        if total == 0:
            continue
        takers = np.flatnonzero(allowed[:, j])
        bucket, none, extra = np.array(j), np.array(0), np.arange(total + 1)
        # (takers, total + 1): time of each taker holding x = 0..total more of bucket j; the running
        # max makes each row monotone even for cost models with a negative coefficient
        curve = np.maximum.accumulate(
            np.stack([_times_after(load, _row(load, d, i), d, i, bucket, none, bucket, extra) for i in takers]), axis=1
        )
        levels = np.unique(curve)
        cap = np.stack([np.searchsorted(row, levels, side="right") - 1 for row in curve])  # -1: above tau already
        level = int(np.argmax(np.maximum(cap, 0).sum(axis=0) >= total))
        take = np.maximum(cap[:, level], 0)
        surplus = int(take.sum()) - total
        for t in np.argsort(-curve[np.arange(takers.size), take], kind="stable"):
            cut = min(surplus, int(take[t]))
            take[t] -= cut
            surplus -= cut
        d[takers, j] += take
    return d


def _whole_buckets(load: LoadModel, allowed: np.ndarray) -> np.ndarray:
    """LPT over whole buckets: the costliest bucket first, each to the class that then finishes first."""
    d = np.zeros(allowed.shape, dtype=np.int64)
    classes = np.arange(len(load.classes))
    rows = -(-load.counts[None, :] // load.n_replicas[:, None])
    alone = np.where(allowed, load.row_cost(classes[:, None], np.arange(d.shape[1]), rows)[0], np.inf)
    for j in np.argsort(-alone.min(axis=0), kind="stable"):
        if load.counts[j] == 0:
            continue
        finish = np.full(len(classes), np.inf)
        for i in np.flatnonzero(allowed[:, j]):
            d[i, j] = load.counts[j]
            finish[i] = load.times(d)[i]
            d[i, j] = 0
        d[int(np.argmin(finish)), j] = load.counts[j]
    return d


def fluid_bound(load: LoadModel) -> float:
    """A lower bound on the dispatcher's estimate of every dispatch on ``load`` (padded or packed, as
    placed), and so on the load model's makespans too: an LP's least largest class mean.

    A busy replica of class i holding n_j sequences of each bucket, with y_j tokens, takes at
    least o_i + sum_j (u_ij n_j + v_ij y_j) (the ``bound_*`` rates: ceil(n / b) >= n / b when
    padded, a micro-batch's constant spread over at most M tokens when packed, see
    :mod:`.load`; the bubble >= 0), so the slowest of the class takes at least
    o + sum_j (u_ij x_ij + v_ij y_ij) / p_i with x_ij, y_ij the class's sequences and tokens of
    bucket j and o the least overhead of any class (an idle replica's estimate is 0, but some
    replica is busy). Which sequences of a bucket a class gets is left to the LP, with
    sum_i y_ij = Y_j and the bucket's shortest and longest lengths bounding y_ij / x_ij.
    Assumes non-negative cost coefficients (fits and the analytic model have them). 0 where
    the LP solve fails.
    """
    per_token = load.bound_per_token_s if np.any(load.bound_per_token_s) else None
    solved = _min_max_lp(
        load,
        load.feasible,
        load.bound_per_seq_s / load.n_replicas[:, None],
        np.full(len(load.classes), load.overhead_s.min()),
        per_token,
    )
    return solved[0] if solved is not None else 0.0


def _fluid_lp(load: LoadModel, allowed: np.ndarray) -> tuple[float, np.ndarray] | None:
    """The LP relaxation (see module docstring): its tau and x_ij (K, R); None on numerical trouble."""
    p = load.n_replicas[:, None]
    rate = (load.per_seq_s + load.per_microbatch_s / np.maximum(load.microbatch_rows, 1)) / p
    return _min_max_lp(load, allowed, rate, load.overhead_s)


def _min_max_lp(
    load: LoadModel, allowed: np.ndarray, rate: np.ndarray, overhead: np.ndarray, per_token: np.ndarray | None = None
) -> tuple[float, np.ndarray] | None:
    """``min tau s.t. sum_i x_ij = D_j, overhead_i + sum_j rate_ij x_ij <= tau, x >= 0`` over the
    allowed (i, j): tau and x (K, R), None on numerical trouble. With ``per_token`` (K, R), each
    pair also has tokens y_ij: sum_i y_ij = Y_j, shortest_j x_ij <= y_ij <= longest_j x_ij, and
    class i's row adds per_token_ij y_ij / p_i."""
    pairs = np.argwhere(allowed & (load.counts > 0)[None, :])
    n_classes, n_buckets = allowed.shape
    n, cls, bucket = len(pairs), pairs[:, 0], pairs[:, 1]
    n_vars = (2 * n if per_token is not None else n) + 1
    cost = np.zeros(n_vars)
    cost[-1] = 1.0  # minimise tau, the last variable
    a_ub = np.zeros((n_classes, n_vars))
    a_ub[cls, np.arange(n)] = rate[cls, bucket]
    a_ub[:, -1] = -1.0
    b_ub = -np.asarray(overhead, dtype=float)
    a_eq = np.zeros((n_buckets, n_vars))
    a_eq[bucket, np.arange(n)] = 1.0
    b_eq = load.counts.astype(float)
    if per_token is not None:
        y = n + np.arange(n)
        a_ub[cls, y] = per_token[cls, bucket] / load.n_replicas[cls]
        ranges = np.zeros((2 * n, n_vars))  # shortest x - y <= 0, y - longest x <= 0
        ranges[np.arange(n), np.arange(n)] = load.length_range[bucket, 0]
        ranges[np.arange(n), y] = -1.0
        ranges[n + np.arange(n), np.arange(n)] = -load.length_range[bucket, 1]
        ranges[n + np.arange(n), y] = 1.0
        tokens = np.zeros((n_buckets, n_vars))
        tokens[bucket, y] = 1.0
        a_ub, b_ub = np.vstack((a_ub, ranges)), np.concatenate((b_ub, np.zeros(2 * n)))
        a_eq, b_eq = np.vstack((a_eq, tokens)), np.concatenate((b_eq, load.tokens))
    solved = linprog(cost, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=(0, None), method="highs")
    if solved.status != 0:
        return None
    x = np.zeros(allowed.shape)
    x[cls, bucket] = solved.x[:n]
    return float(solved.x[-1]), x


def _lp_rounded(load: LoadModel, allowed: np.ndarray) -> np.ndarray:
    """The LP relaxation's x_ij (see module docstring) rounded down to multiples of p_i."""
    solved = _fluid_lp(load, allowed)
    if solved is None:  # numerical trouble: water-filling alone takes over
        return np.zeros(allowed.shape, dtype=np.int64)
    p = load.n_replicas[:, None]
    d = np.floor(solved[1] / p + 1e-9).astype(np.int64) * p
    return np.minimum(d, load.counts[None, :])


def _move_sizes(load: LoadModel, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Candidate amounts, per (class, bucket): (4, K, R) when the class gives and (4, K, R) when it takes.

    Giving: one row fewer on every replica, one micro-batch fewer on every replica, half,
    everything. Taking: what fills its open rows, what fills its open micro-batches, one more
    row and one more micro-batch on every replica. Amounts are clipped to what the giver holds.
    """
    p = load.n_replicas[:, None]
    b = np.maximum(load.microbatch_rows, 1)
    rows = -(-d // p)
    microbatches = -(-rows // b)
    give = np.stack([d - p * (rows - 1), d - p * b * (microbatches - 1), d // 2, d])
    take = np.stack([p * rows - d, p * b * microbatches - d, np.broadcast_to(p, d.shape), p * b])
    return give, take


def _pair_sizes(
    give: np.ndarray, take: np.ndarray, d: np.ndarray, giver: int, taker: int, buckets: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Distinct (bucket, amount) candidates for moving part of ``buckets`` from ``giver`` to ``taker``."""
    sizes = np.clip(np.concatenate((give[:, giver, buckets], take[:, taker, buckets])), 1, d[giver, buckets])
    # many kinds coincide (half = one row fewer, ...): drop repeats, the scoring matrix is |give| x |back|
    span = int(d.max()) + 1
    pairs = np.unique((buckets * span + sizes).ravel())
    return pairs // span, pairs % span


@dataclass(frozen=True)
class _Row:
    """One class's per-bucket costs under the current totals: what candidate changes are scored against."""

    compute: np.ndarray
    """(R,) compute time of the bucket's rows on the slowest replica."""
    largest: np.ndarray
    """(R,) its largest micro-batch time."""
    base: float
    """o_i + sum of ``compute``."""
    top: np.ndarray
    """(3,) buckets with the largest micro-batch times, padded with -2."""
    top_values: np.ndarray
    """(3,) those times, padded with 0."""


def _row(load: LoadModel, d: np.ndarray, i: int) -> _Row:
    compute, largest = load.row_cost(i, np.arange(d.shape[1]), -(-d[i] // load.n_replicas[i]))
    top = np.argsort(-largest, kind="stable")[:3]
    pad = 3 - top.size
    return _Row(
        compute=compute,
        largest=largest,
        base=float(load.overhead_s[i] + compute.sum()),
        top=np.concatenate((top, np.full(pad, -2))),
        top_values=np.concatenate((largest[top], np.zeros(pad))),
    )


def _class_time(load: LoadModel, row: _Row, i: int) -> float:
    return row.base + float(load.bubble_slots[i]) * float(row.top_values[0])


def _times_after(
    load: LoadModel,
    row: _Row,
    d: np.ndarray,
    i: int,
    lose_j: np.ndarray,
    lose_amount: np.ndarray,
    gain_j: np.ndarray,
    gain_amount: np.ndarray,
) -> np.ndarray:
    """Class i's time after losing ``lose_amount`` of bucket ``lose_j`` and gaining ``gain_amount`` of ``gain_j``.

    Arguments broadcast against each other; an amount of 0 leaves its bucket as it is. The
    two buckets of one candidate must differ when both amounts are non-zero. Only the two
    buckets' terms are recomputed; the bubble's max over the other buckets comes from the
    row's top three.
    """
    p = load.n_replicas[i]
    new_lose, big_lose = load.row_cost(i, lose_j, -(-(d[i, lose_j] - lose_amount) // p))
    new_gain, big_gain = load.row_cost(i, gain_j, -(-(d[i, gain_j] + gain_amount) // p))
    total = row.base + (new_lose - row.compute[lose_j]) + (new_gain - row.compute[gain_j])
    if load.bubble_slots[i] == 0:
        return total
    lose_j = np.where(lose_amount != 0, lose_j, -1)
    gain_j = np.where(gain_amount != 0, gain_j, -1)
    others = np.full(np.broadcast_shapes(lose_j.shape, gain_j.shape), row.top_values[2])
    for rank in (1, 0):
        others = np.where((lose_j != row.top[rank]) & (gain_j != row.top[rank]), row.top_values[rank], others)
    bubble = np.maximum(others, np.maximum(np.where(lose_j >= 0, big_lose, 0.0), np.where(gain_j >= 0, big_gain, 0.0)))
    return total + float(load.bubble_slots[i]) * bubble


def _best_exchange(
    load: LoadModel,
    allowed: np.ndarray,
    d: np.ndarray,
    rows: list[_Row],
    sizes: tuple[np.ndarray, np.ndarray],
    c: int,
    k: int,
) -> tuple[float, tuple[int, int, int, int]] | None:
    """The exchange between the slowest class c and class k with the least max(T_c', T_k')."""
    give = np.flatnonzero((d[c] > 0) & allowed[k])
    if give.size == 0:
        return None
    out_j, out_amount = _pair_sizes(*sizes, d, c, k, give)
    back_j, back_amount = _pair_sizes(*sizes, d, k, c, np.flatnonzero((d[k] > 0) & allowed[c]))
    # column 0: nothing back (an amount of 0 changes nothing, whatever its bucket)
    in_j = np.concatenate(([0], back_j))[None, :]
    in_amount = np.concatenate(([0], back_amount))[None, :]
    out_j, out_amount = out_j[:, None], out_amount[:, None]
    worst = np.maximum(
        _times_after(load, rows[c], d, c, out_j, out_amount, in_j, in_amount),
        _times_after(load, rows[k], d, k, in_j, in_amount, out_j, out_amount),
    )
    worst = np.where((out_j == in_j) & (in_amount > 0), np.inf, worst)
    a, e = np.unravel_index(int(np.argmin(worst)), worst.shape)
    return float(worst[a, e]), (int(out_j[a, 0]), int(out_amount[a, 0]), int(in_j[0, e]), int(in_amount[0, e]))


def _exchange_search(load: LoadModel, allowed: np.ndarray, d: np.ndarray) -> np.ndarray:
    d = d.copy()
    rows = [_row(load, d, i) for i in range(len(load.classes))]
    for _ in range(_MAX_EXCHANGES):
        times = [_class_time(load, row, i) for i, row in enumerate(rows)]
        c = int(np.argmax(times))
        sizes = _move_sizes(load, d)
        best = None
        for k in range(len(load.classes)):
            found = _best_exchange(load, allowed, d, rows, sizes, c, k) if k != c else None
            if found is not None and found[0] < times[c] * (1 - _REL_TOL) and (best is None or found[0] < best[0]):
                best = (found[0], k, found[1])
        if best is None:
            return d
        _, k, (j, amount, back_j, back_amount) = best
        d[c, j] -= amount
        d[k, j] += amount
        d[k, back_j] -= back_amount
        d[c, back_j] += back_amount
        rows[c], rows[k] = _row(load, d, c), _row(load, d, k)
    return d
