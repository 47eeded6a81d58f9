"""Replay a schedule (lorafleet's plan or a baseline) on the simulated executor, step by step.

A schedule's phases run one after another within a step (Task-Sequential has one phase
per task; the others have one), so per step

    makespan = Σ_phases makespan_p          GPU-seconds = Σ_phases makespan_p * GPUs_p

Every phase sees the same sampled global batches (restricted to its tasks), the same
noise seed, stragglers and failures, so methods are compared on identical data. Each phase
runs its plan's dispatch policy, online recalibration included: a straggler is priced by
what it was measured to do, in every method alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from lorafleet.costmodel import CostModel
from lorafleet.dispatch import Recalibrator, ReplicaCalibration
from lorafleet.executor.simulated import SimulatedExecutor, SimulationOptions
from lorafleet.loop import PolicySource, run_loop
from lorafleet.planner import Phase, Schedule
from lorafleet.planner.schedule import select_tasks
from lorafleet.plans import GlobalBatch, StepReport
from lorafleet.sampling import sample_global_batch
from lorafleet.workload import Workload


@dataclass(frozen=True)
class PhaseRun:
    """One phase's simulated steps."""

    phase: Phase
    reports: tuple[StepReport, ...]
    calibration: tuple[ReplicaCalibration, ...] = ()
    """Each replica's recalibration factor after the last step."""


@dataclass(frozen=True)
class ScheduleRun:
    """A schedule's simulated steps, per phase and summed per step."""

    name: str
    gpus: int
    """GPUs the schedule holds (the most any phase holds)."""
    phases: tuple[PhaseRun, ...]

    @property
    def makespan_s(self) -> np.ndarray:
        """Per step: Σ over phases of the phase's makespan."""
        return np.sum([[r.makespan_s for r in p.reports] for p in self.phases], axis=0)

    @property
    def gpu_seconds(self) -> np.ndarray:
        """Per step: Σ over phases of makespan x the phase's GPUs."""
        return np.sum([[r.makespan_s * p.phase.plan.used_gpus for r in p.reports] for p in self.phases], axis=0)

    @property
    def padding_ratio(self) -> float:
        real = sum(sum(r.task_tokens.values()) for p in self.phases for r in p.reports)
        pad = sum(sum(r.task_padding_tokens.values()) for p in self.phases for r in p.reports)
        return pad / (real + pad) if real + pad else 0.0

    @property
    def utilisation(self) -> float:
        """Busy GPU-time over held GPU-time, over all phases and steps."""
        busy = sum(
            b * rep.config.n_gpus
            for p in self.phases
            for r in p.reports
            for b, rep in zip(r.replica_busy_s, p.phase.plan.replicas, strict=True)
        )
        return float(busy / self.gpu_seconds.sum()) if self.gpu_seconds.sum() else 0.0

    @property
    def failures(self) -> int:
        return sum(len(r.failed_replicas) for p in self.phases for r in p.reports)


def _phase_batch(workload: Workload, tasks: tuple[int, ...], seed: int, step: int) -> GlobalBatch:
    return select_tasks(sample_global_batch(workload, step, seed), tasks)


def simulate_schedule(
    workload: Workload,
    schedule: Schedule,
    cost_model: CostModel,
    steps: int,
    options: SimulationOptions = SimulationOptions(),
    seed: int | None = None,
) -> ScheduleRun:
    """Simulate ``steps`` steps of ``schedule`` on batches sampled with ``seed`` (default: the workload's)."""
    seed = workload.spec.seed if seed is None else seed
    names = [t.name for t in workload.tasks]
    runs = []
    for phase in schedule.phases:
        source = PolicySource(partial(_phase_batch, workload, phase.tasks, seed), phase.plan, cost_model)
        executor = SimulatedExecutor(phase.plan, cost_model, names, options)
        recalibrator = Recalibrator(len(phase.plan.replicas), phase.plan.policy.recalibration)
        reports = run_loop(source, executor, range(steps), recalibrator=recalibrator)
        runs.append(PhaseRun(phase=phase, reports=tuple(reports), calibration=recalibrator.replicas()))
    return ScheduleRun(name=schedule.name, gpus=schedule.max_gpus, phases=tuple(runs))
