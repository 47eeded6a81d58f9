"""A running job's re-plan: the deployment for the GPUs or the tasks it has now, under the policy it runs.

Two things re-plan a run: a resume on another number of GPUs (``train.preflight``: a fresh plan for the
GPUs there are) and queued task changes (``train.live``, in the running fleet: an incremental re-plan that
keeps the running deployment unless a move pays for itself). Both go through :func:`replan_run`: the old
plan's cost model (its profile verified, or ``--profile``), the running dispatch policy passed whole to the
planner (``PlannerOptions.policy``: every deployment is judged under it and the new plan records it), the
objective, tolerance and pool prices the old plan was planned by (``PlannerOptions.replanning``), and the
result written as the run's ``plan.json`` (checked like any plan by a launch). No torch here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from lorafleet.train.options import TrainOptions

if TYPE_CHECKING:
    from lorafleet.costmodel import CostModel
    from lorafleet.planner import PlannerOptions
    from lorafleet.plans import DeploymentPlan
    from lorafleet.specs.cluster import ClusterSpec
    from lorafleet.specs.dispatch import DispatchPolicy
    from lorafleet.workload import Workload


class Planned(Protocol):
    """What a planner returns: a plan and what it knows of it (``PlanResult``, ``Replan``)."""

    @property
    def plan(self) -> DeploymentPlan: ...


P = TypeVar("P", bound=Planned)


def replan_run(
    workload: Workload,
    cluster: ClusterSpec,
    old: DeploymentPlan,
    policy: DispatchPolicy,
    options: TrainOptions,
    plan_with: Callable[[CostModel, PlannerOptions], P],
    *,
    save: bool = True,
    cost_model: CostModel | None = None,
) -> tuple[Path, P]:
    """Re-plan the run of ``options`` for ``workload`` on ``cluster`` (module doc): priced by ``old``'s cost
    model (``options.plan`` is where ``old`` was read from), judged under ``policy`` (the running one) by what
    ``old`` was planned for (``PlannerOptions.replanning``), found by ``plan_with``; returns where the new plan
    is written (``<out>/plan.json``; with ``save`` only) and the planner's answer. ``cost_model``: ``old``'s for
    ``workload``, when the caller has built it."""
    from lorafleet.assemble import plan_cost_model
    from lorafleet.planner import PlannerOptions

    if cost_model is None:
        cost_model, _ = plan_cost_model(workload, cluster, old, options.plan, options.profile)
    planned = plan_with(cost_model, PlannerOptions().replanning(old, policy))
    path = options.run_dir.plan
    if save:
        planned.plan.save(path)
    return path, planned
