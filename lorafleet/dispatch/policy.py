"""A plan's whole dispatch policy, static buckets included: ``solve_policy``.

Dynamic buckets (lorafleet's) go straight to :func:`~.step.solve_step`. LobRA's static buckets
(its Task-Fused baseline) go through the same dispatcher unchanged in its code: every
length is rounded up to its static boundary, so the DP (alignment 1, one bucket per
boundary) keeps each boundary as a bucket and the micro-batches and their padded times are
exactly those of static bucketing; the real lengths are then put back, so token and padding
counts stay true.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.dispatch.bucketing import bucket_of
from lorafleet.dispatch.step import DispatchOutcome, solve_step
from lorafleet.errors import InputError
from lorafleet.plans import DeploymentPlan, GlobalBatch, MicroBatch, ReplicaWork
from lorafleet.specs.dispatch import DispatchOptions, DispatchPolicy


def solve_policy(
    batch: GlobalBatch,
    plan: DeploymentPlan,
    cost_model: CostModel,
    policy: DispatchPolicy | None = None,
    speed: Sequence[float] | None = None,
) -> DispatchOutcome:
    """The batch dispatched under ``policy`` (default: the plan's own), replicas priced at ``speed``, in the
    policy's pipeline window."""
    policy = plan.policy if policy is None else policy
    window = policy.pipeline_window
    if not policy.static_boundaries:
        return solve_step(batch, plan, cost_model, policy.options, speed, window)
    bounds = np.asarray(policy.static_boundaries, dtype=np.int64)
    over = np.flatnonzero(batch.lengths > bounds[-1])
    if over.size:
        raise InputError(
            f"<global batch of step {batch.step}>",
            f"lengths[{int(over[0])}]",
            f"{int(batch.lengths[over[0]])} tokens exceed the top static bucket {int(bounds[-1])}",
        )
    padded = bounds[bucket_of(batch.lengths, bounds)]
    options = replace(policy.options, n_buckets=bounds.size, bucket_alignment=1)
    outcome = solve_step(replace(batch, lengths=padded), plan, cost_model, options, speed, window)
    real = batch.lengths

    def restore(mb: MicroBatch) -> MicroBatch:
        return replace(mb, lengths=tuple(int(real[q]) for q in mb.seq_ids))

    step = outcome.plan
    work = tuple(
        ReplicaWork(
            replica_id=w.replica_id,
            microbatches=tuple(restore(mb) for mb in w.microbatches),
            estimated_time_s=w.estimated_time_s,
        )
        for w in step.work
    )
    return replace(outcome, plan=replace(step, bucket_boundaries=policy.static_boundaries, work=work))


def policy_with(plan: DeploymentPlan, options: DispatchOptions | None) -> DispatchPolicy:
    """The plan's policy, or, with ``options``, the plan's policy with those options and dynamic buckets
    (its pipeline window and recalibration kept: what a caller that overrides the options runs)."""
    if options is None:
        return plan.policy
    return replace(plan.policy, options=options, static_boundaries=())
