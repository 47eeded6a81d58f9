"""What a simulator replays every step: phases of (tasks, deployment plan with its dispatch policy).

lorafleet's plan is one phase: all tasks, the heterogeneous deployment, the dispatcher's
dynamic buckets and balanced dispatch. Each baseline is expressed the same way
(``baselines.py``), so the planner, the simulator and the reports compare them step by
step through the one dispatcher. Phases run one after another; a step costs the sum of
their makespans, and GPU-seconds count the GPUs each phase holds while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.dispatch import dispatch_step
from lorafleet.plans import DeploymentPlan, GlobalBatch

SMALLEST_STATIC_BUCKET = 256
"""LobRA's Task-Fused buckets start at 256 tokens and double."""


def pow2_boundaries(longest: int, max_tokens: int) -> tuple[int, ...]:
    """LobRA's static buckets 256, 512, ..., 2^ceil(log2 longest), the top one capped at M."""
    top = min(1 << max(int(longest) - 1, 1).bit_length(), int(max_tokens))
    out, s = [], SMALLEST_STATIC_BUCKET
    while s < top:
        out.append(s)
        s *= 2
    return (*out, top)


@dataclass(frozen=True, kw_only=True, slots=True)
class Phase:
    """Some tasks trained on one deployment, dispatched under the deployment's own policy (``plan.policy``)."""

    tasks: tuple[int, ...]
    """Indices (into the workload's tasks) of the tasks this phase trains."""
    plan: DeploymentPlan


@dataclass(frozen=True, kw_only=True, slots=True)
class StepCost:
    makespan_s: float
    """Wall time of the step: the phases' makespans summed."""
    gpu_seconds: float
    """Σ over phases of makespan x GPUs the phase holds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """A way to run every step: phases one after another."""

    name: str
    phases: tuple[Phase, ...]

    @property
    def max_gpus(self) -> int:
        """The most GPUs any phase holds."""
        return max(p.plan.used_gpus for p in self.phases)

    def step_cost(self, batch: GlobalBatch, cost_model: CostModel) -> StepCost:
        """Dispatch ``batch`` phase by phase and add up the estimated makespans."""
        makespan = gpu_seconds = 0.0
        for phase in self.phases:
            part = select_tasks(batch, phase.tasks)
            if len(part) == 0:
                continue
            t = dispatch_step(part, phase.plan, cost_model).estimated_makespan_s
            makespan += t
            gpu_seconds += t * phase.plan.used_gpus
        return StepCost(makespan_s=makespan, gpu_seconds=gpu_seconds)


def expected_cost(schedule: Schedule) -> StepCost:
    """The expected step each phase's plan recorded (``with_expectation``: the expected batch's tasks of
    the phase, dispatched under the plan's policy), added up as :meth:`Schedule.step_cost` adds them:
    the expected batch's cost without dispatching it again."""
    makespan = gpu_seconds = 0.0
    for phase in schedule.phases:
        makespan += phase.plan.expected_makespan_s
        gpu_seconds += phase.plan.expected_makespan_s * phase.plan.used_gpus
    return StepCost(makespan_s=makespan, gpu_seconds=gpu_seconds)


def select_tasks(batch: GlobalBatch, tasks: tuple[int, ...]) -> GlobalBatch:
    """The sequences of ``tasks`` only, in batch order (the whole batch when it has no others)."""
    keep = np.isin(batch.task_ids, np.asarray(tasks, dtype=np.int64))
    if keep.all():
        return batch
    return replace(batch, task_ids=batch.task_ids[keep], sample_ids=batch.sample_ids[keep], lengths=batch.lengths[keep])
