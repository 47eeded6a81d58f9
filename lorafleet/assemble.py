"""Build the pieces a command needs from a workload: its cluster (with overrides) and cost model.

Every command (plan, dispatch, simulate, whatif, train) goes through these functions, so
``--gpus``, ``--gpu`` and ``--profile`` mean the same thing everywhere. A command that runs a plan
applies the overrides of its policy (field key -> value, ``DispatchPolicy.with_overrides``), prices it
with the cost model the plan was judged by (:func:`plan_cost_model`) and checks it
(:func:`lorafleet.plan_check.check_plan`) before any work: :func:`prepare_run`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import ValidationError

from lorafleet.costmodel import AdapterLoad, CostModel, load_cost_model
from lorafleet.errors import InputError
from lorafleet.plan_check import check_plan
from lorafleet.plans import DeploymentPlan
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.dispatch import flag_error
from lorafleet.specs.io import file_sha256
from lorafleet.specs.workload import describe_validation_error
from lorafleet.workload import Workload


def workload_cluster(workload: Workload, gpus: int | None = None, gpu: str | None = None) -> ClusterSpec:
    """The workload's cluster, with the GPU count and/or kind replaced (same GPUs per node)."""
    cluster = workload.cluster
    kind = gpu or cluster.gpu
    if gpus is None:
        try:
            return cluster.model_copy(update={"gpu": ClusterSpec(gpu=kind).gpu})
        except ValueError as err:
            raise InputError("<args>", "--gpu", _message(err)) from None
    if gpus < 1:
        raise InputError("<args>", "--gpus", f"must be >= 1, got {gpus}")
    try:
        return ClusterSpec.with_gpus(gpus, kind, cluster.gpus_per_node)
    except ValueError as err:
        raise InputError("<args>", "--gpus" if "nodes" in str(err) else "--gpu", _message(err)) from None


def _message(err: ValueError) -> str:
    """A validation error's own message, as the same mistake in a workload file gets it (a pydantic
    error's last line is its help URL)."""
    if isinstance(err, ValidationError):
        return describe_validation_error(err.errors()[0])[1]
    return str(err).splitlines()[-1]


def workload_adapters(workload: Workload) -> AdapterLoad:
    """The adapter load of the workload's tasks (ranks, targets, the first task's optimizer)."""
    return AdapterLoad.from_specs([t.spec.lora for t in workload.tasks], workload.tasks[0].spec.optimizer.name)


def workload_cost_model(
    workload: Workload, cluster: ClusterSpec, profile: str | Path | None = None, sync_replicas: int = 2
) -> CostModel:
    """The analytic model of ``cluster``'s GPU, or the fitted one of ``profile`` when given.

    ``sync_replicas`` is how many replicas all-reduce the adapter gradients each step (the
    plan's replica count once there is a plan; the step overhead grows with it). The
    workload's ``recompute`` policy says which configs, with or without activation
    recomputation, the model offers.
    """
    return load_cost_model(
        profile,
        workload.model,
        cluster,
        workload_adapters(workload),
        sync_replicas=sync_replicas,
        recompute=workload.spec.recompute,
    )


@dataclass(frozen=True)
class PlannedRun:
    """A plan, checked, with the cost model to run it by and what the command changed of it."""

    plan: DeploymentPlan
    """The plan, its policy replaced where a flag overrode it."""
    cost_model: CostModel
    overrides: tuple[str, ...]
    """One line per thing a flag changed from the plan (printed by the command)."""


def _plan_profile(plan: DeploymentPlan, plan_path: str) -> Path:
    """The profile file a plan was judged by, found as recorded (from the current directory) or beside the
    plan file, and unchanged since (its SHA-256)."""
    origin = plan.cost_model
    assert origin is not None and origin.kind == "profile"
    recorded = Path(origin.profile)
    found = next((p for p in (recorded, Path(plan_path).parent / recorded) if p.is_file()), None)
    if found is None:
        raise InputError(
            plan_path,
            "cost_model.profile",
            f"{origin.profile}: no such file (the profile the plan was "
            "judged by); run from where the plan was made, or name a profile with --profile",
        )
    if file_sha256(found) != origin.sha256:
        raise InputError(
            plan_path,
            "cost_model.sha256",
            f"{found} changed since the plan was made; re-plan, or pass --profile {found} to run by it as it is now",
        )
    return found


def plan_cost_model(
    workload: Workload, cluster: ClusterSpec, plan: DeploymentPlan, plan_path: str, profile: str | Path | None = None
) -> tuple[CostModel, str | None]:
    """The cost model to run ``plan`` by: the one it was judged by (its profile, verified by content hash,
    or the analytic model of its GPU), or ``profile`` when given; with a line saying so when it is not
    the plan's own. The gradient all-reduce is priced over the plan's replicas."""
    sync = len(plan.replicas)
    origin = plan.cost_model
    if profile is not None:
        cm = workload_cost_model(workload, cluster, profile, sync_replicas=sync)
        assert cm.origin is not None
        if origin is not None and (cm.origin.kind, cm.origin.sha256) == (origin.kind, origin.sha256):
            return cm, None
        judged = origin.describe() if origin is not None else "an unrecorded cost model"
        return cm, f"cost model {cm.origin.describe()} (--profile; the plan was judged by {judged})"
    if origin is None or origin.kind == "analytic":
        return workload_cost_model(workload, cluster, None, sync_replicas=sync), None
    return workload_cost_model(workload, cluster, _plan_profile(plan, plan_path), sync_replicas=sync), None


def prepare_run(
    workload: Workload,
    cluster: ClusterSpec,
    plan_path: str,
    profile: str | Path | None = None,
    policy_overrides: Mapping[str, object] | None = None,
) -> PlannedRun:
    """Load the plan at ``plan_path``, apply the overrides of its dispatch policy (policy field key -> value,
    ``DispatchPolicy.with_overrides``; a bad value is an InputError naming its flag), build its cost model
    and check the plan against all of it (:func:`~lorafleet.plan_check.check_plan`): what every
    plan-reading command does before any work."""
    plan = DeploymentPlan.load(plan_path)
    overrides: list[str] = []
    try:
        changed = plan.policy.with_overrides({k: v for k, v in (policy_overrides or {}).items() if v is not None})
    except InputError as err:
        raise flag_error(err) from None
    if changed != plan.policy:
        overrides.append(f"policy {changed.describe()} (overriding the plan's: {plan.policy.describe()})")
        plan = replace(plan, policy=changed)
    cost_model, note = plan_cost_model(workload, cluster, plan, plan_path, profile)
    if note:
        overrides.append(note)
    check_plan(plan, workload, cluster, cost_model, plan_path)
    return PlannedRun(plan=plan, cost_model=cost_model, overrides=tuple(overrides))
