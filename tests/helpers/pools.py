"""A fleet of two pools for the tests of #29: ``examples/two-tenants.yaml``'s tasks on 8 A100-40GB and 2 nodes
of 4 H100-80GB, priced, and a plan by hand that puts the same configs on both kinds."""

from __future__ import annotations

from pathlib import Path

import yaml

from lorafleet.assemble import workload_cluster, workload_cost_model
from lorafleet.costmodel import CostModel, ParallelConfig
from lorafleet.plans import DeploymentPlan, PlanPool, ReplicaSpec
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.workload import Workload, load_workload
from tests.helpers.repo import SMALL_WORKLOAD

POOLS = (
    {"name": "a100", "gpu": "A100-40GB", "nodes": 1, "gpus_per_node": 8, "price_per_gpu_hour": 1.3},
    {"name": "h100", "gpu": "H100-80GB", "nodes": 2, "gpus_per_node": 4, "price_per_gpu_hour": 2.5},
)
POOLS_WORKLOAD = {**SMALL_WORKLOAD, "cluster": {"pools": [dict(p) for p in POOLS]}}
"""``examples/two-tenants.yaml`` (a chat task and a document task on Llama2-7B) on the two pools."""


def pools_fleet(folder: Path) -> tuple[Workload, ClusterSpec, CostModel, DeploymentPlan]:
    """The workload (written into ``folder``), its cluster and cost model, and a plan of ``<2,1>`` on A100s
    0-1, ``<2,1>`` on H100s 8-9, ``<1,1>`` on H100 10 and ``<2,2>`` on H100s 12-15 (the second H100 node)."""
    path = folder / "pools.yaml"
    path.write_text(yaml.safe_dump(POOLS_WORKLOAD))
    workload = load_workload(path)
    cluster = workload_cluster(workload)
    cost_model = workload_cost_model(workload, cluster, sync_replicas=4)
    layout = [
        ((2, 1, "a100"), (0, 1)),
        ((2, 1, "h100"), (8, 9)),
        ((1, 1, "h100"), (10,)),
        ((2, 2, "h100"), (12, 13, 14, 15)),
    ]
    replicas = []
    for k, ((tp, pp, pool), gpus) in enumerate(layout):
        config = ParallelConfig(tp, pp, pool=pool)
        replicas.append(ReplicaSpec(k, config, cost_model.max_tokens(config), gpus))
    origins = cost_model.origins()
    plan = DeploymentPlan(
        model=workload.model.name,
        pools=tuple(PlanPool(p.name, p.gpu, p.n_gpus, p.gpus_per_node, origins[p.name]) for p in cluster.pools),
        tasks=tuple(t.name for t in workload.tasks),
        replicas=tuple(replicas),
        bucket_boundaries=(workload.max_length,),
        expected_makespan_s=1.0,
        recompute=workload.spec.recompute,
    )
    return workload, cluster, cost_model, plan
