"""GPU placement of a deployment (every TP group inside one node of its pool), and the DeploymentPlan it makes.

A replica of ⟨tp, pp⟩ is pp TP groups of tp GPUs (one per pipeline stage), all on its config's
pool. In each pool, groups are placed first-fit decreasing by tp over the pool's nodes, each on
the lowest free GPUs of its node; a replica's stages are placed in order, so they share a node
when they can. With power-of-two TP degrees the group sizes divide each other, and first-fit
decreasing succeeds whenever the budget rows of :meth:`PlanningProblem.gpu_budget_rows` hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.plans import DeploymentPlan, PlanPool, ReplicaSpec, StepPlan
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.dispatch import DispatchPolicy
from lorafleet.workload import Workload


def place_replicas(
    configs: Sequence[ParallelConfig], max_tokens: Sequence[int], cluster: ClusterSpec
) -> tuple[ReplicaSpec, ...]:
    """ReplicaSpecs, in the order given, with global GPU indices (the pool's first GPU + node *
    gpus_per_node + local).

    Raises:
        ValueError: the TP groups do not fit their pool's nodes (a planner bug: the budget rows forbid it).
    """
    stage_gpus: dict[tuple[int, int], tuple[int, ...]] = {}
    for pool in cluster.pools:
        per_node, first = pool.gpus_per_node, cluster.first_gpu(pool.name)
        used = [0] * pool.nodes
        groups = sorted(
            ((c.tp, r, stage) for r, c in enumerate(configs) if c.pool == pool.name for stage in range(c.pp)),
            key=lambda g: (-g[0], g[1], g[2]),
        )
        node, size = 0, 0
        for tp, r, stage in groups:
            if tp != size:  # a smaller group may fit where a larger one did not: first fit from the first node
                node, size = 0, tp
            while node < pool.nodes and per_node - used[node] < tp:
                node += 1  # for one size, the nodes before the last fit stay too full: first fit resumes there
            if node == pool.nodes:
                where = f" of pool {pool.name!r}" if pool.name else ""
                raise ValueError(
                    f"cannot place a TP group of {tp} GPUs: nodes{where} hold {[per_node - u for u in used]} free GPUs"
                )
            start = first + node * per_node + used[node]
            stage_gpus[r, stage] = tuple(range(start, start + tp))
            used[node] += tp
    unplaced = [str(c) for r, c in enumerate(configs) if (r, 0) not in stage_gpus]
    if unplaced:
        raise ValueError(f"{', '.join(unplaced)}: the cluster has no such pool ({', '.join(cluster.pool_names)})")
    return tuple(
        ReplicaSpec(
            replica_id=r,
            config=c,
            max_tokens=int(m),
            gpus=tuple(g for stage in range(c.pp) for g in stage_gpus[r, stage]),
        )
        for r, (c, m) in enumerate(zip(configs, max_tokens, strict=True))
    )


def plan_pools(cluster: ClusterSpec, cost_model: CostModel) -> tuple[PlanPool, ...]:
    """The cluster's pools as a plan records them, each with the origin of the cost model that prices it and its
    price per GPU-hour."""
    return tuple(
        PlanPool(
            name=pool.name,
            gpu=pool.gpu,
            n_gpus=pool.n_gpus,
            gpus_per_node=pool.gpus_per_node,
            cost_model=cost_model.origins().get(pool.name),
            price_per_gpu_hour=pool.price_per_gpu_hour,
        )
        for pool in cluster.pools
    )


def build_plan(
    workload: Workload,
    cluster: ClusterSpec,
    replicas: Sequence[tuple[ParallelConfig, int, int]],
    *,
    solver: str,
    policy: DispatchPolicy,
    cost_model: CostModel,
    notes: Sequence[str] = (),
) -> DeploymentPlan:
    """A placed DeploymentPlan of ``(config, max_tokens, count)`` triples, replicas in the order given,
    recording the dispatch ``policy`` and the cost model it is judged under, and the workload's
    recompute policy.

    The expectation fields (makespan, per-replica times, buckets) start empty; the planner
    fills them from the expected batch's dispatch (:func:`with_expectation`).
    """
    configs = [c for c, _, n in replicas for _ in range(n)]
    max_tokens = [m for _, m, n in replicas for _ in range(n)]
    return DeploymentPlan(
        model=workload.model.name,
        pools=plan_pools(cluster, cost_model),
        tasks=tuple(t.name for t in workload.tasks),
        replicas=place_replicas(configs, max_tokens, cluster),
        bucket_boundaries=(),
        expected_makespan_s=0.0,
        solver=solver,
        notes=tuple(notes),
        policy=policy,
        recompute=workload.spec.recompute,
    )


def with_expectation(plan: DeploymentPlan, step: StepPlan) -> DeploymentPlan:
    """``plan`` with the expected batch's dispatch recorded: its buckets, makespan and replica times."""
    return replace(
        plan,
        bucket_boundaries=tuple(step.bucket_boundaries),
        expected_makespan_s=step.estimated_makespan_s,
        expected_replica_time_s=tuple(w.estimated_time_s for w in step.work),
    )
