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
_NO_OFFER = np.iinfo(np.int64).max


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
    empty = np.zeros(allowed.shape, dtype=np.int64)
    starts = (
        _water_fill(load, allowed, empty),
        _water_fill(load, allowed, _lp_rounded(load, allowed)),
        _whole_buckets(load, allowed),
    )
    ends: dict[bytes, np.ndarray] = {}
    best = min((_exchange_search(load, allowed, d, ends) for d in starts), key=load.makespan)
    return Assignment(counts=best, makespan_s=load.makespan(best))


def _water_fill(load: LoadModel, allowed: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Add each bucket's sequences not yet in ``start`` (K, R), longest bucket first, at the least level."""
    d = start.copy()
    rows = _Rows(load, d)
    for j in (-load.boundaries).argsort(kind="stable"):
        total = int(load.counts[j] - d[:, j].sum())
        if total == 0:
            continue
        takers = allowed[:, j].nonzero()[0]
        # (takers, total + 1): time of each taker holding x = 0..total more of bucket j (no other bucket changes);
        # the running max makes each row monotone even for cost models with a negative coefficient
        gain = _changes(load, rows, d, takers[:, None], np.array(j), np.arange(total + 1))
        curve = np.maximum.accumulate(_times(load, rows, takers[:, None], _UNCHANGED, gain), axis=1)
        # The least level tau at which the takers hold them all: taker t holds the x >= 1 more with
        # curve[t, x] <= tau (its row is monotone), so tau is the total-th smallest of curve[:, 1:].
        more = curve[:, 1:]
        tau = more.flatten()  # a copy, partitioned in place (array methods: no numpy wrapper a bucket)
        tau.partition(total - 1)
        take = (more <= tau[total - 1]).sum(axis=1)
        surplus = int(take.sum()) - total
        if surplus:  # ties at tau: the takers whose curve is highest there give theirs back first
            for t in (-curve[np.arange(takers.size), take]).argsort(kind="stable"):
                cut = min(surplus, int(take[t]))
                take[t] -= cut
                surplus -= cut
                if not surplus:
                    break
        d[takers, j] += take
        rows.update(load, d, takers[take > 0])
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


def _move_sizes(load: LoadModel, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Candidate amounts, per (class, bucket): (K, R, 4) when the class gives and (K, R, 4) when it takes.

    Giving: one row fewer on every replica, one micro-batch fewer on every replica, half,
    everything. Taking: what fills its open rows, what fills its open micro-batches, one more
    row and one more micro-batch on every replica. Amounts are clipped to what the giver holds.
    """
    p = load.n_replicas[:, None]
    b = np.maximum(load.microbatch_rows, 1)
    rows = -(-d // p)
    microbatches = -(-rows // b)
    full_rows, full_microbatches = p * rows, p * b * microbatches
    give, take = np.empty((*d.shape, 4), dtype=np.int64), np.empty((*d.shape, 4), dtype=np.int64)
    give[..., 0], give[..., 1], give[..., 2], give[..., 3] = d - full_rows + p, d - full_microbatches + p * b, d // 2, d
    take[..., 0], take[..., 1], take[..., 2], take[..., 3] = full_rows - d, full_microbatches - d, p, p * b
    return give, take


def _offers(
    give: np.ndarray, take: np.ndarray, held: np.ndarray, mask: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct (bucket, amount) offers of each of K pairs, ordered by (bucket, amount): ``(j, amount,
    valid)``, each (K, A), A the most any pair has (``valid`` marks the real ones).

    Pair k may move bucket j where ``mask[k, j]``; the amounts tried are the giver's ``give[k, j]`` and
    the taker's ``take[k, j]`` (4 each, :func:`_move_sizes`), clipped to 1 .. ``held[k, j]``, what the
    giver holds.
    """
    cols = mask.any(axis=0).nonzero()[0]  # the buckets some pair may move (methods: no numpy wrapper a call)
    sizes = np.minimum(np.maximum(np.concatenate((give[:, cols], take[:, cols]), axis=2), 1), held[:, cols, None])
    sizes.sort(axis=2)
    drop = np.empty(sizes.shape, dtype=bool)
    drop[:, :, 0] = False
    drop[:, :, 1:] = sizes[:, :, 1:] == sizes[:, :, :-1]  # many kinds coincide (half = one row fewer, ...)
    drop |= ~mask[:, cols, None]
    # one key per offer, ordered as (bucket, amount); the dropped ones sort last
    keys = np.where(drop, _NO_OFFER, cols[:, None] * _BUCKET_KEY + sizes).reshape(len(sizes), -1)
    keys.sort(axis=1)
    width = int((keys < _NO_OFFER).sum(axis=1).max(initial=0))
    keys = keys[:, :width]
    valid = keys < _NO_OFFER
    return np.where(valid, keys // _BUCKET_KEY, 0), np.where(valid, keys % _BUCKET_KEY, 0), valid


def _changes(
    load: LoadModel, rows: _Rows, d: np.ndarray, i: np.ndarray | int, j: np.ndarray, amount: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What changing class ``i``'s totals of bucket ``j`` by ``amount`` (signed; 0 leaves it) does to its row,
    elementwise over broadcastable shapes: ``(compute, rank, largest)``, the change of the bucket's compute
    time, the bucket's :class:`_Rows` rank where the amount is non-zero (else 0), and the bucket's new largest
    micro-batch time where the amount is non-zero (else 0). :func:`_times` combines two of them."""
    held = d[i, j] + amount
    new, big = load.table_cost(i, j, -(-held // load.n_replicas[i]))
    moved = amount != 0
    return new - rows.compute[i, j], rows.rank[i, j] * moved, np.where(moved, big, 0.0)


_UNCHANGED = (0.0, 0, 0.0)
"""A :func:`_changes` that changes nothing (an amount of 0): no compute, rank 0, no new largest micro-batch."""


def _times(
    load: LoadModel,
    rows: _Rows,
    i: np.ndarray | int,
    lose: tuple[np.ndarray, np.ndarray, np.ndarray],
    gain: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> np.ndarray:
    """Class ``i``'s times after two changes of different buckets (:func:`_changes`, broadcast against each
    other): ``base + lose + gain``, plus the bubble ``bubble_slots * max`` of the largest micro-batch time
    of the buckets neither changes (the first of the row's top three the candidate leaves alone: bit r of
    ``touched`` says it changes bucket top[r], r = 0, 1) and the two buckets' new ones.
    Elementwise, in the order :class:`_Rows` keeps, so a candidate's time does not depend on which others
    are scored with it."""
    total = rows.base[i] + lose[0] + gain[0]
    slots = load.bubble_slots[i]
    if not slots.any():
        return total
    # pick[lose rank | gain rank]: the gain's rank is 0, 1 or 2, so the loss side's three candidates (with its
    # own new largest) are chosen between by the gain's rank, without a gather over every pair
    first, second, third = (np.maximum(rows.pick[i, lose[1] | r], lose[2]) for r in (0, 1, 2))
    bubble = np.where(gain[1] == 0, first, np.where(gain[1] == 1, second, third))
    np.maximum(bubble, gain[2], out=bubble)
    bubble *= slots
    if (slots != 0).all():
        total += bubble
        return total
    return np.where(slots != 0, total + bubble, total)


_PICKED = np.array([0, 1, 0, 2])
"""``_Rows.pick`` from the top three: the largest a candidate leaves alone, by the bits of which of the first two
it changes."""


class _Rows:
    """Every class's per-bucket costs under the current totals d (K, R): what candidate changes are
    scored against. Row i: the compute time of each bucket's rows on the class's slowest replica, its
    largest micro-batch time, ``base`` = o_i + their sum, and the three buckets with the largest
    micro-batch times (times 0 past the row's buckets). ``rank`` marks the first two of them: 1 at
    bucket top[0], 2 at top[1], else 0; ``pick[touched]`` is the largest micro-batch time of the
    buckets a candidate leaves alone, by the two bits of which of those two it changes (rank 0 if
    free, else rank 1 if free, else rank 2)."""

    def __init__(self, load: LoadModel, d: np.ndarray) -> None:
        n_classes, n_buckets = d.shape
        self.compute, self.largest = np.zeros((n_classes, n_buckets)), np.zeros((n_classes, n_buckets))
        self.base = np.zeros(n_classes)
        self.top_values = np.zeros((n_classes, 3))
        self.rank = np.zeros((n_classes, n_buckets), dtype=np.int64)
        self.pick = np.zeros((n_classes, 4))
        self._buckets = np.arange(n_buckets)
        self.update(load, d, np.arange(n_classes))

    def update(self, load: LoadModel, d: np.ndarray, i: np.ndarray) -> None:
        """The rows of classes ``i`` (distinct) again, after their totals changed; all in one pass, each row as
        it would be alone (the sums and sorts run along a row)."""
        compute, largest = load.table_cost(i[:, None], self._buckets, -(-d[i] // load.n_replicas[i, None]))
        top = (-largest).argsort(axis=1, kind="stable")[:, :3]
        self.compute[i], self.largest[i] = compute, largest
        self.base[i] = load.overhead_s[i] + compute.sum(axis=1)
        row = np.arange(i.size)[:, None]
        values = np.zeros((i.size, 3))
        values[:, : top.shape[1]] = largest[row, top]
        self.top_values[i] = values
        rank = np.zeros(compute.shape, dtype=np.int64)
        rank[row, top[:, :2]] = np.arange(1, min(top.shape[1], 2) + 1)
        self.rank[i] = rank
        self.pick[i] = values[:, _PICKED]

    def times(self, load: LoadModel) -> np.ndarray:
        """(K,) the load model's time of each class: ``base + bubble_slots * largest``."""
        return self.base + load.bubble_slots * self.top_values[:, 0]


def _best_exchange(
    load: LoadModel, allowed: np.ndarray, d: np.ndarray, rows: _Rows, sizes: tuple[np.ndarray, np.ndarray], c: int
) -> tuple[float, int, tuple[int, int, int, int]] | None:
    """The exchange between the slowest class c and any other class k with the least max(T_c', T_k'),
    scored for every k at once: the first k, then the first candidate of it, among equals (None: c
    can give nothing to anyone).

    Class c gives some of a bucket j it holds to k (an amount from either side's sizes) and takes
    back nothing or some of a bucket it can hold that k holds.
    """
    give, take = sizes
    out_mask = (d[c] > 0)[None, :] & allowed
    out_mask[c] = False
    takers = out_mask.any(axis=1).nonzero()[0]  # the classes c can give something to, in order
    if takers.size == 0:
        return None
    n = takers.size
    # Both sides' offers in one pass: rows 0..n-1 what c gives each taker, rows n.. what each taker gives back
    # (the giver's sizes and holdings, the receiver's sizes and whether it may hold the bucket).
    giver = np.concatenate((np.full(n, c), takers))
    receiver = np.concatenate((takers, np.full(n, c)))
    held = d[giver]
    j, amount, valid = _offers(give[giver], take[receiver], held, (held > 0) & allowed[receiver])
    width = valid.sum(axis=1)
    wide = int(width[:n].max())
    # column 0 of what comes back: nothing (an amount of 0 changes nothing, whatever its bucket)
    in_width = int(width[n:].max(initial=0))
    zero = np.zeros((n, 1), dtype=np.int64)
    # Every candidate side in one (2n, wide + 1 + in_width) table: class c's rows, then the takers'; the columns
    # are what c gives (lost by c, gained by the taker), then what comes back (the other way round).
    moved_j = np.concatenate((j[:n, :wide], zero, j[n:, :in_width]), axis=1)
    moved = np.concatenate((amount[:n, :wide], zero, amount[n:, :in_width]), axis=1)
    usable = np.concatenate((valid[:n, :wide], zero == 0, valid[n:, :in_width]), axis=1)
    sign = np.ones(moved.shape[1], dtype=np.int64)
    sign[:wide] = -1
    compute, rank, largest = _changes(
        load,
        rows,
        d,
        giver[:, None],
        np.concatenate((moved_j, moved_j)),
        np.concatenate((moved * sign, moved * -sign)),
    )
    np.copyto(compute[:n], np.inf, where=~usable)  # no such offer: the candidate is never taken
    side = (compute, rank, largest)
    c_gives = tuple(x[:n, :wide, None] for x in side)  # c's loss, over the first candidate axis
    c_takes = tuple(x[:n, None, wide:] for x in side)  # c's gain back, over the second
    k_gives = tuple(x[n:, None, wide:] for x in side)
    k_takes = tuple(x[n:, :wide, None] for x in side)
    worst = _times(load, rows, c, c_gives, c_takes)
    np.maximum(worst, _times(load, rows, takers[:, None, None], k_gives, k_takes), out=worst)
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


def _exchange_search(load: LoadModel, allowed: np.ndarray, d: np.ndarray, ends: dict[bytes, np.ndarray]) -> np.ndarray:
    """Exchanges (:func:`_best_exchange`) from ``d`` until none improves. The search is a function of the
    totals alone, so a start that reaches totals an earlier start passed through ends where that one
    ended: ``ends`` maps every totals passed through to its end, and is added to."""
    d = d.copy()
    rows = _Rows(load, d)
    path = []
    for _ in range(_MAX_EXCHANGES):
        state = d.tobytes()
        if state in ends:
            d = ends[state]
            break
        path.append(state)
        times = rows.times(load)
        c = int(times.argmax())
        best = _best_exchange(load, allowed, d, rows, _move_sizes(load, d), c)
        if best is None or not best[0] < times[c] * (1 - _REL_TOL):
            break
        _, k, (j, amount, back_j, back_amount) = best
        d[c, j] -= amount
        d[k, j] += amount
        d[k, back_j] -= back_amount
        d[c, back_j] += back_amount
        rows.update(load, d, np.array([c, k]))
    else:
        return d  # the safety cap: not an end another start may take
    ends.update(dict.fromkeys(path, d))
    return d
