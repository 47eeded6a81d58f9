"""Per-step dispatch: every sequence of a global batch on a replica and in a micro-batch.

``dispatch_step(batch, plan, cost_model) -> StepPlan`` runs every training step under the
plan's own policy (``plan.policy``: what the plan was judged under), so it is both
near-optimal and fast (milliseconds by default). See :mod:`.step` for the pipeline,
:mod:`.policy` for static buckets, :mod:`.bucketing` for the bucket DP, :mod:`.load` for the load
model, :mod:`.balance` and :mod:`.ilp` for the two balancing methods, :mod:`.placement` for the
sequences each replica then holds, :mod:`.microbatch` for cutting them into micro-batches
(:mod:`.pipelined` for a pipelined replica's packed ones; :mod:`.sorting` for their sorts),
:mod:`.recalibration` for the online correction of the cost model, :mod:`.lookahead` for computing step
t+1 while step t runs, and :mod:`.fairness` for how each task's tokens spread over the replicas.

This package is dispatch's whole public API; lorafleet's code outside it imports from here only (an
import-linter contract holds the planner to it; tests, and ``benchmarks/bench_planner.py`` that times
dispatch's pieces, import inside). Two uses:

**Running steps**: :func:`dispatch_step`, :class:`LookaheadDispatcher` (step t+1 while t
runs), :class:`Recalibrator` (measured/modelled time per replica, fed back as ``speed``),
:func:`policy_with` (the plan's policy, or given options with dynamic buckets, its window and
recalibration kept).

**Judging a deployment** (what the planner asks of dispatch, so that a plan is judged by
exactly what its steps will run):

1. *the load model*: :func:`config_classes` (a plan's replicas grouped by config and
   speed), :func:`choose_buckets` (a batch's buckets, as the dispatcher picks them, balanced;
   :func:`bucket_load` without the balance) and :func:`build_load_model` (a :class:`LoadModel`:
   per class i and bucket j the time ``T_i(d) = Σ_j ⌈d_ij / p_i⌉ t_ij + c_i``, LobRA Eq. 1-3 with
   p fixed);
2. *balance*: :func:`balance_load` (what every step runs: :func:`balance_fast`, milliseconds,
   :func:`balance_by_length`, LobRA's length-based baseline, or :func:`solve_dispatch_ilp`,
   exact, bounded by the fast answer, which stands with a note when the solve gives nothing), each
   an :class:`Assignment` d_ij; :func:`fluid_bound` is the LP bound no balance beats;
3. *the placed step*: :func:`placed_work` (the sequences placed on replicas, cut into
   micro-batches and priced as a step is; its max is the expected makespan) and
   :func:`placed_times` (the padded load model as placed, no micro-batches formed);
   :func:`sequence_lower_bound` is each sequence's least time on a config.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.dispatch.balance import Assignment, balance_by_length, balance_fast, fluid_bound
from lorafleet.dispatch.bucketing import BucketingResult, bucket_of, optimal_buckets, optimal_buckets_by_count
from lorafleet.dispatch.fairness import task_tokens_per_replica
from lorafleet.dispatch.ilp import IlpOutcome, solve_dispatch_ilp
from lorafleet.dispatch.load import ConfigClass, LoadModel, build_load_model, config_classes, sequence_lower_bound
from lorafleet.dispatch.lookahead import LookaheadDispatcher
from lorafleet.dispatch.placement import placed_times
from lorafleet.dispatch.policy import policy_with, solve_policy
from lorafleet.dispatch.recalibration import Recalibrator, ReplicaCalibration, summarize_factors
from lorafleet.dispatch.step import (
    Balanced,
    DispatchOutcome,
    balance_load,
    bucket_load,
    choose_buckets,
    placed_work,
    solve_step,
)
from lorafleet.errors import SolverFallbackWarning
from lorafleet.plans import DeploymentPlan, GlobalBatch, StepPlan
from lorafleet.specs.dispatch import DispatchMethod, DispatchOptions, DispatchPolicy, MicroBatchMode

__all__ = [
    # running steps
    "DispatchMethod",
    "DispatchOptions",
    "DispatchOutcome",
    "DispatchPolicy",
    "LookaheadDispatcher",
    "MicroBatchMode",
    "Recalibrator",
    "ReplicaCalibration",
    "dispatch_step",
    "solve_policy",
    "solve_step",
    "summarize_factors",
    "task_tokens_per_replica",
    "policy_with",
    # judging a deployment
    "Assignment",
    "Balanced",
    "balance_load",
    "ConfigClass",
    "IlpOutcome",
    "LoadModel",
    "balance_by_length",
    "balance_fast",
    "build_load_model",
    "bucket_load",
    "choose_buckets",
    "config_classes",
    "fluid_bound",
    "placed_times",
    "placed_work",
    "sequence_lower_bound",
    "solve_dispatch_ilp",
    # buckets
    "BucketingResult",
    "bucket_of",
    "optimal_buckets",
    "optimal_buckets_by_count",
]


def dispatch_step(
    batch: GlobalBatch,
    plan: DeploymentPlan,
    cost_model: CostModel,
    options: DispatchOptions | None = None,
    *,
    speed: Sequence[float] | None = None,
) -> StepPlan:
    """The step's StepPlan: one ReplicaWork per replica of ``plan``, in order, with estimated times.

    Dispatched under the plan's policy (``plan.policy``, static buckets included), or under
    ``options`` with dynamic buckets when given (in the plan's pipeline window, :func:`policy_with`);
    ``speed`` prices replicas slower or faster
    (online recalibration). With ``method=exact``, a solve that fails or times out without a
    solution falls back to the fast dispatch and emits a
    :class:`~lorafleet.errors.SolverFallbackWarning`; the step is never skipped.
    """
    outcome = solve_policy(batch, plan, cost_model, policy_with(plan, options), speed)
    if outcome.fallback:
        warnings.warn(outcome.fallback, SolverFallbackWarning, stacklevel=2)
    return outcome.plan
