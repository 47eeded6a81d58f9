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

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lorafleet.dispatch.load import LoadModel
from lorafleet.solvers import solve_lp
from lorafleet.work import count as count_work

_REL_TOL = 1e-12
"""An exchange must lower the slowest class by more than this fraction (floating-point noise)."""
_MAX_EXCHANGES = 10_000
"""Safety cap on exchanges; each one strictly improves, so it is not reached in practice."""
_BUCKET_KEY = 1 << 40
"""An exchange offer's sort key is bucket * _BUCKET_KEY + amount (amounts are sequence counts, far below)."""
_NO_OFFER = 1 << 62
"""Keys from this up are no offer (they sort last): this plus an amount, or this."""


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
    count_work("balances")
    search = _Search(load, allowed)
    empty = np.zeros(allowed.shape, dtype=np.int64)
    starts = (
        _water_fill(search, empty),
        _water_fill(search, _lp_rounded(load, allowed)),
        _whole_buckets(load, allowed),
    )
    ends: dict[bytes, np.ndarray] = {}
    best = min((_exchange_search(search, d, ends) for d in starts), key=load.makespan)
    return Assignment(counts=best, makespan_s=load.makespan(best))


def _water_fill(search: _Search, start: np.ndarray) -> np.ndarray:
    """Add each bucket's sequences not yet in ``start`` (K, R), longest bucket first, at the least level."""
    load, allowed = search.load, search.allowed
    d = start.copy()
    rows = _Rows(search, d)
    stale: set[int] = set()  # classes whose rows are behind their totals: renewed when they next take with others
    missing = (load.counts - d.sum(axis=0)).tolist()  # a bucket's column changes only at its own turn
    for j in (-load.boundaries).argsort(kind="stable").tolist():
        total = missing[j]
        if total == 0:
            continue
        takers = allowed[:, j].nonzero()[0]
        if takers.size == 1:  # alone, it holds them all (its curve's total-th value is its largest)
            d[takers, j] += total
            stale.add(int(takers[0]))
            continue
        renew = [t for t in takers.tolist() if t in stale]
        if renew:
            rows.update(search, d, np.array(renew))
            stale.difference_update(renew)
        take = _fill_takes(search, rows, d, takers, j, total)
        d[takers, j] += take
        stale.update(takers[take > 0].tolist())
    return d


def _fill_takes(search: _Search, rows: _Rows, d: np.ndarray, takers: np.ndarray, j: int, total: int) -> np.ndarray:
    """(takers,) how many more of bucket j each taker holds when they take ``total`` at the least level: with
    T_t(x) taker t's time holding x more (:func:`_fill_times`) and curve_t(x) = max_{y <= x} T_t(y) (the running
    max makes a curve monotone even for cost models with a negative coefficient), the level tau is the total-th
    smallest of all curve_t(x), x = 1..total, and taker t holds the x >= 1 with curve_t(x) <= tau; on ties at tau,
    the takers whose curve is highest there give theirs back first. A large bucket ranks only the start of each
    curve (:func:`_capped_curves`): takers x sequences from :data:`_GUESS_FROM`."""
    bubble = any(search.pipelined[k] for k in takers.tolist())
    if takers.size * total < _GUESS_FROM:  # whole curves, one row a taker
        curve = _fill_times(search, rows, d, takers[:, None], j, np.arange(total + 1), bubble)
        np.maximum.accumulate(curve, axis=1, out=curve)
        tau = curve[:, 1:].flatten()  # a copy, partitioned in place (array methods: no numpy wrapper a bucket)
        tau.partition(total - 1)
        take = (curve[:, 1:] <= tau[total - 1]).sum(axis=1)
        at_take = curve[np.arange(takers.size), take]  # each curve at its take
    else:
        curve, first, level = _capped_curves(search, rows, d, takers, j, total, bubble)
        below = curve <= level
        below[first] = False  # x = 0
        take = np.add.reduceat(below, first, dtype=np.int64)
        at_take = curve.take(first + take)
    surplus = int(take.sum()) - total
    if surplus:
        for t in (-at_take).argsort(kind="stable"):
            cut = min(surplus, int(take[t]))
            take[t] -= cut
            surplus -= cut
            if not surplus:
                break
    return take


def _capped_curves(
    search: _Search, rows: _Rows, d: np.ndarray, takers: np.ndarray, j: int, total: int, bubble: bool
) -> tuple[np.ndarray, np.ndarray, float]:
    """The takers' curves (:func:`_fill_takes`) at x = 0..cap_t + 1 (at most 0..total), one segment a taker from
    ``first``, and the level tau (``bubble``: as :func:`_fill_times`').

    Only x = 1..cap_t are ranked (cap_t: :func:`_fill_caps`' guess); curve_t(cap_t + 1) is a probe. The
    total-th smallest tau' of the ranked values is tau when every probe lies above tau': the curves are
    monotone, so no value left out lies at or below tau', and tau' >= tau (fewer values ranked); the takes
    counted within the segments are then those of the whole curves too. Takers whose probe does not lie above
    tau' have their cap raised, and all are formed again.
    """
    cap = _fill_caps(search, rows, takers, j, total)
    while True:
        width = np.minimum(cap + 1, total) + 1
        first = np.cumsum(width) - width
        segment = np.repeat(np.arange(takers.size), width)
        x = np.arange(segment.size) - first.take(segment)
        curve = _fill_times(search, rows, d, takers.take(segment), j, x, bubble)
        for at, size in zip(first.tolist(), width.tolist()):
            np.maximum.accumulate(curve[at : at + size], out=curve[at : at + size])
        probe, short = first + width - 1, cap < total
        ranked = np.ones(curve.size, dtype=bool)
        ranked[first] = False
        ranked[probe[short]] = False
        tau = curve[ranked]  # a copy, partitioned in place
        if tau.size >= total:
            tau.partition(total - 1)
            low = short & (curve.take(probe) <= tau[total - 1])
            if not low.any():
                return curve, first, tau[total - 1]
        else:
            low = short
        cap = np.where(low, np.minimum(2 * cap + _CAP_STEP, total), cap)


_CAP_STEP = 8
"""A water-fill taker's cap is its guessed share times 1.5 plus this; a cap too low becomes twice itself plus this."""
_GUESS_FROM = 2048
"""Water-filling ranks every taker's whole curve where takers x sequences is below this (there a guess costs
more calls than it saves arithmetic)."""


def _fill_caps(search: _Search, rows: _Rows, takers: np.ndarray, j: int, total: int) -> np.ndarray:
    """(takers,) how many more of bucket j each taker may take, guessed (only the time it takes hangs on it):
    1.5 times its share of ``total`` when all fill to one level lambda on the LP's rates a_tj from their times now
    T_t, sum_t max(0, lambda - T_t) / a_tj = total, plus :data:`_CAP_STEP`; ``total`` where a rate is not
    positive."""
    rate = search.rate[takers, j]
    if not np.all(np.isfinite(rate) & (rate > 0)):
        return np.full(takers.size, total)
    now = rows.base[takers] + search.load.bubble_slots[takers] * rows.largest[takers]
    order = now.argsort()
    low, speed = now[order], 1 / rate[order]
    level = (total + np.cumsum(low * speed)) / np.cumsum(speed)  # the level when the k + 1 lowest take all
    reached = np.flatnonzero(level[:-1] <= low[1:])  # the next one's time is not reached
    share = np.maximum(level[reached[0] if reached.size else -1] - now, 0.0) / rate
    return np.minimum(np.ceil(1.5 * share) + _CAP_STEP, total).astype(np.int64)  # capped as floats: no overflow


def _whole_buckets(load: LoadModel, allowed: np.ndarray) -> np.ndarray:
    """LPT over whole buckets: the costliest bucket first, each to the class that then finishes first."""
    d = np.zeros(allowed.shape, dtype=np.int64)
    classes = np.arange(len(load.classes))
    rows = -(-load.counts[None, :] // load.n_replicas[:, None])
    alone = np.where(allowed, load.row_cost(classes[:, None], np.arange(d.shape[1]), rows)[0], np.inf)
    for j in np.argsort(-alone.min(axis=0), kind="stable"):
        if load.counts[j] == 0:
            continue
        takers = np.flatnonzero(allowed[:, j])
        trial = d[takers]  # each taker's totals with the whole bucket added
        trial[:, j] = load.counts[j]
        d[takers[int(np.argmin(load.times(trial, takers)))], j] = load.counts[j]
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
    return _min_max_lp(load, allowed, _lp_rates(load), load.overhead_s)


def _lp_rates(load: LoadModel) -> np.ndarray:
    """(K, R) a_ij = (alpha_ij + beta_ij / b_ij) / p_i: a sequence of bucket j on class i, amortised over its
    micro-batch and the class's replicas (see module docstring)."""
    return (load.per_seq_s + load.per_microbatch_s / np.maximum(load.microbatch_rows, 1)) / load.n_replicas[:, None]


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
    count_work("lp_solves")
    solved = solve_lp(cost, a_ub, b_ub, a_eq, b_eq)
    if solved is None:
        return None
    x = np.zeros(allowed.shape)
    x[cls, bucket] = solved[:n]
    return float(solved[-1]), x


def _lp_rounded(load: LoadModel, allowed: np.ndarray) -> np.ndarray:
    """The LP relaxation's x_ij (see module docstring) rounded down to multiples of p_i."""
    solved = _fluid_lp(load, allowed)
    if solved is None:  # numerical trouble: water-filling alone takes over
        return np.zeros(allowed.shape, dtype=np.int64)
    p = load.n_replicas[:, None]
    d = np.floor(solved[1] / p + 1e-9).astype(np.int64) * p
    return np.minimum(d, load.counts[None, :])


class _Search:
    """What every search of one balance reads, laid out once (the searches make thousands of numpy calls on
    arrays of a few dozen elements, so what a call costs, not its arithmetic, is their time): the flat
    position of each (class, bucket) in the cost tables; the largest micro-batch table times the class's
    ``bubble_slots`` (s max(x, y) = max(s x, s y) exactly for s >= 0: rounding is monotone, so the bubble
    is the largest of scaled times); which classes have a bubble; the (giver, receiver) pairs of an exchange
    where every other class may take (formed at a giver's first such exchange); :func:`_move_sizes`' buffer
    and :func:`_best_exchange`'s signs; the LP's rates (:func:`_fill_caps` guesses from them)."""

    def __init__(self, load: LoadModel, allowed: np.ndarray) -> None:
        n_classes, n_buckets = allowed.shape
        self.load, self.allowed, self.n_buckets = load, allowed, n_buckets
        self.replicas = load.n_replicas[:, None]
        self.microbatch = np.maximum(load.microbatch_rows, 1)
        stride = load.compute_table.shape[1]
        self.table_at = load.table_start[None, :n_buckets] + np.arange(n_classes)[:, None] * stride
        self.compute_table, self.largest_table = load.compute_table.ravel(), load.largest_table.ravel()
        self.bubble_table = (load.largest_table * load.bubble_slots[:, None]).ravel()
        # _move_sizes' (2, K, R, 4) amounts: what each class gives (0) and takes (1); the last two taken
        # amounts, one row and one micro-batch on every replica, do not depend on the totals
        self.sizes = np.empty((2, n_classes, n_buckets, 4), dtype=np.int64)
        self.sizes[1, :, :, 2] = self.replicas
        self.sizes[1, :, :, 3] = self.replicas * self.microbatch
        # an exchange table's signs, sliced [most - wide : most + 1 + back]: c loses what it gives (as many as
        # 8 amounts a bucket) and gains what comes back, the taker the other way round
        self.most = 8 * n_buckets
        self.signs = np.repeat(np.array([[[-1, 0, 1]], [[1, 0, -1]]]), [self.most, 1, self.most], axis=2)
        self.offer_keys = np.where(allowed, np.arange(n_buckets) * _BUCKET_KEY, _NO_OFFER)  # a receiver's keys
        self.rate = _lp_rates(load)
        self.pipelined = (load.bubble_slots > 0).tolist()
        self.pairs_all: dict[int, np.ndarray] = {}  # by c, formed when c first gives to all others


def _pairs(c: int, takers: list[int]) -> np.ndarray:
    """(2n, 2) the (giver, receiver) of an exchange's offers: c to each taker, then each taker to c."""
    return np.array([(c, k) for k in takers] + [(k, c) for k in takers], dtype=np.int64).reshape(-1, 2)


def _move_sizes(search: _Search, d: np.ndarray) -> np.ndarray:
    """Candidate amounts, per (class, bucket): (2, K, R, 4), [0] when the class gives and [1] when it takes.

    Giving: one row fewer on every replica, one micro-batch fewer on every replica, half,
    everything. Taking: what fills its open rows, what fills its open micro-batches, one more
    row and one more micro-batch on every replica. :func:`_best_exchange` clips them to what the giver
    holds. In the buffer ``search.sizes``, valid until the next call.
    """
    p, b, sizes = search.replicas, search.microbatch, search.sizes
    rows = -(-d // p)
    open_rows = np.subtract(p * rows, d, out=sizes[1, :, :, 0])
    open_microbatches = np.subtract(p * b * -(-rows // b), d, out=sizes[1, :, :, 1])
    np.subtract(p, open_rows, out=sizes[0, :, :, 0])  # d - (p rows - p): one row fewer on every replica
    np.subtract(sizes[1, :, :, 3], open_microbatches, out=sizes[0, :, :, 1])
    np.floor_divide(d, 2, out=sizes[0, :, :, 2])
    sizes[0, :, :, 3] = d
    return sizes


def _changes(
    search: _Search, rows: _Rows, d: np.ndarray, i: np.ndarray | int, j: np.ndarray | int, amount: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What changing class ``i``'s totals of bucket ``j`` by ``amount`` (signed; 0 leaves it) does to its row,
    elementwise over broadcastable shapes: ``(compute, rank, bubble)``, the change of the bucket's compute
    time, the bucket's :class:`_Rows` rank where the amount is non-zero (else 0), and ``bubble_slots`` times
    the bucket's new largest micro-batch time where the amount is non-zero (else 0). :func:`_times` combines
    two of them."""
    at = i * search.n_buckets + j  # (class, bucket), flat
    held = d.take(at) + amount
    table = search.table_at.take(at) - (-held // search.replicas.take(i))
    moved = amount != 0
    return (
        search.compute_table.take(table) - rows.compute.take(at),
        rows.rank.take(at) * moved,
        search.bubble_table.take(table) * moved,
    )


def _fill_times(
    search: _Search, rows: _Rows, d: np.ndarray, who: np.ndarray, j: int, x: np.ndarray, bubble: bool
) -> np.ndarray:
    """Class ``who``'s time holding ``x`` more of bucket j, no other bucket changing, elementwise over their
    broadcast shapes (:func:`_times` of that one change, elementwise alike): base + (the bucket's compute time
    then - now), plus bubble_slots * the largest of 0, the bucket's new largest micro-batch time and that of the
    buckets it leaves alone (``rows.pick`` at its rank). At x = 0 that is the class's time now: the bucket's
    micro-batch time is its current one, and with those it leaves alone it makes the largest of all of them.
    ``bubble``: whether some class of ``who`` has a bubble (else it is 0 and not formed)."""
    at = who * search.n_buckets + j
    table = search.table_at.take(at) - (-(d.take(at) + x) // search.replicas.take(who))
    times = rows.base.take(who) + (search.compute_table.take(table) - rows.compute.take(at))
    if not bubble:
        return times
    left = rows.pick.take(who * _PICKS + rows.rank.take(at))  # at 3 * 0 + rank
    np.maximum(left, 0.0, out=left)
    times += np.maximum(search.bubble_table.take(table), left)
    return times


def _times(
    search: _Search,
    rows: _Rows,
    i: np.ndarray | int,
    first: Sequence[np.ndarray],
    second: Sequence[np.ndarray],
    bubble: bool,
) -> np.ndarray:
    """Class ``i``'s times after two changes of different buckets (:func:`_changes`, broadcast against each
    other): ``base + first + second``, plus the bubble ``bubble_slots * max`` of the largest micro-batch times
    of the buckets neither changes (``rows.pick`` by the two changes' ranks) and the two buckets' new ones.
    Elementwise, in the order :class:`_Rows` keeps, so a candidate's time does not depend on which others
    are scored with it. ``bubble``: whether some class of ``i`` has a bubble (else it is 0 and not formed)."""
    total = rows.base[i] + first[0] + second[0]
    if not bubble:
        return total
    largest = rows.pick.take(i * _PICKS + first[1] * 3 + second[1])  # both already times bubble_slots
    np.maximum(largest, first[2], out=largest)
    np.maximum(largest, second[2], out=largest)
    total += largest
    return total


_PICKED = np.array([0, 1, 0, 2])[np.bitwise_or.outer(np.arange(3), np.arange(3)).ravel()]
"""``_Rows.pick`` from the top three, by the ranks (r, r') of a candidate's two changes at 3 r + r': the largest
it leaves alone, by the bits r | r' of which of the first two it changes (0: top 0, 1: top 1, 2: top 0, 3: top 2)."""
_PICKS = _PICKED.size
"""``_Rows.pick`` entries a class."""


_RANKS = np.array([1, 2])
"""``_Rows.rank`` of the buckets with the largest and the second largest micro-batch time."""


class _Rows:
    """Every class's per-bucket costs under the current totals d (K, R): what candidate changes are
    scored against. Row i: the compute time of each bucket's rows on the class's slowest replica, ``base``
    = o_i + their sum, ``largest`` its largest micro-batch time (the class's time is base + bubble_slots *
    largest), and the three buckets with the largest micro-batch times (times 0 past the row's buckets).
    ``rank`` marks the first two of them: 1 at bucket top[0], 2 at top[1], else 0; ``pick[3 r + r']`` is
    bubble_slots times the largest micro-batch time of the buckets a candidate leaves alone when its two
    changes have ranks r and r' (rank 0 if both are free, else rank 1 if free, else rank 2)."""

    def __init__(self, search: _Search, d: np.ndarray) -> None:
        n_classes, n_buckets = d.shape
        self.compute = np.zeros((n_classes, n_buckets))
        self.base, self.largest = np.zeros(n_classes), np.zeros(n_classes)
        self.rank = np.zeros((n_classes, n_buckets), dtype=np.int64)
        self.pick = np.zeros((n_classes, _PICKS))
        self.update(search, d, np.arange(n_classes))

    def update(self, search: _Search, d: np.ndarray, i: np.ndarray) -> None:
        """The rows of classes ``i`` (distinct) again, after their totals changed; all in one pass, each row as
        it would be alone (the sums and sorts run along a row)."""
        at = (search.table_at - (-d // search.replicas))[i]
        compute, largest = search.compute_table.take(at), search.largest_table.take(at)
        self.compute[i] = compute
        base = search.load.overhead_s[i] + compute.sum(axis=1)
        self.base[i] = base
        values = np.sort(largest, axis=1)[:, :-4:-1]  # the three largest, decreasing
        if values.shape[1] < 3:
            values = np.concatenate((values, np.zeros((i.size, 3 - values.shape[1]))), axis=1)
        self.largest[i] = values[:, 0]
        slots = search.load.bubble_slots[i]
        top = (-largest).argsort(axis=1, kind="stable")[:, :2]  # the first two of them
        self.rank[i] = 0
        self.rank[i[:, None], top] = _RANKS[: top.shape[1]]
        self.pick[i] = values[:, _PICKED] * slots[:, None]


def _best_exchange(
    search: _Search, d: np.ndarray, rows: _Rows, sizes: np.ndarray, c: int
) -> tuple[float, int, tuple[int, int, int, int]] | None:
    """The exchange between the slowest class c and any other class k with the least max(T_c', T_k'),
    scored for every k at once: the first k, then the first candidate of it, among equals (None: c
    can give nothing to anyone).

    Class c gives some of a bucket j it holds to k and takes back nothing or some of a bucket it can
    hold that k holds; the amounts of bucket j tried are the giver's and the receiver's ``sizes``
    (:func:`_move_sizes`) clipped to 1 .. what the giver holds, each once, in increasing order.
    """
    allowed = search.allowed
    out_mask = allowed & (d[c] > 0)
    out_mask[c] = False
    takers = out_mask.any(axis=1).nonzero()[0]  # the classes c can give something to, in order
    if takers.size == 0:
        return None
    n, taker_list = takers.size, takers.tolist()
    # Both sides' offers in one pass: rows 0..n-1 what c gives each taker, rows n.. what each taker gives back
    # (the giver's sizes and holdings, the receiver's sizes and whether it may hold the bucket).
    pairs = search.pairs_all.get(c) if n == d.shape[0] - 1 else _pairs(c, taker_list)
    if pairs is None:
        pairs = search.pairs_all[c] = _pairs(c, taker_list)
    giver = pairs[:, 0]
    held = d[giver]
    # (2n, 2, R, 4): the giver's 4 amounts of each bucket and the receiver's 4, clipped to 1 .. held
    amounts = sizes[_PAIR, pairs]
    np.maximum(amounts, 1, out=amounts)
    np.minimum(amounts, held[:, None, :, None], out=amounts)
    # one key per offer, ordered as (bucket, amount); repeats and what the pair may not move sort last
    amounts += np.where(held > 0, search.offer_keys[pairs[:, 1]], _NO_OFFER)[:, None, :, None]
    keys = amounts.reshape(2 * n, -1)
    keys.sort(axis=1)
    np.copyto(keys[:, 1:], _NO_OFFER, where=keys[:, 1:] == keys[:, :-1])  # many coincide (half = one row fewer)
    keys.sort(axis=1)
    width = np.add.reduce(keys < _NO_OFFER, axis=1).tolist()
    wide, back = max(width[:n]), max(width[n:])
    # Every candidate side in one (n, wide + 1 + back) table: the columns are what c gives (lost by c, gained by
    # the taker), nothing (key 0: an amount of 0 changes nothing), then what comes back (the other way round).
    table = np.concatenate((keys[:n, :wide], np.zeros((n, 1), dtype=np.int64), keys[n:, :back]), axis=1)
    absent = table >= _NO_OFFER
    np.copyto(table, 0, where=absent)
    moved_j, moved = np.divmod(table, _BUCKET_KEY)
    signs = search.signs[:, :, search.most - wide : search.most + 1 + back]
    # (2, n, columns): class c's changes, then each taker's
    side = _changes(search, rows, d, giver.reshape(2, n, 1), moved_j, moved * signs)
    np.copyto(side[0][0], np.inf, where=absent)  # no such offer: the candidate is never taken
    gives, back_in = (slice(None), slice(None, wide), None), (slice(None), None, slice(wide, None))
    c_side, k_side = [x[0] for x in side], [x[1] for x in side]
    c_gives, c_takes = [x[gives] for x in c_side], [x[back_in] for x in c_side]
    worst = _times(search, rows, c, c_gives, c_takes, search.pipelined[c])
    k_gives, k_takes = [x[back_in] for x in k_side], [x[gives] for x in k_side]
    k_bubble = any(search.pipelined[k] for k in taker_list)
    np.maximum(worst, _times(search, rows, takers[:, None, None], k_gives, k_takes, k_bubble), out=worst)
    out_j, in_j, in_amount = moved_j[:, :wide], moved_j[:, wide:], moved[:, wide:]
    np.copyto(worst, np.inf, where=out_j[:, :, None] == np.where(in_amount > 0, in_j, -1)[:, None, :])
    first = int(worst.argmin())
    least = float(worst.flat[first])
    if not math.isfinite(least):
        return None
    taker, a, e = first // (wide * worst.shape[2]), first // worst.shape[2] % wide, first % worst.shape[2]
    return (
        least,
        int(takers[taker]),
        (int(out_j[taker, a]), int(moved[taker, a]), int(in_j[taker, e]), int(in_amount[taker, e])),
    )


_PAIR = np.array([0, 1])
"""0, 1: ``_move_sizes``' sides (an offer's giver gives, its receiver takes); a water-fill taker's x = 0, x > 0."""


def _exchange_search(search: _Search, d: np.ndarray, ends: dict[bytes, np.ndarray]) -> np.ndarray:
    """Exchanges (:func:`_best_exchange`) from ``d`` until none improves. The search is a function of the
    totals alone, so a start that reaches totals an earlier start passed through ends where that one
    ended: ``ends`` maps every totals passed through to its end, and is added to."""
    d = d.copy()
    rows = _Rows(search, d)
    path = []
    for _ in range(_MAX_EXCHANGES):
        state = d.tobytes()
        if state in ends:
            d = ends[state]
            break
        path.append(state)
        times = rows.base + search.load.bubble_slots * rows.largest
        c = int(times.argmax())
        best = _best_exchange(search, d, rows, _move_sizes(search, d), c)
        if best is None or not best[0] < times[c] * (1 - _REL_TOL):
            break
        _, k, (j, amount, back_j, back_amount) = best
        d[c, j] -= amount
        d[k, j] += amount
        d[k, back_j] -= back_amount
        d[c, back_j] += back_amount
        rows.update(search, d, np.array([c, k]))
    else:
        return d  # the safety cap: not an end another start may take
    ends.update(dict.fromkeys(path, d))
    return d
