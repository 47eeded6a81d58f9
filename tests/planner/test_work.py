"""The planner's work counters (``lorafleet.work``): deterministic, counted where the work is done, and
bounded on the shipped examples so that a change that doubles the planner's work fails on any machine
(CPU time is not asserted anywhere: it depends on the machine and its load)."""

from __future__ import annotations

import pytest
import yaml

from lorafleet.assemble import workload_cluster, workload_cost_model
from lorafleet.planner import PlannerOptions, plan_deployment
from lorafleet.work import WORK, by_identity, count, counting, memo
from lorafleet.workload import load_workload
from tests.helpers.repo import EXAMPLES

# The counts of each example when these bounds were set, and the bounds: about 1.5 times the counts, so
# that noise in a solver's path passes and twice the work does not. Re-derived after the merge of #29,
# whose memory-model fix changed the examples' plans (more tokens fit a micro-batch; lobra-70b/64 plans
# <1,8> x 3 + <2,4> x 1 + <4,1,rc> x 2 + <4,2> x 2 + <8,1> x 1 and judges 54 deployments, not 36), then
# again when the polish began to price a swap class by class up to the makespan it must beat (fewer
# replicas priced and timelines built) and the MILP's fixed point to stop within 1 % (one MILP fewer):
#   two-tenants:  59 judged, 45 dispatches, 113 balances, 176 LPs, 14 MILPs, 40 raced, 453 priced, 14 timelines
#   lobra-7b:     19 judged, 49 dispatches,  73 balances, 101 LPs,  7 MILPs, 40 raced, 326 priced, 16 timelines
#   lobra-70b/64: 54 judged, 55 dispatches, 117 balances, 181 LPs,  9 MILPs, 40 raced, 835 priced, 290 timelines
#                 (before that: 577 / 359 / 1,107 priced, 14 / 22 / 390 timelines, 14 / 8 / 10 MILPs;
#                 without the stall memo: 932 timelines; before #26, with the old memory model: 740
#                 timelines, 69 dispatches, 202 balances)
# and, for sweeps at scale (#40), service-sweeps cut to its first 4 tasks (64 tenants, 16-member sweeps) on 64
# GPUs: <1,20> x 1 + <2,8> x 1 + <4,5> x 1 + <8,1,rc> x 1, about 3 CPU s (the whole example: 1,024 tenants on
# 1,024 GPUs, about a minute, benchmarks/planner_times.json):
#   service-sweeps/64: 33 judged, 48 dispatches, 88 balances, 146 LPs, 9 MILPs, 40 raced, 327 priced, 204 timelines
#                 (107 dispatches, 147 balances, 205 LPs, 491 priced before Task-Sequential's tenants of equal
#                 expected lengths shared one choice and one dispatched expected step: #43)
# #43's pipelined packing (dispatch.pipelined) prices a pipelined replica's balanced packings beside first-fit
# decreasing's where the closed form expects them to save 1 %, and their stalls are new timelines: two-tenants
# 569 priced, 18 timelines (423, 12 before), lobra-70b/64 1,103 priced, 130 timelines (818, 106),
# service-sweeps/64 32 judged, 87 balances, 145 LPs, 618 priced, 234 timelines (33, 88, 146, 327, 204); the
# bounds of two-tenants' timelines and service-sweeps/64's replicas priced were raised to about 1.5 times the
# new counts, the others hold. The split LoRA inputs' cost model (#43: TP > 1 configs hold more tokens, so more
# of them are candidates) moved lobra-7b to 31 judged, 85 balances, 126 LPs, 330 priced, 6 timelines and lobra-70b/64
# to 36 judged, 99 balances, 163 LPs, 833 priced, 124 timelines: lobra-7b's judged bound was raised to 1.5 times 31.
# #43's polish solves its LP screen only where a water-filled split of the LP does not already lie below the
# makespan to beat (planner.fluid_split): LPs two-tenants 176 -> 126, lobra-7b 101 -> 88, lobra-70b/64 181 -> 135,
# service-sweeps/64 145 -> 120 (under the split LoRA inputs' model, lobra-7b 126 -> 101); the LP bounds lowered to
# about 1.5 times the new counts.
BOUNDS = {
    ("two-tenants.yaml", None): dict(
        deployments_judged=90,
        dispatches=70,
        balances=170,
        lp_solves=190,
        milp_solves=21,
        batches_raced=40,
        replicas_priced=680,
        stall_timelines=27,
    ),
    ("lobra-7b.yaml", None): dict(
        deployments_judged=47,
        dispatches=75,
        balances=110,
        lp_solves=130,
        milp_solves=11,
        batches_raced=40,
        replicas_priced=490,
        stall_timelines=24,
    ),
    ("lobra-70b.yaml", 64): dict(
        deployments_judged=80,
        dispatches=80,
        balances=175,
        lp_solves=200,
        milp_solves=14,
        batches_raced=40,
        replicas_priced=1250,
        stall_timelines=435,
    ),
    ("service-sweeps.yaml", 64): dict(
        deployments_judged=50,
        dispatches=72,
        balances=132,
        lp_solves=180,
        milp_solves=14,
        batches_raced=40,
        replicas_priced=930,
        stall_timelines=305,
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


def test_sweeps_at_scale_stay_within_their_work_bounds(tmp_path):
    """A sweep's members are tenants of their own (#40): service-sweeps' first four tasks expand into 64 members,
    and planning them on 64 GPUs stays within the bounds above (the whole example takes about a minute)."""
    example = yaml.safe_load((EXAMPLES / "service-sweeps.yaml").read_text())
    example["tasks"] = example["tasks"][:4]
    path = tmp_path / "sweeps.yaml"
    path.write_text(yaml.safe_dump(example))
    workload = load_workload(path)
    assert len(workload.tasks) == 4 * 16
    cluster = workload_cluster(workload, 64)
    within_bounds(
        plan_deployment(workload, cluster, workload_cost_model(workload, cluster), PlannerOptions()),
        "service-sweeps.yaml",
        64,
    )


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


def test_a_memo_by_identity_computes_once_per_owner_and_holds_it():
    """``by_identity`` computes once per (owner, key) in a scope, tells equal owners apart, and its entry keeps the
    owner alive, so no later object can take its id."""
    calls = []

    class Owner:
        pass

    with counting():
        cache = memo("test by identity")
        first, second = Owner(), Owner()
        for owner in (first, first, second):
            by_identity(cache, owner, "k", lambda owner=owner: calls.append(owner) or len(calls))
        assert calls == [first, second]
        assert by_identity(cache, first, "k", lambda: -1) == 1
        assert by_identity(cache, second, "k", lambda: -1) == 2
        assert [held for held, _ in cache.values()] == [first, second]
