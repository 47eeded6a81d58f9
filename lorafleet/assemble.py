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

from lorafleet.costmodel import AdapterLoad, CostModel, CostModelOrigin, fleet_cost_model
from lorafleet.errors import InputError
from lorafleet.plan_check import check_fleet, check_plan, with_plan_base
from lorafleet.plans import DeploymentPlan
from lorafleet.specs.cluster import ClusterSpec, PoolSpec
from lorafleet.specs.dispatch import flag_error
from lorafleet.specs.io import file_sha256
from lorafleet.specs.workload import describe_validation_error
from lorafleet.workload import Workload


def workload_cluster(workload: Workload, gpus: int | None = None, gpu: str | None = None) -> ClusterSpec:
    """The workload's cluster, with the GPU count and/or kind of its one pool replaced (same GPUs per node;
    its name, price, profile and stage load rate kept). A cluster of several pools takes neither: each pool is
    changed by ``--set cluster.pools.NAME.KEY=VALUE``."""
    cluster = workload.cluster
    if (gpus is not None or gpu is not None) and len(cluster.pools) > 1:
        flag = "--gpus" if gpus is not None else "--gpu"
        key = "nodes" if gpus is not None else "gpu"
        raise InputError(
            "<args>",
            flag,
            f"the cluster has {len(cluster.pools)} pools ({', '.join(cluster.pool_names)}): change one with "
            f"--set cluster.pools.NAME.{key}=VALUE",
        )
    if gpus is None and gpu is None:
        return cluster
    pool = cluster.pools[0]
    kind = gpu or pool.gpu
    if gpus is None:
        try:
            return ClusterSpec(pools=(pool.model_copy(update={"gpu": PoolSpec(gpu=kind).gpu}),))
        except ValueError as err:
            raise InputError("<args>", "--gpu", _message(err)) from None
    if gpus < 1:
        raise InputError("<args>", "--gpus", f"must be >= 1, got {gpus}")
    try:
        others = pool.model_dump(include={"name", "price_per_gpu_hour", "profile", "stage_load_gbps"})
        return ClusterSpec.with_gpus(gpus, kind, pool.gpus_per_node, **others)
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
    """The cost model of every pool of ``cluster`` (``costmodel.fleet_cost_model``): the profile a pool names,
    else the analytic model of its GPU kind; ``profile`` (``--profile``) replaces the profile of a cluster's
    one pool. A profile of another GPU kind than its pool's is an InputError naming the pool's field.

    ``sync_replicas`` is how many replicas all-reduce the adapter gradients each step (the
    plan's replica count once there is a plan; the step overhead grows with it). The
    workload's ``recompute`` policy says which configs, with or without activation
    recomputation, the model offers.
    """
    if profile is not None and len(cluster.pools) > 1:
        raise InputError(
            "<args>",
            "--profile",
            f"the cluster has {len(cluster.pools)} pools: name each pool's profile in the workload "
            "(cluster.pools[].profile, or --set cluster.pools.NAME.profile=FILE)",
        )
    profiles = {p.name: profile if profile is not None else p.profile for p in cluster.pools}
    return _fleet_model(workload, cluster, profiles, sync_replicas, given=profile is not None)


def origins_cost_model(
    workload: Workload, cluster: ClusterSpec, profiles: Mapping[str, str | Path | None], sync_replicas: int = 2
) -> CostModel:
    """The cost model of ``cluster`` with pool ``name`` priced by the profile ``profiles[name]`` (None or
    absent: its kind's analytic model), whatever profiles the workload names: a model rebuilt from the
    origins a plan or run file recorded."""
    return _fleet_model(workload, cluster, profiles, sync_replicas)


def _fleet_model(
    workload: Workload,
    cluster: ClusterSpec,
    profiles: Mapping[str, str | Path | None],
    sync_replicas: int,
    given: bool = False,
) -> CostModel:
    """``fleet_cost_model`` of the workload's model and adapters; a pool's profile of another kind is an
    InputError naming where it was given (``--profile`` when ``given``, else the pool's workload field). A
    workload that lets the planner choose its base is priced base by base (``planner.base_choice``): here, an
    InputError (this command prices one base)."""
    if workload.spec.quantize_candidates is not None:
        raise InputError(
            workload.path, "quantize", "this command prices one base: give one (--set quantize=nf4, or null)"
        )
    try:
        return fleet_cost_model(
            workload.model,
            cluster,
            workload_adapters(workload),
            profiles,
            sync_replicas=sync_replicas,
            recompute=workload.spec.recompute,
            quantize=workload.spec.quantize,
        )
    except InputError as err:
        for k, pool in enumerate(cluster.pools):
            path = profiles.get(pool.name)
            if path is not None and err.path == str(path) and err.field == "gpu":
                where = ("<args>", "--profile") if given else (workload.path, _pool_field(cluster, k, "profile"))
                raise InputError(*where, f"{path}: {err.msg}") from None
        raise


def _pool_field(cluster: ClusterSpec, k: int, key: str) -> str:
    """Where pool ``k``'s ``key`` is written in a workload: ``cluster.KEY`` for a flat cluster."""
    return f"cluster.{key}" if not cluster.pools[k].name else f"cluster.pools[{k}].{key}"


@dataclass(frozen=True)
class PlannedRun:
    """A plan, checked, with the cost model to run it by and what the command changed of it."""

    plan: DeploymentPlan
    """The plan, its policy replaced where a flag overrode it."""
    cost_model: CostModel
    overrides: tuple[str, ...]
    """One line per thing a flag changed from the plan (printed by the command)."""


def _plan_profile(origin: CostModelOrigin, field: str, plan_path: str) -> Path:
    """The profile file a plan's pool was judged by (``origin``, recorded at ``field``), found as recorded
    (from the current directory) or beside the plan file, and unchanged since (its SHA-256)."""
    recorded = Path(origin.profile)
    found = next((p for p in (recorded, Path(plan_path).parent / recorded) if p.is_file()), None)
    if found is None:
        raise InputError(
            plan_path,
            f"{field}.profile",
            f"{origin.profile}: no such file (the profile the plan was "
            "judged by); run from where the plan was made, or name a profile with --profile",
        )
    if file_sha256(found) != origin.sha256:
        raise InputError(
            plan_path,
            f"{field}.sha256",
            f"{found} changed since the plan was made; re-plan, or pass --profile {found} to run by it as it is now",
        )
    return found


def plan_cost_model(
    workload: Workload, cluster: ClusterSpec, plan: DeploymentPlan, plan_path: str, profile: str | Path | None = None
) -> tuple[CostModel, str | None]:
    """The cost model to run ``plan`` by: the one each pool was judged by (its profile, verified by content
    hash, or the analytic model of its GPU), or ``profile`` when given (a one-pool cluster); with a line
    saying so when it is not the plan's own. The gradient all-reduce is priced over the plan's replicas.
    A pool the plan names and the cluster has not is left to the plan check."""
    sync = len(plan.replicas)
    judged = plan.cost_models
    if profile is not None:
        cm = workload_cost_model(workload, cluster, profile, sync_replicas=sync)
        mine = {name: (o.kind, o.sha256) if o else None for name, o in cm.origins().items()}
        if mine == {name: (o.kind, o.sha256) if o else None for name, o in judged.items()}:
            return cm, None
        was = " + ".join(o.describe() if o else "an unrecorded cost model" for o in judged.values())
        now = " + ".join(o.describe() for o in cm.origins().values() if o)
        return cm, f"cost model {now} (--profile; the plan was judged by {was})"
    profiles: dict[str, str | Path | None] = {}
    for k, pool in enumerate(plan.pools):
        origin = pool.cost_model
        if origin is not None and origin.kind == "profile":
            profiles[pool.name] = _plan_profile(origin, f"pools[{k}].cost_model", plan_path)
    return origins_cost_model(workload, cluster, profiles, sync), None


def prepare_run(
    workload: Workload,
    cluster: ClusterSpec,
    plan_path: str,
    profile: str | Path | None = None,
    policy_overrides: Mapping[str, object] | None = None,
    plan: DeploymentPlan | None = None,
) -> PlannedRun:
    """Load the plan at ``plan_path`` (or take ``plan``, read already: ``plan_path`` is then what errors name and
    what its profiles are relative to), apply the overrides of its dispatch policy (policy field key -> value,
    ``DispatchPolicy.with_overrides``; a bad value is an InputError naming its flag), build its cost model
    and check the plan against all of it (:func:`~lorafleet.plan_check.check_plan`): what every
    plan-reading command does before any work. A workload that lets the planner choose its base runs over the
    plan's (:func:`~lorafleet.plan_check.with_plan_base`)."""
    plan = plan if plan is not None else DeploymentPlan.load(plan_path)
    overrides: list[str] = []
    try:
        changed = plan.policy.with_overrides({k: v for k, v in (policy_overrides or {}).items() if v is not None})
    except InputError as err:
        raise flag_error(err) from None
    if changed != plan.policy:
        overrides.append(f"policy {changed.describe()} (overriding the plan's: {plan.policy.describe()})")
        plan = replace(plan, policy=changed)
    workload = with_plan_base(plan, workload, plan_path)  # quantize: auto or a list takes the plan's base
    check_fleet(plan, workload, cluster, plan_path)  # the pools the cost model is then built for
    cost_model, note = plan_cost_model(workload, cluster, plan, plan_path, profile)
    if note:
        overrides.append(note)
    check_plan(plan, workload, cluster, cost_model, plan_path)
    return PlannedRun(plan=plan, cost_model=cost_model, overrides=tuple(overrides))
