"""Replay a schedule (lorafleet's plan or a baseline) on the simulated executor, step by step.

A schedule's phases run one after another within a step (Task-Sequential has one phase
per task; the others have one), so per step

    makespan = Σ_phases makespan_p          GPU-seconds = Σ_phases makespan_p * GPUs_p

and each phase's GPU-seconds are shared out among the tasks whose sequences it ran
(:func:`lorafleet.accounting.task_gpu_seconds`: by the simulated busy time of the replicas that
ran them, the idle time by all of the phase's tasks), so Σ_tasks GPU-seconds_t = GPU-seconds.

Tasks with an ``eval`` are evaluated and may stop early (:mod:`lorafleet.eval_replay`): a phase's windows
end where a task may be due, each evaluation is priced on the phase's plan and billed to its tasks apart from
the steps (:attr:`ScheduleRun.eval_gpu_seconds`), and a stopped task takes no step after it (its turns in a
workload with shares are still drawn as if it took them). A phase whose tasks have all stopped runs empty
steps, which cost nothing.

Every phase sees the same sampled global batches (restricted to its tasks), the same
noise seed, stragglers and failures, so methods are compared on identical data. Each phase
runs its plan's dispatch policy, online recalibration included: a straggler is priced by
what it was measured to do, in every method alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial

import numpy as np

from lorafleet.accounting import price_per_second, task_gpu_seconds
from lorafleet.costmodel import CostModel
from lorafleet.dispatch import Recalibrator, ReplicaCalibration
from lorafleet.eval_replay import EvalReplay, TaskEvals
from lorafleet.executor.simulated import SimulatedExecutor, SimulationOptions
from lorafleet.loop import PolicySource, run_loop
from lorafleet.metrics import DeploymentSteps, RunSummary, summarize_phases
from lorafleet.planner import Phase, Schedule
from lorafleet.planner.schedule import select_tasks
from lorafleet.plans import DeploymentPlan, GlobalBatch, StepPlan, StepReport
from lorafleet.sampling import sample_global_batch, workload_turns
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.turns import turns
from lorafleet.workload import Workload


@dataclass(frozen=True)
class PhaseRun:
    """One phase's simulated steps."""

    phase: Phase
    reports: tuple[StepReport, ...]
    calibration: tuple[ReplicaCalibration, ...] = ()
    """Each replica's recalibration factor after the last step."""
    task_gpu_s: tuple[dict[str, float], ...] = ()
    """Per step, the GPU-seconds each task owes (every task of the workload, 0 where absent)."""
    evals: dict[str, TaskEvals] = field(default_factory=dict)
    """The evaluations of the phase's tasks with an ``eval``, by task."""
    eval_s: float = 0.0
    """Wall time of the phase's evaluations."""


@dataclass(frozen=True)
class ScheduleRun:
    """A schedule's simulated steps, per phase; its aggregates are :attr:`summary`'s (the phases one after
    another within each step, ``lorafleet.metrics.summary``), named below as the simulation reads them."""

    name: str
    gpus: int
    """GPUs the schedule holds (the most any phase holds)."""
    phases: tuple[PhaseRun, ...]

    @cached_property
    def summary(self) -> RunSummary:
        """The run's summary: every phase's reports, its replicas' GPUs and what each task owed per step."""
        return summarize_phases(
            [
                DeploymentSteps(p.reports, tuple(r.config.n_gpus for r in p.phase.plan.replicas), p.task_gpu_s)
                for p in self.phases
            ]
        )

    @property
    def makespan_s(self) -> np.ndarray:
        """Per step: Σ over phases of the phase's makespan."""
        return self.summary.makespan_s

    @property
    def gpu_seconds(self) -> np.ndarray:
        """Per step: Σ over phases of makespan x the phase's GPUs."""
        return self.summary.gpu_seconds_per_step

    @property
    def task_gpu_seconds_per_step(self) -> tuple[dict[str, float], ...]:
        """Per step: each task's GPU-seconds, Σ over phases (sums to ``gpu_seconds`` of the step)."""
        return self.summary.task_gpu_seconds_per_step

    @property
    def task_gpu_seconds(self) -> dict[str, float]:
        """Each task's GPU-seconds over all steps and phases (sums to ``gpu_seconds.sum()``)."""
        return self.summary.task_gpu_seconds

    @property
    def task_tokens(self) -> dict[str, int]:
        """Each task's real tokens over all steps and phases."""
        return self.summary.task_tokens

    @property
    def evals(self) -> dict[str, TaskEvals]:
        """Each evaluated task's evaluations and early stop, over all phases."""
        return {name: e for p in self.phases for name, e in p.evals.items()}

    @property
    def eval_gpu_seconds(self) -> dict[str, float]:
        """Each evaluated task's GPU-seconds of evaluation (apart from :attr:`task_gpu_seconds`, its steps')."""
        return {name: e.eval_gpu_s for name, e in self.evals.items()}

    @property
    def total_gpu_seconds(self) -> float:
        """The run's GPU-seconds: its steps' and its evaluations'."""
        return float(self.gpu_seconds.sum()) + sum(self.eval_gpu_seconds.values())

    @property
    def padding_ratio(self) -> float:
        return self.summary.padding_ratio

    @property
    def utilisation(self) -> float:
        """Busy GPU-time over held GPU-time, over all phases and steps."""
        return self.summary.utilisation

    @property
    def failures(self) -> int:
        return self.summary.failures

    def cost_per_step(self, cluster: ClusterSpec) -> np.ndarray | None:
        """Per step: Σ over phases of the phase's makespan x what its replicas cost a second at the pools'
        prices (:func:`~lorafleet.accounting.price_per_second`); None when a pool it uses has no price."""
        cost = np.zeros(len(self.makespan_s))
        for run in self.phases:
            price = price_per_second(run.phase.plan, cluster)
            if price is None:
                return None
            cost += price * np.array([r.makespan_s for r in run.reports], dtype=float)
        return cost

    def pool_usage(self) -> dict[str, PoolUsage]:
        """What the run held and used of each pool its plans' replicas are on, over all steps and phases."""
        held: dict[str, float] = {}
        busy: dict[str, float] = {}
        gpus: dict[str, int] = {}
        for run in self.phases:
            replicas = run.phase.plan.replicas
            for pool in dict.fromkeys(r.pool for r in replicas):
                gpus[pool] = max(gpus.get(pool, 0), sum(r.config.n_gpus for r in replicas if r.pool == pool))
            for report in run.reports:
                for replica, b in zip(replicas, report.replica_busy_s, strict=True):
                    held[replica.pool] = held.get(replica.pool, 0.0) + report.makespan_s * replica.config.n_gpus
                    busy[replica.pool] = busy.get(replica.pool, 0.0) + min(b, report.makespan_s) * replica.config.n_gpus
        return {pool: PoolUsage(gpus=gpus[pool], gpu_seconds=held[pool], busy_gpu_seconds=busy[pool]) for pool in gpus}


@dataclass(frozen=True)
class PoolUsage:
    """One pool's part of a simulated run."""

    gpus: int
    """GPUs the run's replicas hold in the pool (the most any phase holds)."""
    gpu_seconds: float
    """GPU-seconds held there over the run: every step's makespan x the replicas' GPUs."""
    busy_gpu_seconds: float
    """Of those, the replicas' busy time x their GPUs."""

    @property
    def utilisation(self) -> float:
        return self.busy_gpu_seconds / self.gpu_seconds if self.gpu_seconds > 0 else 0.0


def _phase_batch(
    workload: Workload, tasks: tuple[int, ...], seed: int, took: np.ndarray | None, stopped: set[str], step: int
) -> GlobalBatch:
    """The phase's tasks' sequences of step ``step``; with ``took`` (``lorafleet.turns``: shares and deadlines),
    only those whose turn it is; never those ``stopped`` early."""
    if took is not None:
        tasks = tuple(t for t in tasks if took[step, t])
    tasks = tuple(t for t in tasks if workload.tasks[t].name not in stopped)
    return select_tasks(sample_global_batch(workload, step, seed), tasks)


def _turns(workload: Workload, steps: int) -> np.ndarray | None:
    """Which task takes part in which step when some task has a share or a deadline (else: every task every step)."""
    if all(t.spec.share is None and t.spec.deadline is None for t in workload.tasks):
        return None
    return turns(workload_turns(workload), steps)


def _account(
    owed: list[dict[str, float]],
    evals: EvalReplay,
    plan: DeploymentPlan,
    cost_model: CostModel,
    names: Sequence[str],
    report: StepReport,
    step_plan: StepPlan,
) -> None:
    """``run_loop``'s ``on_report``: what each task owes for the step, appended to ``owed``; then the tasks due
    an evaluation after it are evaluated."""
    owed.append(task_gpu_seconds(step_plan, report, plan, cost_model, names))
    evals.took(report.task_tokens)
    evals.evaluate(evals.due(), report.step + 1, plan, cost_model, names)


def simulate_schedule(
    workload: Workload,
    schedule: Schedule,
    cost_model: CostModel,
    steps: int,
    options: SimulationOptions = SimulationOptions(),
    seed: int | None = None,
    stops: bool = True,
) -> ScheduleRun:
    """Simulate ``steps`` steps of ``schedule`` on batches sampled with ``seed`` (default: the workload's);
    ``stops=False``: the tasks are evaluated but never stop early, and a sweep's members are evaluated as without
    halving (``eval_replay.EvalReplay``): what an early stop and a halving save against, a run that uses neither."""
    seed = workload.spec.seed if seed is None else seed
    names = [t.name for t in workload.tasks]
    runs = []
    took = _turns(workload, steps) if len(schedule.phases) == 1 else None  # one task a phase: no sharing
    for phase in schedule.phases:
        present = [names[t] for t in phase.tasks]
        tasks = {n: workload.task(n) for n in present}
        evals = EvalReplay(tasks, seed, stops)
        batch = partial(_phase_batch, workload, phase.tasks, seed, took, evals.stopped)
        source = PolicySource(batch, phase.plan, cost_model)
        executor = SimulatedExecutor(phase.plan, cost_model, names, options)
        recalibrator = Recalibrator.for_plan(phase.plan)
        owed: list[dict[str, float]] = []
        account = partial(_account, owed, evals, phase.plan, cost_model, names)
        reports = run_loop(
            source,
            executor,
            range(steps),
            on_report=account,
            recalibrator=recalibrator,
            window=phase.plan.loop_window,
            next_boundary=partial(evals.next_boundary, present=present),
        )
        evals.evaluate(evals.due(last=present), steps, phase.plan, cost_model, names)  # after each task's last step
        runs.append(
            PhaseRun(
                phase=phase,
                reports=tuple(reports),
                calibration=recalibrator.replicas(),
                task_gpu_s=tuple(owed),
                evals=evals.outcomes(),
                eval_s=evals.eval_seconds,
            )
        )
    return ScheduleRun(name=schedule.name, gpus=schedule.max_gpus, phases=tuple(runs))
