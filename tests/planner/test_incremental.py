"""Incremental re-planning (``planner.incremental``): the running deployment is kept unless a new one
saves more than its migration over the horizon; it is left when it cannot serve the new tasks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lorafleet.planner import PlannerOptions, ReplanOptions, plan_deployment, replan_incremental
from lorafleet.planner.incremental import kept_plan, torn_down
from lorafleet.workload import load_workload
from tests.helpers.planning import skewed_histogram, write_workload

OPTIONS = PlannerOptions(robust_samples=0, baselines=False)


def _tasks(rng: np.random.Generator, longest: int = 4096) -> list[dict]:
    return [
        {"name": "chat", "batch_size": 64, "context_length": 2048, "histogram": skewed_histogram(rng, 200, 2048)},
        {"name": "code", "batch_size": 32, "context_length": longest, "histogram": skewed_histogram(rng, 600, longest)},
    ]


@pytest.fixture(scope="module")
def running(tmp_path_factory, cost_model_7b):
    """A plan for two short tasks on one node."""
    tmp = tmp_path_factory.mktemp("incremental")
    rng = np.random.default_rng(0)
    workload = load_workload(write_workload(tmp / "w.yaml", _tasks(rng)[:1], nodes=1))
    return tmp, plan_deployment(workload, workload.cluster, cost_model_7b, OPTIONS).plan


def _grown(tmp, longest: int, name: str = "w2.yaml"):
    return load_workload(write_workload(tmp / name, _tasks(np.random.default_rng(0), longest), nodes=1))


def test_a_huge_migration_keeps_the_running_deployment(running, cost_model_7b):
    tmp, current = running
    workload = _grown(tmp, 2048)
    replan = replan_incremental(
        current, workload, workload.cluster, cost_model_7b, OPTIONS, ReplanOptions(migration_s=1e9), steps_left=50
    )
    assert not replan.moved
    assert [r.config for r in replan.plan.replicas] == [r.config for r in current.replicas]
    assert replan.plan.tasks == ("chat", "code") and replan.plan.expected_makespan_s > 0
    assert "kept" in replan.describe()


def test_the_new_plan_is_never_judged_worse_than_keeping(running, cost_model_7b):
    """The running deployment enters the planner's pool (warm start): T_move <= T_keep."""
    tmp, current = running
    workload = _grown(tmp, 2048)
    replan = replan_incremental(
        current, workload, workload.cluster, cost_model_7b, OPTIONS, ReplanOptions(migration_s=0.0), steps_left=50
    )
    assert replan.move_step_s <= replan.keep_step_s * (1 + 1e-9)
    if replan.moved:
        assert replan.saving_gpu_s > replan.migration_gpu_s
    assert replan.horizon == 50


def test_the_saving_is_counted_over_the_horizon_and_charged_per_replica_torn_down(running, cost_model_7b):
    tmp, current = running
    workload = _grown(tmp, 2048)
    replan = replan_incremental(
        current,
        workload,
        workload.cluster,
        cost_model_7b,
        OPTIONS,
        ReplanOptions(migration_s=7.0, horizon_steps=10),
        steps_left=50,
    )
    assert replan.horizon == 10
    fresh = plan_deployment(workload, workload.cluster, cost_model_7b, OPTIONS).plan
    gone = torn_down(current, fresh)
    assert replan.migration_gpu_s == pytest.approx(7.0 * sum(current.replicas[r].config.n_gpus for r in gone))
    keep = kept_plan(current, workload, cost_model_7b)
    assert replan.keep_step_s == pytest.approx(keep.expected_makespan_s)


def test_a_task_longer_than_every_replica_forces_a_move(running, cost_model_7b):
    tmp, current = running
    workload = _grown(tmp, 8192, "w3.yaml")
    assert kept_plan(current, workload, cost_model_7b) is None
    replan = replan_incremental(
        current, workload, workload.cluster, cost_model_7b, OPTIONS, ReplanOptions(migration_s=1e9), steps_left=50
    )
    assert replan.moved and math.isinf(replan.keep_step_s)
    assert max(r.max_tokens for r in replan.plan.replicas) >= 8192
    assert "cannot serve" in replan.describe()
    assert replan.plan.policy == current.policy
