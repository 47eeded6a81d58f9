"""Build the pieces a command needs from a workload: its cluster (with overrides) and cost model.

Every command (plan, dispatch, simulate, whatif, train) goes through these two functions,
so ``--gpus``, ``--gpu`` and ``--profile`` mean the same thing everywhere.
"""

from __future__ import annotations

from pathlib import Path

from lorafleet.costmodel import AdapterLoad, CostModel, load_cost_model
from lorafleet.errors import InputError
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.workload import Workload


def workload_cluster(workload: Workload, gpus: int | None = None, gpu: str | None = None) -> ClusterSpec:
    """The workload's cluster, with the GPU count and/or kind replaced (same GPUs per node)."""
    cluster = workload.cluster
    kind = gpu or cluster.gpu
    if gpus is None:
        try:
            return cluster.model_copy(update={"gpu": ClusterSpec(gpu=kind).gpu})
        except ValueError as err:
            raise InputError("<args>", "--gpu", str(err).splitlines()[-1]) from None
    if gpus < 1:
        raise InputError("<args>", "--gpus", f"must be >= 1, got {gpus}")
    try:
        return ClusterSpec.with_gpus(gpus, kind, cluster.gpus_per_node)
    except ValueError as err:
        raise InputError("<args>", "--gpus" if "nodes" in str(err) else "--gpu", str(err).splitlines()[-1]) from None


def workload_adapters(workload: Workload) -> AdapterLoad:
    """The adapter load of the workload's tasks (ranks, targets, the first task's optimizer)."""
    return AdapterLoad.from_specs([t.spec.lora for t in workload.tasks], workload.tasks[0].spec.optimizer.name)


def workload_cost_model(workload: Workload, cluster: ClusterSpec, profile: str | Path | None = None,
                        sync_replicas: int = 2) -> CostModel:
    """The analytic model of ``cluster``'s GPU, or the fitted one of ``profile`` when given.

    ``sync_replicas`` is how many replicas all-reduce the adapter gradients each step (the
    plan's replica count once there is a plan; the step overhead grows with it). The
    workload's ``recompute`` policy says which configs, with or without activation
    recomputation, the model offers.
    """
    return load_cost_model(profile, workload.model, cluster, workload_adapters(workload), sync_replicas=sync_replicas,
                           recompute=workload.spec.recompute)
