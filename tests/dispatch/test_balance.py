"""Balancers: the MILP is exact for the load model, the fast method is close to it, the baseline is LobRA's."""

from __future__ import annotations

import itertools

import numpy as np
import pulp
import pytest

from lorafleet.dispatch.balance import balance_by_length
from lorafleet.dispatch.ilp import build_model, solve_dispatch_ilp
from lorafleet.dispatch.load import config_classes
from lorafleet.dispatch.microbatch import padded_microbatches
from lorafleet.dispatch.placement import interleave, place_sequences, placed_times
from lorafleet.dispatch.step import choose_buckets
from lorafleet.presets import LOBRA_7B_PLAN, TP1, TP2, TP2_PP2, TP4, TP8, lobra_7b_cost_model, make_batch, make_plan
from lorafleet.solvers import SolverName, solve
from lorafleet.specs.dispatch import DispatchOptions, MicroBatchMode

COST_MODEL = lobra_7b_cost_model()


def small_load(layout, n_seqs: int, n_buckets: int, seed: int, mode: MicroBatchMode = MicroBatchMode.PADDING):
    """A random batch fitting ``layout``, bucketed, with its load model and fast assignment (a load model does
    not depend on the pipeline window: ``test_the_load_model_charges_a_drain_whatever_the_window``)."""
    cost_model = COST_MODEL
    rng = np.random.default_rng(seed)
    plan = make_plan(layout)
    largest = max(r.max_tokens for r in plan.replicas)
    lengths = np.minimum(rng.lognormal(6.0, 1.2, n_seqs).astype(np.int64) + 1, largest)
    batch = make_batch(lengths, rng.integers(0, 4, n_seqs))
    options = DispatchOptions(n_buckets=n_buckets, microbatch_mode=mode)
    _, load, fast = choose_buckets(batch, config_classes(plan, cost_model), cost_model, options)
    return batch, plan, load, fast


def all_assignments(load):
    """Every split of every bucket's count over the classes that can hold it."""
    per_bucket = []
    for j, total in enumerate(load.counts):
        takers = np.flatnonzero(load.feasible[:, j])
        splits = []
        for cut in itertools.product(range(total + 1), repeat=takers.size - 1):
            if sum(cut) <= total:
                column = np.zeros(len(load.classes), dtype=np.int64)
                column[takers] = [*cut, total - sum(cut)]
                splits.append(column)
        per_bucket.append(splits)
    for columns in itertools.product(*per_bucket):
        yield np.stack(columns, axis=1)


@pytest.mark.parametrize(
    "layout,seed",
    [
        (((TP1, 2), (TP2, 1)), 0),
        (((TP1, 3), (TP4, 1)), 1),
        (((TP1, 2), (TP2_PP2, 1)), 2),  # pipelined: the bubble constraints
        (((TP2_PP2, 1), (TP8, 1)), 3),
    ],
)
def test_milp_optimum_equals_brute_force(layout, seed):
    _, _, load, fast = small_load(layout, n_seqs=9, n_buckets=3, seed=seed)
    best = min(load.makespan(d) for d in all_assignments(load))
    outcome = solve_dispatch_ilp(load, SolverName.CBC, time_limit_s=30, gap_rel=1e-9, upper_bound_s=fast.makespan_s)
    assert outcome.result.proven_optimal
    assert outcome.assignment.makespan_s == pytest.approx(best, rel=1e-6)
    assert outcome.result.objective == pytest.approx(best, rel=1e-6)
    assert np.array_equal(outcome.assignment.counts.sum(axis=0), load.counts)
    assert fast.makespan_s >= best - 1e-12


@pytest.mark.parametrize("seed", range(6))
def test_milp_families_reproduce_the_load_model(seed):
    """With every d_ij fixed, the MILP's T (coverage, ceil, fragment, bubble, makespan) is the load model's makespan."""
    layout = [((TP1, 3), (TP2_PP2, 1), (TP8, 1)), ((TP1, 6), (TP2, 1), (TP8, 1))][seed % 2]
    _, _, load, fast = small_load(layout, n_seqs=40, n_buckets=5, seed=seed)
    rng = np.random.default_rng(seed)
    d = np.zeros_like(fast.counts)
    for j, total in enumerate(load.counts):  # a random split, not an optimised one
        takers = np.flatnonzero(load.feasible[:, j])
        d[takers, j] = np.bincount(rng.choice(takers.size, total), minlength=takers.size)
    problem, v = build_model(load)
    for (i, j), var in v.d.items():
        problem += var == int(d[i, j]), f"fix_{i}_{j}"
    result = solve(problem, SolverName.CBC, time_limit_s=30, gap_rel=1e-9)
    assert result.objective == pytest.approx(load.makespan(d), rel=1e-6)


def test_load_model_is_the_cost_model_in_padding_mode():
    """When each class's totals are multiples of its replica count, every replica's estimate equals T_i."""
    batch, plan, load, fast = small_load(LOBRA_7B_PLAN, n_seqs=300, n_buckets=8, seed=7)
    p = load.n_replicas[:, None]
    d = fast.counts // p * p
    d[-1] += load.counts - d.sum(axis=0)  # the rest to the <8,1> class (p = 1), which holds every bucket
    held = place_sequences(
        load, d, np.searchsorted(load.boundaries, batch.lengths), batch.lengths, batch.task_ids, len(plan.replicas)
    )
    times = load.times(d)
    padded_len = load.boundaries[np.searchsorted(load.boundaries, batch.lengths)]
    for i, cls in enumerate(load.classes):
        for r in cls.replicas:
            mbs = padded_microbatches(held[r], batch.lengths, batch.task_ids, padded_len, cls.max_tokens)
            assert COST_MODEL.replica_time(cls.config, [mb.shape for mb in mbs]) == pytest.approx(times[i], rel=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_placed_times_are_the_cost_model_of_the_placed_replicas_in_padding_mode(seed):
    """Whatever the class totals, a class's slowest replica as placed (``placed_times``, the load
    model's view of the placement) is the cost model's time of its padded micro-batches; with few sequences
    per bucket it is below the all-ceil bound ``load.times`` that the balancers minimise."""
    layouts = [((TP1, 3), (TP2, 2)), ((TP1, 2), (TP2_PP2, 2), (TP8, 1)), ((TP1, 4), (TP2, 2), (TP8, 1))]
    batch, plan, load, fast = small_load(layouts[seed], n_seqs=25, n_buckets=6, seed=seed)
    bucket = np.searchsorted(load.boundaries, batch.lengths)
    held = place_sequences(load, fast.counts, bucket, batch.lengths, batch.task_ids, len(plan.replicas))
    placed = placed_times(load, fast.counts)
    for i, cls in enumerate(load.classes):
        estimates = [
            COST_MODEL.replica_time(
                cls.config,
                [
                    mb.shape
                    for mb in padded_microbatches(
                        held[r], batch.lengths, batch.task_ids, load.boundaries[bucket], cls.max_tokens
                    )
                ],
            )
            for r in cls.replicas
        ]
        assert placed[i] == pytest.approx(max(estimates), rel=1e-9)
    assert np.all(placed <= load.times(fast.counts)) and placed.max() < load.makespan(fast.counts)


def test_the_load_model_charges_a_drain_whatever_the_window():
    """(pp - 1) * largest, LobRA's 1F1B, under W = 1 and W = 8 alike: before dispatch no one knows how
    many micro-batches of how many tasks a pipelined replica gets, hence what a window saves it
    (``dispatch.load``); no pipeline: none. The window is not an input of a load model at all (the cost model
    takes it as an argument where a dispatched step is priced)."""
    _, _, flushed, _ = small_load(((TP1, 2), (TP2_PP2, 1)), n_seqs=30, n_buckets=3, seed=4)
    pp = flushed.pp.astype(float)
    assert np.array_equal(flushed.bubble_slots, pp - 1)


def test_replica_load_beyond_the_step_counts_uses_the_closed_form():
    """Callers with their own row counts (the planner) get T above the step's D_j too, not a neighbour's table entry."""
    _, _, load, _ = small_load(((TP1, 2), (TP2_PP2, 1)), n_seqs=30, n_buckets=3, seed=4)
    for i in range(len(load.classes)):
        b = np.maximum(load.microbatch_rows[i], 1)
        alpha, beta = load.per_seq_s[i], load.per_microbatch_s[i]
        for rows in (load.counts, load.counts * 3 + 1):  # in the tables, beyond them
            expected = (
                load.overhead_s[i]
                + (alpha * rows + beta * np.ceil(rows / b)).sum()
                + (load.pp[i] - 1) * (alpha * np.minimum(rows, b) + beta).max()
            )
            assert load.replica_load(i, rows) == pytest.approx(expected)


@pytest.mark.parametrize("seed", range(10))
def test_fast_is_close_to_exact_on_small_instances(seed):
    layouts = [((TP1, 2), (TP2, 1)), ((TP1, 3), (TP4, 1)), ((TP1, 2), (TP2_PP2, 1), (TP8, 1)), LOBRA_7B_PLAN]
    _, _, load, fast = small_load(layouts[seed % len(layouts)], n_seqs=30 + 7 * seed, n_buckets=3 + seed % 4, seed=seed)
    exact = solve_dispatch_ilp(load, SolverName.CBC, time_limit_s=30, gap_rel=1e-6, upper_bound_s=fast.makespan_s)
    assert exact.result.proven_optimal
    assert exact.assignment.makespan_s <= fast.makespan_s * (1 + 1e-6)
    assert fast.makespan_s <= exact.assignment.makespan_s * 1.03


def test_length_baseline_uses_only_the_tightest_class_and_is_never_better():
    _, _, load, fast = small_load(LOBRA_7B_PLAN, n_seqs=400, n_buckets=16, seed=11)
    baseline = balance_by_length(load)
    max_tokens = np.array([c.max_tokens for c in load.classes])
    for j, s in enumerate(load.boundaries):
        tightest = max_tokens[max_tokens >= s].min()
        assert set(np.flatnonzero(baseline.counts[:, j])) <= set(np.flatnonzero(max_tokens == tightest))
    assert np.array_equal(baseline.counts.sum(axis=0), load.counts)
    assert fast.makespan_s <= baseline.makespan_s


def test_packing_mode_load_model_is_built_and_balanced():
    _, _, load, fast = small_load(LOBRA_7B_PLAN, n_seqs=300, n_buckets=6, seed=5, mode=MicroBatchMode.PACKING)
    assert np.array_equal(fast.counts.sum(axis=0), load.counts)
    assert np.all(fast.counts[~load.feasible] == 0)
    assert fast.makespan_s <= balance_by_length(load).makespan_s


def test_interleave_spreads_owners_in_proportion():
    owners = interleave(np.array([4, 2, 0, 2]))
    assert np.bincount(owners, minlength=4).tolist() == [4, 2, 0, 2]
    assert owners.tolist() == [0, 1, 3, 0, 0, 1, 3, 0]
    for prefix in range(1, owners.size + 1):  # every prefix is split within one of proportional
        share = np.bincount(owners[:prefix], minlength=4)
        assert np.all(np.abs(share - prefix * np.array([4, 2, 0, 2]) / 8) <= 1)


def test_milp_names_are_reviewable():
    _, _, load, fast = small_load(((TP1, 2), (TP8, 1)), n_seqs=20, n_buckets=2, seed=0)
    problem, _ = build_model(load, upper_bound_s=fast.makespan_s)
    names = {v.name for v in problem.variables()}
    assert "makespan" in names and any(n.startswith("d_tp1_pp1_m2048_bucket_0_s") for n in names)
    assert problem.get_constraint_by_name("bound_by_fast") is not None
    assert problem.get_constraint_by_name("makespan_tp8_pp1_m16384") is not None
    assert isinstance(problem.objective, pulp.LpAffineExpression)


@pytest.mark.parametrize("seed", range(4))
def test_the_best_exchange_is_the_least_of_every_candidate_scored_alone(seed):
    """``_best_exchange`` scores every (taker, give, take back) candidate from one table: its answer is the least
    max(T_c', T_k') of the candidates, each re-timed alone from its totals by the load model, and no candidate
    is better (the brute force over the same offers)."""
    from lorafleet.dispatch.balance import _best_exchange, _move_sizes, _Rows, _Search

    _, _, load, _ = small_load(LOBRA_7B_PLAN, n_seqs=200, n_buckets=5, seed=seed, mode=MicroBatchMode.PACKING)
    rng = np.random.default_rng(seed)
    d = np.zeros((len(load.classes), load.counts.size), dtype=np.int64)
    for j, total in enumerate(load.counts):  # a random split of every bucket over the classes that hold it
        takers = np.flatnonzero(load.feasible[:, j])
        d[takers, j] = np.bincount(rng.choice(takers, int(total)), minlength=len(load.classes))[takers]
    c = int(np.argmax(load.times(d)))
    search = _Search(load, load.feasible)
    found = _best_exchange(search, d, _Rows(search, d), _move_sizes(search, d), c)
    give, take = _move_sizes(search, d)
    best = np.inf
    for k in range(len(load.classes)):
        out = [
            (j, x)
            for j in np.flatnonzero((d[c] > 0) & load.feasible[k])
            for x in {int(np.clip(a, 1, d[c, j])) for a in (*give[c, j], *take[k, j])}
        ]
        back = [(0, 0)] + [
            (j, x)
            for j in np.flatnonzero((d[k] > 0) & load.feasible[c])
            for x in {int(np.clip(a, 1, d[k, j])) for a in (*give[k, j], *take[c, j])}
        ]
        for (j, x), (i, y) in itertools.product(out if k != c else [], back):
            if i == j and y:
                continue
            moved = d.copy()
            moved[c, j], moved[k, j], moved[k, i], moved[c, i] = d[c, j] - x, d[k, j] + x, moved[k, i] - y, d[c, i] + y
            best = min(best, load.times(moved)[[c, k]].max())
    assert found is not None and found[0] == pytest.approx(best, rel=1e-12)
    _, k, (j, x, i, y) = found
    moved = d.copy()
    moved[c, j] -= x
    moved[k, j] += x
    moved[k, i] -= y
    moved[c, i] += y
    assert found[0] == pytest.approx(load.times(moved)[[c, k]].max(), rel=1e-12)


def test_cost_tables_float_ceiling_is_the_integer_ceiling():
    """``_row_cost`` takes ceil(n / b) of the rounded float quotient: the integer ceiling for integers below 2**53
    (every product then the one of the integers), checked against integer arithmetic on random and edge counts."""
    from lorafleet.dispatch.load import _row_cost

    rng = np.random.default_rng(0)
    n = np.concatenate((rng.integers(0, 1 << 40, 20_000), np.arange(0, 5000), [(1 << 52) - 1, (1 << 52) + 1]))
    b = np.concatenate((rng.integers(1, 1 << 20, 20_000), rng.integers(1, 70, 5000), [3, 7]))
    alpha, beta = rng.random(n.size), rng.random(n.size)
    compute, largest = _row_cost(alpha, beta, b, n)
    assert np.array_equal(compute, alpha * n + beta * -(-n // b))
    assert np.array_equal(largest, np.where(n > 0, alpha * np.minimum(n, b) + beta, 0.0))


def test_cost_tables_of_no_bucket_are_empty_with_the_first_start():
    """A class set with no bucket (a replay's step where no sequence of a stopped task is left) gives empty tables and
    the start table ``[0]``, as before the tables were built by repeats (a broadcast error then)."""
    from lorafleet.dispatch.load import _cost_tables

    empty = np.zeros((2, 0))
    compute, largest, start = _cost_tables(empty, empty, empty.astype(np.int64), np.zeros(0, dtype=np.int64))
    assert compute.shape == largest.shape == (2, 0) and start.tolist() == [0]
    compute, largest, start = _cost_tables(np.ones((1, 2)), np.ones((1, 2)), np.ones((1, 2)), np.array([2, 1]))
    assert start.tolist() == [0, 3] and compute.tolist() == [[0.0, 2.0, 4.0, 0.0, 2.0]]


@pytest.mark.parametrize("seed", range(3))
def test_rows_updated_together_are_the_rows_built_alone(seed):
    """``_Rows.update`` of several classes at once (the exchange's two, a water-fill's takers) gives, to the bit,
    the rows built from scratch on the new totals: each row's sums and sorts run along that row alone. ``pick``
    holds bubble_slots times the largest micro-batch time a candidate leaves alone, by the ranks of what it
    changes; ``base + bubble_slots * largest`` is the load model's time."""
    from lorafleet.dispatch.balance import _Rows, _Search

    _, _, load, fast = small_load(LOBRA_7B_PLAN, n_seqs=200, n_buckets=5, seed=seed, mode=MicroBatchMode.PACKING)
    rng = np.random.default_rng(seed)
    d = fast.counts.copy()
    search = _Search(load, load.feasible)
    rows = _Rows(search, d)
    for _ in range(5):
        changed = rng.choice(len(load.classes), size=min(2, len(load.classes)), replace=False)
        d[changed] = np.minimum(rng.integers(0, load.counts + 1, (changed.size, load.counts.size)), load.counts)
        rows.update(search, d, changed)
        assert np.array_equal(rows.base + load.bubble_slots * rows.largest, load.times(d))
        for i in range(len(load.classes)):  # each row alone, in one dimension
            compute, largest = load.table_cost(i, np.arange(d.shape[1]), -(-d[i] // load.n_replicas[i]))
            top = (-largest).argsort(kind="stable")[:3]
            values = np.concatenate((largest[top], np.zeros(3 - top.size)))
            assert np.array_equal(rows.compute[i], compute)
            assert rows.base[i] == load.overhead_s[i] + compute.sum()
            assert np.array_equal(np.flatnonzero(rows.rank[i]), np.sort(top[:2]))
            assert [rows.rank[i, b] for b in top[:2]] == list(range(1, top[:2].size + 1))
            for r, r_back in itertools.product(range(3), repeat=2):  # the first of the top three neither changes
                left = next(v for v, rank in zip(values, (1, 2, 3)) if rank not in (r, r_back))
                assert rows.pick[i, 3 * r + r_back] == load.bubble_slots[i] * left


@pytest.mark.parametrize("seed", range(4))
def test_placed_sequences_are_the_deal_by_its_definition(seed):
    """``place_sequences`` (one sort per bucket for every class's deal, then one by replica) holds, replica by
    replica and in order, what the deal gives by its definition: bucket by bucket, longest first, the bucket's
    sequences by (task, length, position) interleaved over the classes, each class's over its replicas'
    ``replica_rows``, appended to each replica in turn. Random totals, so classes of several replicas get shares
    that are not multiples of their size."""
    from lorafleet.dispatch.placement import replica_rows

    batch, plan, load, _ = small_load(((TP1, 5), (TP2, 3), (TP8, 1)), n_seqs=400, n_buckets=6, seed=seed)
    rng = np.random.default_rng(seed)
    counts = np.zeros((len(load.classes), load.counts.size), dtype=np.int64)
    for j, total in enumerate(load.counts):
        takers = np.flatnonzero(load.feasible[:, j])
        counts[takers, j] = np.bincount(rng.choice(takers, int(total)), minlength=len(load.classes))[takers]
    bucket = np.searchsorted(load.boundaries, batch.lengths)
    held = place_sequences(load, counts, bucket, batch.lengths, batch.task_ids, len(plan.replicas))
    expected = [[] for _ in plan.replicas]
    rows = [replica_rows(load, i, counts[i], len(c.replicas)) for i, c in enumerate(load.classes)]
    for i, cls in enumerate(load.classes):  # the rows by their definition: extras to the least loaded so far
        p, by_definition = len(cls.replicas), np.zeros_like(rows[i])
        for j in np.argsort(-load.boundaries, kind="stable"):
            least_loaded = np.argsort(load.replica_load(i, by_definition), kind="stable")
            by_definition[:, j] = counts[i, j] // p
            by_definition[least_loaded[: counts[i, j] % p], j] += 1
        assert np.array_equal(rows[i], by_definition)
    for j in np.argsort(-load.boundaries, kind="stable"):
        members = np.flatnonzero(bucket == j)
        members = members[np.lexsort((members, batch.lengths[members], batch.task_ids[members]))]
        to_class = interleave(counts[:, j])
        for i, cls in enumerate(load.classes):
            mine = members[to_class == i]
            to_replica = interleave(rows[i][:, j])
            for r, replica in enumerate(cls.replicas):
                expected[replica] += mine[to_replica == r].tolist()
    assert [h.tolist() for h in held] == expected
    assert all(h.dtype == np.int64 for h in held)


@pytest.mark.parametrize("seed", range(3))
def test_a_large_bucket_takes_what_the_whole_curves_give(seed, monkeypatch):
    """``_fill_takes`` ranks only the start of each taker's curve when a bucket is large: its takes are those of the
    definition over the whole curves (tau the total-th smallest of every running-max curve at x = 1..total, each
    taker holding its x <= tau, ties given back by the highest curve there), whether the guessed caps are ample
    or too low (zero: each is raised until the probes lie above the level). The curves are the load model's
    times of the takers holding x more."""
    from lorafleet.dispatch import balance

    _, _, load, _ = small_load(LOBRA_7B_PLAN, n_seqs=1500, n_buckets=3, seed=seed)
    rng = np.random.default_rng(seed)
    search = balance._Search(load, load.feasible)
    checked = 0
    for j, count in enumerate(load.counts.tolist()):
        takers = np.flatnonzero(load.feasible[:, j])
        d = np.zeros((len(load.classes), load.counts.size), dtype=np.int64)
        d[:, :j] = balance._water_fill(search, d)[:, :j]  # the buckets before it placed, a random part of it too
        d[takers, j] = rng.integers(0, count // (2 * takers.size) + 1, takers.size)
        total = count - int(d[:, j].sum())
        if takers.size < 2 or takers.size * total < balance._GUESS_FROM:
            continue
        rows = balance._Rows(search, d)
        bubble = bool(np.any(load.bubble_slots[takers] > 0))
        curve = balance._fill_times(search, rows, d, takers[:, None], j, np.arange(total + 1), bubble)
        for t, x in itertools.product(range(takers.size), (0, 1, total // 2, total)):
            more = d.copy()
            more[takers[t], j] += x
            assert curve[t, x] == pytest.approx(load.times(more)[takers[t]], rel=1e-12)
        curve = np.maximum.accumulate(curve, axis=1)
        tau = np.sort(curve[:, 1:], axis=None)[total - 1]
        expected = (curve[:, 1:] <= tau).sum(axis=1)
        for t in np.argsort(-curve[np.arange(takers.size), expected], kind="stable"):
            expected[t] -= min(int(expected.sum()) - total, int(expected[t]))
        assert expected.sum() == total
        assert np.array_equal(balance._fill_takes(search, rows, d, takers, j, total), expected)
        with monkeypatch.context() as low:
            low.setattr(
                balance, "_fill_caps", lambda _search, _rows, who, _j, _total: np.zeros(who.size, dtype=np.int64)
            )
            assert np.array_equal(balance._fill_takes(search, rows, d, takers, j, total), expected)
        checked += 1
    assert checked > 0
