"""The typed objects between stages: what a StepPlan counts of its own tokens; the replica and pool rules a
DeploymentPlan states once (which GPUs a stage holds, the same replica, the longest sequence, the loop's
window, a replica's pool)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.errors import InputError
from lorafleet.plans import DeploymentPlan, MicroBatch, PlanPool, ReplicaSpec, ReplicaWork, StepPlan, stage_position
from lorafleet.specs.cluster import PoolSpec
from lorafleet.specs.dispatch import DispatchPolicy


def test_task_token_counts_are_real_and_padding_tokens_per_task_name():
    padded = MicroBatch(seq_ids=(0, 1), task_ids=(0, 2), lengths=(5, 3), padded_len=8)
    packed = MicroBatch(seq_ids=(2,), task_ids=(2,), lengths=(4,), padded_len=None)
    step_plan = StepPlan(
        step=0,
        bucket_boundaries=(8,),
        work=(ReplicaWork(0, (padded,), 1.0), ReplicaWork(1, (packed,), 0.5), ReplicaWork(2, (), 0.0)),
        estimated_makespan_s=1.0,
    )
    tokens, padding = step_plan.task_token_counts(("a", "idle", "b"))
    assert tokens == {"a": 5, "idle": 0, "b": 7} and padding == {"a": 3, "idle": 0, "b": 5}
    assert list(tokens) == ["a", "idle", "b"]  # every name, in order
    assert sum(tokens.values()) == step_plan.tokens and sum(padding.values()) == step_plan.padding_tokens


def _plan(*replicas: ReplicaSpec, window: int = 8) -> DeploymentPlan:
    return DeploymentPlan(
        model="tiny-llama", pools=(PlanPool("a", "cpu", 4, 2), PlanPool("b", "cpu", 4, 4)), tasks=("t",),
        replicas=replicas, bucket_boundaries=(), expected_makespan_s=1.0,
        policy=DispatchPolicy(pipeline_window=window),
    )  # fmt: skip


TP2_PP2 = ReplicaSpec(0, ParallelConfig(2, 2, pool="b"), 2048, (4, 5, 7, 6))
ONE = ReplicaSpec(1, ParallelConfig(1, 1, pool="a"), 512, (0,))


def test_stage_k_of_a_replica_holds_gpus_k_tp_to_k_plus_1_tp():
    assert TP2_PP2.stages == ((4, 5), (7, 6)) and TP2_PP2.stage_gpus(1) == (7, 6)
    assert [stage_position(TP2_PP2.gpus, 2, g) for g in (4, 5, 7, 6)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_the_same_replica_is_the_same_config_on_the_same_gpus():
    plan = _plan(TP2_PP2, ONE)
    swapped = _plan(replace(ONE, replica_id=0), replace(TP2_PP2, replica_id=1, max_tokens=99))
    assert plan.same_deployment(swapped) and plan.placements != swapped.placements  # M and order aside
    assert plan.replica_ids_in(swapped) == (1, 0)
    moved = _plan(TP2_PP2, ReplicaSpec(1, ParallelConfig(1, 1, pool="a"), 512, (1,)))
    assert not plan.same_deployment(moved) and plan.replica_ids_in(moved) == (0, None)


def test_the_longest_sequence_fits_the_largest_replica():
    plan = _plan(TP2_PP2, ONE)
    assert plan.largest_max_tokens == 2048 and plan.holds(2048) and not plan.holds(2049)
    assert not _plan().holds(1)


def test_the_loop_window_is_the_pipeline_window_only_with_a_pipelined_replica():
    assert _plan(TP2_PP2, ONE, window=8).loop_window == 8
    assert _plan(ONE, window=8).loop_window == 1
    assert _plan(TP2_PP2, window=1).loop_window == 1


def test_a_replica_s_pool_is_its_config_s_and_its_file_writes_it_beside_the_layout():
    plan = _plan(TP2_PP2, ONE)
    assert [r.pool for r in plan.replicas] == ["b", "a"]
    data = plan.to_json()
    assert [(r["config"], r["pool"]) for r in data["replicas"]] == [("tp2_pp2", "b"), ("tp1_pp1", "a")]
    assert DeploymentPlan.from_json(data, "p.json") == plan
    data["replicas"][1]["config"] = "tp1_pp1@b"
    with pytest.raises(InputError, match=r"p.json: replicas\[1\]: .*on another pool than 'a'"):
        DeploymentPlan.from_json(data, "p.json")
    assert PoolSpec(name="a", gpu="cpu").describe() == "8 x cpu (a)" and plan.pools[0].describe() == "4 x cpu (a)"
