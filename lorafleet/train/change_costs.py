"""What a fleet change costs and says, beside the component that makes it (``train.changes``): the price of the
next move learnt from this one's measured phases, a changed fleet's cost model, and the line a change handed to the
launcher logs. No torch here."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorafleet.costmodel import CostModel
    from lorafleet.planner import MigrationModel
    from lorafleet.plans import DeploymentPlan
    from lorafleet.train.options import TrainOptions
    from lorafleet.train.running import AppliedChange
    from lorafleet.workload import Workload


def learnt_migration(
    migration: MigrationModel, applied: AppliedChange, plan: DeploymentPlan, workload: Workload
) -> MigrationModel:
    """``migration`` after a change of the fleet to ``plan``: a move's measured phases price the next one, its stage
    builds giving the load rate (the largest stage built over the slowest rank's build) and the rest of its time the
    fixed part (``MigrationModel``); unchanged when no stage was built."""
    if not applied.rebuilt:
        return migration
    built = [r for r in plan.replicas if set(r.gpus) & set(applied.rebuilt)]
    largest = max(workload.model.n_params * migration.dtype_bytes / r.config.n_gpus for r in built)
    stage = applied.phases["stage"]
    return replace(
        migration,
        fixed_s=max(applied.seconds - stage, 0.0),
        load_bytes_per_s=largest / stage if stage > 0 else migration.load_bytes_per_s,
    )


def fleet_cost_model(options: TrainOptions, workload: Workload, plan: DeploymentPlan) -> CostModel:
    """``plan``'s cost model for ``workload``'s tasks, as a launch builds it (``assemble.plan_cost_model``)."""
    from lorafleet.assemble import plan_cost_model

    return plan_cost_model(workload, plan.fleet(), plan, options.plan, options.profile)[0]


def handed_off(step: int, plan: DeploymentPlan, world_size: int, checkpoint: Path, said: str = "") -> str:
    """The log line of a change handed to the launcher: ``plan`` needs more processes than the run's
    ``world_size``, so the workers stop at the committed ``checkpoint`` of ``step`` and the launcher applies it
    (``train.live.apply_pending``); ``said``: the line's start."""
    return (
        f"step {step}: {said}it needs {plan.world_size} processes and the run has {world_size}: "
        f"the workers restart to apply it (checkpoint {checkpoint.name})"
    )
