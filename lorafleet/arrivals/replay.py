"""A trace replayed under each strategy on the one step loop, and the GPU-seconds each strategy spends.

Simulated time starts at 0 and the fleet runs global steps of the tasks present
(:mod:`lorafleet.arrivals.fleet`: changes at step boundaries, idle time not charged). At each change the
strategy (:mod:`lorafleet.arrivals.strategies`) names the plan the tasks run on, by ``train``'s rule
(``planner.decision.decide``: on the kept deployment while the re-plan runs beside the next
``--replan-after`` steps, when it serves the new tasks); a change of deployment makes the clock wait its
migration first (``planner.incremental.MigrationModel``: the in-process rebuild's price, or
``--migration-s`` a rebuilt replica). Then that plan runs on :func:`lorafleet.loop.run_loop` until the task
set changes again, as ``simulate`` and ``train`` run theirs: in the plan's loop windows
(``DeploymentPlan.loop_window``), each step planned by the source (:mod:`lorafleet.arrivals.source`), run on
the noise-free simulated executor and learnt from by a recalibrator.

**Events apply at window boundaries**, as ``lorafleet train`` reads its queue: before each window
(``run_loop``'s ``stop``), never inside one, since a request it has not seen cannot end a window. The windows are
``run_loop``'s, with ``train``'s arguments: ``W = loop_window`` steps (the pipeline window when a replica is
pipelined, else 1), cut where a task departs, an evaluation is due or a re-plan beside the steps answers
(``train``'s fleet changes and evaluations name those boundaries ahead) and at every multiple of
``checkpoint_every`` (``train --checkpoint-every``). So an
event at ``t`` applies at the first window boundary at or after the step in flight at ``t``: with windows from
step ``S`` (the segment's start) and no cut, at ``S + W * ceil((k + 1 - S) / W)``, ``k`` that step; every step is
a boundary when no replica is pipelined (``W = 1``). A segment's first window is run whole: its start's queue
was read before the change was applied, so an event that lands in the change's rebuild applies at the end of the
new deployment's first window (``train.changes``: one change a boundary).

**One loop run per deployment segment.** ``run_loop`` takes one executor, and a simulated executor (and a
recalibrator) belongs to one deployment: its replicas. So the replay calls ``run_loop`` once per
*segment*, a stretch of steps with one plan and one task set, with that plan's executor. A segment's
steps end where its first present task departs; ``stop`` ends it sooner, at the first window boundary
(after its first window) where an event has changed the task set. The replay, between segments, is where
the things outside any step happen: the idle jumps, the strategy's answer and the migration wait. The
recalibrator carries over a change that keeps the deployment's replicas; a new deployment's starts from
what the last one measured of each pool (as ``Recalibrator.load_state_dict`` does for a re-planned one).

**Evaluations and early stops** (:mod:`lorafleet.eval_replay`). After each step the tasks due are evaluated
together on the segment's plan (a task that took its last step included): the clock waits the pass, its
GPU-seconds are billed to those tasks apart from their steps, and a task the evaluation stopped early departs
at that boundary, as a task that took its steps does, so the strategy answers the change (the incremental
re-plan hands its capacity back, or moves the fleet). A segment's windows end where a present task may be
due. A cancelled task is not evaluated at its cancel.

A step costs ``makespan x plan.used_gpus`` GPU-seconds (the GPUs the plan's replicas hold, as ``simulate``
charges: GPUs a plan leaves unused are free for other work), and each task's part of it is
:func:`lorafleet.accounting.task_gpu_seconds`'s (the parts sum to the step's GPU-seconds). Every strategy
is priced by one cost model, built for all the tasks of the run (each replica keeps room for every adapter
the trace brings, so no deployment is rebuilt only because an adapter arrives).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import partial

from lorafleet.accounting import task_gpu_seconds
from lorafleet.arrivals.fleet import Fleet, TaskOutcome
from lorafleet.arrivals.source import TraceSource
from lorafleet.arrivals.strategies import REPLANNERS, Change, PlanMaker, Replanner, Static, Strategy
from lorafleet.arrivals.trace import Trace
from lorafleet.costmodel import CostModel
from lorafleet.dispatch import Recalibrator
from lorafleet.eval_replay import EvalReplay, TaskEvals
from lorafleet.executor.simulated import SimulatedExecutor
from lorafleet.loop import run_loop
from lorafleet.planner import PlannerOptions, ReplanOptions
from lorafleet.planner.decision import Keep, decide
from lorafleet.plans import DeploymentPlan, StepPlan, StepReport
from lorafleet.runtime.checkpoint_files import CHECKPOINT_EVERY
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.workload import Task


@dataclass(frozen=True, kw_only=True)
class ArrivalOptions:
    """How the trace is replayed."""

    planner: PlannerOptions = PlannerOptions(robust_samples=0, baselines=False)
    """Options of every plan made (the first plan, each re-plan, the static plan)."""
    replan: ReplanOptions = ReplanOptions()
    """How every strategy prices a change of deployment (``pricing``), the incremental horizon and objective, and
    the steps a move found by the incremental re-plan waits, the tasks on the running deployment, when it can
    serve them (``settings.after``: ``lorafleet train --replan-after``, the re-plan runs beside those steps)."""
    seed: int | None = None
    """Seed of the sampled batches; None: the workload's."""
    strategies: tuple[Strategy, ...] = tuple(Strategy)
    stops: bool = True
    """Tasks with ``early_stopping`` may stop early; False: evaluated but never stopped (the reference an early
    stop's saving is measured against)."""
    checkpoint_every: int = CHECKPOINT_EVERY
    """A training run's checkpoint cadence (``lorafleet train --checkpoint-every``): a checkpoint ends a window, so
    ``train`` reads its queue there too."""


@dataclass(frozen=True)
class StrategyRun:
    """One strategy's replay of the trace."""

    strategy: Strategy
    step_gpu_s: float
    """GPU-seconds of the steps (makespan x the plan's used GPUs, summed)."""
    migration_gpu_s: float
    finish_s: float
    """When the last task departed."""
    steps: int
    """Global steps run."""
    plans: int
    """Plans made (the planner's calls: the first plan, then one per change; 1 for static)."""
    moves: int
    """Changes of deployment after the first plan."""
    rebuilt: int
    """Replicas torn down and rebuilt, in all."""
    tasks: dict[str, TaskOutcome]
    changes: tuple[Change, ...]
    step_s: tuple[float, ...] = field(repr=False, default=())
    """Each global step's makespan."""
    eval_gpu_s: float = 0.0
    """GPU-seconds of the evaluations (each pass's seconds x the plan's used GPUs, summed)."""
    evals: dict[str, TaskEvals] = field(default_factory=dict)
    """Each evaluated task's evaluations and early stop."""

    @property
    def gpu_s(self) -> float:
        """Total: the steps', the evaluations' and the migrations'."""
        return self.step_gpu_s + self.eval_gpu_s + self.migration_gpu_s

    @property
    def tokens(self) -> int:
        """Real tokens trained, all tasks (fewer where a cancel came before a task's steps were taken)."""
        return sum(o.tokens for o in self.tasks.values())


@dataclass(frozen=True)
class ArrivalsResult:
    """Every strategy's replay of one trace."""

    trace: Trace
    runs: tuple[StrategyRun, ...]
    static_plan: DeploymentPlan | None = None

    def run(self, strategy: Strategy | str) -> StrategyRun:
        return next(r for r in self.runs if r.strategy == Strategy(strategy))


def _same_replicas(a: DeploymentPlan | None, b: DeploymentPlan) -> bool:
    """``b`` runs ``a``'s replicas (the same configs on the same GPUs, in the same order)."""
    return a is not None and a.placements == b.placements


@dataclass(frozen=True)
class _Segment:
    """The steps of one plan and one task set (module docstring): ``run_loop``'s source, executor and hooks."""

    fleet: Fleet
    plan: DeploymentPlan
    cost_model: CostModel
    tasks: Mapping[str, Task]
    seed: int
    recalibrator: Recalibrator
    evals: EvalReplay
    first_step: int
    checkpoint_every: int
    most_steps: int | None = None
    """At most this many steps (None: until the first present task departs)."""

    def on_report(self, report: StepReport, step_plan: StepPlan) -> None:
        """A step ran: the fleet's clock and tasks move on, each task owing its part of the step; the tasks due
        are evaluated, and those an evaluation stopped depart."""
        gpus = self.plan.used_gpus
        owed = task_gpu_seconds(step_plan, report, self.plan, self.cost_model, self.plan.tasks)
        done = self.fleet.record(report.makespan_s, gpus, owed, report.task_tokens)
        self.evals.took(report.task_tokens)
        cost = self.evals.evaluate(
            self.evals.due(last=done), self.fleet.step, self.plan, self.cost_model, self.plan.tasks
        )
        if cost is not None:
            self.fleet.evaluated(cost.seconds, gpus, cost.task_gpu_s, self.evals.stopped)

    def stop(self, present: tuple[str, ...]) -> bool:
        """At a window boundary after the segment's first window: the events due, or an early stop, change the task
        set (``present``: the segment's). Not before it: the events due at the segment's start were applied, and
        those due during the migration wait before it are applied at its end (module doc)."""
        return self.fleet.step > self.first_step and (self.fleet.apply_due() or tuple(self.fleet.present) != present)

    def run(self) -> None:
        run_loop(
            TraceSource(self.fleet, self.plan, self.cost_model, self.tasks, self.seed),
            SimulatedExecutor(self.plan, self.cost_model, self.plan.tasks),
            range(self.first_step, self.first_step + min(self.fleet.first_departure(), self.most_steps or math.inf)),
            on_report=self.on_report,
            recalibrator=self.recalibrator,
            stop=partial(self.stop, tuple(self.fleet.present)),
            window=self.plan.loop_window,
            boundary_every=self.checkpoint_every,
            next_boundary=partial(self.evals.next_boundary, present=self.fleet.present),
        )


def _replay(
    replanner: Replanner, trace: Trace, cost_model: CostModel, seed: int, options: ArrivalOptions
) -> StrategyRun:
    """One strategy's replay: between segments the idle jumps, the strategy's answer and the migration wait. A
    move whose running deployment can serve the new tasks (its ``interim``) waits on it, by the rule a training
    run follows (``planner.decision.decide``: the re-plan runs beside the next ``--replan-after`` steps); a change
    of the task set in those steps or at their end supersedes it (it is never made: the next change is
    re-planned from the running deployment, as ``train.changes`` does)."""
    fleet = Fleet(trace)
    tasks = {a.task.name: a.task for a in trace.arrivals}
    evals = EvalReplay(tasks, seed, options.stops)
    segment = partial(_Segment, fleet, cost_model=cost_model, tasks=tasks, seed=seed, evals=evals,
                      checkpoint_every=options.checkpoint_every)  # fmt: skip
    plan: DeploymentPlan | None = None
    recalibrator: Recalibrator | None = None
    changes: list[Change] = []
    while True:
        fleet.apply_due()
        if not fleet.present:
            if fleet.idle():
                continue
            break
        decision = replanner.on_change(plan, tuple(fleet.present), fleet.clock, fleet.steps_left())
        after = options.replan.settings.after
        now = decide(fleet.step, True, lambda d=decision: d.interim, plan, after) if plan else None
        if isinstance(now, Keep) and now.replan_at is not None:  # the move waits on the running deployment
            assert recalibrator is not None and _same_replicas(plan, now.plan)
            plan, present = now.plan, tuple(fleet.present)
            steps = now.replan_at - fleet.step
            segment(plan=plan, recalibrator=recalibrator, first_step=fleet.step, most_steps=steps).run()
            if fleet.apply_due() or tuple(fleet.present) != present:
                continue  # the task set changed by the move's step: the next change's re-plan supersedes it
        if decision.change is not None:
            changes.append(replace(decision.change, step=fleet.step))
            if decision.change.migration_s:
                fleet.wait(decision.change.migration_s)  # the fleet rebuilds before the next step
        if recalibrator is None or not _same_replicas(plan, decision.plan):
            measured = recalibrator.measured_pool_scales() if recalibrator is not None else None
            recalibrator = Recalibrator.for_plan(decision.plan, prior=measured)
        plan = decision.plan
        assert set(fleet.present) <= set(plan.tasks), (fleet.present, plan.tasks)
        segment(plan=plan, recalibrator=recalibrator, first_step=fleet.step).run()
    return StrategyRun(
        strategy=replanner.strategy,
        step_gpu_s=fleet.step_gpu_s,
        migration_gpu_s=sum((c.migration_gpu_s for c in changes), 0.0),
        finish_s=max((o.completion_s or 0.0 for o in fleet.outcomes.values()), default=0.0),
        steps=fleet.step,
        plans=replanner.plans_made,
        moves=sum(c.moved for c in changes),
        rebuilt=sum(c.torn_down for c in changes),
        tasks=fleet.outcomes,
        changes=tuple(changes),
        step_s=tuple(fleet.step_s),
        eval_gpu_s=fleet.eval_gpu_s,
        evals=evals.outcomes(),
    )


def replay_trace(
    trace: Trace, cluster: ClusterSpec, cost_model: CostModel, options: ArrivalOptions = ArrivalOptions()
) -> ArrivalsResult:
    """Replay ``trace`` under each of ``options.strategies`` (module docstring) on ``cluster``, priced by
    ``cost_model`` (one for the run's tasks: ``assemble.workload_cost_model(trace.all_tasks(), cluster)``)."""
    plans = PlanMaker(trace, cluster, cost_model, options.planner)
    seed = trace.workload.spec.seed if options.seed is None else options.seed
    replanners = [REPLANNERS[s](plans, options.replan) for s in options.strategies]
    runs = tuple(_replay(r, trace, cost_model, seed, options) for r in replanners)
    static_plan = next((r.plan for r in replanners if isinstance(r, Static)), None)
    return ArrivalsResult(trace=trace, runs=runs, static_plan=static_plan)
