"""Planning a fleet of several GPU kinds (#29): candidates are (config, pool) pairs, a GPU budget per pool, a
replica never spans pools, the baselines run one layout on every pool, and ``objective=cost`` picks the
cheapest step (#43), within a step-time limit when one is given."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lorafleet.accounting import price_per_second
from lorafleet.costmodel import ParallelConfig
from lorafleet.errors import InputError
from lorafleet.plan_check import check_plan
from lorafleet.planner import PlannerOptions, PlanObjective, plan_deployment
from lorafleet.planner.candidates import propose_candidates, valid_candidates
from lorafleet.planner.problem import gpu_budget_rows
from lorafleet.specs.cluster import ClusterSpec
from tests.helpers.pools import pools_fleet

FAST = PlannerOptions(robust_samples=0)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    workload, cluster, cost_model, _ = pools_fleet(tmp_path_factory.mktemp("pools"))
    return workload, cluster, cost_model


@pytest.fixture(scope="module")
def planned(fleet):
    workload, cluster, cost_model = fleet
    return plan_deployment(workload, cluster, cost_model, FAST)


def test_each_pool_has_its_gpu_budget():
    """8 A100s in one node, 8 H100s in two nodes of 4: a <8,1> fits on the A100s only, and the A100s'
    budget is not the H100s'."""
    cluster = ClusterSpec.model_validate(
        {
            "pools": [
                {"name": "a", "gpu": "A100-40GB"},
                {"name": "h", "gpu": "H100-80GB", "nodes": 2, "gpus_per_node": 4},
            ]
        }
    )
    configs = [ParallelConfig(8, 1, pool="a"), ParallelConfig(4, 1, pool="a"), ParallelConfig(4, 1, pool="h")]
    rows, caps = gpu_budget_rows(configs, cluster)

    def fits(p):
        return bool(np.all(rows @ np.asarray(p) <= caps))

    assert fits([1, 0, 2]) and fits([0, 2, 2])
    assert not fits([1, 1, 0])  # 12 A100s
    assert not fits([0, 0, 3])  # 12 H100s
    h8 = gpu_budget_rows([ParallelConfig(8, 1, pool="h")], cluster)
    assert not np.all(h8[0] @ np.array([1]) <= h8[1])  # a TP group of 8 in nodes of 4


def test_candidates_are_config_pool_pairs_proposed_in_each_pool(fleet):
    workload, cluster, cost_model = fleet
    valid = valid_candidates(cost_model, cluster)
    assert {c.config.pool for c in valid} == {"a100", "h100"}
    assert all(c.config.tp <= cluster.pool(c.config.pool).gpus_per_node for c in valid)
    proposed = propose_candidates(valid, workload.max_length)
    for pool in ("a100", "h100"):
        assert any(c.config.pool == pool and c.max_tokens >= workload.max_length for c in proposed)


def test_a_plan_on_two_pools_checks_and_keeps_replicas_in_their_pools(fleet, planned):
    workload, cluster, cost_model = fleet
    plan = planned.plan
    check_plan(plan, workload, cluster, cost_model, "plan")
    assert {r.pool for r in plan.replicas} == {"a100", "h100"}  # the fleet is used, both kinds
    for replica in plan.replicas:
        first = cluster.first_gpu(replica.pool)
        assert all(first <= g < first + cluster.pool(replica.pool).n_gpus for g in replica.gpus)
    assert [p.name for p in plan.pools] == ["a100", "h100"]
    assert {p.cost_model.gpu for p in plan.pools} == {"A100-40GB", "H100-80GB"}


def test_the_baselines_run_one_layout_on_every_pool(planned):
    for baseline in planned.baselines:
        for phase in baseline.phases:
            replicas = phase.plan.replicas
            assert len({r.config.layout for r in replicas}) == 1, baseline.name
            assert {r.pool for r in replicas} == {"a100", "h100"}, baseline.name


def test_the_cost_objective_buys_the_cheapest_step_and_keeps_a_step_time_limit(fleet, planned):
    """#43: the cost objective's plan is the cheapest step over every subset of the pools' GPUs, however slow
    (here one H100 replica, 1 of 16 GPUs, cheaper a step than the fastest plan); with a step-time limit of 1.25x
    the fastest plan's step it is within the limit and still cheaper than the fastest plan."""
    workload, cluster, cost_model = fleet
    options = PlannerOptions(robust_samples=0, objective=PlanObjective.COST)
    cheapest = plan_deployment(workload, cluster, cost_model, options)

    def cost(result):
        return result.plan.expected_makespan_s * price_per_second(result.plan, cluster)

    assert cost(cheapest) < cost(planned)
    assert cheapest.plan.used_gpus < planned.plan.used_gpus
    frontier = cheapest.frontier
    assert frontier == cheapest.plan.cost_frontier and len(frontier) >= 3
    assert [p.makespan_s for p in frontier] == sorted(p.makespan_s for p in frontier)
    assert all(a.cost_per_step > b.cost_per_step for a, b in zip(frontier, frontier[1:]))
    assert cheapest.plan.describe() in [p.deployment for p in frontier]

    limit = 1.25 * planned.plan.expected_makespan_s
    bounded = plan_deployment(workload, cluster, cost_model, replace(options, max_step_s=limit))
    assert bounded.plan.expected_makespan_s <= limit and bounded.plan.max_step_s == limit
    assert cost(cheapest) <= cost(bounded) < cost(planned)
    pools = (cluster.pools[0].model_copy(update={"price_per_gpu_hour": None}), cluster.pools[1])
    unpriced = cluster.model_copy(update={"pools": pools})
    with pytest.raises(InputError, match="--objective: cost needs a price_per_gpu_hour on every pool; 'a100' has none"):
        plan_deployment(workload, unpriced, cost_model, PlannerOptions(objective=PlanObjective.COST))


def test_the_clusters_a_sizing_sweeps_over_pools():
    from lorafleet.planner.sizing_search import candidate_clusters

    two = ClusterSpec.model_validate(
        {"pools": [{"name": "a100", "nodes": 2, "price_per_gpu_hour": 1.3}, {"name": "h100", "gpu": "H100-80GB"}]}
    )
    swept = [tuple((p.name, p.nodes) for p in c.pools) for c in candidate_clusters(two)]
    assert swept == [
        (("a100", 1),),
        (("h100", 1),),
        (("a100", 2),),
        (("a100", 1), ("h100", 1)),
        (("a100", 2), ("h100", 1)),
    ]
    assert [c.n_gpus for c in candidate_clusters(two, max_nodes=1)] == [8, 8, 16]
    one = candidate_clusters(ClusterSpec.model_validate({"pools": [two.pools[0].model_dump()]}))
    assert [c.pools[0] for c in one] == [two.pools[0].model_copy(update={"nodes": n}) for n in (1, 2)]


def test_sizing_over_pools_buys_the_cheapest_fleet_that_meets_the_deadline(fleet):
    """#29: which of the pools' nodes to hold for a deadline, at the fewest cost: every combination of the
    pools' nodes planned, the cheapest job that finishes in time chosen (not the one on fewest GPUs)."""
    from lorafleet.assemble import workload_cost_model
    from lorafleet.planner import Deadline, SizingObjective, size_fleet
    from lorafleet.planner.sizing_choice import judge

    workload, cluster, _ = fleet
    options = PlannerOptions(robust_samples=0, baselines=False)
    free = size_fleet(workload, cluster, lambda c: workload_cost_model(workload, c), options, max_nodes=1)
    assert [r.nodes for r in free.rows] == ["h100 1", "a100 1", "a100 1, h100 1"]  # 4, 8, 12 GPUs
    assert free.chosen_row.cost_per_step == min(r.cost_per_step for r in free.rows)
    steps = 1000
    fastest = min(r.step_s for r in free.rows if r.feasible)
    sized = judge(free.rows, SizingObjective(deadline=Deadline(steps, fastest * steps / 3600 * 1.5)), steps)
    meeting = [r for r in sized.rows if r.meets(sized.objective)]
    assert sized.chosen_row.cost_per_step == min(r.cost_per_step for r in meeting)
    assert "cheapest that finishes 1000 steps" in sized.reason
