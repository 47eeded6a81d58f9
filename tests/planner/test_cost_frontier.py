"""The cost objective (#43): the sweep over step times that finds the cheapest deployment of the aggregated model
(``planner.frontier``), checked against every deployment of a small fleet; the frontier it draws; the objective's
choice (``objective.preferred`` with a price and a limit); and the planner's cost search against the exhaustive
reference, the work each takes counted (``lorafleet.work``)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import yaml

from lorafleet.accounting import price_per_second
from lorafleet.assemble import workload_cluster, workload_cost_model
from lorafleet.planner import PlannerMode, PlannerOptions, PlanObjective, plan_deployment
from lorafleet.planner.candidates import enumerate_deployments, propose_candidates, valid_candidates
from lorafleet.planner.cost_search import entry_cost
from lorafleet.planner.expected import expected_global_batch
from lorafleet.planner.frontier import SWEEP_REL, SWEEP_SOLVES, cheapest_at, cost_sweep, fluid_makespan, pareto
from lorafleet.planner.objective import preferred
from lorafleet.planner.problem import build_problem
from lorafleet.specs.dispatch import DispatchPolicy
from lorafleet.work import counting
from lorafleet.workload import load_workload
from tests.helpers.repo import SMALL_WORKLOAD

POOLS = [
    {"name": "a100", "gpu": "A100-40GB", "nodes": 1, "gpus_per_node": 4, "price_per_gpu_hour": 1.3},
    {"name": "h100", "gpu": "H100-80GB", "nodes": 1, "gpus_per_node": 4, "price_per_gpu_hour": 2.5},
]
COST = PlannerOptions(objective=PlanObjective.COST, robust_samples=0, baselines=False)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """``examples/two-tenants.yaml`` without recomputation on 4 A100-40GB + 4 H100-80GB, priced: 12 candidates
    and 214 deployments that hold the batch, few enough to enumerate."""
    path = tmp_path_factory.mktemp("cost") / "small.yaml"
    path.write_text(yaml.safe_dump({**SMALL_WORKLOAD, "recompute": "off", "cluster": {"pools": POOLS}}))
    workload = load_workload(path)
    cluster = workload_cluster(workload)
    cost_model = workload_cost_model(workload, cluster)
    batch = expected_global_batch(workload)
    candidates = propose_candidates(valid_candidates(cost_model, cluster), int(batch.lengths.max()))
    problem = build_problem(batch, candidates, cost_model, cluster, DispatchPolicy())
    return workload, cluster, cost_model, problem


@pytest.fixture(scope="module")
def every_deployment(small):
    """(model cost of a step, model step time) of every deployment of the small fleet, maximal or not."""
    problem = small[3]
    prices = problem.replica_prices
    found = []
    for p in enumerate_deployments(problem, 10_000, maximal=False):
        t = fluid_makespan(problem, p)
        found.append((t * float(p @ prices), t))
    assert len(found) == 214
    return found


SOLVES = {None: 18, 0.6: 9, 0.8: 13, 1.2: 14}
"""MILPs (the makespan MILP's 3 and the cost MILPs) of each sweep below when this was written, plus 2: 16, 7, 11
and 12."""


@pytest.mark.parametrize("limit", [None, 0.6, 0.8, 1.2])
def test_the_sweep_finds_the_models_cheapest_step_in_few_solves(small, every_deployment, limit):
    """The sweep's cheapest point is the cheapest of all 214 deployments by the model (within its 1 %), with the
    limit kept; it costs the makespan MILP's fixed point and 4-13 cost MILPs here (:data:`SOLVES`; SWEEP_SOLVES
    at most anywhere). A limit below the model's fastest step (0.52 s) finds nothing, and says so."""
    problem = small[3]
    prices = problem.replica_prices
    with counting() as work:
        sweep = cost_sweep(problem, prices, limit=limit)
    assert work["milp_solves"] == len(sweep.solves) <= SOLVES[limit]
    assert len(sweep.solves) <= 3 + SWEEP_SOLVES
    within = [cost for cost, t in every_deployment if limit is None or t <= limit]
    best = sweep.best
    assert best is not None and best.cost <= min(within) * (1 + SWEEP_REL)
    assert limit is None or best.makespan <= limit
    assert sweep.closed and sweep.bound <= best.cost
    for point in sweep.points:  # each answer reaches the step time it was solved at, and is the cheapest there
        assert point.makespan <= point.limit * (1 + 1e-9)
        cheaper = [cost / t for cost, t in every_deployment if t <= point.limit and cost / t < point.price * 0.999]
        assert not cheaper
    with counting() as work:
        none = cost_sweep(problem, prices, limit=0.3)
    assert none.best is None and "below the model's fastest" in none.notes[0] and work["milp_solves"] <= 4


def test_the_cheapest_deployment_at_a_step_time_and_its_model_step(small):
    problem = small[3]
    prices = problem.replica_prices
    point, result = cheapest_at(problem, prices, 1.0, solver="cbc", time_limit_s=10)
    assert result.proven_optimal and point is not None
    assert point.makespan == pytest.approx(fluid_makespan(problem, point.replicas)) and point.makespan <= 1.0
    assert point.price == pytest.approx(float(point.replicas @ prices))
    assert cheapest_at(problem, prices, 0.1, solver="cbc", time_limit_s=10)[0] is None  # faster than any deployment
    assert math.isinf(fluid_makespan(problem, np.zeros(len(problem.candidates), dtype=np.int64)))


def test_the_frontier_keeps_the_points_nothing_beats_fastest_first():
    points = [(3.0, 10.0), (1.0, 30.0), (2.0, 20.0), (2.5, 25.0), (4.0, 10.0), (1.0, 31.0), (math.inf, 1.0)]
    assert pareto(points, lambda p: p[0], lambda p: p[1]) == [(1.0, 30.0), (2.0, 20.0), (3.0, 10.0)]
    assert pareto([], lambda p: p[0], lambda p: p[1]) == []


def test_the_cost_objective_prefers_the_cheapest_step_within_the_limit():
    """(makespan, price a second): costs 10, 9.9, 12 and 8 a step. The cheapest wins, whatever its step; costs
    within the tolerance tie and the faster wins; a limit keeps only the plans within it; with none within it,
    the fastest is returned (the caller says the limit is missed)."""
    plans = [(1.0, 10.0), (1.1, 9.0), (0.6, 20.0), (4.0, 2.0)]

    def pick(tie_rel, limit=None):
        return preferred(plans, lambda p: p[0], lambda p: 1, tie_rel, lambda p: p[1], limit)

    assert pick(0.0) == (4.0, 2.0)
    assert pick(0.3) == (1.0, 10.0)  # 10 and 9.9 are within 30 % of 8: the fastest of the three
    assert pick(0.24) == (1.1, 9.0)  # 9.9 is within 24 % of 8, 10 is not
    assert pick(0.0, limit=1.5) == (1.1, 9.0)
    assert pick(0.02, limit=1.5) == (1.0, 10.0)  # 10 ties with 9.9 at 2 %: the faster
    assert pick(0.0, limit=0.5) == (0.6, 20.0)
    gpus = preferred(plans, lambda p: p[0], lambda p: int(p[1]), 0.0)  # the makespan objective: unchanged
    assert gpus == (0.6, 20.0)


@pytest.mark.parametrize("limit", [None, 0.8])
def test_the_cost_search_finds_the_exhaustive_cheapest_plan(small, limit):
    """The planner's cost search (the sweep, the dispatcher's judgement, the moves) finds the plan the exhaustive
    mode finds by judging all 214 deployments, at a tenth of the deployments judged."""
    workload, cluster, cost_model, _ = small
    options = PlannerOptions(objective=PlanObjective.COST, robust_samples=0, baselines=False, max_step_s=limit)
    found, reference = (
        plan_deployment(workload, cluster, cost_model, PlannerOptions(**{**_fields(options), "mode": mode}))
        for mode in (PlannerMode.DECOMPOSED, PlannerMode.EXHAUSTIVE)
    )

    def cost(result):
        return result.plan.expected_makespan_s * price_per_second(result.plan, cluster)

    assert found.plan.describe() == reference.plan.describe()
    assert cost(found) == pytest.approx(cost(reference))
    assert limit is None or found.plan.expected_makespan_s <= limit
    assert found.diagnostics.work["deployments_judged"] <= 40 < reference.diagnostics.work["deployments_judged"]
    assert found.diagnostics.work["milp_solves"] <= 3 + SWEEP_SOLVES + 3
    assert [p.deployment for p in found.frontier].count(found.plan.describe()) == 1


def _fields(options: PlannerOptions) -> dict:
    return {name: getattr(options, name) for name in options.__dataclass_fields__}


def test_a_step_cost_cap_alone_prefers_the_fastest_step_within_it():
    """(makespan, price a second): costs 10, 9.9, 12 and 8 a step. With a cap C alone the fastest plan costing at
    most C wins; makespans within the tolerance tie and the cheaper wins; with a limit too, the cheapest within both;
    with none within the cap, the plan preferred without it (the caller says the cap is missed)."""
    plans = [(1.0, 10.0), (1.1, 9.0), (0.6, 20.0), (4.0, 2.0)]

    def pick(tie_rel, cap, limit=None):
        return preferred(plans, lambda p: p[0], lambda p: 1, tie_rel, lambda p: p[1], limit, cap)

    assert pick(0.0, cap=12.0) == (0.6, 20.0)
    assert pick(0.0, cap=10.0) == (1.0, 10.0)  # 0.6 s costs 12 a step: over the cap
    assert pick(0.15, cap=10.0) == (1.1, 9.0)  # 1.1 s ties with 1.0 s at 15 %: the cheaper
    assert pick(0.0, cap=9.0) == (4.0, 2.0)  # 1.1 s costs 9.9
    assert pick(0.0, cap=7.0) == (4.0, 2.0)  # none within: the cheapest, as without a cap
    assert pick(0.0, cap=7.0, limit=1.5) == (1.1, 9.0)  # none within both: the cheapest within the limit
    assert pick(0.0, cap=11.0, limit=1.5) == (1.1, 9.0)  # both: the cheapest within both
    assert pick(0.0, cap=12.0, limit=0.5) == (0.6, 20.0)  # none within the limit: the fastest


def test_the_cost_search_under_a_cap_finds_the_fastest_step_within_it(small):
    """``max_step_cost`` between the cheapest and the fastest frontier point (at the second cheapest): the plan is
    within the cap, faster than the cheapest plan, and no deployment the planner judged within the cap is faster
    by more than tie_rel."""
    workload, cluster, cost_model, problem = small
    cheapest = plan_deployment(workload, cluster, cost_model, COST)
    frontier = cheapest.frontier
    cap = frontier[-2].cost_per_step * (1 + 1e-9)
    assert frontier[-1].cost_per_step < cap < frontier[0].cost_per_step
    options = PlannerOptions(**{**_fields(COST), "max_step_cost": cap})
    capped = plan_deployment(workload, cluster, cost_model, options)
    plan = capped.plan
    assert plan.expected_makespan_s * price_per_second(plan, cluster) <= cap and plan.max_step_cost == cap
    assert plan.expected_makespan_s < cheapest.plan.expected_makespan_s
    assert capped.diagnostics.candidates == problem.candidates
    judged = [e for e in capped.diagnostics.pool if e.expected is not None]
    within = [e for e in judged if entry_cost(e, problem.replica_prices) <= cap]
    assert min(e.expected_makespan for e in within) >= plan.expected_makespan_s * (1 - COST.tie_rel)
    assert f"step-cost cap {cap:.4g}: met" in " ".join(plan.notes)


def test_the_race_runs_only_the_finalists_within_the_bounds():
    """The robust race's finalists under the cost objective's bounds (``driver._within_bounds``): those within the
    step-time limit and the step-cost cap on the expected batch, so that a finalist past the limit (ranked after
    those within) cannot win the race by being cheaper on the sampled batches; all of them without a bound."""
    from types import SimpleNamespace

    from lorafleet.planner.driver import _within_bounds

    problem = SimpleNamespace(replica_prices=np.array([1.0, 2.0]))
    entries = [  # (makespan s, replicas): costs 3, 4 and 1 a step
        SimpleNamespace(expected_makespan=t, replicas=np.array(r), expected=object())
        for t, r in ((1.0, (1, 1)), (2.0, (0, 1)), (1.0, (1, 0)))
    ]

    def kept(**bounds):
        within = _within_bounds(problem, entries, replace(COST, **bounds))
        return [k for k, e in enumerate(entries) if any(e is w for w in within)]

    assert kept() == []
    assert kept(max_step_s=1.5) == [0, 2]
    assert kept(max_step_cost=3.5) == [0, 2]
    assert kept(max_step_cost=3.5, max_step_s=0.5) == []
    assert kept(max_step_cost=4.0, max_step_s=2.0) == [0, 1, 2]
