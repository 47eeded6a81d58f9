"""What a simulator replays every step: phases of (tasks, deployment plan, dispatch policy).

lorafleet's plan is one phase: all tasks, the heterogeneous deployment, the dispatcher's
dynamic buckets and balanced dispatch. Each baseline is expressed the same way
(``baselines.py``), so the planner, the simulator and the reports compare them step by
step through the one dispatcher. Phases run one after another; a step costs the sum of
their makespans, and GPU-seconds count the GPUs each phase holds while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.dispatch import DispatchOptions, bucket_of, dispatch_step
from lorafleet.errors import InputError
from lorafleet.plans import DeploymentPlan, GlobalBatch, MicroBatch, ReplicaWork, StepPlan

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
class DispatchPolicy:
    """How a phase's sequences are bucketed, balanced and cut into micro-batches."""

    options: DispatchOptions = field(default_factory=DispatchOptions)
    """The dispatcher's options: balance method, padding or packing, dynamic bucket count."""
    static_boundaries: tuple[int, ...] = ()
    """Fixed padding buckets (LobRA's Task-Fused baseline); empty: the dispatcher's per-step DP."""

    def dispatch(self, batch: GlobalBatch, plan: DeploymentPlan, cost_model: CostModel) -> StepPlan:
        """The batch's StepPlan under this policy.

        Static buckets go through the dispatcher unchanged in its code: every length is
        rounded up to its static boundary, so the DP (alignment 1, one bucket per boundary)
        keeps each boundary as a bucket and the micro-batches and their padded times are
        exactly those of static bucketing; the real lengths are then put back, so token and
        padding counts stay true.
        """
        if not self.static_boundaries:
            return dispatch_step(batch, plan, cost_model, self.options)
        bounds = np.asarray(self.static_boundaries, dtype=np.int64)
        over = np.flatnonzero(batch.lengths > bounds[-1])
        if over.size:
            raise InputError(f"<global batch of step {batch.step}>", f"lengths[{int(over[0])}]",
                             f"{int(batch.lengths[over[0]])} tokens exceed the top static bucket {int(bounds[-1])}")
        padded = bounds[bucket_of(batch.lengths, bounds)]
        options = replace(self.options, n_buckets=bounds.size, bucket_alignment=1)
        step = dispatch_step(replace(batch, lengths=padded), plan, cost_model, options)
        real = batch.lengths

        def restore(mb: MicroBatch) -> MicroBatch:
            return replace(mb, lengths=tuple(int(real[q]) for q in mb.seq_ids))

        work = tuple(ReplicaWork(replica_id=w.replica_id, microbatches=tuple(restore(mb) for mb in w.microbatches),
                                 estimated_time_s=w.estimated_time_s) for w in step.work)
        return replace(step, bucket_boundaries=self.static_boundaries, work=work)


@dataclass(frozen=True, kw_only=True, slots=True)
class Phase:
    """Some tasks trained on one deployment with one policy."""

    tasks: tuple[int, ...]
    """Indices (into the workload's tasks) of the tasks this phase trains."""
    plan: DeploymentPlan
    policy: DispatchPolicy


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
            t = phase.policy.dispatch(part, phase.plan, cost_model).estimated_makespan_s
            makespan += t
            gpu_seconds += t * phase.plan.used_gpus
        return StepCost(makespan_s=makespan, gpu_seconds=gpu_seconds)


def select_tasks(batch: GlobalBatch, tasks: tuple[int, ...]) -> GlobalBatch:
    """The sequences of ``tasks`` only, in batch order (the whole batch when it has no others)."""
    keep = np.isin(batch.task_ids, np.asarray(tasks, dtype=np.int64))
    if keep.all():
        return batch
    return replace(batch, task_ids=batch.task_ids[keep], sample_ids=batch.sample_ids[keep], lengths=batch.lengths[keep])
