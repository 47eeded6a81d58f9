"""Incremental re-planning (``planner.incremental``): the running deployment is kept unless a new one
saves more than its migration over the horizon; it is left when it cannot serve the new tasks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.planner import MigrationModel, PlannerOptions, ReplanOptions, plan_deployment, replan_incremental
from lorafleet.planner.incremental import Migration, kept_plan, rebuilt_ranks, torn_down
from lorafleet.plans import DeploymentPlan, PlanPool, ReplicaSpec
from lorafleet.specs.replan import ReplanSettings
from lorafleet.workload import load_workload
from tests.helpers.planning import skewed_histogram, write_workload

OPTIONS = PlannerOptions(robust_samples=0, baselines=False)
DEAR, FREE = (ReplanOptions(ReplanSettings(migration_s=s)) for s in (1e9, 0.0))  # a move's flat price


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
    replan = replan_incremental(current, workload, workload.cluster, cost_model_7b, OPTIONS, DEAR, steps_left=50)
    assert not replan.moved
    assert [r.config for r in replan.plan.replicas] == [r.config for r in current.replicas]
    assert replan.plan.tasks == ("chat", "code") and replan.plan.expected_makespan_s > 0
    assert "kept" in replan.describe()


def test_the_new_plan_is_never_judged_worse_than_keeping(running, cost_model_7b):
    """The running deployment enters the planner's pool (warm start): T_move <= T_keep."""
    tmp, current = running
    workload = _grown(tmp, 2048)
    replan = replan_incremental(current, workload, workload.cluster, cost_model_7b, OPTIONS, FREE, steps_left=50)
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
        ReplanOptions(ReplanSettings(migration_s=7.0, horizon=10)),
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
    replan = replan_incremental(current, workload, workload.cluster, cost_model_7b, OPTIONS, DEAR, steps_left=50)
    assert replan.moved and math.isinf(replan.keep_step_s)
    assert max(r.max_tokens for r in replan.plan.replicas) >= 8192
    assert "cannot serve" in replan.describe()
    assert replan.plan.policy == current.policy


# ---- migration, priced by what the in-process rebuild costs (#28) -----------------------------------


def _plan(*replicas: tuple[int, int, tuple[int, ...]]) -> DeploymentPlan:
    specs = tuple(ReplicaSpec(i, ParallelConfig(tp, pp), 4096, gpus) for i, (tp, pp, gpus) in enumerate(replicas))
    return DeploymentPlan(
        model="tiny-llama", pools=(PlanPool("", "cpu", 4, 4),), tasks=("a",), replicas=specs,
        bucket_boundaries=(), expected_makespan_s=1.0,
    )  # fmt: skip


TWO = _plan((1, 1, (0,)), (2, 1, (1, 2)))  # rank 3 idle
THREE = _plan((1, 1, (0,)), (1, 1, (1,)), (1, 2, (2, 3)))


def test_a_rank_rebuilds_when_its_stage_or_its_tp_partners_change():
    assert rebuilt_ranks(TWO, TWO) == set()
    assert rebuilt_ranks(TWO, THREE) == {1, 2, 3}  # tp2 -> tp1 and pp2; the idle rank 3 builds its first stage
    assert rebuilt_ranks(THREE, _plan((1, 1, (0,)), (1, 2, (2, 3)))) == set()  # a replica dropped: the others stay
    assert rebuilt_ranks(TWO, _plan((1, 1, (0,)), (2, 1, (2, 1)))) == {1, 2}  # the TP ranks swapped: other slices
    assert rebuilt_ranks(_plan((2, 1, (0, 1))), _plan((2, 1, (0, 2)))) == {0, 2}  # rank 0's TP group changed


def test_the_measured_migration_is_the_slowest_stage_load_plus_the_fixed_part_on_every_gpu_held():
    model = MigrationModel(fixed_s=0.5, load_bytes_per_s=1e6, dtype_bytes=4)
    n_params = 1_000_000
    move = model.price(TWO, THREE, n_params)
    stage = max(n_params * 4 / 1 / 1e6, n_params * 4 / 2 / 1e6)  # <1,1> rank 1 loads the whole model; pp2 half
    assert move.wall_s == pytest.approx(0.5 + stage) and move.gpu_s == pytest.approx(move.wall_s * 4)
    assert move.rebuilt == 2
    trim = model.price(THREE, _plan((1, 1, (0,)), (1, 2, (2, 3))), n_params)
    assert trim.wall_s == 0.5 and trim.gpu_s == 0.5 * 4 and trim.rebuilt == 0  # nothing loaded, the groups remade
    assert model.price(TWO, TWO, n_params) == Migration(0.0, 0.0, 0)
    flat = ReplanOptions(ReplanSettings(migration_s=60.0)).pricing.price(TWO, THREE, n_params)
    assert (flat.wall_s, flat.gpu_s, flat.rebuilt) == (60.0, 120.0, 1)  # the tp2 replica torn down, 2 GPUs
