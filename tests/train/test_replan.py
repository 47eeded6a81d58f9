"""A re-plan keeps what its plan was planned for (#37): a fleet planned with ``--objective cost`` on priced pools
is re-planned by that objective, its tolerance and its pools' prices, whichever way it is re-planned (a task
changed in the running fleet through ``train.replan.replan_run``, or ``planner.incremental``), on the plan's own
fleet, which carries no price of its own."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

from lorafleet.planner import PlannerOptions, PlanObjective, ReplanOptions, plan_deployment, replan_incremental
from lorafleet.plans import DeploymentPlan
from lorafleet.train.options import TrainOptions
from lorafleet.train.replan import replan_run
from lorafleet.workload import load_workload
from tests.helpers.pools import POOLS_WORKLOAD, pools_fleet

COST = PlannerOptions(robust_samples=0, baselines=False, objective=PlanObjective.COST, tie_rel=0.25)
PRICES = (("a100", 1.3), ("h100", 2.5))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """The chat task planned by cost on the two priced pools (saved as ``plan.json``), then the docs task joins:
    the grown workload, its priced cluster and cost model, and the plan."""
    tmp = tmp_path_factory.mktemp("replan")
    grown, cluster, cost_model, _ = pools_fleet(tmp)
    first = tmp / "first.yaml"
    first.write_text(yaml.safe_dump({**POOLS_WORKLOAD, "tasks": POOLS_WORKLOAD["tasks"][:1]}))
    plan = plan_deployment(load_workload(first), cluster, cost_model, COST).plan
    plan.save(tmp / "plan.json")
    return tmp, grown, cluster, cost_model, plan


def test_the_plan_records_its_objective_and_prices_and_round_trips(fleet):
    tmp, _, _, _, plan = fleet
    assert plan.objective is PlanObjective.COST and plan.tie_rel == 0.25
    assert [(p.name, p.price_per_gpu_hour) for p in plan.pools] == list(PRICES)
    assert DeploymentPlan.load(tmp / "plan.json") == plan
    assert PlannerOptions().replanning(plan) == replace(PlannerOptions(), baselines=False, **_planned_for())


def _planned_for() -> dict:
    return {"objective": PlanObjective.COST, "tie_rel": 0.25, "prices": PRICES}


def test_a_task_change_replans_by_the_cost_objective_at_the_plans_prices(fleet):
    """The running fleet's re-plan (``train.live``: on the plan's fleet, ``DeploymentPlan.fleet``) finds the plan
    the cost objective finds on the priced cluster, not the fastest plan."""
    tmp, grown, cluster, _, plan = fleet
    options = TrainOptions(workload=str(tmp / "pools.yaml"), plan=str(tmp / "plan.json"), out=str(tmp / "run"))
    seen = []

    def plan_with(model, planner):
        seen.append((model, planner))
        return plan_deployment(grown, plan.fleet(), model, planner)

    path, replanned = replan_run(grown, plan.fleet(), plan, plan.policy, options, plan_with)
    ((model, planner),) = seen
    assert (planner.objective, planner.tie_rel) == (PlanObjective.COST, 0.25) and planner.prices == PRICES
    by_cost = plan_deployment(grown, cluster, model, COST).plan
    fastest = plan_deployment(grown, cluster, model, replace(COST, objective=PlanObjective.MAKESPAN)).plan
    assert by_cost.describe() != fastest.describe()  # the objective decides this re-plan
    assert replanned.plan.describe() == by_cost.describe()
    saved = DeploymentPlan.load(path)
    assert saved == replanned.plan and saved.objective is PlanObjective.COST
    assert [(p.name, p.price_per_gpu_hour) for p in saved.pools] == list(PRICES)


def test_an_incremental_replan_plans_by_the_running_plans_objective(fleet, monkeypatch):
    """``replan_incremental`` told the default options re-plans by the cost objective the running plan records."""
    import lorafleet.planner.incremental as incremental

    _, grown, _, cost_model, plan = fleet
    seen = []

    def planned(workload, cluster, model, options):
        seen.append(options)
        return plan_deployment(workload, cluster, model, options)

    monkeypatch.setattr(incremental, "plan_deployment", planned)
    options = PlannerOptions(robust_samples=0)
    replan = replan_incremental(plan, grown, plan.fleet(), cost_model, options, ReplanOptions(), steps_left=100)
    (planner,) = seen
    assert (planner.objective, planner.tie_rel) == (PlanObjective.COST, 0.25) and planner.prices == PRICES
    assert replan.plan.objective is PlanObjective.COST
    assert [p.price_per_gpu_hour for p in replan.plan.pools] == [1.3, 2.5]
