"""Incremental re-planning: when tasks join or leave a running job, keep the deployment unless another
one pays for its migration.

With the running plan ``P`` (replicas on their GPUs) and the new task set's workload:

1. **Keep.** ``P``'s replicas, unchanged, judged on the new workload: the dispatcher's expected step
   time ``T_keep`` on the new expected batch (infinite when its longest sequence fits no replica).
2. **Move.** The planner's plan ``P'`` for the new workload, warm-started from ``P``: ``P``'s
   deployment enters the planner's pool as it stands (``PlannerOptions.incumbent``), so ``P'`` is never
   judged worse than keeping. Its expected step time is ``T_move``.
3. **Migration** (:class:`MigrationModel`): what moving from ``P`` to a plan costs, ``C_mig`` GPU-seconds.
4. **Decide**, over the horizon of ``H`` steps (the steps the job still has to run, at most
   ``ReplanSettings.horizon``), by the objective (:class:`~lorafleet.specs.replan.ReplanObjective`):

   - ``makespan`` (the planner's own objective): ``P'`` is taken when its GPU-second saving
     ``S = H · (T_keep · G_keep - T_move · G_move)`` exceeds ``C_mig`` (always when keeping is infeasible),
     else ``P`` is kept with the new task list and buckets (``G`` the GPUs each plan uses). A plan cheaper in
     GPU-seconds but slower than ``P`` is never proposed: the planner ranks by makespan.
   - ``gpu-s``: the candidate with the fewest GPU-seconds over the horizon, migration included,
     ``H · T_c · G_c + C_mig(c)``, is taken (``P`` on a tie). The candidates are ``P`` and ``P'``, and each of
     them trimmed (:func:`trimmed`): replicas dropped one at a time while the GPU-seconds per step fall, so
     a slower plan on fewer GPUs is found and can win.

A change that moves nothing (``P'`` has every replica of ``P``, on the same GPUs) costs no migration.

**On sampled batches** (``ReplanSettings.samples`` = K > 0, ``--replan-samples``): the saving a step
``T_keep · G_keep - T_move · G_move`` that both objectives' move is taken by is the mean over K sampled batches
of the new tasks (:func:`sampled_saving`) rather than the expected batch's. A sampled batch's longest
sequences and its imbalance cost a plan more than the expected batch shows, and not alike for every plan: on
the T4 departure of docs/simulation.md the expected batch prices the move's saving at 2.17 GPU-s a step and
32 sampled batches at about 1.35, the replay's steps after the move gaining about 1.04. The candidates (the
planner's plan and, with ``gpu-s``, the trims) are still chosen on the expected batch; the samples price only
the chosen one against keeping, at ``2 K`` dispatches.

**Migration, priced by the rebuild** (:class:`MigrationModel`). A running fleet moves in its own processes
(``executor/torch/change.py``): every rank whose stage changes (its replica's degrees, its stage, its TP
rank or, under TP, the ranks beside it: :func:`rebuilt_ranks`) builds it from the base model's
checkpoint, the staying tasks' adapters and optimizer states travel, the process groups are made, and
every GPU of the run waits at that step boundary. So

    W     = fixed_s + max over rebuilt ranks r of  bytes(stage_r) / rate(r)     (0: nothing moves)
    C_mig = W · |GPUs of P ∪ GPUs of P'|

with ``bytes(stage) = n_params · dtype_bytes / (tp · pp)``. ``rate(r)`` is the rank's pool's load rate
(``PoolSpec.stage_load_bytes_per_s``: the cluster's ``stage_load_gbps``, else its GPU kind's,
``GPUSpec.stage_load_gbps``), so on a cluster of several pools the wait is the slowest rebuilt rank's, each
loading at its own pool's rate, and every pool's GPUs wait for it. A training run replaces the rate by what it
measures, one rate for every rank: its own start-up's stage load (``train.torch_fleet.initial_migration``),
then each in-process move's phases (``train.change_costs.learnt_migration``, which also measures
``fixed_s``). ``fixed_s`` defaults to ``benchmarks/bench_queue.py``'s figure on the CPU development machine
for every hardware (no GPU measure of it yet). ``--migration-s`` prices instead a flat ``migration_s``
seconds of the GPUs of every replica torn down (the pricing before the in-process rebuild).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.dispatch import dispatch_step
from lorafleet.planner.driver import plan_deployment
from lorafleet.planner.expected import expected_global_batch
from lorafleet.planner.options import PlannerOptions
from lorafleet.planner.placement import with_expectation
from lorafleet.plans import DeploymentPlan, GlobalBatch, ReplicaSpec
from lorafleet.sampling import sample_global_batch
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.replan import ReplanObjective, ReplanSettings
from lorafleet.workload import Workload


@dataclass(frozen=True)
class Migration:
    """What one change of deployment costs."""

    wall_s: float
    """Seconds the fleet stops at the step boundary."""
    gpu_s: float
    """GPU-seconds held meanwhile."""
    rebuilt: int
    """Replicas of the new plan with a rank that builds its stage (flat pricing: replicas torn down)."""


@dataclass(frozen=True)
class MigrationModel:
    """A change of deployment priced by what the in-process rebuild costs, measured (module doc)."""

    fixed_s: float = 0.17
    """Seconds of a move whatever is loaded: the new task's rows sent, the staying tasks' states gathered and
    sent, the groups made, the slots changed (``benchmarks/bench_queue.py``: the 2 -> 3 replicas move of
    tiny-llama on 4 CPU ranks, its change less its stage builds; 2026-12-04, the 2-core machine)."""
    load_bytes_per_s: float | None = None
    """Bytes of its stage a rank builds per second, measured by a training run (module doc), for every rank;
    None: each rank at its pool's rate (``PoolSpec.stage_load_bytes_per_s``)."""
    dtype_bytes: int = 2
    """Bytes of one base weight (the run's ``--dtype``; bf16 for a what-if)."""

    def __post_init__(self) -> None:
        rate = self.load_bytes_per_s
        if not (self.fixed_s >= 0 and (rate is None or rate > 0) and self.dtype_bytes > 0):
            raise ValueError(f"a migration model needs fixed_s >= 0 and positive rates, got {self}")

    def describe(self, cluster: ClusterSpec) -> str:
        """``0.17 s + a rebuilt stage's bytes at 2000 MB/s (A100-40GB), every GPU held waiting`` (``simulate``)."""
        if self.load_bytes_per_s is not None:
            rates = f"{self.load_bytes_per_s / 1e6:.4g} MB/s (measured)"
        else:
            rates = ", ".join(f"{p.stage_load_bytes_per_s / 1e6:.4g} MB/s ({p.name or p.gpu})" for p in cluster.pools)
        return f"{self.fixed_s:.3g} s + a rebuilt stage's bytes at {rates}, every GPU held waiting"

    def stage_s(self, n_params: int, replica: ReplicaSpec, cluster: ClusterSpec) -> float:
        """Seconds one rank of ``replica`` builds its stage in: its bytes at the measured rate, else its pool's."""
        rate = self.load_bytes_per_s or cluster.pool(replica.pool).stage_load_bytes_per_s
        return n_params * self.dtype_bytes / (replica.config.tp * replica.config.pp) / rate

    def price(self, current: DeploymentPlan, new: DeploymentPlan, n_params: int, cluster: ClusterSpec) -> Migration:
        """The move from ``current`` to ``new`` of a model of ``n_params`` parameters on ``cluster`` (module doc)."""
        if current.same_deployment(new):
            return Migration(0.0, 0.0, 0)
        rebuilt = rebuilt_ranks(current, new)
        replicas = [r for r in new.replicas if set(r.gpus) & rebuilt]
        load = max((self.stage_s(n_params, r, cluster) for r in replicas), default=0.0)
        wall = self.fixed_s + load
        held = {g for plan in (current, new) for r in plan.replicas for g in r.gpus}
        return Migration(wall, wall * len(held), len(replicas))


@dataclass(frozen=True)
class FlatMigration:
    """``seconds`` of the GPUs of every replica torn down (``--migration-s``; the fleet waits ``seconds``)."""

    seconds: float

    def describe(self, cluster: ClusterSpec) -> str:
        return f"{self.seconds:g} s per torn-down replica (--migration-s)"

    def price(self, current: DeploymentPlan, new: DeploymentPlan, n_params: int, cluster: ClusterSpec) -> Migration:
        gone = torn_down(current, new)
        gpus = sum(current.replicas[r].config.n_gpus for r in gone)
        return Migration(self.seconds if gone else 0.0, self.seconds * gpus, len(gone))


@dataclass(frozen=True)
class ReplanOptions:
    """What an incremental re-plan weighs: the run's settings (checked as they were built) and the measured
    price of a move."""

    settings: ReplanSettings = field(default_factory=ReplanSettings)
    """The flat price of a move or none, the objective, the horizon (``--migration-s``, ``--replan-objective``,
    ``--replan-horizon``; ``after`` is the caller's: ``planner.decision.decide``)."""
    migration: MigrationModel = field(default_factory=MigrationModel)
    """The measured price of a move, used unless ``settings.migration_s`` is given."""

    @property
    def pricing(self) -> MigrationModel | FlatMigration:
        """How a move is priced."""
        flat = self.settings.migration_s
        return FlatMigration(flat) if flat is not None else self.migration


@dataclass(frozen=True)
class Replan:
    """The plan an incremental re-plan chose, and the figures it chose by."""

    plan: DeploymentPlan
    moved: bool
    """Whether the deployment changes, or the running one is kept."""
    keep_step_s: float
    """``T_keep``: the running deployment's expected step time on the new workload (inf: it cannot serve it)."""
    move_step_s: float
    """The expected step time of the best plan other than keeping (``T_move``, or with ``gpu-s`` the cheapest)."""
    torn_down: int
    """Replicas of the running plan the new one does not keep (as they are, on the same GPUs)."""
    migration_gpu_s: float
    saving_gpu_s: float
    """What moving saves over ``horizon`` steps, before the migration (inf when keeping is infeasible)."""
    horizon: int
    migration_s: float = 0.0
    """Seconds the fleet stops to move (0 when it keeps its deployment)."""
    objective: ReplanObjective = ReplanObjective.MAKESPAN
    kept: DeploymentPlan | None = None
    """The running deployment serving the new tasks (:func:`kept_plan`; None when it cannot): what a fleet runs
    while its re-plan runs beside the steps (``train.background``), until a move is applied."""
    sampled: int = 0
    """Sampled batches ``saving_gpu_s`` was priced on (0: the expected batch)."""

    def describe(self) -> str:
        """One line for the run's log."""
        if self.moved:
            why = (
                "the running deployment cannot serve the new tasks"
                if math.isinf(self.keep_step_s)
                else f"saves {self.saving_gpu_s:.4g} GPU-s over {self.horizon} steps{self._on()}"
            )
            return (
                f"re-planned to {self.plan.describe()}: {why}, migration {self.migration_gpu_s:.4g} GPU-s "
                f"({self.migration_s:.3g} s, {self.torn_down} replicas torn down); step {self.keep_step_s:.4g} s "
                f"-> {self.move_step_s:.4g} s"
            )
        if not self.torn_down and not self.migration_gpu_s:
            return f"kept {self.plan.describe()}: the planner's best plan for the new tasks is this deployment"
        return (
            f"kept {self.plan.describe()}: a new plan would save {max(self.saving_gpu_s, 0.0):.4g} GPU-s over "
            f"{self.horizon} steps{self._on()}, not more than its migration, {self.migration_gpu_s:.4g} GPU-s "
            f"({self.torn_down} replicas torn down)"
        )

    def _on(self) -> str:
        return f" on {self.sampled} sampled batches" if self.sampled else ""


def _stages(plan: DeploymentPlan) -> dict[int, tuple]:
    """Rank -> what its stage is: (tp, pp, stage, TP rank, the stage's ranks) (``ReplicaSpec.stages``)."""
    out = {}
    for r in plan.replicas:
        tp, pp = r.config.tp, r.config.pp
        for k, ranks in enumerate(r.stages):
            for j, g in enumerate(ranks):
                out[g] = (tp, pp, k, j, ranks if tp > 1 else ())
    return out


def rebuilt_ranks(current: DeploymentPlan, new: DeploymentPlan) -> set[int]:
    """The ranks of ``new`` that build their stage: their stage in ``current`` is another, or none (the rule of
    ``executor/torch/change.can_keep_stage``, for the deployment; a task targeting a projection no running
    adapter targets also makes a stage build, which the price leaves out)."""
    before, after = _stages(current), _stages(new)
    return {g for g, stage in after.items() if before.get(g) != stage}


def kept_plan(current: DeploymentPlan, workload: Workload, cost_model: CostModel) -> DeploymentPlan | None:
    """The running deployment serving ``workload``'s tasks, with its expected dispatch; None when the longest
    expected sequence fits no replica. Each replica's M is ``cost_model``'s for the new tasks (their adapters
    and optimizer states share its memory); None too when a replica no longer fits at all."""
    expected = expected_global_batch(workload)
    replicas = tuple(replace(r, max_tokens=cost_model.max_tokens(r.config)) for r in current.replicas)
    plan = replace(current, tasks=tuple(t.name for t in workload.tasks), replicas=replicas)
    if min(r.max_tokens for r in replicas) <= 0 or not plan.holds(int(expected.lengths.max())):
        return None
    return _judged(plan, expected, cost_model)


def _judged(plan: DeploymentPlan, expected: GlobalBatch, cost_model: CostModel) -> DeploymentPlan:
    return with_expectation(plan, dispatch_step(expected, plan, cost_model))


def torn_down(current: DeploymentPlan, new: DeploymentPlan) -> list[int]:
    """The replicas of ``current`` that ``new`` does not have (the same replica: ``ReplicaSpec.placement``)."""
    return [r.replica_id for r, kept in zip(current.replicas, current.replica_ids_in(new), strict=True) if kept is None]


def _without(plan: DeploymentPlan, drop: int) -> DeploymentPlan:
    kept = [r for r in plan.replicas if r.replica_id != drop]
    return replace(plan, replicas=tuple(replace(r, replica_id=i) for i, r in enumerate(kept)))


def trimmed(plan: DeploymentPlan, expected: GlobalBatch, cost_model: CostModel) -> Iterator[DeploymentPlan]:
    """``plan`` with replicas dropped one at a time, each time the one whose removal lowers the expected
    GPU-seconds per step ``T · G`` the most (one replica per config tried: equal replicas are alike), while it
    lowers them and every expected sequence still fits some replica; each plan on the way (``plan`` not
    included). Replicas that stay keep their GPUs: a trim loads nothing."""
    longest = int(expected.lengths.max())
    while len(plan.replicas) > 1:
        tried = {}
        for r in plan.replicas:
            if r.config not in tried:
                fewer = _without(plan, r.replica_id)
                if fewer.holds(longest):
                    tried[r.config] = _judged(fewer, expected, cost_model)
        best = min(tried.values(), key=lambda p: p.expected_gpu_seconds, default=None)
        if best is None or best.expected_gpu_seconds >= plan.expected_gpu_seconds:
            return
        yield best
        plan = best


def sampled_saving(
    keep: DeploymentPlan, move: DeploymentPlan, workload: Workload, cost_model: CostModel, samples: int, seed: int
) -> float:
    """``mean_k (T_keep(b_k) · G_keep - T_move(b_k) · G_move)``: the GPU-seconds a step that ``move`` saves
    against ``keep`` on ``workload``'s sampled batches ``b_0 .. b_{samples-1}`` (drawn by ``seed``), each plan's
    step the dispatcher's estimate under its own policy. Both are dispatched on the same batches, so the mean's
    noise is the plans' difference, not the batches' spread."""
    total = 0.0
    for step in range(samples):
        batch = sample_global_batch(workload, step, seed)
        for sign, plan in ((1.0, keep), (-1.0, move)):
            total += sign * dispatch_step(batch, plan, cost_model).estimated_makespan_s * plan.used_gpus
    return total / samples


def replan_incremental(
    current: DeploymentPlan,
    workload: Workload,
    cluster: ClusterSpec,
    cost_model: CostModel,
    options: PlannerOptions,
    replan: ReplanOptions,
    steps_left: int,
) -> Replan:
    """Keep ``current`` or move to another plan for ``workload`` (module doc); every deployment is judged
    under ``current``'s dispatch policy and found by what ``current`` was planned for, its objective, tolerance
    and pool prices, which the chosen plan keeps (``options.replanning(current)``). ``steps_left``: the steps
    the job still has to run (the horizon's bound)."""
    counts: dict = {}
    for r in current.replicas:
        counts[r.config] = counts.get(r.config, 0) + 1
    running = replace(options.replanning(current), incumbent=tuple(counts.items()))
    fresh = plan_deployment(workload, cluster, cost_model, running)
    move = fresh.plan
    keep = kept_plan(current, workload, fresh.cost_model)
    horizon = max(1, min(replan.settings.horizon, steps_left))
    pricing, n_params = replan.pricing, workload.model.n_params

    def cost(plan: DeploymentPlan) -> float:
        return horizon * plan.expected_gpu_seconds + pricing.price(current, plan, n_params, cluster).gpu_s

    objective = replan.settings.objective
    if objective is ReplanObjective.GPU_S:
        expected = expected_global_batch(workload)
        others = [move, *trimmed(move, expected, fresh.cost_model)]
        if keep is not None:
            others += list(trimmed(keep, expected, fresh.cost_model))
        move = min(others, key=cost)  # the first of equals: the planner's plan before its trims
    mig = pricing.price(current, move, n_params, cluster)
    gone = len(torn_down(current, move))
    move_s = move.expected_makespan_s
    if keep is None:
        return Replan(move, True, math.inf, move_s, gone, mig.gpu_s, math.inf, horizon, mig.wall_s, objective)
    keep_s = keep.expected_makespan_s
    samples = replan.settings.samples
    if samples and not move.same_deployment(current):
        seed = workload.spec.seed if running.seed is None else running.seed
        saving = horizon * sampled_saving(keep, move, workload, fresh.cost_model, samples, seed)
    else:
        samples, saving = 0, horizon * (keep.expected_gpu_seconds - move.expected_gpu_seconds)
    # The same deployment as the planner placed it is no move: the running replicas (in their order) serve on.
    moved = not move.same_deployment(current) and saving > mig.gpu_s
    return Replan(
        move if moved else keep,
        moved,
        keep_s,
        move_s,
        gone,
        mig.gpu_s,
        saving,
        horizon,
        mig.wall_s if moved else 0.0,
        objective,
        keep,
        samples,
    )
