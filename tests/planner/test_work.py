"""The planner's work counters (``lorafleet.work``): deterministic, counted where the work is done, and
bounded on the shipped examples so that a change that doubles the planner's work fails on any machine
(CPU time is not asserted anywhere: it depends on the machine and its load)."""

from __future__ import annotations

import pytest

from lorafleet.assemble import workload_cluster, workload_cost_model
from lorafleet.planner import PlannerOptions, plan_deployment
from lorafleet.work import WORK, count, counting
from lorafleet.workload import load_workload
from tests.helpers.repo import EXAMPLES

# The counts of each example when these bounds were set (issue #26), and the bounds: about 1.5 times
# the counts, so that noise in a solver's path passes and twice the work does not.
#   two-tenants:  55 judged, 45 dispatches, 109 balances, 169 LPs, 14 MILPs, 40 raced, 545 priced, 12 timelines
#   lobra-7b:     21 judged, 49 dispatches,  78 balances, 104 LPs, 12 MILPs, 40 raced, 350 priced, 34 timelines
#   lobra-70b/64: 36 judged, 55 dispatches,  98 balances, 162 LPs, 10 MILPs, 40 raced, 1,049 priced, 326 timelines
#                 (before #26's memo: 740 timelines; before the bases were recorded: 69 dispatches, 202 balances)
BOUNDS = {
    ("two-tenants.yaml", None): dict(
        deployments_judged=80,
        dispatches=70,
        balances=165,
        lp_solves=255,
        milp_solves=21,
        batches_raced=40,
        replicas_priced=820,
        stall_timelines=18,
    ),
    ("lobra-7b.yaml", None): dict(
        deployments_judged=32,
        dispatches=70,
        balances=120,
        lp_solves=160,
        milp_solves=18,
        batches_raced=40,
        replicas_priced=525,
        stall_timelines=52,
    ),
    ("lobra-70b.yaml", 64): dict(
        deployments_judged=54,
        dispatches=70,
        balances=150,
        lp_solves=245,
        milp_solves=15,
        batches_raced=40,
        replicas_priced=1575,
        stall_timelines=490,
    ),
}


def plan_example(name: str, gpus: int | None, options: PlannerOptions = PlannerOptions()):
    workload = load_workload(EXAMPLES / name)
    cluster = workload_cluster(workload, gpus)
    return plan_deployment(workload, cluster, workload_cost_model(workload, cluster), options)


def within_bounds(result, example: str, gpus: int | None) -> None:
    work = result.diagnostics.work
    over = {name: (work[name], bound) for name, bound in BOUNDS[example, gpus].items() if work[name] > bound}
    assert not over, f"{example}: (count, bound) of the counters over their bounds: {over}"
    assert work["batches_raced"] == 3 * 8 + 2 * 8  # successive halving: three plans, then two, rungs of 8


@pytest.mark.parametrize(("example", "gpus"), [("lobra-7b.yaml", None), ("lobra-70b.yaml", 64)])
def test_the_shipped_examples_stay_within_their_work_bounds(example, gpus):
    within_bounds(plan_example(example, gpus), example, gpus)


def test_counts_are_the_same_every_time_and_reported_in_the_plan():
    """Planning twice in one process counts the same work (the stall timelines of a plan are memoised in its
    own scope, so a warm process-wide cache cannot hide them), within the example's bounds."""
    first, second = (plan_example("two-tenants.yaml", None) for _ in range(2))
    assert first.diagnostics.work.counts == second.diagnostics.work.counts
    within_bounds(first, "two-tenants.yaml", None)
    work = first.diagnostics.work
    assert work["stall_timelines"] > 0 and work["milp_solves"] == len(first.diagnostics.solves)
    assert work["dispatches"] >= work["batches_raced"] > 0
    assert first.plan.notes[-1] == f"work: {work.describe()}"
    assert set(work.counts) == set(WORK)


def test_a_scope_inside_another_adds_its_counts_to_it():
    with counting() as outer:
        count("dispatches")
        with counting() as inner:
            count("dispatches", 2)
            assert inner["dispatches"] == 2 and outer["dispatches"] == 1
        assert outer["dispatches"] == 3
    count("dispatches")  # outside every scope: counted nowhere, and no error
    with pytest.raises(KeyError):
        with counting():
            count("no_such_counter")
