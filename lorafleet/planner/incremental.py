"""Incremental re-planning: when tasks join or leave a running job, keep the deployment unless a new
one pays for its migration.

With the running plan ``P`` (replicas on their GPUs) and the new task set's workload:

1. **Keep.** ``P``'s replicas, unchanged, judged on the new workload: the dispatcher's expected step
   time ``T_keep`` on the new expected batch (infinite when its longest sequence fits no replica).
2. **Move.** The planner's plan ``P'`` for the new workload, warm-started from ``P``: ``P``'s
   deployment enters the planner's pool as it stands (``PlannerOptions.incumbent``), so ``P'`` is never
   judged worse than keeping. Its expected step time is ``T_move``.
3. **Migration.** Every replica of ``P`` that ``P'`` does not have on the same GPUs with the same config
   is torn down and rebuilt (re-sharding, reloading its base weights); each costs ``migration_s``
   seconds of its GPUs: ``C_mig = migration_s · Σ_{r torn down} g_r`` GPU-seconds.
4. **Decide.** Over the horizon of ``H`` steps (the steps the job still has to run, at most
   ``horizon_steps``), moving saves ``S = H · (T_keep · G_keep - T_move · G_move)`` GPU-seconds
   (``G`` the GPUs each plan uses). ``P'`` is taken when ``S > C_mig`` (always when keeping is
   infeasible), else ``P`` is kept with the new task list and buckets.

A change that moves nothing (``P'`` has every replica of ``P``) costs no migration and is taken when it
is any better.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.dispatch import dispatch_step
from lorafleet.planner.driver import plan_deployment
from lorafleet.planner.expected import expected_global_batch
from lorafleet.planner.options import PlannerOptions
from lorafleet.planner.placement import with_expectation
from lorafleet.plans import DeploymentPlan
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.workload import Workload


@dataclass(frozen=True)
class ReplanOptions:
    """What an incremental re-plan weighs."""

    migration_s: float = 60.0
    """Seconds a torn-down replica's GPUs spend being rebuilt (checkpoint, restart, reload its shards)."""
    horizon_steps: int = 200
    """The most steps a new deployment's savings are counted over (fewer when the job ends sooner)."""

    def __post_init__(self) -> None:
        if self.migration_s < 0 or self.horizon_steps < 1:
            raise ValueError(f"migration_s must be >= 0 and horizon_steps >= 1, got {self}")


@dataclass(frozen=True)
class Replan:
    """The plan an incremental re-plan chose, and the figures it chose by."""

    plan: DeploymentPlan
    moved: bool
    """Whether the deployment changes (``plan`` is the planner's), or the running one is kept."""
    keep_step_s: float
    """``T_keep``: the running deployment's expected step time on the new workload (inf: it cannot serve it)."""
    move_step_s: float
    """``T_move``: the new plan's expected step time."""
    torn_down: int
    """Replicas of the running plan the new one does not keep."""
    migration_gpu_s: float
    saving_gpu_s: float
    """``S`` over ``horizon`` steps (inf when keeping is infeasible)."""
    horizon: int

    def describe(self) -> str:
        """One line for the run's log."""
        if self.moved:
            why = (
                "the running deployment cannot serve the new tasks"
                if math.isinf(self.keep_step_s)
                else f"saves {self.saving_gpu_s:.4g} GPU-s over {self.horizon} steps"
            )
            return (
                f"re-planned to {self.plan.describe()}: {why}, migration {self.migration_gpu_s:.4g} GPU-s "
                f"({self.torn_down} replicas rebuilt); step {self.keep_step_s:.4g} s -> {self.move_step_s:.4g} s"
            )
        if not self.torn_down:
            return f"kept {self.plan.describe()}: the planner's best plan for the new tasks is this deployment"
        return (
            f"kept {self.plan.describe()}: a new plan would save {max(self.saving_gpu_s, 0.0):.4g} GPU-s over "
            f"{self.horizon} steps, less than its migration, {self.migration_gpu_s:.4g} GPU-s "
            f"({self.torn_down} replicas rebuilt)"
        )


def kept_plan(current: DeploymentPlan, workload: Workload, cost_model: CostModel) -> DeploymentPlan | None:
    """The running deployment serving ``workload``'s tasks, with its expected dispatch; None when the longest
    expected sequence fits no replica. Each replica's M is ``cost_model``'s for the new tasks (their adapters
    and optimizer states share its memory); None too when a replica no longer fits at all."""
    expected = expected_global_batch(workload)
    replicas = tuple(replace(r, max_tokens=cost_model.max_tokens(r.config)) for r in current.replicas)
    if min(r.max_tokens for r in replicas) <= 0 or int(expected.lengths.max()) > max(r.max_tokens for r in replicas):
        return None
    plan = replace(current, tasks=tuple(t.name for t in workload.tasks), replicas=replicas)
    return with_expectation(plan, dispatch_step(expected, plan, cost_model))


def torn_down(current: DeploymentPlan, new: DeploymentPlan) -> list[int]:
    """The replicas of ``current`` that ``new`` does not have with the same config on the same GPUs."""
    kept = {(r.config, r.gpus) for r in new.replicas}
    return [r.replica_id for r in current.replicas if (r.config, r.gpus) not in kept]


def replan_incremental(
    current: DeploymentPlan,
    workload: Workload,
    cluster: ClusterSpec,
    cost_model: CostModel,
    options: PlannerOptions,
    replan: ReplanOptions,
    steps_left: int,
) -> Replan:
    """Keep ``current`` or move to a new plan for ``workload`` (module doc); every deployment is judged
    under ``current``'s dispatch policy, which the chosen plan keeps (``options.policy`` is replaced by it).
    ``steps_left``: the steps the job still has to run (the horizon's bound)."""
    counts: dict = {}
    for r in current.replicas:
        counts[r.config] = counts.get(r.config, 0) + 1
    running = replace(options, policy=current.policy, incumbent=tuple(counts.items()), baselines=False)
    fresh = plan_deployment(workload, cluster, cost_model, running)
    move = fresh.plan
    keep = kept_plan(current, workload, fresh.cost_model)
    horizon = max(1, min(replan.horizon_steps, steps_left))
    gone = torn_down(current, move)
    migration = replan.migration_s * sum(current.replicas[r].config.n_gpus for r in gone)
    move_s = move.expected_makespan_s
    if keep is None:
        return Replan(move, True, math.inf, move_s, len(gone), migration, math.inf, horizon)
    keep_s = keep.expected_makespan_s
    saving = horizon * (keep_s * keep.used_gpus - move_s * move.used_gpus)
    moved = saving > migration if gone else saving > 0
    return Replan(move if moved else keep, moved, keep_s, move_s, len(gone), migration, saving, horizon)
