"""dispatch_step end to end: every sequence once, memory respected, rows contiguous by task, never skipped."""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lorafleet.dispatch.ilp as ilp_module
from lorafleet.dispatch import (
    DispatchMethod,
    DispatchOptions,
    MicroBatchMode,
    dispatch_step,
    solve_step,
    task_tokens_per_replica,
)
from lorafleet.dispatch.balance import fluid_bound
from lorafleet.dispatch.load import config_classes
from lorafleet.dispatch.step import choose_buckets
from lorafleet.errors import InputError, SolverFallbackWarning
from lorafleet.presets import (
    LOBRA_7B_PLAN,
    TP1,
    TP2,
    TP2_PP2,
    TP4,
    TP8,
    lobra_7b_cost_model,
    lognormal_batch,
    make_batch,
    make_plan,
)
from lorafleet.solvers import SolveResult, SolverName, SolveStatus
from lorafleet.work import counting

COST_MODEL = lobra_7b_cost_model()
LAYOUTS = [LOBRA_7B_PLAN, ((TP1, 2), (TP2, 1)), ((TP1, 2), (TP2_PP2, 1), (TP8, 1)), ((TP4, 2),), ((TP2, 3), (TP8, 1))]


@st.composite
def dispatch_cases(draw):
    plan = make_plan(draw(st.sampled_from(LAYOUTS)), n_tasks=4)
    largest = max(r.max_tokens for r in plan.replicas)
    n = draw(st.integers(1, 80))
    lengths = draw(st.lists(st.one_of(st.integers(1, 600), st.integers(1, largest)), min_size=n, max_size=n))
    tasks = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    options = DispatchOptions(
        method=draw(st.sampled_from([DispatchMethod.FAST, DispatchMethod.LENGTH])),
        n_buckets=draw(st.integers(1, 8)),
        bucket_alignment=draw(st.sampled_from([1, 16, 64])),
        microbatch_mode=draw(st.sampled_from(list(MicroBatchMode))),
        choose_buckets_by_makespan=draw(st.booleans()),
    )
    return make_batch(lengths, tasks, step=draw(st.integers(0, 5))), plan, options


def check_step_plan(step_plan, batch, plan, options):
    # one ReplicaWork per replica, in plan order
    assert [w.replica_id for w in step_plan.work] == [r.replica_id for r in plan.replicas]
    # every sequence exactly once, with its own task and length
    placed = Counter(q for w in step_plan.work for mb in w.microbatches for q in mb.seq_ids)
    assert placed == Counter(range(len(batch)))
    for work, replica in zip(step_plan.work, plan.replicas, strict=True):
        for mb in work.microbatches:
            assert list(mb.lengths) == batch.lengths[list(mb.seq_ids)].tolist()
            assert list(mb.task_ids) == batch.task_ids[list(mb.seq_ids)].tolist()
            # memory: tokens (padding included) within this replica's M
            assert mb.tokens <= replica.max_tokens
            if options.microbatch_mode is MicroBatchMode.PADDING:
                assert mb.padded_len in step_plan.bucket_boundaries and max(mb.lengths) <= mb.padded_len
            else:
                assert mb.padded_len is None
            # rows contiguous by task: each task is one segment
            tasks_in_order = [seg[0] for seg in mb.segments]
            assert len(tasks_in_order) == len(set(tasks_in_order))
            assert sum(seg[2] for seg in mb.segments) == len(mb.seq_ids)
        # 1F1B order: non-increasing tokens
        tokens = [mb.tokens for mb in work.microbatches]
        assert tokens == sorted(tokens, reverse=True)
        # the estimate is the cost model's
        shapes = [mb.shape for mb in work.microbatches]
        assert work.estimated_time_s == pytest.approx(COST_MODEL.replica_time(replica.config, shapes))
    assert step_plan.estimated_makespan_s == pytest.approx(max(w.estimated_time_s for w in step_plan.work))
    assert step_plan.n_seqs == len(batch)
    assert step_plan.tokens == int(batch.lengths.sum())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=dispatch_cases())
def test_every_sequence_once_within_memory(case):
    batch, plan, options = case
    outcome = solve_step(batch, plan, COST_MODEL, options)
    check_step_plan(outcome.plan, batch, plan, options)
    if options.microbatch_mode is MicroBatchMode.PADDING:  # the load model bounds the padded plan's estimate
        assert outcome.plan.estimated_makespan_s <= outcome.modelled_makespan_s * (1 + 1e-9)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=dispatch_cases())
def test_fluid_bound_is_below_the_steps_estimate(case):
    """The LP bound the planner's swap polish skips deployments by is a lower bound of the
    dispatcher's estimate, padded or packed (packed micro-batches pay their constant at their
    longest sequence and may run part-empty; the bound charges each sequence its token share)."""
    batch, plan, options = case
    _, load, _ = choose_buckets(batch, config_classes(plan, COST_MODEL), COST_MODEL, options)
    assert fluid_bound(load) <= solve_step(batch, plan, COST_MODEL, options).plan.estimated_makespan_s * (1 + 1e-9)


@settings(max_examples=15, deadline=None)
@given(case=dispatch_cases())
def test_deterministic(case):
    batch, plan, options = case
    first, second = (
        dataclasses.replace(dispatch_step(batch, plan, COST_MODEL, options), solve_s=0.0) for _ in range(2)
    )
    assert first == second


def test_lobra_7b_step_fast_beats_length_baseline():
    plan = make_plan(LOBRA_7B_PLAN)
    batch = lognormal_batch(0)
    fast = dispatch_step(batch, plan, COST_MODEL)
    length = dispatch_step(batch, plan, COST_MODEL, DispatchOptions(microbatch_mode="padding", method="length"))
    check_step_plan(fast, batch, plan, DispatchOptions(microbatch_mode="padding"))
    assert fast.method == "fast" and length.method == "length"
    assert fast.estimated_makespan_s < length.estimated_makespan_s
    assert len(fast.bucket_boundaries) == 16
    assert 0 < fast.padding_ratio < 0.25


def test_choosing_buckets_by_makespan_is_never_worse_in_the_model():
    plan = make_plan(LOBRA_7B_PLAN)
    batch = lognormal_batch(3, scale=0.25)
    by_padding = solve_step(batch, plan, COST_MODEL, DispatchOptions(microbatch_mode="padding", n_buckets=8))
    by_makespan = solve_step(
        batch,
        plan,
        COST_MODEL,
        DispatchOptions(microbatch_mode="padding", n_buckets=8, choose_buckets_by_makespan=True),
    )
    assert by_makespan.modelled_makespan_s <= by_padding.modelled_makespan_s
    assert len(by_makespan.plan.bucket_boundaries) <= 8


def test_a_plan_scope_reuses_a_bucketing_of_the_same_lengths_and_memory_limits():
    """A counted scope (a plan) keeps each bucketing DP's answer: the same batch on a deployment of other
    replicas of the same M gets the same buckets, computed once; outside a scope nothing is kept."""
    batch = lognormal_batch(1)
    bigger = make_plan(((TP1, 4), (TP2, 2), (TP8, 1)))  # the configs of LOBRA_7B_PLAN, other counts
    classes = [config_classes(p, COST_MODEL) for p in (make_plan(LOBRA_7B_PLAN), bigger)]
    assert {c.max_tokens for c in classes[0]} == {c.max_tokens for c in classes[1]}
    alone = [choose_buckets(batch, c, COST_MODEL, DispatchOptions())[0] for c in classes]
    with counting() as work:
        scoped = [choose_buckets(batch, c, COST_MODEL, DispatchOptions())[0] for c in classes]
        assert len(work.memos["bucketings"]) == 1
    assert scoped == alone and scoped[0] is scoped[1] and alone[0] is not alone[1]


def test_exact_method_is_at_least_as_good_and_reports_its_bound():
    plan = make_plan(((TP1, 3), (TP2, 1), (TP8, 1)))
    batch = lognormal_batch(1, scale=0.15)
    fast = solve_step(batch, plan, COST_MODEL, DispatchOptions(microbatch_mode="padding"))
    exact = solve_step(
        batch,
        plan,
        COST_MODEL,
        DispatchOptions(microbatch_mode="padding", method="exact", solver=SolverName.HIGHS, time_limit_s=30),
    )
    assert exact.plan.method.startswith("milp:highs:")
    assert exact.modelled_makespan_s <= fast.modelled_makespan_s * (1 + 1e-6)
    assert exact.lower_bound_s is not None and exact.lower_bound_s <= exact.modelled_makespan_s * (1 + 1e-6)
    check_step_plan(exact.plan, batch, plan, DispatchOptions(microbatch_mode="padding"))


def test_failed_solve_falls_back_to_fast_with_a_warning(monkeypatch):
    plan = make_plan(LOBRA_7B_PLAN)
    batch = lognormal_batch(2, scale=0.3)

    def failing(problem, solver, time_limit_s, gap_rel):
        return SolveResult(SolveStatus.FAILED, None, time_limit_s, SolverName(solver))

    monkeypatch.setattr(ilp_module, "solve", failing)
    with pytest.warns(SolverFallbackWarning, match="the fast dispatch stands"):
        fallback = dispatch_step(
            batch, plan, COST_MODEL, DispatchOptions(microbatch_mode="padding", method="exact", time_limit_s=0.001)
        )
    fast = dispatch_step(batch, plan, COST_MODEL)
    assert fallback.method == "milp:cbc:failed->fast"
    assert fallback.work == fast.work


@pytest.mark.parametrize("solver", list(SolverName))
def test_near_zero_time_limit_never_skips_the_step(solver):
    """A real solve stopped at ~0 s: either its incumbent or the fast plan, with a warning; never nothing."""
    plan = make_plan(LOBRA_7B_PLAN)
    batch = lognormal_batch(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step_plan = dispatch_step(
            batch,
            plan,
            COST_MODEL,
            DispatchOptions(microbatch_mode="padding", method="exact", solver=solver, time_limit_s=1e-3),
        )
    check_step_plan(step_plan, batch, plan, DispatchOptions(microbatch_mode="padding"))
    fell_back = step_plan.method.endswith("->fast")
    assert fell_back == any(issubclass(w.category, SolverFallbackWarning) for w in caught)


def test_too_long_sequence_is_an_input_error():
    plan = make_plan(((TP1, 2), (TP2, 1)))
    with pytest.raises(InputError, match=r"lengths\[1\].*5000 tokens.*largest M = 4096"):
        dispatch_step(make_batch([100, 5000], [0, 1]), plan, COST_MODEL)


@pytest.mark.parametrize(
    "field,value",
    [
        ("method", "greedy"),
        ("microbatch_mode", "pad"),
        ("solver", "gurobi"),
        ("time_limit_s", 0),
        ("n_buckets", 0),
        ("bucket_alignment", 0),
        ("gap_rel", 1.5),
    ],
)
def test_bad_options_name_the_field(field, value):
    with pytest.raises(InputError, match=field):
        DispatchOptions(**{field: value})


def test_options_accept_strings_and_are_frozen():
    options = DispatchOptions(method="exact", solver="scip", microbatch_mode="packing")
    assert options.method is DispatchMethod.EXACT and options.solver is SolverName.SCIP
    assert options.microbatch_mode is MicroBatchMode.PACKING
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.method = DispatchMethod.FAST


def test_fairness_matrix_accounts_for_every_token():
    plan = make_plan(LOBRA_7B_PLAN)
    batch = lognormal_batch(5)
    tokens = task_tokens_per_replica(dispatch_step(batch, plan, COST_MODEL), n_tasks=6)
    assert tokens.shape == (len(plan.replicas), 6)
    assert (
        tokens.sum(axis=0).tolist()
        == np.bincount(batch.task_ids, weights=batch.lengths, minlength=6).astype(int).tolist()
    )
    # replicas of one class share every task: the six <1,1> replicas each get some of every short task
    assert np.all(tokens[:6, [0, 5]] > 0)


@pytest.mark.parametrize("mode", list(MicroBatchMode))
def test_a_pipeline_window_orders_task_major_and_prices_the_tasks(mode):
    """W > 1: every replica (pp = 1 too) finishes its tasks in one global order, and each replica is priced
    with its micro-batches' tasks; the same step under W = 1 keeps LobRA's largest-first order and Eq. 12."""
    plan = make_plan(((TP1, 2), (TP2_PP2, 1), (TP8, 1)), n_tasks=6)
    batch = lognormal_batch(3)
    options = DispatchOptions(microbatch_mode=mode)
    step = solve_step(batch, plan, COST_MODEL, options, window=8).plan
    flushed = solve_step(batch, plan, COST_MODEL, options).plan
    for work, replica in zip(step.work, plan.replicas, strict=True):
        tops = [max(mb.task_ids) for mb in work.microbatches]
        assert tops == sorted(tops)
        shapes, tasks = [mb.shape for mb in work.microbatches], [mb.task_ids for mb in work.microbatches]
        assert work.estimated_time_s == pytest.approx(COST_MODEL.replica_time(replica.config, shapes, tasks, window=8))
    for work, replica in zip(flushed.work, plan.replicas, strict=True):
        sizes = [mb.tokens for mb in work.microbatches]
        assert sizes == sorted(sizes, reverse=True)
        assert work.estimated_time_s == pytest.approx(
            COST_MODEL.replica_time(replica.config, [mb.shape for mb in work.microbatches])
        )
    pipelined = [w for w, r in zip(step.work, plan.replicas, strict=True) if r.config.pp > 1 and w.microbatches]
    assert pipelined


def test_a_step_is_balanced_across_gpu_kinds_by_each_replicas_own_time_model(tmp_path):
    """#29: <2,1> on H100s and <2,1> on A100s are one layout on two kinds; each is priced by its pool's model,
    so the H100 replica takes more of the step's tokens, and every estimate is its own model's."""
    from lorafleet.sampling import sample_global_batch
    from tests.helpers.pools import pools_fleet

    workload, _, cost_model, plan = pools_fleet(tmp_path)
    step = dispatch_step(sample_global_batch(workload, 0, 0), plan, cost_model)
    tokens = task_tokens_per_replica(step, len(workload.tasks)).sum(axis=1)
    a100, h100 = plan.replicas[0], plan.replicas[1]
    assert a100.config.layout == h100.config.layout and (a100.pool, h100.pool) == ("a100", "h100")
    assert tokens[1] > 1.5 * tokens[0] > 0
    deployed = cost_model.spanning(r.pool for r in plan.replicas)  # its gradient all-reduce crosses pools
    for replica, work in zip(plan.replicas, step.work, strict=True):
        mbs = work.microbatches
        priced = deployed.replica_time(
            replica.config, [m.shape for m in mbs], [m.task_ids for m in mbs], window=plan.policy.pipeline_window
        )
        assert work.estimated_time_s == pytest.approx(priced)
    # the A100's model would price the H100 replica's work slower than the H100's does
    mbs = step.work[1].microbatches
    as_a100 = cost_model.replica_time(a100.config, [m.shape for m in mbs])
    assert as_a100 > cost_model.replica_time(h100.config, [m.shape for m in mbs])
