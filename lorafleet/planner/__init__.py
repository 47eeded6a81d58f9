"""Deployment planning: which replicas of which ⟨TP, PP⟩ config to run, and the baselines.

``plan_deployment(workload, cluster, cost_model, options) -> PlanResult`` is the entry
point (see :mod:`.driver`; what makes one plan better than another is :mod:`.objective`);
``size_fleet`` plans it on 1 .. K whole nodes and picks the GPU count for a deadline, a GPU-hour
budget or the fewest GPU-seconds (:mod:`.sizing`, with its goal, rows, search and choice in
:mod:`.sizing_objective`, :mod:`.sizing_result`, :mod:`.sizing_search` (one pool's counts),
:mod:`.sizing_pools` (the mixes of several pools' nodes) and :mod:`.sizing_choice`).
The baselines are :class:`Schedule`\\ s (a DeploymentPlan and a dispatch policy per phase)
that a simulator can replay step by step, like the plan itself.

The planner top to bottom (ARCHITECTURE.md, "A plan's life"): :mod:`.options` (what it is told),
:mod:`.expected` (the expected batch), :mod:`.candidates` and :mod:`.problem` (configs, the planning
problem), :mod:`.fallback` (the heuristic deployment), :mod:`.deployment_ilp` (the aggregated MILP that
proposes) and :mod:`.joint_minlp` (LobRA's MINLP), :mod:`.search` (the pool of deployments), :mod:`.frontier` and
:mod:`.cost_search` (the cost objective's sweep over step times, its frontier, and its search),
:mod:`.evaluation` (a deployment's expected dispatch), :mod:`.refine` (trims and swaps) and :mod:`.local_search`
(the first-improvement search of swaps and of the cost objective's moves; :mod:`.fluid_split` spares it LPs),
:mod:`.placement`
(GPUs, then the DeploymentPlan), :mod:`.baselines` and :mod:`.schedule` (replayable schedules),
:mod:`.bounds` (lower bounds) and :mod:`.plot` (a plan's load per replica, as a PNG); :mod:`.base_choice`
(``quantize: auto``: the fleet planned once per candidate base, the better plan kept; :mod:`.sizing_bases`, sized
once per base).

A running fleet's re-plan: :mod:`.incremental` (``replan_incremental``: keep the deployment unless another pays
for its migration, priced by :class:`MigrationModel`) and :mod:`.decision` (``decide``, ``settle``: what a
fleet does at a change of its tasks, the one rule of ``lorafleet train`` and ``simulate --arrivals``).
"""

import importlib
from typing import TYPE_CHECKING

from lorafleet.planner.baselines import (
    BaselineKind,
    baseline_schedules,
    best_homogeneous,
    packing_policy,
    padding_policy,
    workload_baselines,
)
from lorafleet.planner.driver import LORAFLEET, PlanDiagnostics, PlanResult, ScheduleCost, plan_deployment
from lorafleet.planner.expected import expected_global_batch
from lorafleet.planner.options import PlannerMode, PlannerOptions, PlanObjective
from lorafleet.planner.schedule import Phase, Schedule, StepCost, pow2_boundaries

_LAZY = {
    "MigrationModel": "incremental",
    "Replan": "incremental",
    "ReplanObjective": "incremental",
    "ReplanOptions": "incremental",
    "replan_incremental": "incremental",
    "size_fleet": "sizing",
    "Deadline": "sizing_objective",
    "SizingGoal": "sizing_objective",
    "SizingObjective": "sizing_objective",
    "SizingError": "sizing_result",
    "SizingResult": "sizing_result",
    "SizingRow": "sizing_result",
}
"""The re-plan's and the fleet sizing's names, by module: imported on first use (PEP 562), so a plain plan does not
import the modules of ``--gpus auto`` and of a running fleet's re-plan (~0.03 CPU s of every plan's start). The
imports under ``TYPE_CHECKING`` name the same (for readers, type checkers and the docs' name check; a test keeps the
two equal)."""

if TYPE_CHECKING:
    from lorafleet.planner.incremental import MigrationModel, Replan, ReplanObjective, ReplanOptions, replan_incremental
    from lorafleet.planner.sizing import size_fleet
    from lorafleet.planner.sizing_objective import Deadline, SizingGoal, SizingObjective
    from lorafleet.planner.sizing_result import SizingError, SizingResult, SizingRow


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)


__all__ = [
    "LORAFLEET",
    "BaselineKind",
    "Deadline",
    "MigrationModel",
    "Phase",
    "PlanDiagnostics",
    "PlanResult",
    "PlanObjective",
    "PlannerMode",
    "PlannerOptions",
    "Replan",
    "ReplanObjective",
    "ReplanOptions",
    "Schedule",
    "ScheduleCost",
    "SizingError",
    "SizingGoal",
    "SizingObjective",
    "SizingResult",
    "SizingRow",
    "StepCost",
    "baseline_schedules",
    "best_homogeneous",
    "expected_global_batch",
    "packing_policy",
    "padding_policy",
    "plan_deployment",
    "pow2_boundaries",
    "replan_incremental",
    "size_fleet",
    "workload_baselines",
]
