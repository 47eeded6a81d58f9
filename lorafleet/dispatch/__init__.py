"""Per-step dispatch: every sequence of a global batch on a replica and in a micro-batch.

``dispatch_step(batch, plan, cost_model) -> StepPlan`` runs every training step under the
plan's own policy (``plan.policy``: what the plan was judged under), so it is both
near-optimal and fast (milliseconds by default). See :mod:`.step` for the pipeline,
:mod:`.policy` for static buckets, :mod:`.bucketing` for the bucket DP, :mod:`.balance` and
:mod:`.ilp` for the two balancing methods, :mod:`.recalibration` for the online correction
of the cost model, and :mod:`.lookahead` for computing step t+1 while step t runs.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.dispatch.balance import Assignment, balance_by_length, balance_fast
from lorafleet.dispatch.bucketing import BucketingResult, bucket_of, optimal_buckets, optimal_buckets_by_count
from lorafleet.dispatch.fairness import task_tokens_per_replica
from lorafleet.dispatch.lookahead import LookaheadDispatcher
from lorafleet.dispatch.policy import solve_policy
from lorafleet.dispatch.step import DispatchOutcome, solve_step
from lorafleet.errors import SolverFallbackWarning
from lorafleet.plans import DeploymentPlan, GlobalBatch, StepPlan
from lorafleet.specs.dispatch import DispatchMethod, DispatchOptions, DispatchPolicy, MicroBatchMode

__all__ = [
    "Assignment",
    "BucketingResult",
    "DispatchMethod",
    "DispatchOptions",
    "DispatchOutcome",
    "DispatchPolicy",
    "LookaheadDispatcher",
    "MicroBatchMode",
    "balance_by_length",
    "balance_fast",
    "bucket_of",
    "dispatch_step",
    "optimal_buckets",
    "optimal_buckets_by_count",
    "solve_policy",
    "solve_step",
    "task_tokens_per_replica",
]


def dispatch_step(
    batch: GlobalBatch, plan: DeploymentPlan, cost_model: CostModel, options: DispatchOptions | None = None, *,
    speed: Sequence[float] | None = None,
) -> StepPlan:
    """The step's StepPlan: one ReplicaWork per replica of ``plan``, in order, with estimated times.

    Dispatched under the plan's policy (``plan.policy``, static buckets included), or under
    ``options`` with dynamic buckets when given; ``speed`` prices replicas slower or faster
    (online recalibration). With ``method=exact``, a solve that fails or times out without a
    solution falls back to the fast dispatch and emits a
    :class:`~lorafleet.errors.SolverFallbackWarning`; the step is never skipped.
    """
    outcome = solve_policy(batch, plan, cost_model, DispatchPolicy(options=options) if options is not None else None, speed)
    if outcome.fallback:
        warnings.warn(outcome.fallback, SolverFallbackWarning, stacklevel=2)
    return outcome.plan
